"""Compile the W4A4 Triton kernels for a GPU without one: registers, spills, loads, instruction mix.

    python bench/gpu_compile.py [--arch 90] [--kernels act,act_values,decode_gemm,...]
                                [--explore | --tune]

Triton compiles for any NVIDIA target on a CPU-only machine (its wheel ships ``ptxas`` and
``cuobjdump``), so the questions that cost no device time are answered here, one row per
(kernel, tile):

* ``regs``, ``stack`` (> 0: register spills to local memory), ``smem`` (bytes of shared memory);
* ``per_element``: SASS instructions of the main loop (the longest backward branch; the whole
  kernel when there is no loop) per operand element a thread handles in one trip, the figure
  to set against the memory: an H100 moves about 23 NVFP4 weights per SM clock at its copy
  bandwidth, and issues at most 128 thread-instructions per SM clock;
* ``ldg128`` / ``ldg_narrow``: 16-byte global loads (``LDG.E.128``, ``LDGSTS.*.128``: cp.async
  into shared memory) against narrower ones in SASS; ``ptx_v4``: ``ld.global.v4`` and 16-byte
  ``cp.async`` in PTX;
* ``wgmma`` (Hopper's ``HGMMA``/``QGMMA``) and ``mma_sync`` (``HMMA``) instructions;
  ``loop_smem``: shared-memory stores / loads in the main loop (a decoded operand that goes
  through shared memory on its way to the tensor cores shows as stores there), ``loop_bar``
  its block-wide barriers (``BAR``);
* in PTX, ``fma`` (``fma.rn.f32``: the per-block transform is a chain of them, the order
  :mod:`kbbq_pl.kernels.reference` assumes), ``div_rn`` against ``div_approx`` (every division
  must be correctly rounded) and ``ftz`` (nothing may flush subnormals).

Kernels: the activation kernel writing codes (``act``) or values (``act_values``: fp16/bf16 in
word order for the decode GEMM, bf16 for the prefill product), the decode GEMM (``decode_gemm``,
its autotuned tiles, 16 rows high and 32 to 128 for more rows, and the one-row DP4A
product's; ``--tune``: the tiles ``bench/gpu.py``'s ``tune`` section times), what the
``stream`` section sets beside it (``stream``: a decode step's tile as stored, tile by tile and
without its decode, and ``bench/_gpu_stream.py``'s reads alone), the prefill path's weight
decode
(``weight_decode``) and product on decoded operands (``gemm_decoded``), and the tiled GEMM
(``gemm_small``, ``gemm_large``).  ``--explore`` compiles candidate tiles instead of the ones
that run.  It times nothing.
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
    "inexact_ptr": "*i32", "t1_ptr": "*fp32", "t2_ptr": "*fp32", "global1_ptr": "*fp32",
    "global2_ptr": "*fp32", "M": "i32", "n_blocks": "i32", "stride_xm": "i32", "stride_cm": "i32",
    "stride_sm": "i32", "stride_vm": "i32", "stride_vg": "i32", "m_bucket": "i32",
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


ALIGNED = {"stride_xm", "stride_cm", "stride_sm", "stride_vm", "n_blocks", "N", "K", "R",
           "stride_am", "stride_asm", "stride_wn", "stride_wsn", "stride_om", "stride_cr",
           "stride_sr", "stride_or", "stride_wr", "stride_er", "stride_vr", "N1", "N2",
           "stride_ag", "stride_vg", "stride_sn", "K_WORDS"}
"""Integer arguments taken as multiples of 16, as Triton specializes them at launch for the
benchmark's shapes (K = N = 8192); pointers are 16-byte aligned too."""


def compile_kernel(fn, signature: dict, constants: dict, target: GPUTarget, **options):
    """``fn`` compiled for ``target`` (constexprs left out take their defaults) with the
    product's compile options (``triton_kernels.COMPILE_OPTIONS``) unless ``options`` says."""
    constants = dict({p.name: p.default for p in fn.params
                      if p.is_constexpr and p.has_default}, **constants)
    signature = dict(signature, **{name: "constexpr" for name in constants})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*") or name in ALIGNED}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants,
                                       attrs=attrs)
    return triton.compile(source, target=target, options=dict(tk.COMPILE_OPTIONS, **options))


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


def sass_ops(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every SASS instruction."""
    return [(int(a, 16), op, rest) for a, op, rest in _SASS_LINE.findall(cuobjdump(cubin, "-sass"))]


def main_loop(ops: list[tuple[int, str, str]]) -> list[str]:
    """The opcodes of the longest backward branch's body (the main loop); all of them when
    there is no loop."""
    best = None
    for address, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            span = (int(target.group(1), 16), address)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        return [op for _, op, _ in ops]
    return [op for address, op, _ in ops if best[0] <= address <= best[1]]


def global_loads(ops: list[tuple[int, str, str]]) -> tuple[int, int]:
    """(16-byte global loads, narrower ones) in SASS: ``LDG.E.128`` and ``LDGSTS.*.128``
    (cp.async into shared memory) against every other ``LDG`` / ``LDGSTS``."""
    wide = narrow = 0
    for _, op, _ in ops:
        if op.startswith(("LDG.", "LDGSTS.")) and not op.startswith("LDGDEPBAR"):
            if ".128" in op:
                wide += 1
            else:
                narrow += 1
    return wide, narrow


def analyse(compiled, per_thread: float) -> dict:
    """The figures of one compiled kernel; ``per_thread``: operand elements one thread handles
    per trip of the main loop (the whole kernel when it has none)."""
    cubin = compiled.asm["cubin"]
    ptx = compiled.asm["ptx"]
    ops = sass_ops(cubin)
    loop = main_loop(ops)
    wide, narrow = global_loads(ops)
    used = resources(cubin)
    kinds = [op.split(".")[0] for op in loop]
    return dict(
        regs=used["regs"], stack=used["stack"], smem=compiled.metadata.shared, sass=len(ops),
        loop_sass=len(loop), per_element=f"{len(loop) / per_thread:.1f}",
        ldg128=wide, ldg_narrow=narrow,
        ptx_v4=count(r"ld\.global[.\w]*\.v4|cp\.async\.c[ag]\.shared\.global[^\[]*\[[^]]+\], "
                     r"\[[^]]+\], (?:16|0x10)\b", ptx),
        wgmma=sum(op.startswith(("HGMMA", "QGMMA")) for _, op, _ in ops),
        mma_sync=sum(op.startswith("HMMA") for _, op, _ in ops),
        loop_smem=f"{kinds.count('STS')}/{kinds.count('LDSM') + kinds.count('LDS')}",
        loop_bar=kinds.count("BAR"),
        fma=count(r"fma\.rn\.f32", ptx), div_rn=count(r"div\.rn\.f32", ptx),
        div_approx=count(r"div\.(?:full|approx)", ptx), ftz=count(r"\.ftz", ptx))


FORMATS = (("nvfp4", 16, tk.SCALE_E4M3), ("mxfp4", 32, tk.SCALE_E8M0))


def _row(kernel: str, config: str, compiled, per_thread: float, start: float) -> dict:
    return dict(kernel=kernel, config=config, seconds=time.perf_counter() - start,
                **analyse(compiled, per_thread))


def _tile_config(tile: dict) -> triton.Config:
    """A tile of ``triton_kernels`` (its ``num_warps`` among its keys) as a Triton config."""
    return triton.Config({k: v for k, v in tile.items() if k != "num_warps"},
                         num_warps=tile["num_warps"])


def act_configs(d: int, explore: bool):
    """The activation kernel's tiles for block size ``d``: those it runs (``ACT_TILES``, and
    ``FEW_ROWS_TILES`` up to 16 rows, at one row too), or (``explore``) the candidates it can
    autotune over and the decode step's register tile it replaced."""
    if explore:
        return tk._prune_act_configs(tk._act_configs(), {"D": d}) + [
            _tile_config(tk.REGISTER_FEW_ROWS_TILES[d])]
    return [_tile_config(tile) for tile in (tk.ACT_TILES[d], tk.FEW_ROWS_TILES[d],
                                            tk.few_rows_tile(tk.FEW_ROWS_TILES[d], 1))]


FMA_DOT_TILES = {16: triton.Config({"BLOCK_M": 64, "NB": 4}, num_warps=4),
                 32: triton.Config({"BLOCK_M": 64, "NB": 2}, num_warps=4)}
"""The tile the FMA-dot product ran at before the register chain replaced it (compiled beside
it for comparison; it stays selectable for benchmarks)."""


def activation_rows(target: GPUTarget, explore: bool, values: bool = False) -> list[dict]:
    """The activation kernel with a per-block transform (the FMA chain; the FMA dot beside it):
    codes, or (``values``) the decoded values, fp16 / bf16 in word order for the decode GEMM
    and bf16 in natural order for the prefill product (also without a transform)."""
    rows = []
    outputs = ([(False, False, "*bf16", True)] if not values else
               [(True, True, None, True), (True, False, "*bf16", True),
                (True, False, "*bf16", False), (True, False, "*i8", True)])
    for fmt, d, kind in FORMATS:
        for out_values, word_order, dtype, has_t in outputs:
            signature = dict(ACT_SIGNATURE)
            if out_values:
                signature["values_ptr"] = dtype or ("*fp16" if fmt == "nvfp4" else "*bf16")
            if dtype == "*i8":  # the DP4A product's operand: 2q, FP32 block scales; one row
                signature["scales_ptr"] = "*fp32"
            runs = [(config, tk.PRODUCT_FMA_CHAIN, 1) for config in act_configs(d, explore)
                    if dtype != "*i8" or config.kwargs["BLOCK_M"] <= 16]
            if word_order and has_t and not explore:  # a decode step's siblings, one launch
                runs.append((_tile_config(tk.FEW_ROWS_TILES[d]), tk.PRODUCT_FMA_CHAIN, 3))
            if has_t and not explore and dtype != "*i8":
                runs.append((FMA_DOT_TILES[d], tk.PRODUCT_FMA_DOT, 1))
                runs.append((_tile_config(tk.BF16X3_TILE), tk.PRODUCT_BF16X3, 1))
            for config, product, groups in runs:
                parts = product == tk.PRODUCT_BF16X3  # the transforms as bf16 parts
                run_signature = (dict(signature, t_ptr="*bf16", t1_ptr="*bf16", t2_ptr="*bf16")
                                 if parts else signature)
                constants = dict(D=d, SCALE_KIND=kind, ROUNDING=0, GAIN=1.0, HAS_T=has_t,
                                 STATIC=False, AMAX_ONLY=False, PRODUCT=product,
                                 WRITE_CODES=not out_values, WRITE_VALUES=out_values,
                                 WORD_ORDER=word_order, PARTS_FIRST=tk.PARTS_FIRST,
                                 GROUPS=groups, **config.kwargs)
                start = time.perf_counter()
                compiled = compile_kernel(tk._quantize_activations_kernel, run_signature, constants,
                                          target, num_warps=config.num_warps,
                                          enable_fp_fusion=True)
                per_thread = (config.kwargs["BLOCK_M"] * config.kwargs["NB"] * d
                              / (32 * config.num_warps))
                name = "act codes" if not out_values else (
                    "act values word-order" if word_order else
                    "act values int8 (DP4A)" if dtype == "*i8" else "act values bf16")
                name += "" if has_t else ", no transform"
                name += {tk.PRODUCT_FMA_DOT: ", fma dot", tk.PRODUCT_BF16X3: ", bf16x3"}.get(
                    product, "")
                name += ", 3 siblings" if groups > 1 else ""
                memory = ", from memory" if config.kwargs.get("FROM_MEMORY") else ""
                rows.append(_row(f"{name} {fmt}", f"BM={config.kwargs['BLOCK_M']} "
                                 f"NB={config.kwargs['NB']} w={config.num_warps}{memory}", compiled,
                                 per_thread, start))
    return rows


SKINNY_SIGNATURE = {
    "a_ptr": "*fp16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32",
    "count_ptr": "*i32", "a_global_ptr": "*fp32", "w_global_ptr": "*fp32", "bias_ptr": "*bf16",
    "a_scale_ptr": "*fp32", "table_ptr": "*i32", "w1_ptr": "*u8", "w2_ptr": "*u8",
    "ws1_ptr": "*u8", "ws2_ptr": "*u8", "w_global1_ptr": "*fp32", "w_global2_ptr": "*fp32",
    "bias1_ptr": "*bf16", "bias2_ptr": "*bf16", "out1_ptr": "*bf16", "out2_ptr": "*bf16",
    "M": "i32", "N": "i32", "K": "i32", "shift": "i32", "stride_am": "i32", "stride_wn": "i32",
    "stride_wsn": "i32", "stride_om": "i32", "m_bucket": "i32", "N1": "i32", "N2": "i32",
    "stride_ag": "i32", "probe_ptr": "*i64",
}

def skinny_configs(explore: bool):
    """The decode GEMM's autotuned tiles, or (``explore``) a wider grid to choose them from."""
    from kbbq_pl.kernels import skinny

    if not explore:
        return skinny._configs()
    few = [(16, n, k, w, st) for n, k, w, st in (
        (32, 256, 4, 4), (64, 256, 4, 3), (64, 256, 4, 4), (64, 512, 4, 3), (64, 512, 4, 2),
        (128, 256, 4, 3), (128, 256, 8, 3), (128, 512, 8, 3), (256, 256, 8, 3), (64, 1024, 4, 2))]
    more = [(32, 64, 256, 4, 3), (32, 128, 256, 4, 3), (32, 128, 256, 8, 3), (64, 64, 256, 4, 3),
            (64, 128, 128, 4, 3), (64, 128, 256, 4, 2), (64, 128, 256, 8, 3),
            (128, 64, 128, 4, 3), (128, 128, 128, 8, 2), (128, 128, 128, 8, 3),
            (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 128, 8, 2),
            (256, 128, 64, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k,
                           "PRODUCT": skinny.PRODUCT_DOT}, num_warps=w, num_stages=st)
            for m, n, k, w, st in few + more]


def tune_configs():
    """The decode GEMM's tiles that ``bench/gpu.py``'s ``tune`` section times (``TUNE_TILES``,
    ``TUNE_DP4A_TILES``)."""
    import gpu  # bench/gpu.py, beside this script

    from kbbq_pl.kernels import skinny

    tiles = ([(tile, skinny.PRODUCT_DOT) for tile in gpu.TUNE_TILES]
             + [(tile, skinny.PRODUCT_DP4A) for tile in gpu.TUNE_DP4A_TILES])
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "PRODUCT": product},
                          num_warps=w, num_stages=st)
            for (m, n, k, w, st), product in tiles]


def compile_decode_gemm(target: GPUTarget, d: int, kind: int, config: triton.Config,
                        **extra):
    """The decode GEMM compiled as it launches on sm_90 (MX shift 0) at ``config``'s tile and
    product; ``extra``: further constants (``GROUPS``, ``TILED``, ``RAW``)."""
    from kbbq_pl.kernels import skinny

    values = skinny.VALUES_FP16 if kind == tk.SCALE_E4M3 else skinny.VALUES_BF16
    k = config.kwargs
    constants = dict(D=d, SCALE_KIND=kind, GAIN2=1.0, HAS_GLOBAL=kind == tk.SCALE_E4M3,
                     HAS_BIAS=True, VALUES=values, EXPLICIT_BF16=False, EVEN_K=True,
                     SHIFTED=False, **k, **extra)
    a_type = ("*i8" if k["PRODUCT"] == skinny.PRODUCT_DP4A
              else "*fp16" if values == skinny.VALUES_FP16 else "*bf16")
    return compile_kernel(skinny._skinny_kernel, dict(SKINNY_SIGNATURE, a_ptr=a_type),
                          constants, target, num_warps=config.num_warps,
                          num_stages=config.num_stages, enable_fp_fusion=True)


def skinny_rows(target: GPUTarget, explore: bool = False, tune: bool = False) -> list[dict]:
    from kbbq_pl.kernels import skinny

    rows = []
    for fmt, d, kind in FORMATS:
        if tune:
            configs = [(c, 1) for c in tune_configs()]
        else:
            configs = [(c, 1) for c in [*skinny_configs(explore), *skinny._DP4A_CONFIGS]]
            configs.insert(1, (configs[0][0], 3))  # a decode step's first tile, 3 siblings
            configs.append((skinny._DP4A_CONFIGS[0], 3))  # and the one-row product's
        for config, groups in configs:
            k = config.kwargs
            start = time.perf_counter()
            compiled = compile_decode_gemm(target, d, kind, config, GROUPS=groups)
            per_thread = k["BLOCK_N"] * k["BLOCK_K"] / (32 * config.num_warps)
            product = {skinny.PRODUCT_DOT: "dot", skinny.PRODUCT_DP4A: "dp4a"}[k["PRODUCT"]]
            product += ", 3 siblings" if groups > 1 else ""
            rows.append(_row(f"decode gemm {fmt} {product}",
                             f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w={config.num_warps} "
                             f"s={config.num_stages}", compiled, per_thread, start))
    return rows


STREAM_SIGNATURE = {"w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*i32", "K_WORDS": "i32",
                    "stride_wn": "i32", "stride_sn": "i32"}


def stream_rows(target: GPUTarget) -> list[dict]:
    """What ``bench/gpu.py``'s ``stream`` section sets side by side, at a decode step's tile
    (each format): the decode GEMM as stored, on ``skinny.tile_major``'s layout and without its
    decode (``RAW``); ``bench/_gpu_stream.py``'s reads alone (the codes; codes and scale bytes
    as stored and tile by tile) at the tile's stages and twice them."""
    import _gpu_stream  # bench/_gpu_stream.py, beside this script

    from kbbq_pl.kernels import skinny

    config = skinny._CONFIGS[0]
    k = config.kwargs
    per_thread = k["BLOCK_N"] * k["BLOCK_K"] / (32 * config.num_warps)
    rows = []
    for fmt, d, kind in FORMATS:
        for label, extra in (("as stored", {}), ("tile by tile", {"TILED": True}),
                             ("without its decode", {"RAW": True})):
            start = time.perf_counter()
            compiled = compile_decode_gemm(target, d, kind, config, **extra)
            rows.append(_row(f"decode gemm {fmt} {label}", f"{k['BLOCK_M']}x{k['BLOCK_N']}x"
                             f"{k['BLOCK_K']} w={config.num_warps} s={config.num_stages}",
                             compiled, per_thread, start))
        for label, tiled, scales in (("codes as stored", False, False),
                                     ("weights as stored", False, True),
                                     ("weights tile by tile", True, True)):
            if not scales and fmt != FORMATS[0][0]:
                continue  # the codes alone do not depend on the format
            for stages in (config.num_stages, 2 * config.num_stages):
                start = time.perf_counter()
                compiled = compile_kernel(
                    _gpu_stream._stream_kernel, STREAM_SIGNATURE,
                    dict(TILED=tiled, D=d if scales else 0, BLOCK_N=k["BLOCK_N"],
                         BLOCK_C=k["BLOCK_K"] // 8, STAGES=stages), target,
                    num_warps=config.num_warps)
                rows.append(_row(f"stream {fmt if scales else ''} {label}".replace("  ", " "),
                                 f"{k['BLOCK_N']}x{k['BLOCK_K']} w={config.num_warps} "
                                 f"s={stages}", compiled, per_thread, start))
    return rows


DECODE_SIGNATURE = {"codes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*bf16", "R": "i32",
                    "K": "i32", "stride_cr": "i32", "stride_sr": "i32", "stride_or": "i32"}


def decode_rows(target: GPUTarget) -> list[dict]:
    """The prefill path's weight decode (packed codes to bf16), at its launch tile."""
    rows = []
    for fmt, d, kind in FORMATS:
        block_r, block_k, warps = tk.DECODE_TILE
        constants = dict(D=d, SCALE_KIND=kind, BLOCK_R=block_r, BLOCK_K=block_k, EVEN_K=True)
        start = time.perf_counter()
        compiled = compile_kernel(tk._decode_kernel, DECODE_SIGNATURE, constants, target,
                                  num_warps=warps, enable_fp_fusion=True)
        rows.append(_row(f"weight decode {fmt}", f"{block_r}x{block_k} w={warps}", compiled,
                         block_r * block_k / (32 * warps), start))
    return rows


FOLD_SIGNATURE = {"words_ptr": "*i32", "exps_ptr": "*i32", "values_ptr": "*i32",
                  "scales_ptr": "*fp32", "inexact_ptr": "*i32", "R": "i32", "stride_wr": "i32",
                  "stride_er": "i32", "stride_vr": "i32", "multiplier": "fp32"}


def fold_rows(target: GPUTarget) -> list[dict]:
    """The MX fold to E4M3 of the FP8 prefill product: the weights' fold kernel and the
    activation kernel folding its values (a per-block transform), each at its tile."""
    block_r, warps = tk.FOLD_TILE
    start = time.perf_counter()
    compiled = compile_kernel(tk._fold_e4m3_kernel, FOLD_SIGNATURE, dict(D=32, BLOCK_R=block_r),
                              target, num_warps=warps, enable_fp_fusion=True)
    rows = [_row("fold to e4m3 mxfp4", f"{block_r}x128 w={warps}", compiled,
                 block_r * 128 / (32 * warps), start)]
    tile = dict(tk.E4M3_TILE)
    warps = tile.pop("num_warps")
    constants = dict(D=32, SCALE_KIND=tk.SCALE_E8M0, ROUNDING=0, GAIN=1.0, HAS_T=True,
                     STATIC=False, AMAX_ONLY=False, PRODUCT=tk.PRODUCT_FMA_CHAIN,
                     WRITE_CODES=False, WRITE_VALUES=False, WORD_ORDER=False,
                     PARTS_FIRST=tk.PARTS_FIRST, WRITE_E4M3=True,
                     **tile)
    signature = dict(ACT_SIGNATURE, scales_ptr="*fp32")
    start = time.perf_counter()
    compiled = compile_kernel(tk._quantize_activations_kernel, signature, constants, target,
                              num_warps=warps, enable_fp_fusion=True)
    rows.append(_row("act e4m3 (folded) mxfp4", f"BM={tile['BLOCK_M']} NB={tile['NB']} "
                     f"w={warps}", compiled, tile["BLOCK_M"] * tile["NB"] * 32 / (32 * warps),
                     start))
    return rows


def gemm_rows(target: GPUTarget, small: bool, configs, decoded: bool = False) -> list[dict]:
    """The tiled GEMM: ``small`` (both operands packed), large (activations decoded) or
    ``decoded`` (both decoded: the prefill path's Triton product)."""
    rows = []
    signature = dict(GEMM_SIGNATURE)
    if not small:
        signature["a_ptr"] = "*bf16"
    if decoded:
        signature["w_ptr"] = "*bf16"
    name = "gemm small" if small else ("gemm decoded" if decoded else "gemm large")
    for fmt, d, kind in FORMATS:
        for config in configs:
            constants = dict(D=d, SCALE_KIND=kind, GAIN2=1.0, A_PACKED=small,
                             W_PACKED=not decoded, HAS_GLOBAL=kind == tk.SCALE_E4M3,
                             HAS_BIAS=True, DOT_DTYPE=tl.bfloat16, EXPLICIT_BF16=False,
                             **config.kwargs)
            start = time.perf_counter()
            compiled = compile_kernel(tk._w4a4_kernel, signature, constants, target,
                                      num_warps=config.num_warps, num_stages=config.num_stages,
                                      enable_fp_fusion=True)
            k = config.kwargs
            per_thread = (k["BLOCK_N"] + (k["BLOCK_M"] if small else 0)) * k["BLOCK_K"] / (
                32 * config.num_warps)
            rows.append(_row(f"{name} {fmt}", f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} "
                             f"w={config.num_warps} s={config.num_stages}", compiled, per_thread,
                             start))
        if decoded:  # one format suffices: the operands are bf16 either way
            break
    return rows


KERNELS = ("act", "act_values", "decode_gemm", "stream", "weight_decode", "fold", "gemm_small",
           "gemm_large", "gemm_decoded")
HEADER = ("kernel", "config", "regs", "stack", "smem", "loop_sass", "per_element", "ldg128",
          "ldg_narrow", "ptx_v4", "wgmma", "mma_sync", "loop_smem", "loop_bar", "fma", "div_rn",
          "div_approx", "ftz", "seconds")


def ptxas_version() -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    try:
        out = subprocess.run([str(tool), "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "ptxas ?"
    found = re.search(r"release ([\d.]+)", out)
    return f"ptxas {found.group(1) if found else '?'}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma-separated, of {', '.join(KERNELS)}")
    tiles = parser.add_mutually_exclusive_group()
    tiles.add_argument("--explore", action="store_true",
                       help="candidate tiles: the decode GEMM on a wider grid than it autotunes "
                            "over, the activation kernel on those it can autotune over")
    tiles.add_argument("--tune", action="store_true",
                       help="the decode GEMM at the tiles bench/gpu.py's tune section times")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    rows: list[dict] = []
    wanted = args.kernels.split(",")
    unknown = set(wanted) - set(KERNELS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if "act" in wanted:
        rows += activation_rows(target, args.explore)
    if "act_values" in wanted:
        rows += activation_rows(target, args.explore, values=True)
    if "decode_gemm" in wanted:
        rows += skinny_rows(target, args.explore, args.tune)
    if "stream" in wanted:
        rows += stream_rows(target)
    if "weight_decode" in wanted:
        rows += decode_rows(target)
    if "fold" in wanted:
        rows += fold_rows(target)
    if "gemm_small" in wanted:
        rows += gemm_rows(target, True, tk._gemm_configs(True))
    if "gemm_large" in wanted:
        rows += gemm_rows(target, False, tk._gemm_configs(False))
    if "gemm_decoded" in wanted:
        rows += gemm_rows(target, False, tk._gemm_configs(False), decoded=True)
    print(f"Triton {triton.__version__}, {ptxas_version()}, target sm_{args.arch}. stack > 0: "
          "register spills; per_element: SASS of the main loop per operand element a thread "
          "handles in one trip; ldg128 / ldg_narrow: 16-byte / narrower global loads "
          "(LDG, LDGSTS) in SASS; ptx_v4: ld.global.v4 + 16-byte cp.async in PTX; "
          "loop_smem: STS / LDS+LDSM in the loop; loop_bar: BAR in the loop")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(f"{row[h]:.1f}" if h == "seconds" else str(row[h])
                                for h in HEADER) + " |")


if __name__ == "__main__":
    main()
