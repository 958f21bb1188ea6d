"""A sequence alone and in a batch: how much a W4A4 model's output depends on its batch.

    python bench/batch_composition.py [--model smollm2] [--recipe rtn_kbbq_nvfp4_lam0.75]
        [--pieces 16] [--batch-size 8] [--new-tokens 16] [--calibration-tokens 4096]
    python bench/batch_composition.py --tiny     # a tiny random Llama, 4 pieces, 4 tokens

A product's float sums are ordered by its shape, so a row's output changes in the last bits
with the rows beside it, at full precision as in FP4; rounding the activations to FP4 can turn
such a bit into another code, and the sequence goes on with another rounding.  This bench
takes ``--pieces`` WikiText-2 test paragraphs, cut to 40, 48, 56 and 64 tokens in turn, and
runs each alone and in left-padded batches of ``--batch-size``, for the full-precision model
and the recipe's quantized one (emulated on the CPU).  Per model it prints

* ``KL alone`` / ``KL batched``: the mean next-token KL(p_FP || p) over every position, the
  pieces run alone / batched (p_FP: the full-precision model alone);
* ``KL alone||batched`` and ``argmax``: how far the two runs are apart, and the share of
  positions whose most likely token is the same;
* ``greedy differ``: of the pieces' first 8 tokens, continued greedily for ``--new-tokens``
  tokens alone and batched, how many continuations differ.

Deterministic (seeded calibration, greedy decoding).  ``--tiny`` only checks that the script
runs (tests/bench/test_tiny_modes.py).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import _tiny
import torch
from torch import Tensor

from kbbq_pl.cli.compare import load_recipe
from kbbq_pl.cli.quantize import calibration_batches
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import quantize_model
from kbbq_pl.quant.w4a4 import cache_decoded_weights

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TINY = {"pieces": 4, "batch_size": 2, "new_tokens": 4, "calibration_tokens": 256}


def pieces(tokenizer, path: Path, count: int) -> list[list[int]]:
    """The first ``count`` paragraphs of ``path`` long enough, as 40, 48, 56, 64 tokens in turn."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the pieces are WikiText-2 test paragraphs "
                         "(../shared/data/wikitext2/test.txt)")
    out = []
    for line in path.open(encoding="utf-8"):
        ids = tokenizer(line.strip(), add_special_tokens=False)["input_ids"]
        if len(ids) >= 64:
            out.append(ids[:40 + 8 * (len(out) % 4)])
        if len(out) == count:
            return out
    raise SystemExit(f"{path} has fewer than {count} paragraphs of 64 tokens")


@torch.no_grad()
def log_probs(model, tokenizer, ids: list[list[int]], batch_size: int) -> list[Tensor]:
    """Each piece's next-token log-probabilities, the pieces in left-padded batches."""
    out = []
    for start in range(0, len(ids), batch_size):
        batch = tokenizer.pad({"input_ids": ids[start:start + batch_size]}, return_tensors="pt")
        logits = model(**batch).logits.float().log_softmax(-1)
        out += [row[-len(piece):] for row, piece in zip(logits, ids[start:start + batch_size],
                                                        strict=True)]
    return out


@torch.no_grad()
def greedy(model, tokenizer, ids: list[list[int]], new_tokens: int,
           batch_size: int) -> list[list[int]]:
    """Greedy continuations of exactly ``new_tokens`` ids, in left-padded batches."""
    out = []
    for start in range(0, len(ids), batch_size):
        batch = tokenizer.pad({"input_ids": ids[start:start + batch_size]}, return_tensors="pt")
        tokens = model.generate(**batch, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
        out += tokens[:, batch["input_ids"].shape[1]:].tolist()
    return out


def kl(p: list[Tensor], q: list[Tensor]) -> Tensor:
    """KL(p || q) at every position of every piece (a float sum: clamped at 0)."""
    terms = [(a.exp() * (a - b)).sum(-1) for a, b in zip(p, q, strict=True)]
    return torch.cat(terms).clamp(min=0)


def row(model, tokenizer, ids: list[list[int]], reference: list[Tensor],
        args: argparse.Namespace) -> dict[str, float]:
    """The table's columns for ``model``."""
    alone = log_probs(model, tokenizer, ids, 1)
    batched = log_probs(model, tokenizer, ids, args.batch_size)
    prompts = [piece[:8] for piece in ids]
    differ = sum(a != b for a, b in zip(greedy(model, tokenizer, prompts, args.new_tokens, 1),
                                        greedy(model, tokenizer, prompts, args.new_tokens,
                                               args.batch_size), strict=True))
    argmax = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(alone, batched,
                                                                     strict=True)])
    return {"alone": kl(reference, alone).mean().item(),
            "batched": kl(reference, batched).mean().item(),
            "apart": kl(alone, batched).mean().item(),
            "argmax": argmax.float().mean().item(), "differ": differ}


def table(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(args.model, causal=True, quantized="refuse")
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    ids = pieces(tokenizer, Path(args.text), args.pieces)
    reference = log_probs(model, tokenizer, ids, 1)
    rows = {"full precision": row(model, tokenizer, ids, reference, args)}
    data, config, stem = load_recipe(args.recipe, args.model,
                                     {"n_tokens": args.calibration_tokens})
    quantized = copy.deepcopy(model)
    quantize_model(quantized, calibration_batches(data, model, tokenizer, torch.device("cpu"),
                                                  args.model), config, progress=False)
    with cache_decoded_weights():
        rows[stem] = row(quantized.eval(), tokenizer, ids, reference, args)
    print(f"\n{args.model}: {args.pieces} WikiText-2 pieces of 40 to 64 tokens, alone and in "
          f"left-padded batches of {args.batch_size}; greedy {args.new_tokens} tokens")
    print(f"{'model':<28}{'KL alone':>10}{'KL batched':>12}{'KL alone||batched':>19}"
          f"{'argmax':>8}{'greedy differ':>15}")
    for name, r in rows.items():
        print(f"{name:<28}{r['alone']:10.4f}{r['batched']:12.4f}{r['apart']:19.4f}"
              f"{r['argmax']:8.3f}{r['differ']:>9} of {args.pieces}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--recipe", default="rtn_kbbq_nvfp4_lam0.75")
    parser.add_argument("--pieces", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--text", default=str(DATA / "wikitext2" / "test.txt"))
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random Llama, {TINY}, eager kernels, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return table(args)
    vars(args).update(TINY)
    _tiny.eager()
    with tempfile.TemporaryDirectory(prefix="kbbq-batch-composition-") as tmp:
        vars(args).update(model=str(_tiny.save_tiny_model(Path(tmp) / "tiny")),
                          text=str(_tiny.wikitext_file()))
        table(args)


if __name__ == "__main__":
    main()
