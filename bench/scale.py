"""Peak memory and time of ``kbbq-pl quantize`` on models of growing size: the default, ``--stream``
and the previous default (``--no-stream --dtype float32``), in one run.

    python bench/scale.py [--blocks 1 12 26] [--methods rtn_kbbq gptq_kbbq] [--threads 1]
                          [--processes 1 2] [--no-table] [--arch qwen3_moe|gemma4_text]
    python bench/scale.py --tiny     # one block of a tiny Llama, RTN-KBBQ, one process

1. For each depth, saves a random-initialized Llama (hidden 2048, FFN 5632, 16 heads, 4 KV
   heads, vocabulary 32,000, untied embeddings: 250 MiB of embeddings and 86 MiB a block; 1,
   12 and 26 blocks are 0.3, 1.3 and 2.5 GB; ``--arch qwen3_moe``: a Qwen3-MoE of hidden 1024
   with 16 experts of FFN 512 a block, 4 routed, 125 MiB of embeddings and 55 MiB a block;
   ``--arch gemma4_text``: a Gemma 4 of hidden 1024, FFN 4096, per-layer inputs of 128) to
   a temporary folder as sharded bf16 safetensors (shards of 256 MB, as HuggingFace writes
   large models, the experts expert by expert).
2. Runs ``kbbq-pl quantize --config RECIPE --model FOLDER --data.init_args.n_tokens TOKENS``
   (RTN-KBBQ NVFP4 lambda 0.75 and GPTQ-KBBQ NVFP4 by default; the model has no tokenizer, so
   the calibration tokens are random, seeded) in one subprocess per run, in each mode: the
   default (the model held in its stored dtype, streamed only when it exceeds half of the
   memory available), ``--stream`` and ``--no-stream --dtype float32`` (the model upcast to
   float32 as a whole, the default before 2026-11-28).
3. Prints one table: the model's size, blocks, the peak RSS of each process (``VmHWM``: not
   ``ru_maxrss``, which a subprocess inherits from this large parent) and its time (the
   command, imports excluded), whether the default streamed, whether the three checkpoints hold
   the same values bit for bit (the default's full-precision tensors in the source's bf16);
   and the fixed cost: the default command's peak on a one-block
   Llama of hidden size 64 (the imported libraries and what the command holds whatever the
   model), with each row's default peak less that cost, over the model's bytes.
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

BLOCK = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}
TINY_BLOCK = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
              "tie_word_embeddings": True}
MOE_BLOCK = {"hidden_size": 1024, "moe_intermediate_size": 512, "intermediate_size": 2816,
             "num_experts": 16, "num_experts_per_tok": 4, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
             "max_position_embeddings": 2048, "tie_word_embeddings": False}
"""A Qwen3-MoE block (``--arch qwen3_moe``): 16 experts of FFN 512, 4 routed; 50 MiB of bf16
expert weights a block."""
TINY_MOE_BLOCK = {**TINY_BLOCK, "moe_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2, "head_dim": 16}
GEMMA4_BLOCK = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32000,
                "vocab_size_per_layer_input": 32000, "hidden_size_per_layer_input": 128,
                "max_position_embeddings": 2048, "tie_word_embeddings": True}
"""A Gemma 4 text block (``--arch gemma4_text``): per-layer inputs of 128 from the embeddings
through ``per_layer_model_projection``, a layer outside the blocks; its layer types are the
config's (one full-attention layer in six, and the last)."""
TINY_GEMMA4_BLOCK = {**TINY_BLOCK, "head_dim": 16, "vocab_size_per_layer_input": 256,
                     "hidden_size_per_layer_input": 16}
ARCHES = {"llama": ("LlamaConfig", BLOCK, TINY_BLOCK),
          "qwen3_moe": ("Qwen3MoeConfig", MOE_BLOCK, TINY_MOE_BLOCK),
          "gemma4_text": ("Gemma4TextConfig", GEMMA4_BLOCK, TINY_GEMMA4_BLOCK)}
"""Each ``--arch``: its transformers config class, its block, its tiny block."""
TINY = {"blocks": [1], "methods": ["rtn_kbbq"], "tokens": 256, "processes": [1]}
RECIPES = {"rtn_kbbq": "rtn_kbbq_nvfp4_lam0.75", "gptq_kbbq": "gptq_kbbq_nvfp4",
           "rtn_kbbq_auto": "rtn_kbbq_nvfp4_auto"}
MODES = {"default": [], "stream": ["--stream"], "previous": ["--no-stream", "--dtype", "float32"]}
"""``kbbq-pl quantize`` flags of each mode."""
STREAMED_BY_ITSELF = "streaming them from disk block by block"
"""What ``kbbq-pl quantize`` prints when it chooses to stream."""


def save_model(folder: Path, blocks: int, args: argparse.Namespace, fixed_cost: bool = False
               ) -> None:
    """A random model of ``blocks`` blocks of ``args.arch`` (:data:`ARCHES`; tiny blocks for
    ``args.tiny`` and ``fixed_cost``) in ``folder``."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config_class, block, tiny_block = ARCHES[args.arch]
    block = tiny_block if args.tiny or fixed_cost else block
    config = getattr(transformers, config_class)(num_hidden_layers=blocks, **block)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="256MB")


def tensor_digest(folder: Path) -> str:
    """The checkpoint's tensors' names and values (floating ones as float32, which holds each
    stored dtype exactly: a bf16 source's checkpoint and the float32 run's have the same)."""
    from kbbq_pl.io.checkpoint import read_tensors

    digest = hashlib.sha256()
    for name, tensor in sorted(read_tensors(folder).items()):
        digest.update(name.encode())
        values = tensor.float() if tensor.is_floating_point() else tensor
        digest.update(values.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def worker(args: argparse.Namespace) -> None:
    """Run ``kbbq-pl`` with ``args.argv`` in this process; print its time and peak RSS."""
    torch.set_num_threads(args.threads)
    from kbbq_pl.cli.commands import main as kbbq_pl
    from kbbq_pl.quant.report import peak_rss_mb

    start = time.perf_counter()
    code = kbbq_pl(json.loads(args.argv))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mb": peak_rss_mb(), "code": code}))


def quantize(source: Path, out: Path, method: str, mode: str, args: argparse.Namespace
             ) -> dict:
    """``kbbq-pl quantize`` of ``source`` in ``mode``, in a subprocess: its seconds, peak RSS and
    whether it streamed."""
    argv = ["quantize", "--config", RECIPES[method], "--model", str(source),
            "--data.init_args.n_tokens", str(args.tokens), "--output_dir", str(out),
            *MODES[mode]]
    result = subprocess.run(
        [sys.executable, __file__, "--worker", "--argv", json.dumps(argv), "--threads",
         str(args.threads)], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"kbbq-pl {' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    return {**row, "streamed": mode == "stream" or STREAMED_BY_ITSELF in result.stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 12, 26])
    parser.add_argument("--methods", nargs="+", default=["rtn_kbbq", "gptq_kbbq"],
                        choices=list(RECIPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--arch", default="llama", choices=list(ARCHES),
                        help="Llama blocks (BLOCK), mixture-of-experts Qwen3-MoE blocks "
                             "(MOE_BLOCK) or Gemma 4 blocks (GEMMA4_BLOCK)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--processes", type=int, nargs="*", default=[1, 2],
                        help="process counts of the torchrun comparison (none: skip it)")
    parser.add_argument("--table", action=argparse.BooleanOptionalAction, default=True,
                        help="the table of the three modes (--no-table: skip it)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"one block of hidden size 64, {TINY}, in seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--argv", help=argparse.SUPPRESS)
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


def mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20


def size_table(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "fixed-cost"
        save_model(tiny, 1, args, fixed_cost=True)
        fixed = quantize(tiny, Path(tmp) / "out-fixed-cost", "rtn_kbbq", "default", args)
        print(f"fixed cost: {fixed}", flush=True)
        for blocks in args.blocks:
            source = Path(tmp) / f"{args.arch}-{blocks}"
            save_model(source, blocks, args)
            for method in args.methods:
                row = {"size_mb": mib(source), "blocks": blocks, "method": method}
                digests = {}
                for mode in args.modes:
                    out = Path(tmp) / f"out-{blocks}-{method}-{mode}"
                    row[mode] = quantize(source, out, method, mode, args)
                    digests[mode] = tensor_digest(out)
                    print(f"{blocks} blocks {method} {mode}: {row[mode]}", flush=True)
                row["equal"] = len(set(digests.values())) == 1 if len(digests) > 1 else None
                rows.append(row)
    print(f"\n`kbbq-pl quantize --data.init_args.n_tokens {args.tokens}`, {args.threads} "
          f"thread(s), {args.arch}; peak RSS in MiB; fixed cost (the default command on a "
          f"one-block {args.arch} of hidden size 64): {fixed['peak_mb']:.0f} MiB\n")
    cells = [f"{mode} peak" for mode in args.modes] + [f"{mode} s" for mode in args.modes]
    print("| bf16 weights (MiB) | blocks | method | " + " | ".join(cells)
          + " | (default - fixed) / weights | default streamed | same tensors |")
    print("|---:|---:|---|" + "---:|" * len(cells) + "---:|---|---|")
    nan = {"peak_mb": float("nan"), "seconds": float("nan")}
    for row in rows:
        peaks = [f"{row[mode]['peak_mb']:.0f}" for mode in args.modes]
        times = [f"{row[mode]['seconds']:.1f}" for mode in args.modes]
        default = row.get("default", nan)
        above = (default["peak_mb"] - fixed["peak_mb"]) / row["size_mb"]
        print(f"| {row['size_mb']:.0f} | {row['blocks']} | {row['method']} | "
              + " | ".join(peaks + times)
              + f" | {above:.2f} | {default.get('streamed', '')} | {row['equal']} |")


def processes_table(args: argparse.Namespace) -> None:
    """``kbbq-pl quantize --stream`` on the smallest model with 1 process and under torchrun
    with more (gloo, ``--threads`` threads each): wall time of the command (imports and start
    included) and whether the checkpoints equal the one-process one bit for bit."""
    import shutil

    kbbq = shutil.which("kbbq-pl") or str(Path(sys.executable).with_name("kbbq-pl"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / args.arch
        blocks = min(args.blocks)
        save_model(source, blocks, args)
        for method in args.methods:
            digests = {}
            for count in args.processes:
                out = Path(tmp) / f"out-{method}-{count}"
                command = [kbbq, "quantize", "--config", RECIPES[method], "--model",
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
