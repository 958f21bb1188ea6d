"""Peak memory and time of quantizing models of growing size: streamed from disk against
loaded in memory, in one run.

    python bench/scale.py [--sizes 0.25 0.5 1 2] [--methods rtn_kbbq gptq_kbbq] [--threads 1]
                          [--processes 1 2] [--no-table]
    python bench/scale.py --tiny     # one block of a tiny Llama, RTN-KBBQ, one process

1. For each size (GB of bf16 weights), saves a random-initialized Llama (hidden 1024, FFN 2816,
   16 heads, 4 KV heads, vocabulary 1024, tied embeddings; the depth sets the size, 22.4 MB a
   block) to a temporary folder as sharded bf16 safetensors (shards of 256 MB, as HuggingFace
   writes large models); the calibration tokens are fixed (seeded, ``--tokens``).
2. Quantizes each model with each method (RTN-KBBQ lambda 0.75 and GPTQ-KBBQ lambda 0.75 by
   default, ``rtn_kbbq_auto`` on request; NVFP4, static activation scales) in one subprocess
   per run, twice: streamed (:func:`kbbq_pl.io.streaming.quantize_checkpoint`, ``kbbq-pl
   quantize --stream``) and in memory (``load_model`` + ``quantize_model`` +
   ``save_quantized``, what ``kbbq-pl quantize`` does without ``--stream``).
3. Prints one table: the model's size, blocks, the peak RSS of each process (``VmHWM``: not
   ``ru_maxrss``, which a subprocess inherits from this large parent) and
   its time (imports excluded, loading and writing included), whether the two checkpoints hold
   the same tensors bit for bit, and the ratio of the largest to the smallest streamed peak.

4. Then (``--processes``) runs ``kbbq-pl quantize --stream`` on the smallest model with one
   process and under ``torchrun`` with two (gloo): wall time and whether the checkpoints are
   the one-process one bit for bit.

The subprocesses run one after another with ``--threads`` threads each; compare ratios taken
in the same run.  ``--tiny`` only checks that the script runs (tests/bench/test_tiny_modes.py):
both tables on one block of hidden size 64, 256 calibration tokens, RTN-KBBQ, one process,
eager kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _tiny
import torch

BLOCK = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 512,
         "tie_word_embeddings": True}
BLOCK_BYTES = 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816 + 2 * 1024)
TINY_BLOCK = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "tie_word_embeddings": True}
TINY = {"sizes": [0.0], "methods": ["rtn_kbbq"], "tokens": 256, "processes": [1]}
METHODS = {
    "rtn_kbbq": {"transform": {"name": "kbbq", "lam": 0.75}},
    "gptq_kbbq": {"weights": {"quantizer": "gptq"}, "transform": {"name": "kbbq", "lam": 0.75}},
    "rtn_kbbq_auto": {"transform": {"name": "kbbq", "lam": "auto"}},
}


def save_model(folder: Path, gigabytes: float, block: dict = BLOCK) -> int:
    """A random Llama of about ``gigabytes`` of bf16 weights in ``folder`` (blocks of
    ``BLOCK``'s size, at least one, each made as ``block`` says); returns its number of
    blocks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    blocks = max(1, round(gigabytes * 1e9 / BLOCK_BYTES))
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=blocks, **block)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="256MB")
    return blocks


def tensor_digest(folder: Path) -> str:
    from kbbq_pl.io.checkpoint import read_tensors

    digest = hashlib.sha256()
    for name, tensor in sorted(read_tensors(folder).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    from kbbq_pl.io.checkpoint import save_quantized
    from kbbq_pl.io.models import load_model
    from kbbq_pl.io.streaming import quantize_checkpoint
    from kbbq_pl.quant import QuantizationConfig, quantize_model
    from kbbq_pl.quant.report import peak_rss_mb

    config = QuantizationConfig.from_dict(METHODS[args.method])
    generator = torch.Generator().manual_seed(0)
    vocab = (TINY_BLOCK if args.tiny else BLOCK)["vocab_size"]
    ids = torch.randint(0, vocab, (args.tokens // 256, 256), generator=generator)
    batches = [{"input_ids": ids[i:i + 4]} for i in range(0, len(ids), 4)]
    start = time.perf_counter()
    if args.mode == "streamed":
        quantize_checkpoint(args.source, args.out, config, batches, progress=False)
    else:
        model, _ = load_model(args.source)
        quantize_model(model, batches, config, progress=False)
        save_quantized(model, args.out)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mb": peak_rss_mb()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--methods", nargs="+", default=["rtn_kbbq", "gptq_kbbq"],
                        choices=list(METHODS))
    parser.add_argument("--modes", nargs="+", default=["streamed", "memory"],
                        choices=["streamed", "memory"])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--processes", type=int, nargs="*", default=[1, 2],
                        help="process counts of the torchrun comparison (none: skip it)")
    parser.add_argument("--table", action=argparse.BooleanOptionalAction, default=True,
                        help="the streamed / in-memory table (--no-table: skip it)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"one block of hidden size 64, {TINY}, in seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.tiny:
        vars(args).update(TINY)
        _tiny.eager()
    if args.table:
        size_table(args)
    if args.processes:
        processes_table(args)


def size_table(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            source = Path(tmp) / f"llama-{size}"
            blocks = save_model(source, size, TINY_BLOCK if args.tiny else BLOCK)
            disk = sum(p.stat().st_size for p in source.glob("*.safetensors")) / 2**20
            for method in args.methods:
                row = {"size_mb": disk, "blocks": blocks, "method": method}
                digests = {}
                for mode in args.modes:
                    out = Path(tmp) / f"out-{size}-{method}-{mode}"
                    result = subprocess.run(
                        [sys.executable, __file__, "--worker", "--mode", mode, "--method",
                         method, "--source", str(source), "--out", str(out), "--tokens",
                         str(args.tokens), "--threads", str(args.threads),
                         *(["--tiny"] if args.tiny else [])],
                        capture_output=True, text=True, check=True)
                    row[mode] = json.loads(result.stdout.strip().splitlines()[-1])
                    digests[mode] = tensor_digest(out)
                    print(f"{size} GB {method} {mode}: {row[mode]}", flush=True)
                row["equal"] = len(set(digests.values())) == 1 if len(digests) > 1 else None
                rows.append(row)
    print("\n| bf16 weights (MiB) | blocks | method | streamed peak RSS (MiB) | in-memory peak RSS "
          "(MiB) | streamed s | in-memory s | streamed / in-memory time | same tensors |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        streamed, memory = row.get("streamed", {}), row.get("memory", {})
        ratio = (f"{streamed['seconds'] / memory['seconds']:.2f}x" if streamed and memory
                 else "")
        print(f"| {row['size_mb']:.0f} | {row['blocks']} | {row['method']} | "
              f"{streamed.get('peak_mb', float('nan')):.0f} | "
              f"{memory.get('peak_mb', float('nan')):.0f} | "
              f"{streamed.get('seconds', float('nan')):.1f} | "
              f"{memory.get('seconds', float('nan')):.1f} | {ratio} | {row['equal']} |")
    for method in args.methods:
        peaks = [r["streamed"]["peak_mb"] for r in rows if r["method"] == method
                 and "streamed" in r]
        if len(peaks) > 1:
            largest = [r for r in rows if r["method"] == method][-1]
            print(f"\n{method}: streamed peak RSS, largest / smallest model: "
                  f"{peaks[-1] / peaks[0]:.2f}; largest model's peak / its bf16 size: "
                  f"{peaks[-1] / largest['size_mb']:.2f}")


CLI_RECIPES = {"rtn_kbbq": "rtn_kbbq_nvfp4_lam0.75", "gptq_kbbq": "gptq_kbbq_nvfp4",
               "rtn_kbbq_auto": "rtn_kbbq_nvfp4_auto"}


def processes_table(args: argparse.Namespace) -> None:
    """``kbbq-pl quantize --stream`` on the smallest model with 1 process and under torchrun
    with more (gloo, ``--threads`` threads each): wall time of the command (imports and start
    included) and whether the checkpoints equal the one-process one bit for bit."""
    import shutil

    kbbq = shutil.which("kbbq-pl") or str(Path(sys.executable).with_name("kbbq-pl"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "llama"
        blocks = save_model(source, min(args.sizes), TINY_BLOCK if args.tiny else BLOCK)
        for method in args.methods:
            digests = {}
            for count in args.processes:
                out = Path(tmp) / f"out-{method}-{count}"
                command = [kbbq, "quantize", "--config", CLI_RECIPES[method], "--model",
                           str(source), "--stream", "--data.n_tokens", str(args.tokens),
                           "--data.seq_len", "256", "--data.batch_size", "1",
                           "--output_dir", str(out)]
                if count > 1:
                    command = [sys.executable, "-m", "torch.distributed.run",
                               "--nproc_per_node", str(count), "--master_port", "29561",
                               *command]
                start = time.perf_counter()
                subprocess.run(command, capture_output=True, text=True, check=True, env=env)
                seconds = time.perf_counter() - start
                digests[count] = tensor_digest(out)
                rows.append((method, count, seconds, digests[count] == digests[args.processes[0]]))
                print(f"{method} {count} process(es): {seconds:.1f} s", flush=True)
    print(f"\n`kbbq-pl quantize --stream`, {blocks} blocks, {args.tokens} calibration tokens in "
          f"batches of one sequence, {args.threads} thread(s) per process\n")
    print("| method | processes | wall s | same tensors as 1 process |\n|---|---:|---:|---|")
    for method, count, seconds, same in rows:
        print(f"| {method} | {count} | {seconds:.1f} | {same} |")


if __name__ == "__main__":
    main()
