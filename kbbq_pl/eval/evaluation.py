"""Evaluation: embedding fidelity, causal-LM perplexity and lm-evaluation-harness benchmarks.

* :func:`wikitext_sentences` picks sentences from a WikiText-2 (tokenized variant) file.
* :func:`mean_pooled_embeddings`, :func:`cosine_to_reference` and :func:`embedding_fidelity`
  measure how close a (quantized) sentence-embedding model stays to its full-precision
  reference: the cosine similarity of sentence-transformers style mean-pooled embeddings.  This
  is the acceptance metric for all-MiniLM-L6-v2.  Compute the reference embeddings once and
  compare every variant against them::

      sentences = wikitext_sentences("../shared/data/wikitext2/test.txt", n=512)
      reference = mean_pooled_embeddings(fp_model, tokenizer, sentences)
      cosine_to_reference(quantized_model, tokenizer, sentences, reference)
      # {"mean_cosine": 0.998..., "min_cosine": 0.97..., "n_sentences": 512}

* :func:`perplexity` scores a causal LM on a token stream with rolling windows, every token
  scored exactly once; :func:`window_batches` gives the same windows as dataloader batches
  (held-out validation inside ``Trainer.fit``).
* The figures accumulate in the torchmetrics metrics of :mod:`kbbq_pl.eval.metrics`
  (:class:`~kbbq_pl.eval.metrics.CosineFidelity`, :class:`~kbbq_pl.eval.metrics.TokenPerplexity`),
  which a LightningModule can log and which sync across processes.
* :func:`run_benchmarks` runs MMLU, GSM8K, HellaSwag, WinoGrande and MBPP offline through
  lm-evaluation-harness on local data files (:mod:`kbbq_pl.eval.tasks`).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kbbq_pl.eval.tasks import BENCHMARKS, run_benchmarks
from kbbq_pl.io.data import source_records
from kbbq_pl.io.models import check_context, max_context

__all__ = [
    "BENCHMARKS",
    "cosine_summary",
    "cosine_to_reference",
    "detokenize_wikitext",
    "embedding_fidelity",
    "mean_pool",
    "mean_pooled_embeddings",
    "perplexity",
    "prepare_stream",
    "rolling_windows",
    "run_benchmarks",
    "scored_positions",
    "split_wikitext_sentences",
    "wikitext_sentences",
    "window_batches",
    "window_groups",
    "window_logits",
    "window_shape",
]

_SENTENCE_END = {".", "!", "?"}
_WORD = re.compile(r"\w")
_CLITIC = re.compile(r"^(n't|'\w*)$")


# ---------------------------------------------------------------------------------------------
# WikiText sentences
# ---------------------------------------------------------------------------------------------

def _count_words(tokens: Sequence[str]) -> int:
    return sum(bool(_WORD.search(t)) and not _CLITIC.match(t) for t in tokens)


def _is_heading(line: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= 2 and stripped.startswith("=") and stripped.endswith("=")


def split_wikitext_sentences(paragraph: str) -> list[list[str]]:
    """A tokenized WikiText paragraph as sentences, each a list of tokens.

    A sentence ends after a standalone ``.``, ``!`` or ``?`` token (WikiText's tokenization
    separates sentence punctuation; decimals are ``3 @.@ 5``) or at the end of the paragraph.
    """
    sentences: list[list[str]] = []
    current: list[str] = []
    for token in paragraph.split():
        current.append(token)
        if token in _SENTENCE_END:
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    return sentences


def detokenize_wikitext(tokens: Sequence[str]) -> str:
    """Plain text from WikiText tokens: ``@-@``-style splits joined, spaces before punctuation
    and inside quotes and brackets removed (approximately the original spelling)."""
    text = " ".join(tokens)
    text = re.sub(r" @(.)@ ", r"\1", text)
    text = re.sub(r" ([.,;:!?)%])", r"\1", text)
    text = re.sub(r"\( ", "(", text)
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    text = re.sub(r'" (.*?) "', r'"\1"', text)
    return text


def wikitext_sentences(
    path: str | Path,
    n: int | None,
    min_words: int = 5,
    seed: int | None = 0,
    *,
    max_words: int | None = 64,
    drop_unk: bool = True,
    detokenize: bool = True,
) -> list[str]:
    """``n`` sentences from a WikiText-2 file of the tokenized variant (``<unk>``, `` @-@ ``).

    Headings (`` = Title = ``) and blank lines are skipped; every other line is a paragraph, split
    into sentences by :func:`split_wikitext_sentences`.  A sentence is eligible when it ends with
    ``.``, ``!`` or ``?`` (no paragraph fragments), has ``min_words`` to ``max_words`` words
    (tokens with a letter or digit; clitics such as ``'s`` are not words) and, with
    ``drop_unk``, no ``<unk>`` token.  Which ``n``: a uniformly random subset of the eligible
    sentences drawn with ``random.Random(seed)``, returned in file order, so the same arguments
    always give the same sentences; ``seed=None`` takes the first ``n``, ``n=None`` all of them.
    With ``detokenize`` the sentences are turned back into plain text (:func:`detokenize_wikitext`).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"WikiText file {str(path)!r} does not exist")
    eligible: list[list[str]] = []
    with file.open(encoding="utf-8") as handle:
        for line in handle:
            if not line.strip() or _is_heading(line):
                continue
            for tokens in split_wikitext_sentences(line):
                if tokens[-1] not in _SENTENCE_END:
                    continue
                words = _count_words(tokens)
                if words < min_words or (max_words is not None and words > max_words):
                    continue
                if drop_unk and "<unk>" in tokens:
                    continue
                eligible.append(tokens)
    if n is not None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if n > len(eligible):
            raise ValueError(
                f"{file}: only {len(eligible)} sentences have {min_words} to {max_words} words"
                f"{' and no <unk>' if drop_unk else ''}; asked for n={n}"
            )
        if seed is None:
            eligible = eligible[:n]
        else:
            picks = sorted(random.Random(seed).sample(range(len(eligible)), n))
            eligible = [eligible[i] for i in picks]
    return [detokenize_wikitext(t) if detokenize else " ".join(t) for t in eligible]


# ---------------------------------------------------------------------------------------------
# Embedding fidelity
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def padding_tokenizer(tokenizer: Any) -> Iterator[Any]:
    """``tokenizer``, able to pad a batch: when it has no pad token, its EOS (else UNK, else
    BOS) token pads for the duration of the block, and the pad token is unset again after.
    The padded positions are masked out (attention mask), so which token pads does not matter.
    """
    if tokenizer.pad_token is not None:
        yield tokenizer
        return
    fallback = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
    if fallback is None:
        raise ValueError("the tokenizer has no pad, EOS, UNK or BOS token to pad a batch with; "
                         "set tokenizer.pad_token")
    tokenizer.pad_token = fallback
    try:
        yield tokenizer
    finally:
        tokenizer.pad_token = None


def _device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """The mean of ``hidden`` ``[batch, tokens, dim]`` over the tokens the mask keeps, float32."""
    mask = attention_mask.to(torch.float32).unsqueeze(-1)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1e-9)


def mean_pooled_embeddings(
    model: nn.Module,
    tokenizer: Any,
    sentences: Sequence[str],
    batch_size: int = 32,
    max_length: int = 256,
) -> Tensor:
    """Sentence embeddings ``[len(sentences), hidden]`` (float32, CPU): the model's last hidden
    state averaged over each sentence's tokens (attention mask), as sentence-transformers does for
    all-MiniLM-L6-v2 (before its L2 normalization, which cosine similarity does not see).

    Sentences are truncated to ``max_length`` tokens (256: all-MiniLM-L6-v2's ``max_seq_length``).
    The model runs in eval mode under ``torch.inference_mode``; its training flag is restored.
    A tokenizer without a pad token pads with :func:`padding_tokenizer`'s stand-in.
    """
    if not sentences:
        raise ValueError("no sentences to embed")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _device(model)
    # batches of similar lengths pad less; the rows go back to the input order at the end
    order = sorted(range(len(sentences)), key=lambda i: (-len(sentences[i]), i))
    chunks = []
    with _eval_mode(model), padding_tokenizer(tokenizer):
        for start in range(0, len(order), batch_size):
            texts = [sentences[i] for i in order[start : start + batch_size]]
            batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                              return_tensors="pt")
            batch = {key: value.to(device) for key, value in batch.items()}
            output = model(**batch)
            hidden = getattr(output, "last_hidden_state", None)
            if hidden is None:
                hidden = output[0]
            chunks.append(mean_pool(hidden, batch["attention_mask"]).cpu())
    embeddings = torch.empty(len(order), chunks[0].shape[-1])
    embeddings[torch.tensor(order)] = torch.cat(chunks)
    return embeddings


def cosine_summary(embeddings: Tensor, reference: Tensor) -> dict[str, float | int]:
    """Row-wise cosine similarity of two ``[n, dim]`` embedding matrices (float64): mean, min
    and n, as :class:`~kbbq_pl.eval.metrics.CosineFidelity` computes them."""
    from .metrics import CosineFidelity

    fidelity = CosineFidelity(sync_on_compute=False)  # both matrices are here whole
    fidelity.update(embeddings, reference)
    return fidelity.summary()


def cosine_to_reference(
    model: nn.Module,
    tokenizer: Any,
    sentences: Sequence[str],
    reference_embeddings: Tensor,
    batch_size: int = 32,
    max_length: int = 256,
) -> dict[str, float | int]:
    """:func:`cosine_summary` of ``model``'s embeddings of ``sentences`` against embeddings
    computed beforehand (by :func:`mean_pooled_embeddings` of the reference model)."""
    if len(sentences) != len(reference_embeddings):
        raise ValueError(f"{len(sentences)} sentences but {len(reference_embeddings)} "
                         "reference embeddings")
    embeddings = mean_pooled_embeddings(model, tokenizer, sentences, batch_size, max_length)
    return cosine_summary(embeddings, reference_embeddings)


def embedding_fidelity(
    reference_model: nn.Module,
    model: nn.Module,
    tokenizer: Any,
    sentences: Sequence[str],
    batch_size: int = 32,
    max_length: int = 256,
) -> dict[str, float | int]:
    """Mean (and min) cosine similarity of ``model``'s mean-pooled sentence embeddings to
    ``reference_model``'s, with the number of sentences.  1.0 means identical directions."""
    reference = mean_pooled_embeddings(reference_model, tokenizer, sentences, batch_size,
                                       max_length)
    return cosine_to_reference(model, tokenizer, sentences, reference, batch_size, max_length)


# ---------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------

Window = tuple[int, int, int]  # (begin, first_target, end) of rolling_windows


def rolling_windows(n_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """Windows ``(begin, first_target, end)`` over a stream of ``n_tokens`` tokens.

    The model reads ``tokens[begin:end]`` (at most ``seq_len`` tokens) and the window scores the
    targets ``tokens[first_target:end]``; the first window scores positions ``1 .. seq_len - 1``,
    each later one the next ``stride`` positions with at least ``seq_len - stride`` tokens of
    context.  Together the windows score every position ``1 .. n_tokens - 1`` exactly once.
    """
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {n_tokens}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not 1 <= stride < seq_len:
        raise ValueError(f"stride (--stride) must be in [1, context - 1] = [1, {seq_len - 1}] "
                         "(every scored token needs a token of context in its window), got "
                         f"{stride}")
    windows = []
    first, end = 1, min(seq_len, n_tokens)
    while True:
        windows.append((max(0, end - seq_len), first, end))
        if end == n_tokens:
            return windows
        first, end = end, min(end + stride, n_tokens)


def _leading_tokens(tokenizer: Any, text: str, count: int | None) -> list[int]:
    """The first ``count`` tokens of ``text`` (all of them for None), as tokenizing the whole
    text gives them, from a prefix of it: the shortest of 8, 16, 32, ... characters a token whose
    tokens agree with those of a prefix twice as long on the first ``count`` (a tokenizer's
    pieces depend on the text near them, not on its end), so that scoring 2,048 tokens of a file
    of many megabytes does not tokenize all of it."""
    def encode(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=False, return_attention_mask=False,
                         verbose=False)["input_ids"]

    chars = 8 * count if count else len(text)
    ids = encode(text[:chars])
    while chars < len(text):
        longer = encode(text[:2 * chars])
        if len(ids) > count and longer[:count] == ids[:count]:
            return ids[:count]
        chars, ids = 2 * chars, longer
    return ids


def _token_stream(
    tokenizer: Any, source: str | Path | Tensor | Sequence[int], max_tokens: int | None
) -> list[int]:
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(source, (str, Path)):
        file = Path(source)
        if not file.is_file():
            raise FileNotFoundError(f"perplexity text file {str(source)!r} does not exist")
        if tokenizer is None:
            raise ValueError(f"scoring the text file {file} needs a tokenizer")
        # a text file as written; a data file's (.jsonl, .parquet, ...) text column, records
        # joined by newlines, as calibration reads it
        text = source_records(file, tokenizer=tokenizer).stream
        ids = _leading_tokens(tokenizer, text, max_tokens)
    elif isinstance(source, Tensor):
        if source.dim() != 1:
            raise ValueError(f"token ids must be one stream (1-D), got shape {tuple(source.shape)}")
        ids = source.tolist()
    else:
        ids = [int(i) for i in source]
    return list(ids[:max_tokens])


def _bos_id(model: nn.Module, tokenizer: Any) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if bos is None:
        bos = getattr(getattr(model, "config", None), "bos_token_id", None)
    return bos


def perplexity(
    model: nn.Module,
    tokenizer: Any,
    source: str | Path | Tensor | Sequence[int],
    seq_len: int | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    *,
    add_bos: bool = True,
    batch_size: int = 4,
) -> dict[str, float | int]:
    """Perplexity of a causal LM on a text file (tokenized whole, no special tokens) or a 1-D
    stream of token ids, with :func:`rolling_windows`.

    ``max_tokens`` keeps the first tokens of the stream.  With ``add_bos`` a BOS token (the
    tokenizer's, else ``model.config.bos_token_id``) is put in front, so every token of the
    stream is scored; without one the first token has no context and is not scored.
    ``seq_len`` defaults to ``model.config.max_position_embeddings``, ``stride`` to
    ``seq_len // 2``.  Returns ``{"perplexity", "nll" (mean, nats), "n_tokens" (scored),
    "n_windows"}``; ``perplexity == exp(nll)``, the NLL summed in float64 window by window
    (:class:`~kbbq_pl.eval.metrics.TokenPerplexity`).
    """
    from .metrics import TokenPerplexity

    ids = prepare_stream(model, tokenizer, source, max_tokens, add_bos=add_bos)
    seq_len, stride = window_shape(model, seq_len, stride)
    windows = rolling_windows(len(ids), seq_len, stride)
    scores = TokenPerplexity(sync_on_compute=False)  # the whole stream is scored here
    for _, targets, predicted in window_logits(model, ids, windows, batch_size):
        scores.update(predicted, targets)
    return {**scores.summary(), "n_windows": len(windows)}


def prepare_stream(model: nn.Module, tokenizer: Any, source: str | Path | Tensor | Sequence[int],
                   max_tokens: int | None, *, add_bos: bool = True) -> list[int]:
    """The token stream :func:`perplexity` scores: ``source`` cut to ``max_tokens``, with the
    BOS token in front when ``add_bos`` and the model or tokenizer has one."""
    ids = _token_stream(tokenizer, source, max_tokens)
    bos = _bos_id(model, tokenizer) if add_bos else None
    return [bos, *ids] if bos is not None else ids


DEFAULT_CONTEXT = 512
"""The window ``kbbq-pl eval`` and ``compare`` read by default (:func:`default_window`)."""


def window_shape(model: nn.Module, seq_len: int | None, stride: int | None) -> tuple[int, int]:
    """``(seq_len, stride)``: ``seq_len`` defaults to the model's ``max_position_embeddings``
    (:func:`max_context`), which it may not exceed, ``stride`` to half of it."""
    longest = max_context(model)
    if seq_len is None:
        if longest is None:
            raise ValueError("pass seq_len: the model's config has no max_position_embeddings")
        seq_len = longest
    else:
        check_context(model, seq_len, "a context (--context)")
    return seq_len, seq_len // 2 if stride is None else stride


def default_window(model: nn.Module, context: int | None,
                   stride: int | None) -> tuple[int, int]:
    """``(context, stride)`` of the command line: ``context`` defaults to
    :data:`DEFAULT_CONTEXT` tokens, or the model's ``max_position_embeddings`` where it reads
    fewer; ``stride`` to half of the context (:func:`window_shape`)."""
    if context is None:
        longest = max_context(model)
        context = DEFAULT_CONTEXT if longest is None else min(DEFAULT_CONTEXT, longest)
    return window_shape(model, context, stride)


def window_groups(windows: Sequence[Window], batch_size: int = 4) -> list[list[Window]]:
    """The forward passes of :func:`window_logits`: ``batch_size`` windows at a time, in order,
    or one at a time where their lengths differ (they stack into one batch only when equal)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    groups: list[list[Window]] = []
    for start in range(0, len(windows), batch_size):
        group = list(windows[start : start + batch_size])
        lengths = {end - begin for begin, _, end in group}
        groups.extend([group] if len(lengths) == 1 else [[w] for w in group])
    return groups


def window_batches(ids: Sequence[int], windows: Sequence[Window],
                   batch_size: int = 4) -> list[dict[str, Tensor]]:
    """:func:`window_groups`' forward passes as batches (``DataLoader(..., batch_size=None)``),
    e.g. to validate on held-out text inside ``Trainer.fit``: ``{"input_ids": [b, length],
    "first": [b]}``, ``first[r]`` the index in row ``r`` of its first scored position
    (:func:`scored_positions` pairs the targets with the model's logits)."""
    stream = torch.tensor(list(ids), dtype=torch.long)
    return [{"input_ids": torch.stack([stream[b:e] for b, _, e in group]),
             "first": torch.tensor([f - b for b, f, _ in group])}
            for group in window_groups(windows, batch_size)]


def scored_positions(batch: Mapping[str, Tensor], logits: Tensor) -> list[tuple[Tensor, Tensor]]:
    """For each row of a :func:`window_batches` batch and the model's ``logits`` on its
    ``input_ids``: ``(targets, predicted)``, the window's scored tokens and the logits (float32)
    that predict them, on ``logits``' device."""
    ids = batch["input_ids"]
    return [(ids[row, first:].to(logits.device), logits[row, first - 1 : ids.shape[1] - 1].float())
            for row, first in enumerate(batch["first"].tolist())]


def window_logits(
    model: nn.Module, ids: Sequence[int], windows: Sequence[Window],
    batch_size: int = 4,
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """For each of :func:`rolling_windows`' windows, in order: ``(first_target, targets,
    logits)``, the logits (float32) that predict ``ids[first_target:end]``."""
    device = _device(model)
    groups = window_groups(windows, batch_size)
    for group, batch in zip(groups, window_batches(ids, windows, batch_size)):
        # inference mode is thread-global: held across a ``yield`` it would leak into the
        # caller and, with two of these generators interleaved, outlive both
        with _eval_mode(model):
            logits = model(input_ids=batch["input_ids"].to(device)).logits
        for (_, first, _), (targets, predicted) in zip(group, scored_positions(batch, logits)):
            yield first, targets, predicted
