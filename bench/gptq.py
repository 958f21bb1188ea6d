"""kbbq-pl's GPTQ side by side with llm-compressor's GPTQModifier, NVFP4 weights, one run.

    python bench/gptq.py [--llmc-python /work/venvs/llmc/bin/python] [--layers 4] ...

llm-compressor is not a dependency of kbbq-pl: install it in a virtual environment of its own
(``python3 -m venv /work/venvs/llmc && /work/venvs/llmc/bin/pip install torch==2.13.0
llmcompressor``) and pass its python.  The script

1. builds a random-initialized Llama from a config with a fixed seed (hidden 1024, FFN 2752,
   4 layers, 16 heads, vocabulary 32000), saves it once to a temporary folder, and draws the
   calibration and held-out token blocks (seeded, uniform over the vocabulary);
2. quantizes it in two subprocesses, each loading the same folder and tokens: kbbq-pl
   (``quantize_model`` with ``weight_quantizer="gptq"``, identity transform, NVFP4) and
   llm-compressor (``oneshot`` with ``GPTQModifier(scheme="NVFP4")``); both use group 16,
   NVFP4's per-tensor scale, lazy blocks of 128 columns, damping 0.01, act-order with scales
   fixed before the loop, the sequential per-layer pipeline, and W4A4 propagation;
3. compares, per linear layer, the relative output error on held-out inputs with only that
   layer's weight quantized: ``||X (W_q - W)^T||^2 / ||X W^T||^2``, ``X`` the layer's inputs in
   the full-precision model on the held-out tokens;
4. prints one table: wall time of the quantization call (model loading and imports excluded),
   peak RSS of each process, per-layer errors, and the ratios ours / theirs.

Both subprocesses run with the same number of threads (``--threads``); kbbq-pl runs its eager
rounding kernels unless ``--compile`` (compiling costs seconds once per process, more than it
saves on a model this small).  The two GPTQs implement the same algorithm with the same
conventions, so per-layer errors agree to a fraction of a percent on the first block (identical
inputs) and differ by a few percent either way later, where each tool calibrates on the outputs
of its own quantized blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _batches(ids: torch.Tensor, size: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids[i:i + size], "attention_mask": torch.ones_like(ids[i:i + size])}
            for i in range(0, len(ids), size)]


# ----------------------------------------------------------------------------- workers


def run_ours(folder: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from kbbq_pl.quant import QuantizationConfig, quantize_model
    from kbbq_pl.quant.layers import quantized_linears

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    calib = torch.load(folder / "calib.pt")
    config = QuantizationConfig(format="nvfp4", transform="identity", weight_quantizer="gptq",
                                gptq_damping=0.01, gptq_block_size=128, act_order=True,
                                group_scales=args.group_scales, scale_search="minmax",
                                act_scale="static")
    start = time.perf_counter()
    report = quantize_model(model, _batches(calib, args.batch_size), config, progress=False)
    seconds = time.perf_counter() - start
    weights = {name: layer.dequantized_weight(torch.float32)[:, :layer.in_features]
               for name, layer in quantized_linears(model).items()}
    torch.save(weights, folder / "ours.pt")
    return {"seconds": seconds, "peak_rss_mb": _peak_rss_mb(),
            "phases": {k: round(v, 2) for k, v in report.seconds.items()}}


def run_llmc(folder: Path, args: argparse.Namespace) -> dict:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    calib = torch.load(folder / "calib.pt")
    dataset = Dataset.from_dict({"input_ids": calib.tolist(),
                                 "attention_mask": torch.ones_like(calib).tolist()})
    recipe = GPTQModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"], block_size=128,
                          dampening_frac=0.01, actorder="static")
    # the tokens are given: oneshot only insists on having a processor object
    processor = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>", pad_token="<unk>")
    start = time.perf_counter()
    oneshot(model=model, dataset=dataset, recipe=recipe, processor=processor,
            num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], batch_size=args.batch_size,
            shuffle_calibration_samples=False, pipeline="sequential")
    seconds = time.perf_counter() - start
    weights = {}
    idempotent = True
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or not hasattr(module, "weight_scale"):
                continue
            q = fake_quantize(module.weight, module.weight_scale, module.weight_zero_point,
                              scheme.weights, global_scale=getattr(module, "weight_global_scale",
                                                                   None))
            idempotent &= bool(torch.equal(q, module.weight))
            weights[name] = q.float()
    torch.save(weights, folder / "llmc.pt")
    return {"seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "weights_on_grid": idempotent}


# ------------------------------------------------------------------------------ parent


def build(folder: Path, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=max(2048, args.seq_len))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.calib_tokens // args.seq_len + args.heldout_tokens
                                        // args.seq_len, args.seq_len), generator=g)
    calib_rows = args.calib_tokens // args.seq_len
    torch.save(ids[:calib_rows].clone(), folder / "calib.pt")
    torch.save(ids[calib_rows:].clone(), folder / "heldout.pt")


def worker(kind: str, python: str, folder: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT) if kind == "ours" else "",
           "KBBQ_PL_COMPILE": "1" if args.compile else "0"}
    command = [python, str(Path(__file__).resolve()), "--worker", kind, "--folder", str(folder),
               "--batch-size", str(args.batch_size), "--group-scales", args.group_scales]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"the {kind} worker failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


@torch.no_grad()
def layer_errors(folder: Path, weights: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict]:
    """Relative output error of each linear on held-out inputs, only that layer quantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    heldout = torch.load(folder / "heldout.pt")
    names = sorted(set.intersection(*(set(w) for w in weights.values())),
                   key=lambda n: list(dict(model.named_modules())).index(n))
    sums = {name: {kind: torch.zeros((), dtype=torch.float64) for kind in [*weights, "energy"]}
            for name in names}
    modules = dict(model.named_modules())

    def hook(module, args, name):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        w = module.weight.double()
        sums[name]["energy"] += (x @ w.T).square().sum()
        for kind, table in weights.items():
            sums[name][kind] += (x @ (table[name].double() - w).T).square().sum()

    handles = [modules[n].register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n))
               for n in names]
    for start in range(0, len(heldout), 4):
        model(input_ids=heldout[start:start + 4])
    for handle in handles:
        handle.remove()
    return {name: {kind: float(s[kind] / s["energy"]) for kind in weights} for name, s in
            sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llmc-python", default="/work/venvs/llmc/bin/python")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2752)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--heldout-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-scales", choices=["static", "dynamic"], default="static",
                        help="kbbq-pl's GPTQ block scales (llm-compressor's are static)")
    parser.add_argument("--compile", action="store_true",
                        help="kbbq-pl's torch.compile'd rounding kernels (default: eager; "
                             "compiling costs seconds once per process)")
    parser.add_argument("--worker", choices=["ours", "llmc"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = (run_ours if args.worker == "ours" else run_llmc)(args.folder, args)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory(prefix="kbbq_gptq_bench_") as tmp:
        folder = Path(tmp)
        build(folder, args)
        ours = worker("ours", sys.executable, folder, args)
        theirs = worker("llmc", args.llmc_python, folder, args)
        weights = {"ours": torch.load(folder / "ours.pt"), "llmc": torch.load(folder / "llmc.pt")}
        errors = layer_errors(folder, weights)

    print(f"GPTQ, NVFP4 weights (group 16, per-tensor scale), random-init Llama: hidden "
          f"{args.hidden}, FFN {args.intermediate}, {args.layers} layers, vocab {args.vocab}; "
          f"calibration {args.calib_tokens} tokens, held-out {args.heldout_tokens} tokens, "
          f"{args.threads} thread(s) per process")
    print(f"{'':28}{'kbbq-pl':>14}{'llm-compressor':>16}{'ours/theirs':>13}")
    print(f"{'wall time (s)':28}{ours['seconds']:14.1f}{theirs['seconds']:16.1f}"
          f"{ours['seconds'] / theirs['seconds']:13.2f}")
    print(f"{'peak RSS (MiB)':28}{ours['peak_rss_mb']:14.0f}{theirs['peak_rss_mb']:16.0f}"
          f"{ours['peak_rss_mb'] / theirs['peak_rss_mb']:13.2f}")
    ratios = []
    print("per-layer relative output error on held-out inputs (only that layer quantized):")
    for name, row in errors.items():
        ratio = row["ours"] / row["llmc"]
        ratios.append(ratio)
        print(f"  {name:36}{row['ours']:12.3e}{row['llmc']:16.3e}{ratio:13.3f}")
    geo = float(torch.tensor(ratios).log().mean().exp())
    mean_ours = sum(r["ours"] for r in errors.values()) / len(errors)
    mean_llmc = sum(r["llmc"] for r in errors.values()) / len(errors)
    print(f"{'mean error':28}{mean_ours:14.3e}{mean_llmc:16.3e}{mean_ours / mean_llmc:13.3f}")
    print(f"geometric mean of per-layer ratios {geo:.3f}; layers with ours <= theirs: "
          f"{sum(r <= 1 for r in ratios)} / {len(ratios)}")
    first = [r for name, r in zip(errors, ratios) if ".layers.0." in name]
    print(f"first block (the same full-precision inputs in both): ratios {min(first):.3f} to "
          f"{max(first):.3f}; later blocks calibrate on each tool's own quantized outputs")
    print(f"kbbq-pl phases (s): {ours['phases']}; llm-compressor weights on their grid: "
          f"{theirs['weights_on_grid']}")


if __name__ == "__main__":
    main()
