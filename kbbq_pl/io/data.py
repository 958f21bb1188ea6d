"""Calibration data: fixed-length token blocks from text, jsonl, a datasets dataset or noise.

:func:`token_blocks` is the pure part (deterministic for a seed); :class:`CalibrationDataModule`
wraps it for Lightning.  Sources:

* a local ``.txt`` file (one text stream) or ``.jsonl`` file (the ``text_key`` field of each
  line, joined by newlines);
* ``"hf:<path>[:<config>][:<split>]"`` or a ``datasets.Dataset`` (its ``text_key`` column);
* ``"mixed"`` (the default): the mixed-domain corpus shipped with kbbq-pl (prose from
  WikiText-2 valid, math from GSM8K train, code from MBPP train tasks; about 480 KB, see
  ``kbbq_pl/resources/CALIBRATION_CORPUS.md``), the paper's default kind of calibration data;
* ``"random"``: the paper's random corpus (its ablation), tokens uniform over the tokenizer's
  vocabulary (its special tokens excluded), seeded.

Each block is ``seq_len`` tokens including the tokenizer's own special tokens (``[CLS] ...
[SEP]`` for BERT, ``<s> ...`` for Llama).  Blocks are distinct, non-overlapping windows of the
token stream chosen with the seed; the token budget ``n_tokens`` counts every token of every
block (the paper's n, Table calib: 256 to 65536).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

try:
    from lightning.pytorch import LightningDataModule
except ImportError:  # pragma: no cover - lightning is a dependency
    from pytorch_lightning import LightningDataModule

RANDOM = "random"
MIXED = "mixed"


def _read_text(source: str | Path, text_key: str) -> str:
    if str(source) == MIXED:
        from ..resources import calibration_corpus

        source, text_key = calibration_corpus(), "text"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"calibration source {str(source)!r} is not a file, 'mixed', "
                                "'random' or 'hf:<dataset>'")
    if path.suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not valid JSON ({error})") from None
                if text_key not in record:
                    raise ValueError(f"{path}:{number}: no {text_key!r} field "
                                     f"(fields: {sorted(record)}); pass text_key=")
                texts.append(str(record[text_key]))
        return "\n".join(texts)
    return path.read_text(encoding="utf-8")


def _dataset_text(source: Any, text_key: str) -> str:
    if isinstance(source, str):
        import datasets

        parts = source[len("hf:"):].split(":")
        path, config = parts[0], (parts[1] or None) if len(parts) > 1 else None
        split = parts[2] if len(parts) > 2 else "train"
        source = datasets.load_dataset(path, config, split=split)
    if text_key not in source.column_names:
        raise ValueError(f"dataset has no {text_key!r} column (columns: {source.column_names})")
    return "\n".join(str(t) for t in source[text_key])


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
) -> Tensor:
    """``[ceil(n_tokens / seq_len), seq_len]`` token ids (int64) from ``source``.

    ``tokenizer`` is a HuggingFace tokenizer; without one only ``"random"`` works, over
    ``vocab_size`` ids.
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
            raise ValueError(f"calibration source {source!r} is text: it needs a tokenizer (a "
                             "model without one calibrates on source 'random')")
        if isinstance(source, (str, Path)) and not str(source).startswith("hf:"):
            text = _read_text(source, text_key)
        else:
            text = _dataset_text(source, text_key)
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                        verbose=False)["input_ids"]
        available = len(ids) // body
        if available < n_blocks:
            raise ValueError(
                f"calibration source {source!r} has {len(ids)} tokens: {available} blocks of "
                f"{body}, fewer than the {n_blocks} needed for n_tokens={n_tokens}"
            )
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randperm(available, generator=generator)[:n_blocks].sort().values
        flat = torch.tensor(ids[: available * body], dtype=torch.long).reshape(available, body)
        chosen = list(flat[picks])
    if not chosen:
        raise ValueError(f"calibration source {source!r} gave no tokens")
    blocks = torch.stack(chosen)
    if specials:
        rows = len(blocks)
        before = torch.tensor(prefix, dtype=torch.long).expand(rows, -1)
        after = torch.tensor(suffix, dtype=torch.long).expand(rows, -1)
        blocks = torch.cat([before, blocks, after], dim=1)
    return blocks


class CalibrationDataModule(LightningDataModule):
    """Fixed-length token blocks for calibration (and, through the same pipeline, fine-tuning).

    Batches are dicts ``{"input_ids", "attention_mask"}`` of shape ``[batch, seq_len]``; the
    blocks hold no padding, so every token counts.  ``tokenizer`` is a tokenizer object or a
    local path it loads from.
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
    ) -> None:
        super().__init__()
        self.source = source
        self.tokenizer = tokenizer
        self.n_tokens = n_tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.text_key = text_key
        self.vocab_size = vocab_size
        self.blocks: Tensor | None = None

    def _tokenizer(self):
        if isinstance(self.tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer))
        return self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.blocks is None:
            self.blocks = token_blocks(
                self.source, self._tokenizer(), n_tokens=self.n_tokens, seq_len=self.seq_len,
                seed=self.seed, text_key=self.text_key, vocab_size=self.vocab_size,
            )

    def _loader(self, blocks: Tensor) -> DataLoader:
        dataset = TensorDataset(blocks, torch.ones_like(blocks))
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False,
                          collate_fn=_collate)

    def calibration_dataloader(self) -> DataLoader:
        """The calibration blocks in a fixed order."""
        self.setup()
        assert self.blocks is not None
        return self._loader(self.blocks)

    def train_dataloader(self) -> DataLoader:
        return self.calibration_dataloader()


def _collate(rows: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    ids, mask = zip(*rows)
    return {"input_ids": torch.stack(ids), "attention_mask": torch.stack(mask)}
