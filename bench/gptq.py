"""kbbq-pl side by side with llm-compressor, NVFP4 W4A4, in one run: GPTQ and round to nearest.

    python bench/gptq.py [--llmc-python /work/venvs/llmc/bin/python] [--layers 4]
                         [--methods gptq rtn gptq_kbbq rtn_kbbq] ...
    python bench/gptq.py --tiny     # kbbq-pl's GPTQ and GPTQ-KBBQ on a one-layer Llama only

llm-compressor is not a dependency of kbbq-pl: install it in a virtual environment of its own
(``python3 -m venv /work/venvs/llmc && /work/venvs/llmc/bin/pip install torch==2.13.0
llmcompressor``) and pass its python.  The script

1. builds a random-initialized Llama from a config with a fixed seed (hidden 1024, FFN 2752,
   4 layers, 16 heads, vocabulary 32000), saves it once to a temporary folder, and draws the
   calibration and held-out token blocks (seeded, uniform over the vocabulary);
2. quantizes it in one subprocess per tool and method, each loading the same folder and
   tokens, NVFP4 weights and activations with a static activation per-tensor scale:
   * GPTQ: kbbq-pl (``quantize_model``, ``weights.quantizer: gptq``, identity transform)
     against llm-compressor (``oneshot`` with ``GPTQModifier(scheme="NVFP4")``); both use
     group 16, NVFP4's per-tensor scale, lazy blocks of 128 columns, damping 0.01, act-order
     with scales fixed before the loop, the sequential per-layer pipeline, W4A4 propagation;
   * RTN: kbbq-pl's round to nearest with the identity transform against llm-compressor's
     ``QuantizationModifier(scheme="NVFP4")``;
   * GPTQ-KBBQ and RTN-KBBQ (kbbq-pl only, lambda 0.75, as the shipped recipes run them):
     their cost over the identity versions;
3. compares, per linear layer, the relative output error on held-out inputs with only that
   layer's weight quantized: ``||X (W_q - W)^T||^2 / ||X W^T||^2``, ``X`` the layer's inputs in
   the full-precision model on the held-out tokens (identity versions only);
4. prints one table: wall time of the quantization call (model loading and imports excluded);
   "to disk": that plus writing the compressed-tensors checkpoint vLLM serves (kbbq-pl's
   ``save_compressed_tensors``, llm-compressor's ``save_pretrained(save_compressed=True)``,
   which is where llm-compressor rounds and packs the weights that its RTN only calibrated
   scales for); peak RSS of each process, mean error, the ratios, and both phase timers.

Every subprocess runs with the same number of threads (``--threads``); kbbq-pl runs its eager
rounding kernels unless ``--compile``.  The subprocesses run one after another: run the script
on an otherwise idle machine, or compare only ratios taken in the same run.  ``--tiny`` only
checks that the script runs (tests/bench/test_tiny_modes.py): kbbq-pl's side alone (no
llm-compressor), GPTQ and GPTQ-KBBQ on a Llama of one layer of hidden size 64, 64 calibration
and 32 held-out tokens.
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
TINY = {"hidden": 64, "intermediate": 128, "layers": 1, "heads": 4, "vocab": 256,
        "calib_tokens": 64, "heldout_tokens": 32, "seq_len": 32, "batch_size": 2,
        "methods": ["gptq", "gptq_kbbq"]}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _batches(ids: torch.Tensor, size: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids[i:i + size], "attention_mask": torch.ones_like(ids[i:i + size])}
            for i in range(0, len(ids), size)]


# ----------------------------------------------------------------------------- workers


def _timed_save(save, folder: Path, name: str) -> float:
    """Seconds to write the quantized model as the compressed-tensors checkpoint a server
    reads (packed FP4 codes and scales), into ``folder / name`` (deleted after): llm-compressor
    rounds and packs its weights there, kbbq-pl already did while quantizing."""
    import shutil

    out = folder / f"{name}_checkpoint"
    start = time.perf_counter()
    save(out)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds


OUR_METHODS = ("gptq", "rtn", "gptq_kbbq", "rtn_kbbq")
THEIR_METHODS = ("gptq", "rtn")
LABELS = {"gptq": "GPTQ", "rtn": "RTN", "gptq_kbbq": "GPTQ-KBBQ", "rtn_kbbq": "RTN-KBBQ"}


def our_config(method: str, args: argparse.Namespace):
    """kbbq-pl's recipe for ``method``: NVFP4 W4A4 with a static activation scale; GPTQ with
    llm-compressor's settings (group 16, lazy blocks of 128, damping 0.01, act-order with
    static scales); the KBBQ versions as the shipped recipes run them (lambda 0.75; GPTQ-KBBQ
    refits the transform in the loop, in column order, without act-order)."""
    from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig, WeightsConfig

    kbbq = method.endswith("_kbbq")
    transform = TransformConfig("kbbq" if kbbq else "identity", lam=0.75)
    if method.startswith("gptq"):
        weights = WeightsConfig("gptq", damping=0.01, block_size=128,
                                act_order=None if kbbq else True,
                                group_scales=args.group_scales, scale_search="minmax")
    else:
        weights = WeightsConfig("rtn")
    return QuantizationConfig(format=FormatConfig("nvfp4", act_scale="static"),
                              transform=transform, weights=weights)


def run_ours(folder: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from kbbq_pl.io.compressed_tensors import save_compressed_tensors
    from kbbq_pl.quant import quantize_model
    from kbbq_pl.quant.layers import quantized_linears

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    calib = torch.load(folder / "calib.pt")
    config = our_config(args.method, args)
    start = time.perf_counter()
    report = quantize_model(model, _batches(calib, args.batch_size), config, progress=False)
    seconds = time.perf_counter() - start
    save_seconds = _timed_save(lambda out: save_compressed_tensors(model, out), folder,
                               f"ours_{args.method}")
    weights = {}  # errors are compared for the identity versions, where Q(W T^-1) = Q(W)
    if config.transform.name == "identity":
        weights = {name: layer.dequantized_weight(torch.float32)[:, :layer.in_features]
                   for name, layer in quantized_linears(model).items()}
    torch.save(weights, folder / f"ours_{args.method}.pt")
    return {"seconds": seconds, "save_seconds": save_seconds, "peak_rss_mb": _peak_rss_mb(),
            "phases": {k: round(v, 2) for k, v in report.seconds.items()}}


def run_llmc(folder: Path, args: argparse.Namespace) -> dict:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    calib = torch.load(folder / "calib.pt")
    dataset = Dataset.from_dict({"input_ids": calib.tolist(),
                                 "attention_mask": torch.ones_like(calib).tolist()})
    if args.method == "gptq":
        recipe = GPTQModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"],
                              block_size=128, dampening_frac=0.01, actorder="static")
    else:
        recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
    # the tokens are given: oneshot only insists on having a processor object
    processor = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>", pad_token="<unk>")
    phases = _time_llmc_phases()
    start = time.perf_counter()
    oneshot(model=model, dataset=dataset, recipe=recipe, processor=processor,
            num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], batch_size=args.batch_size,
            shuffle_calibration_samples=False, pipeline="sequential")
    seconds = time.perf_counter() - start
    phases["other"] = seconds - sum(phases.values())
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
    torch.save(weights, folder / f"llmc_{args.method}.pt")
    save_seconds = _timed_save(lambda out: model.save_pretrained(out, save_compressed=True),
                               folder, f"llmc_{args.method}")
    return {"seconds": seconds, "save_seconds": save_seconds, "peak_rss_mb": _peak_rss_mb(),
            "weights_on_grid": idempotent,
            "phases": {k: round(v, 2) for k, v in phases.items()}}


def _time_llmc_phases() -> dict[str, float]:
    """Time llm-compressor's phases by wrapping its functions: its sequential pipeline's block
    forwards, with the calibration hooks on (``calibration``: forward + Hessian / observer
    hooks) or off (``propagation``), the end of each block's calibration (``quantize``: GPTQ's
    ``compress_modules`` or RTN's scales, run from ``sequential_epoch_end``) and the graph
    tracing (``tracing``)."""
    from llmcompressor.core import LifecycleCallbacks
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.pipelines.sequential import helpers, pipeline

    phases = dict.fromkeys(("calibration", "propagation", "quantize", "tracing"), 0.0)

    def timed(function, phase):
        def run(*args, **kwargs):
            key = phase() if callable(phase) else phase
            tick = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phases[key] += time.perf_counter() - tick
        return run

    helpers.Subgraph.forward = timed(
        helpers.Subgraph.forward,
        lambda: "propagation" if HooksMixin._HOOKS_DISABLED else "calibration")
    LifecycleCallbacks.sequential_epoch_end = timed(LifecycleCallbacks.sequential_epoch_end,
                                                    "quantize")
    pipeline.trace_subgraphs = timed(pipeline.trace_subgraphs, "tracing")
    return phases


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


def worker(kind: str, method: str, python: str, folder: Path, args: argparse.Namespace
           ) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT) if kind == "ours" else "",
           "KBBQ_PL_COMPILE": "1" if args.compile else "0"}
    command = [python, str(Path(__file__).resolve()), "--worker", kind, "--folder", str(folder),
               "--batch-size", str(args.batch_size), "--group-scales", args.group_scales,
               "--method", method]
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


def _to_disk(run: dict) -> float:
    """Quantization call plus writing the compressed-tensors checkpoint."""
    return run["seconds"] + run["save_seconds"]


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
    parser.add_argument("--methods", nargs="+", default=list(OUR_METHODS),
                        choices=list(OUR_METHODS),
                        help="what to run (llm-compressor runs gptq and rtn)")
    parser.add_argument("--method", choices=list(OUR_METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["ours", "llmc"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true",
                        help=f"kbbq-pl's side only, {TINY}, in seconds")
    args = parser.parse_args()
    if args.worker:
        result = (run_ours if args.worker == "ours" else run_llmc)(args.folder, args)
        print(json.dumps(result))
        return
    if args.tiny:
        vars(args).update(TINY)
        print("llm-compressor: skipped (--tiny runs kbbq-pl's side only)")

    with tempfile.TemporaryDirectory(prefix="kbbq_gptq_bench_") as tmp:
        folder = Path(tmp)
        build(folder, args)
        runs = {("ours", m): worker("ours", m, sys.executable, folder, args)
                for m in args.methods if m in OUR_METHODS}
        runs.update({("llmc", m): worker("llmc", m, args.llmc_python, folder, args)
                     for m in args.methods if m in THEIR_METHODS and not args.tiny})
        weights = {f"{tool}_{m}": torch.load(folder / f"{tool}_{m}.pt") for tool, m in runs
                   if not m.endswith("_kbbq")}
        errors = layer_errors(folder, weights)

    print(f"NVFP4 W4A4 (group 16, per-tensor scales, static activation scale), random-init "
          f"Llama: hidden {args.hidden}, FFN {args.intermediate}, {args.layers} layers, vocab "
          f"{args.vocab}; calibration {args.calib_tokens} tokens, held-out "
          f"{args.heldout_tokens} tokens, {args.threads} thread(s) per process")
    print(f"{'':30}{'wall (s)':>10}{'to disk (s)':>13}{'peak RSS (MiB)':>16}"
          f"{'mean error':>12}")
    mean_error = {key: sum(r[key] for r in errors.values()) / len(errors)
                  for key in weights}
    for (tool, m), run in runs.items():
        name = f"{'kbbq-pl' if tool == 'ours' else 'llm-compressor'} {LABELS[m]}"
        error = mean_error.get(f"{tool}_{m}")
        print(f"{name:30}{run['seconds']:10.1f}{_to_disk(run):13.1f}{run['peak_rss_mb']:16.0f}"
              + (f"{error:12.3e}" if error is not None else f"{'':>12}"))
    print("ratios:")
    pairs = [(("ours", m), ("llmc", m), f"kbbq-pl / llm-compressor, {LABELS[m]}")
             for m in THEIR_METHODS]
    pairs += [(("ours", f"{m}_kbbq"), ("ours", m), f"{LABELS[m]}-KBBQ / {LABELS[m]} (kbbq-pl)")
              for m in THEIR_METHODS]
    for a, b, label in pairs:
        if a in runs and b in runs:
            line = (f"  {label:44} wall {runs[a]['seconds'] / runs[b]['seconds']:.2f}x, "
                    f"to disk {_to_disk(runs[a]) / _to_disk(runs[b]):.2f}x, "
                    f"RSS {runs[a]['peak_rss_mb'] / runs[b]['peak_rss_mb']:.2f}x")
            ka, kb = "_".join(a), "_".join(b)
            if ka in mean_error and kb in mean_error:
                line += f", mean error {mean_error[ka] / mean_error[kb]:.3f}x"
            print(line)
    for m in THEIR_METHODS:
        ka, kb = f"ours_{m}", f"llmc_{m}"
        if ka not in weights or kb not in weights:
            continue
        ratios = [row[ka] / row[kb] for row in errors.values()]
        geo = float(torch.tensor(ratios).log().mean().exp())
        print(f"{LABELS[m]} per-layer error ratio ours/theirs: geometric mean {geo:.3f}, "
              f"ours <= theirs in {sum(r <= 1 for r in ratios)} / {len(ratios)} layers")
    for (tool, m), run in runs.items():
        print(f"{'kbbq-pl' if tool == 'ours' else 'llm-compressor'} {LABELS[m]} phases (s): "
              f"{run.get('phases')}")


if __name__ == "__main__":
    main()
