"""Compile the W4A4 Triton kernels for a GPU without one: registers, spills, instruction mix.

    python bench/gpu_compile.py [--arch 90] [--kernels act,gemm_small,gemm_large] [--all-configs]

Triton compiles for any NVIDIA target on a CPU-only machine (its wheel ships ``ptxas``), so the
questions that cost no device time are answered here: does every autotune configuration fit in
registers (``stack`` > 0 means spills to local memory), does the large GEMM use Hopper's
``wgmma`` (the small one ``mma.sync``: M = 16 is below wgmma's 64), is the per-block transform a
chain of ``fma.rn.f32`` (the order :mod:`kbbq_pl.kernels.reference` assumes), are all divisions
``div.rn.f32``, is nothing flushed to zero (``.ftz``), and how many SASS instructions the whole
program runs per element it handles (``sass_per_element``: for the activation kernel, elements
quantized per thread; for the GEMM, operand elements decoded per thread and K step, the loop
body counted with prologue and epilogue, so an upper estimate).  It prints one row per
(kernel, configuration) and times nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("bench/gpu_compile.py compiles for a GPU: unset TRITON_INTERPRET")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kbbq_pl.kernels import triton_kernels as tk  # noqa: E402

ACT_SIGNATURE = {
    "x_ptr": "*bf16", "t_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8",
    "global_ptr": "*fp32", "amax_ptr": "*fp32", "pts_ptr": "*fp32", "values_ptr": "*bf16",
    "M": "i32", "n_blocks": "i32", "stride_xm": "i32", "stride_cm": "i32", "stride_sm": "i32",
    "stride_vm": "i32", "m_bucket": "i32",
}
GEMM_SIGNATURE = {
    "a_ptr": "*u8", "a_scale_ptr": "*u8", "w_ptr": "*u8", "w_scale_ptr": "*u8",
    "a_global_ptr": "*fp32", "w_global_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
    "partial_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "split_k": "i32",
    "stride_am": "i32", "stride_asm": "i32", "stride_wn": "i32", "stride_wsn": "i32",
    "stride_om": "i32", "m_bucket": "i32",
}


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([str(tool), flag, handle.name], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes per thread and the number of SASS instructions."""
    found = dict(re.findall(r"(REG|STACK):(\d+)", cuobjdump(cubin, "--dump-resource-usage")))
    sass = len(re.findall(r"/\*[0-9a-f]{4}\*/\s+\S", cuobjdump(cubin, "-sass")))
    return {"regs": int(found.get("REG", -1)), "stack": int(found.get("STACK", -1)),
            "sass": sass}


ALIGNED = {"stride_xm", "stride_cm", "stride_sm", "n_blocks", "N", "K", "stride_am",
           "stride_asm", "stride_wn", "stride_wsn", "stride_om"}
"""Integer arguments taken as multiples of 16, as Triton specializes them at launch for the
benchmark's shapes (K = N = 8192); pointers are 16-byte aligned too."""


def compile_kernel(fn, signature: dict, constants: dict, target: GPUTarget, **options):
    """``fn`` compiled for ``target`` (constexprs left out take their defaults)."""
    constants = dict({p.name: p.default for p in fn.params
                      if p.is_constexpr and p.has_default}, **constants)
    signature = dict(signature, **{name: "constexpr" for name in constants})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*") or name in ALIGNED}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants,
                                       attrs=attrs)
    return triton.compile(source, target=target, options=options)


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def activation_rows(target: GPUTarget, configs) -> list[dict]:
    rows = []
    for fmt, d, kind in (("nvfp4", 16, tk.SCALE_E4M3), ("mxfp4", 32, tk.SCALE_E8M0)):
        for config in configs:
            constants = dict(D=d, SCALE_KIND=kind, ROUNDING=0, GAIN=1.0, HAS_T=True, STATIC=False,
                             AMAX_ONLY=False, PRODUCT=tk.PRODUCT_FMA_DOT, **config.kwargs)
            start = time.perf_counter()
            compiled = compile_kernel(tk._quantize_activations_kernel, ACT_SIGNATURE, constants,
                                      target, num_warps=config.num_warps, enable_fp_fusion=True)
            ptx = compiled.asm["ptx"]
            used = resources(compiled.asm["cubin"])
            per_thread = config.kwargs["BLOCK_M"] * config.kwargs["NB"] * d / (32 * config.num_warps)
            rows.append(dict(
                kernel=f"act {fmt}", config=f"BM={config.kwargs['BLOCK_M']} NB={config.kwargs['NB']}"
                f" w={config.num_warps}", seconds=time.perf_counter() - start, **used,
                sass_per_element=f"{used['sass'] / per_thread:.0f}",
                fma=count(r"fma\.rn\.f32", ptx), add=count(r"\badd\.f32", ptx),
                div_rn=count(r"div\.rn\.f32", ptx), div_approx=count(r"div\.(?:full|approx)", ptx),
                ftz=count(r"\.ftz", ptx), mma=0))
    return rows


def gemm_rows(target: GPUTarget, small: bool, configs) -> list[dict]:
    rows = []
    signature = dict(GEMM_SIGNATURE)
    if not small:
        signature["a_ptr"] = "*bf16"
    for fmt, d, kind in (("nvfp4", 16, tk.SCALE_E4M3), ("mxfp4", 32, tk.SCALE_E8M0)):
        for config in configs:
            constants = dict(D=d, SCALE_KIND=kind, GAIN2=1.0, A_PACKED=small,
                             HAS_GLOBAL=kind == tk.SCALE_E4M3, HAS_BIAS=True,
                             DOT_DTYPE=tl.bfloat16, EXPLICIT_BF16=False, **config.kwargs)
            start = time.perf_counter()
            compiled = compile_kernel(tk._w4a4_kernel, signature, constants, target,
                                      num_warps=config.num_warps, num_stages=config.num_stages,
                                      enable_fp_fusion=True)
            ptx = compiled.asm["ptx"]
            k = config.kwargs
            used = resources(compiled.asm["cubin"])
            per_thread = (k["BLOCK_N"] + (k["BLOCK_M"] if small else 0)) * k["BLOCK_K"] / (
                32 * config.num_warps)
            rows.append(dict(
                kernel=f"gemm {'small' if small else 'large'} {fmt}",
                config=f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w={config.num_warps} "
                f"s={config.num_stages}", seconds=time.perf_counter() - start, **used,
                sass_per_element=f"{used['sass'] / per_thread:.0f}", fma=count(r"fma\.rn\.f32", ptx),
                add=count(r"\badd\.f32", ptx), div_rn=count(r"div\.rn\.f32", ptx),
                div_approx=count(r"div\.(?:full|approx)", ptx), ftz=count(r"\.ftz", ptx),
                mma=count(r"wgmma\.mma_async", ptx) + count(r"mma\.sync", ptx)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--kernels", default="act,gemm_small,gemm_large")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    rows: list[dict] = []
    wanted = args.kernels.split(",")
    if "act" in wanted:
        rows += activation_rows(target, tk._act_configs())
    if "gemm_small" in wanted:
        rows += gemm_rows(target, True, tk._gemm_configs(True))
    if "gemm_large" in wanted:
        rows += gemm_rows(target, False, tk._gemm_configs(False))
    print(f"Triton {triton.__version__}, target sm_{args.arch}; stack > 0 means register spills")
    header = ("kernel", "config", "regs", "stack", "sass", "sass_per_element", "mma", "fma",
              "add", "div_rn", "div_approx", "ftz", "seconds")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[h]:.1f}" if h == "seconds" else str(row[h]) for h in header))


if __name__ == "__main__":
    main()
