"""Greedy generation of an emulated W4A4 causal LM against its FP model: how long the quantized
model's answer follows the FP model's, and how likely the FP model finds what it wrote.

    python bench/generation_agreement.py [--model smollm2]
        [--recipes rtn_kbbq_nvfp4_lam0.75,rtn_wush_nvfp4] [--seeds 0,1,2]
        [--prompts 64] [--new-tokens 64] [--calibration-tokens 4096] [--out FILE.json]
    python bench/generation_agreement.py --tiny     # a tiny random Llama, 2 prompts, 4 tokens

Perplexity and KL score one next token at a time on given text; the paper's interior optimum of
the brake is carried by its generation tasks (GSM8K, MBPP), where errors compound over the
model's own output.  This bench measures that side on a model too small to solve GSM8K: the
first ``--prompts`` GSM8K test questions (``../shared/data/gsm8k/test.jsonl``), each in the
model's chat template, answered greedily for ``--new-tokens`` tokens by the FP model and by each
recipe (each calibration seed quantizes a fresh copy; the recipe's calibration corpus, budget
``--calibration-tokens``).  Per recipe and seed it prints

* ``prefix``: mean number of leading tokens equal to the FP model's answer (``--new-tokens``
  when the whole answer matches), and ``match``: the share of answers that match in full;
* ``agree``: the share of positions whose token equals the FP model's at the same position;
* ``FP NLL``: the FP model's mean negative log-likelihood (nats per token) of the quantized
  model's answer, against the same for the FP model's own answer (how plausible, to the FP
  model, the text the quantized model wrote is).

Deterministic: greedy decoding, seeded calibration, one thread recommended
(``OMP_NUM_THREADS=1``) for bit-reproducible numbers.  ``--tiny`` only checks that the script
runs (tests/bench/test_tiny_modes.py): a tiny random Llama with a byte-level tokenizer and a
chat template, two GSM8K-style questions, 256 calibration tokens, eager kernels.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from statistics import mean

import _tiny
import torch

from kbbq_pl.cli.compare import load_recipe
from kbbq_pl.cli.quantize import calibration_batches
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import quantize_model
from kbbq_pl.quant.w4a4 import cache_decoded_weights

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TINY = {"seeds": "0", "prompts": 2, "new_tokens": 4, "batch_size": 2, "calibration_tokens": 256}


def chat_prompts(tokenizer, path: Path, count: int) -> list[str]:
    """The first ``count`` GSM8K questions, each as one user turn of the chat template."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the prompts are GSM8K test questions "
                         "(../shared/data/gsm8k/test.jsonl)")
    questions = [json.loads(line)["question"] for line in path.open(encoding="utf-8")][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], new_tokens: int,
                   batch_size: int) -> list[list[int]]:
    """Greedy continuations of exactly ``new_tokens`` ids each (``min_new_tokens`` masks EOS,
    so no answer ends early and all have the same length), left-padded batches."""
    answers: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        out = model.generate(**batch, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
        answers += out[:, batch["input_ids"].shape[1]:].tolist()
    return answers


@torch.no_grad()
def fp_nll(model, tokenizer, prompts: list[str], answers: list[list[int]]) -> float:
    """The FP model's mean negative log-likelihood per answer token, given each prompt."""
    total, count = 0.0, 0
    for prompt, answer in zip(prompts, answers, strict=True):
        context = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = torch.cat([context, torch.tensor([answer])], dim=1)
        logits = model(input_ids=ids).logits[0, context.shape[1] - 1:-1].float()
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(answer),
                                                   reduction="sum").item()
        count += len(answer)
    return total / count


def agreement(reference: list[list[int]], answers: list[list[int]]) -> dict[str, float]:
    """Leading-prefix length, full-match share and per-position agreement with ``reference``."""
    prefixes, positions = [], []
    for want, got in zip(reference, answers, strict=True):
        same = [a == b for a, b in zip(want, got, strict=True)]
        prefixes.append(same.index(False) if False in same else len(same))
        positions.append(sum(same) / len(same))
    return {"prefix": mean(prefixes), "match": mean(p == len(r) for p, r in
                                                     zip(prefixes, reference, strict=True)),
            "agree": mean(positions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--recipes", default="rtn_kbbq_nvfp4_lam0.75,rtn_wush_nvfp4")
    parser.add_argument("--seeds", default="0", help="calibration seeds, comma-separated")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--questions", default=str(DATA / "gsm8k" / "test.jsonl"))
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random Llama, {TINY}, eager kernels, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return agreement_table(args)
    vars(args).update(TINY)
    _tiny.eager()
    with tempfile.TemporaryDirectory(prefix="kbbq-generation-agreement-") as tmp:
        vars(args).update(model=str(_tiny.save_tiny_model(Path(tmp) / "tiny")),
                          questions=str(_tiny.save_gsm8k(Path(tmp) / "test.jsonl")))
        agreement_table(args)


def agreement_table(args: argparse.Namespace) -> None:
    """Answer the prompts of ``args`` with the FP model and each recipe and seed, print the
    table (and write the rows to ``args.out``)."""
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    model, tokenizer = load_model(args.model, causal=True, quantized="refuse")
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = chat_prompts(tokenizer, Path(args.questions), args.prompts)
    reference = greedy_answers(model, tokenizer, prompts, args.new_tokens, args.batch_size)
    rows = [{"recipe": "FP", "seed": None, **agreement(reference, reference),
             "fp_nll": fp_nll(model, tokenizer, prompts, reference)}]
    for name in [r for r in args.recipes.split(",") if r]:
        for seed in seeds:
            begin = time.perf_counter()
            data, config, stem = load_recipe(
                name, args.model, {"n_tokens": args.calibration_tokens, "seed": seed})
            quantized = copy.deepcopy(model)
            batches = calibration_batches(data, model, tokenizer, torch.device("cpu"), args.model)
            quantize_model(quantized, batches, config, progress=False)
            quantized.eval()
            with cache_decoded_weights():
                answers = greedy_answers(quantized, tokenizer, prompts, args.new_tokens,
                                         args.batch_size)
            rows.append({"recipe": stem, "seed": seed, **agreement(reference, answers),
                         "fp_nll": fp_nll(model, tokenizer, prompts, answers),
                         "seconds": time.perf_counter() - begin})
            print(json.dumps(rows[-1]), flush=True)
            del quantized
    print(f"\n{args.model}: {args.prompts} GSM8K test questions (chat template), "
          f"{args.new_tokens} greedy tokens; calibration {args.calibration_tokens} tokens")
    print(f"{'recipe':<28}{'seed':>6}{'prefix':>9}{'match':>8}{'agree':>8}{'FP NLL':>9}")
    for row in rows:
        seed = "" if row["seed"] is None else row["seed"]
        print(f"{row['recipe']:<28}{seed:>6}{row['prefix']:9.2f}{row['match']:8.3f}"
              f"{row['agree']:8.3f}{row['fp_nll']:9.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
