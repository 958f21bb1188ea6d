"""Calibration data: fixed-length token blocks from text, jsonl, a datasets dataset or noise.

:func:`token_blocks` is the pure part (deterministic for a seed); :class:`CalibrationDataModule`
wraps it for Lightning.  Sources:

* a local ``.txt`` file (one text stream) or ``.jsonl`` file (the ``text_key`` field of each
  line, joined by newlines); a ``.json``, ``.parquet``, ``.csv`` or ``.arrow`` file (JSON lines
  and CSV also compressed: ``.jsonl.gz``) is read by ``datasets``' loader of that format (its
  ``text_key`` column);
* ``"hf:<path>[:<config>][:<split>]"`` or a ``datasets.Dataset`` (its ``text_key`` column), or
  a Python list of records (texts, or dicts holding ``text_key``); in each, a field holding a
  conversation (a list of ``{"role", "content"}`` messages, as in ultrachat's ``messages``) is
  rendered by the tokenizer's chat template (:func:`is_chat`);
* ``"mixed"`` (the default): the mixed-domain corpus shipped with kbbq-pl (prose from
  WikiText-2 valid, math from GSM8K train, code from MBPP train tasks; about 480 KB, see
  ``kbbq_pl/resources/CALIBRATION_CORPUS.md``), the paper's default kind of calibration data;
* ``"random"``: the paper's random corpus (its ablation), tokens uniform over the tokenizer's
  vocabulary (its special tokens excluded), seeded.

:func:`token_records` (``CalibrationDataModule(packing=False)``) keeps each record whole
instead, one per sequence, for a sentence encoder.

Each block is ``seq_len`` tokens including the tokenizer's own special tokens (``[CLS] ...
[SEP]`` for BERT, ``<s> ...`` for Llama).  Blocks are distinct, non-overlapping windows of the
token stream chosen with the seed; the token budget ``n_tokens`` counts every token of every
block (the paper's n, Table calib: 256 to 65536).  A source holding more than
:data:`CHARS_PER_TOKEN` characters a token is read in part: a seeded draw of its records
(:func:`drawn`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

try:
    from lightning.pytorch import LightningDataModule
except ImportError:  # pragma: no cover - lightning is a dependency
    from pytorch_lightning import LightningDataModule

log = logging.getLogger(__name__)

RANDOM = "random"
# local files read by datasets' packaged loader of their format (a JSON array or JSON lines),
# compressed too (datasets decompresses by the extension: c4-train.00001-of-01024.json.gz)
DATASET_FILES = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
MIXED = "mixed"
# a calibration source holding more than this many characters a token of ``n_tokens`` (in
# English about 64 times the tokens it needs) is read in part, a seeded draw of its records
# (source_records' max_chars), so that a large corpus is not tokenized whole
CHARS_PER_TOKEN = 256


def _field(record: Mapping[str, Any], text_key: str, where: str) -> Any:
    """``record``'s ``text_key`` field; an error naming ``where`` the record is without it."""
    if text_key not in record:
        raise ValueError(f"{where}: no {text_key!r} field (fields: {sorted(record)}); "
                         "pass text_key=")
    return record[text_key]


def _jsonl_fields(path: Path, text_key: str) -> list[Any]:
    """The ``text_key`` field of each record of a ``.jsonl`` file."""
    fields = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error})") from None
            fields.append(_field(record, text_key, f"{path}:{number}"))
    return fields


def data_file_format(path: Path) -> str | None:
    """The ``datasets`` loader of a local data file (:data:`DATASET_FILES`; JSON lines and CSV
    also compressed), or None for a text or ``.jsonl`` file."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSED and suffixes[-2] in (".json", ".jsonl",
                                                                             ".csv"):
        return "csv" if suffixes[-2] == ".csv" else "json"
    return DATASET_FILES.get(suffixes[-1]) if suffixes else None


def _dataset_fields(source: Any, text_key: str,
                    max_chars: int | None = None) -> tuple[list[Any], bool | None]:
    """The ``text_key`` column of a dataset, of ``"hf:<path>[:<config>][:<split>]"`` (the split
    as ``datasets`` reads it, a slice too: ``train[:512]``) or of a local file of one of
    :data:`DATASET_FILES`' formats, and, for a streaming dataset's (``IterableDataset``, read
    in its own order until its fields hold ``max_chars`` characters, to its end without),
    whether it was read in part (None for any other dataset)."""
    import datasets

    dataset = source
    if isinstance(source, Path):
        try:
            dataset = datasets.load_dataset(data_file_format(source), data_files=str(source),
                                            split="train")
        except ValueError as error:  # a file of no records: datasets names no file
            raise ValueError(f"text source {source} cannot be read as "
                             f"{data_file_format(source)} ({error})") from None
    elif isinstance(source, str):
        dataset = hf_dataset(source)
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise ValueError(f"text source is a DatasetDict of the splits {list(dataset)}: "
                         f"pass one split, e.g. dataset[{next(iter(dataset), 'train')!r}]")
    if not hasattr(dataset, "column_names"):
        raise TypeError(f"text source {source_name(source)}: pass a file, "
                        "'mixed', 'random', 'hf:<dataset>', a datasets.Dataset or a list of "
                        "records (texts, conversations or dicts)")
    # a streaming dataset may not know its columns before its first record
    if dataset.column_names is not None and text_key not in dataset.column_names:
        raise ValueError(f"text source {source_name(source)} has no {text_key!r} "
                         f"column (columns: {dataset.column_names}); pass text_key=")
    if not isinstance(dataset, datasets.IterableDataset):
        return list(dataset[text_key]), None
    fields, chars = [], 0
    for index, row in enumerate(dataset):
        fields.append(_field(row, text_key, f"text source {source_name(source)}, record {index}"))
        chars += _chars(fields[-1])
        if max_chars is not None and chars >= max_chars:
            log.info("text source %s (streaming): its first %d records read, %d characters",
                     source_name(source), len(fields), chars)
            return fields, True
    return fields, False


HF_SLICE = re.compile(r"^(?P<split>[^\[\]]+)\[(?P<start>\d*):(?P<stop>\d*)\]$")
"""A split sliced by records, ``train[:2048]`` or ``train[100:2148]``: what a stream reads."""


def hf_dataset(source: str, streaming: bool = False) -> Any:
    """The dataset ``"hf:<path>[:<config>][:<split>]"`` names (split ``train`` by default),
    loaded by ``datasets.load_dataset``: the split whole (a slice, ``train[:512]``, is cut from
    it after its files are downloaded), or with ``streaming`` an ``IterableDataset`` read from
    the Hub as it is iterated, whose slice is ``skip`` and ``take`` of records (only what a
    calibration reads is downloaded: C4's ``en`` train split is about 300 GB)."""
    import datasets

    parts = source[len("hf:"):].split(":", 2)  # a split may slice: train[:512]
    path, config = parts[0], (parts[1] or None) if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "train"
    if not streaming:
        try:
            return datasets.load_dataset(path, config, split=split)
        except datasets.exceptions.DatasetGenerationError as error:  # a data file it can't read
            cause = error.__cause__ or error
            raise ValueError(f"text source {source!r}: datasets could not read its split "
                             f"{split!r} ({type(cause).__name__}: "
                             f"{' '.join(str(cause).split())[:300]})") from error
    sliced = HF_SLICE.match(split)
    if sliced is None and "[" in split:
        raise ValueError(f"text source {source!r}: a streamed split is sliced by records "
                         f"from the start, as 'train[:2048]' or 'train[100:2148]', not "
                         f"{split!r} (percentages and negative indices need the whole split: "
                         "streaming=False)")
    dataset = datasets.load_dataset(path, config, split=sliced["split"] if sliced else split,
                                    streaming=True)
    if sliced is not None:
        start = int(sliced["start"] or 0)
        dataset = dataset.skip(start) if start else dataset
        if sliced["stop"]:
            dataset = dataset.take(max(int(sliced["stop"]) - start, 0))
    return dataset


def checked_file(source: str | Path) -> Path:
    """The file a local text source names; a FileNotFoundError where it is none."""
    path = Path(source)
    if path.is_dir():
        raise FileNotFoundError(f"text source {str(source)!r} is a folder: "
                                f"'hf:{source}' reads its data files (datasets' "
                                "load_dataset), or name one file")
    if not path.is_file():
        raise FileNotFoundError(f"text source {str(source)!r} is not a file, "
                                "'mixed', 'random' or 'hf:<dataset>'")
    return path


def source_name(source: Any) -> str:
    """A text source as an error message names it: a path or name quoted, else its type
    (and size), never the records themselves."""
    if isinstance(source, (str, Path)):
        return repr(str(source))
    kind = type(source).__name__
    size = f" of {len(source)} records" if hasattr(source, "__len__") else ""
    info = getattr(source, "info", None)  # a datasets dataset's name and split, where known
    named = (f" ({info.dataset_name}, split {source.split})"
             if getattr(info, "dataset_name", None) and getattr(source, "split", None) else "")
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}{named}{size}"


def _list_fields(records: list | tuple, text_key: str) -> list[Any]:
    """A Python list's records: each a text, a conversation, or a dict holding ``text_key``."""
    return [_field(record, text_key, f"text record {index}") if isinstance(record, Mapping)
            else record for index, record in enumerate(records)]


def is_chat(value: Any) -> bool:
    """Whether a record's field is a conversation: a list of messages, each a dict with a
    ``role`` and a ``content`` (the OpenAI / HF chat format: ultrachat's ``messages``)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def _as_text(value: Any, tokenizer: Any, source: str, index: int) -> str:
    """A record's field as the text the model reads: a string as it is, a conversation
    rendered by the tokenizer's chat template (what an instruct model is served), as
    llm-compressor's examples calibrate instruct models."""
    if isinstance(value, str):
        return value
    if is_chat(value):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", None) or "the model's"
            raise ValueError(f"text source {source}, record {index}: a "
                             f"conversation, but tokenizer {name!r} has no chat template to "
                             "render it with")
        return tokenizer.apply_chat_template(value, tokenize=False)
    if isinstance(value, (list, dict)):
        raise ValueError(f"text source {source}, record {index}: the field is "
                         f"a {type(value).__name__}, neither text nor a conversation (a list of "
                         "dicts with 'role' and 'content')")
    return str(value)


class Records(NamedTuple):
    """A text source's records as the model reads them."""

    texts: list[str]
    stream: str  # the records as one text: a text file as written, others joined by newlines
    templated: list[bool]  # the record is a rendered conversation, framed by its template
    read: str = ""  # which of the source's records these are (:func:`records_read`)


def records_read(total: int, chosen: list[int] | None, seed: int,
                 cut: bool | None = None) -> str:
    """How much of a source a calibration read, as its report says it: all ``total`` records,
    a seeded draw of them (``chosen``), or of a stream (``cut`` not None) its first records
    (``cut``: read until the budget, not to its end)."""
    if cut is not None:
        return f"the first {total:,} records of a stream" if cut else \
            f"all {total:,} records of a stream"
    if chosen is None:
        return f"all {total:,} records"
    return f"{len(chosen):,} of {total:,} records, a seeded draw (seed {seed})"


def _chars(value: Any) -> int:
    """A record field's characters (a conversation's: its messages' contents)."""
    if is_chat(value):
        return sum(len(str(message["content"])) for message in value)
    return len(value) if isinstance(value, str) else len(str(value))


def drawn(sizes: list[int], max_chars: int | None, seed: int, source: Any) -> list[int] | None:
    """The records a calibration reads of a large ``source``: a seeded draw of them, until they
    hold ``max_chars`` characters, as indices in the source's order; None where there is no
    limit or the source holds no more than it (all of it is read, as it stands)."""
    if max_chars is None or sum(sizes) <= max_chars:
        return None
    chosen, chars = [], 0
    for index in torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist():
        chosen.append(index)
        chars += sizes[index]
        if chars >= max_chars:
            break
    log.info("text source %s holds more than %d characters: %d of its %d records drawn "
             "(seed %d)", source_name(source), max_chars, len(chosen), len(sizes), seed)
    return sorted(chosen)


def source_records(source: Any, text_key: str = "text", tokenizer: Any = None, *,
                   max_chars: int | None = None, seed: int = 0) -> Records:
    """The records of a text source: a text file's non-empty lines, a ``.jsonl`` file's or a
    dataset's ``text_key`` fields (a ``.json``, ``.parquet``, ``.csv`` or ``.arrow`` file,
    ``"hf:..."`` or a ``datasets.Dataset``), a list's records (texts, conversations, or dicts
    holding ``text_key``), or the shipped corpus (``"mixed"``); a conversation field rendered
    by the tokenizer's chat template.  With ``max_chars``, a source holding more text is read
    in part: the records of a seeded draw until ``max_chars`` characters (:func:`drawn`), in
    the source's order; a streaming dataset's first records (:func:`_dataset_fields`)."""
    cut = None  # a stream: whether it was read in part (None: not a stream)
    if isinstance(source, (str, Path)) and not str(source).startswith("hf:"):
        if str(source) == MIXED:
            from ..resources import calibration_corpus

            source, text_key = calibration_corpus(), "text"
        path = checked_file(source)
        if path.suffix == ".jsonl":
            fields = _jsonl_fields(path, text_key)
        elif data_file_format(path):
            fields, _ = _dataset_fields(path, text_key)
        else:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"text source {str(source)!r} is not UTF-8 text (byte "
                    f"{error.start}); a data file is read by its extension: .jsonl, "
                    f"{', '.join(DATASET_FILES)} (JSON lines and CSV also "
                    f"{'/'.join(COMPRESSED)})") from None
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            chosen = drawn([len(line) for line in lines], max_chars, seed, source)
            read = records_read(len(lines), chosen, seed)
            if chosen is not None:
                lines = [lines[index] for index in chosen]
                text = "\n".join(lines)
            return Records(lines, text, [False] * len(lines), read)
    elif isinstance(source, (list, tuple)):
        fields = _list_fields(source, text_key)
    else:
        fields, cut = _dataset_fields(source, text_key, max_chars)
    name = source_name(source)
    # an empty field (null, a blank CSV cell, "") is no record, as a text file's blank lines
    kept = [(index, value) for index, value in enumerate(fields)
            if value is not None and not (isinstance(value, str) and not value.strip())]
    sizes = [_chars(value) for _, value in kept]
    # a streaming dataset's first records are what it gives of itself: no draw among them
    chosen = None if cut is not None else drawn(sizes, max_chars, seed, source)
    read = records_read(len(kept), chosen, seed, cut)
    if chosen is not None:
        kept = [kept[index] for index in chosen]
    texts = [_as_text(value, tokenizer, name, index) for index, value in kept]
    return Records(texts, "\n".join(texts), [is_chat(value) for _, value in kept], read)


def calibration_records(source: Any, text_key: str, tokenizer: Any, *, n_tokens: int,
                        seed: int) -> Records:
    """The records of ``source`` that a calibration of ``n_tokens`` tokens reads: up to
    :data:`CHARS_PER_TOKEN` characters a token (:func:`source_records`)."""
    return source_records(source, text_key, tokenizer, max_chars=CHARS_PER_TOKEN * n_tokens,
                          seed=seed)


def random_tokens(vocab_size: int, count: int, seed: int,
                  exclude: list[int] | None = None) -> Tensor:
    """``count`` token ids uniform over ``[0, vocab_size)`` minus ``exclude``, seeded."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    if exclude:
        allowed[torch.tensor([e for e in exclude if 0 <= e < vocab_size], dtype=torch.long)] = False
    ids = allowed.nonzero().squeeze(1)
    generator = torch.Generator().manual_seed(seed)
    return ids[torch.randint(len(ids), (count,), generator=generator)]


def special_framing(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a single sequence."""
    body = tokenizer("kbbq", add_special_tokens=False)["input_ids"]
    full = tokenizer("kbbq", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(body) + 1):
        if full[start : start + len(body)] == body:
            return list(full[:start]), list(full[start + len(body):])
    return [], []


def token_blocks(
    source: Any,
    tokenizer: Any = None,
    *,
    n_tokens: int,
    seq_len: int,
    seed: int = 0,
    text_key: str = "text",
    vocab_size: int | None = None,
    records: Records | None = None,
) -> Tensor:
    """``[ceil(n_tokens / seq_len), seq_len]`` token ids (int64) from ``source``.

    ``tokenizer`` is a HuggingFace tokenizer; without one only ``"random"`` works, over
    ``vocab_size`` ids.  ``records``: the source's, read already (:func:`calibration_records`).
    """
    if n_tokens < 1 or seq_len < 2:
        raise ValueError(f"need n_tokens >= 1 and seq_len >= 2, got {n_tokens} and {seq_len}")
    n_blocks = math.ceil(n_tokens / seq_len)
    prefix, suffix = special_framing(tokenizer) if tokenizer is not None else ([], [])
    specials = len(prefix) + len(suffix)
    body = seq_len - specials
    if body < 1:
        raise ValueError(f"seq_len {seq_len} leaves no room beside {specials} special tokens")

    if isinstance(source, str) and source == RANDOM:
        if tokenizer is not None:
            vocab = len(tokenizer)
            exclude = list(tokenizer.all_special_ids)
        elif vocab_size:
            vocab, exclude = vocab_size, []
        else:
            raise ValueError("the random corpus needs a tokenizer or vocab_size")
        stream = random_tokens(vocab, n_blocks * body, seed, exclude).reshape(n_blocks, body)
        chosen = list(stream)
    else:
        if tokenizer is None:
            raise ValueError(f"calibration source {source_name(source)} is text: it needs a "
                             "tokenizer (a model without one calibrates on source 'random')")
        if records is None:
            records = calibration_records(source, text_key, tokenizer, n_tokens=n_tokens,
                                          seed=seed)
        text = records.stream
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                        verbose=False)["input_ids"]
        available = len(ids) // body
        if available < n_blocks:
            raise ValueError(
                f"calibration source {source_name(source)} has {len(ids)} tokens: {available} "
                f"blocks of {body}, fewer than the {n_blocks} needed for n_tokens={n_tokens}"
            )
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randperm(available, generator=generator)[:n_blocks].sort().values
        flat = torch.tensor(ids[: available * body], dtype=torch.long).reshape(available, body)
        chosen = list(flat[picks])
    if not chosen:
        raise ValueError(f"calibration source {source_name(source)} gave no tokens")
    blocks = torch.stack(chosen)
    if specials:
        rows = len(blocks)
        before = torch.tensor(prefix, dtype=torch.long).expand(rows, -1)
        after = torch.tensor(suffix, dtype=torch.long).expand(rows, -1)
        blocks = torch.cat([before, blocks, after], dim=1)
    return blocks


def token_records(
    source: Any,
    tokenizer: Any,
    *,
    n_tokens: int,
    max_len: int,
    seed: int = 0,
    text_key: str = "text",
    records: Records | None = None,
) -> list[Tensor]:
    """Whole records of ``source`` as token sequences (int64, 1-D), one record per sequence:
    a seeded draw of the records (a text file's non-empty lines, a jsonl file's or a dataset's
    ``text_key`` fields), each tokenized with the tokenizer's special tokens and cut at
    ``max_len`` tokens, until ``n_tokens`` tokens; nothing is packed or padded (what a
    sentence encoder embeds).  ``records``: the source's, read already
    (:func:`calibration_records`)."""
    if n_tokens < 1 or max_len < 2:
        raise ValueError(f"need n_tokens >= 1 and max_len >= 2, got {n_tokens} and {max_len}")
    if tokenizer is None or (isinstance(source, str) and source == RANDOM):
        raise ValueError(f"calibration on whole records needs text and a tokenizer, got source "
                         f"{source_name(source)}"
                         f"{'' if tokenizer is not None else ' without a tokenizer'}")
    if records is None:
        records = calibration_records(source, text_key, tokenizer, n_tokens=n_tokens, seed=seed)
    order = torch.randperm(len(records.texts), generator=torch.Generator().manual_seed(seed))
    chosen: list[Tensor] = []
    total = 0
    for index in order.tolist():
        # a rendered conversation holds its template's special tokens already
        ids = tokenizer(records.texts[index], add_special_tokens=not records.templated[index],
                        truncation=True, max_length=max_len, return_attention_mask=False,
                        verbose=False)["input_ids"]
        chosen.append(torch.tensor(ids, dtype=torch.long))
        total += len(ids)
        if total >= n_tokens:
            return chosen
    raise ValueError(f"calibration source {source_name(source)} has {len(records.texts)} "
                     f"records of {total} tokens, fewer than n_tokens={n_tokens}")


def batches_by_length(sequences: list[Tensor], batch_size: int) -> list[dict[str, Tensor]]:
    """Sequences of one length share batches of up to ``batch_size`` (shortest first, each
    length's in the given order), so none is padded."""
    by_length: dict[int, list[Tensor]] = {}
    for ids in sequences:
        by_length.setdefault(len(ids), []).append(ids)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            for length in sorted(by_length)
            for ids in torch.stack(by_length[length]).split(batch_size)]


class CalibrationDataModule(LightningDataModule):
    """Fixed-length token blocks for calibration (and, through the same pipeline, fine-tuning).

    Batches are dicts ``{"input_ids", "attention_mask"}`` of shape ``[batch, seq_len]``; the
    blocks hold no padding, so every token counts.  With ``packing=False`` each record of the
    source (a line of a text file, a jsonl record) is its own sequence instead, cut at
    ``seq_len`` (:func:`token_records`), and records of one length share a batch: what a
    sentence encoder should calibrate on.  ``packing=None`` (the default) leaves it to the model
    (:meth:`for_model`, which the CLI and the KBBQ callback call): packed for a causal LM, whole
    records for any other model with text to read; packed where no model says.  ``tokenizer``
    is a tokenizer object or a local path it loads from.  ``streaming`` reads an ``hf:`` source
    as a stream (:func:`hf_dataset`): its first records, until they hold what the token budget
    needs (:data:`CHARS_PER_TOKEN` characters a token), instead of a seeded draw from the whole
    split, which is downloaded first.
    """

    def __init__(
        self,
        source: Any = MIXED,
        tokenizer: Any = None,
        n_tokens: int = 4096,
        seq_len: int = 256,
        batch_size: int = 4,
        seed: int = 0,
        text_key: str = "text",
        vocab_size: int | None = None,
        packing: bool | None = None,
        streaming: bool = False,
    ) -> None:
        super().__init__()
        if n_tokens < 1 or seq_len < 2 or batch_size < 1:
            raise ValueError(f"calibration data: need n_tokens >= 1, seq_len >= 2 and "
                             f"batch_size >= 1, got {n_tokens}, {seq_len} and {batch_size}")
        if isinstance(source, (str, Path)) and str(source) not in (MIXED, RANDOM) \
                and not str(source).startswith("hf:"):
            checked_file(source)  # before any work, not when the first batch is read
        if streaming and not (isinstance(source, str) and source.startswith("hf:")):
            raise ValueError(f"streaming reads an 'hf:<dataset>' source from the Hub; source "
                             f"{source_name(source)} is read as it is (a file's records drawn "
                             "in part): pass streaming=False")
        self.source = source
        self.tokenizer = tokenizer
        self.n_tokens = n_tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.text_key = text_key
        self.vocab_size = vocab_size
        self.packing = packing
        self.streaming = streaming
        self.blocks: Tensor | None = None
        self.records: list[Tensor] | None = None
        self.read: str | None = None  # which records of the source were read, once set up

    def for_model(self, model: Any) -> CalibrationDataModule:
        """Settle ``packing=None`` for ``model``: a causal LM is scored on running text, so it
        calibrates on packed blocks; an encoder embeds one text at a time, so it calibrates on
        whole records, unless there is no text (``random``, or no tokenizer).  An explicit
        ``packing`` is kept.  A ``seq_len`` longer than the positions ``model`` reads (a
        recipe's 256 on a model of 128 positions) is cut to them, with a warning: calibration
        sequences past the model's context would be out of its range, or out of its position
        table.  Without a tokenizer, text is read with the model's own, saved where the model
        was loaded from (:func:`~kbbq_pl.io.models.model_tokenizer`), as llm-compressor
        loads a model's processor from its path."""
        from .checkpoint import is_causal_model
        from .models import max_context, model_tokenizer

        if self.tokenizer is None and not (isinstance(self.source, str) and
                                           self.source == RANDOM):
            self.tokenizer = model_tokenizer(model)
            if self.tokenizer is not None:
                log.info("calibration text read with the tokenizer of %s (the model's; "
                         "CalibrationDataModule(tokenizer=...) sets another)", model.name_or_path)

        longest = max_context(model)
        if longest is not None and self.seq_len > longest:
            log.warning("seq_len %d is longer than %s reads (max_position_embeddings %d): "
                        "calibrating on sequences of %d tokens (--data.init_args.seq_len sets "
                        "it)", self.seq_len, type(model).__name__, longest, longest)
            self.seq_len = longest
        if self.packing is None:
            self.packing = (is_causal_model(model) or self.tokenizer is None
                            or (isinstance(self.source, str) and self.source == RANDOM))
        return self

    @property
    def packs(self) -> bool:
        """Whether the sequences are packed blocks (``packing`` True, or None unsettled)."""
        return self.packing is not False

    def _tokenizer(self):
        if isinstance(self.tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer))
        return self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        """Build the blocks (or records).  Lightning's call (``stage`` given) leaves it to the
        first dataloader: it comes before the KBBQ callback settles the data for its model
        (:meth:`for_model`: packing, sequence length, tokenizer)."""
        if stage is not None or (self.blocks if self.packs else self.records) is not None:
            return
        source = hf_dataset(self.source, streaming=True) if self.streaming else self.source
        records = None
        if not (isinstance(source, str) and source == RANDOM) and self._tokenizer() is not None:
            records = calibration_records(source, self.text_key, self._tokenizer(),
                                          n_tokens=self.n_tokens, seed=self.seed)
            self.read = records.read
        if not self.packs:
            self.records = token_records(
                source, self._tokenizer(), n_tokens=self.n_tokens, max_len=self.seq_len,
                seed=self.seed, text_key=self.text_key, records=records)
        else:
            self.blocks = token_blocks(
                source, self._tokenizer(), n_tokens=self.n_tokens, seq_len=self.seq_len,
                seed=self.seed, text_key=self.text_key, vocab_size=self.vocab_size,
                records=records)

    def _loader(self, blocks: Tensor) -> DataLoader:
        dataset = TensorDataset(blocks, torch.ones_like(blocks))
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False,
                          collate_fn=_collate)

    def calibration_dataloader(self) -> DataLoader:
        """The calibration blocks (or records) in a fixed order."""
        self.setup()
        if not self.packs:
            assert self.records is not None
            return DataLoader(batches_by_length(self.records, self.batch_size), batch_size=None)
        assert self.blocks is not None
        return self._loader(self.blocks)

    def train_dataloader(self) -> DataLoader:
        return self.calibration_dataloader()


def _collate(rows: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    ids, mask = zip(*rows)
    return {"input_ids": torch.stack(ids), "attention_mask": torch.stack(mask)}
