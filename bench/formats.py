"""fake_quantize throughput for every format, side by side with torchao and a plain copy.

    python bench/formats.py [--size 4096] [--repeats 7] [--formats nvfp4,mxfp4] [--device cpu]
    python bench/formats.py --tiny     # 64 x 64, NVFP4 and MXFP4, one repeat, eager kernels

For each dtype (fp32, bf16) it times, in one run: a plain ``x.clone()`` (allocating, as
fake_quantize allocates its output) and ``out.copy_(x)`` (preallocated: the memory-bandwidth
floor); kbbq-pl's compiled ``fake_quantize`` and its eager reference; torchao's CPU path
(``NVFP4Tensor.to_nvfp4(x, per_tensor_scale) .dequantize()`` and ``MXTensor.to_mx(...)
.dequantize()``) where torchao has the format.  Times are the minimum over repeats after a
warm-up (compile time is reported separately); ratios are computed within the run.
``--tiny`` only checks that the script runs (tests/bench/test_tiny_modes.py): its "ours" column
is the eager kernels, since compiling them takes longer than the rest of the run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from kbbq_pl import formats as F
from kbbq_pl._compat import quiet_loggers

with quiet_loggers("torchao", "torch.utils._pytree"):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

DEFAULT_FORMATS = [
    "nvfp4", "mxfp4", "mxfp4_no_clip", "mxfp4_ceil", "mxfp4_even", "mxfp4_rceil",
    "fp8_e4m3", "fp8_e4m3_row", "int4", "int8", "e2m1_b64_fp32",
]
TORCHAO_MX = {
    "mxfp4": ScaleCalculationMode.FLOOR,
    "mxfp4_ceil": ScaleCalculationMode.CEIL,
    "mxfp4_even": ScaleCalculationMode.EVEN,
    "mxfp4_rceil": ScaleCalculationMode.RCEIL,
}
TINY = {"size": 64, "repeats": 1, "formats": "nvfp4,mxfp4", "device": "cpu"}


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The shortest of ``repeats`` calls of ``fn``, the device synchronized around each."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def torchao_fn(name: str, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """torchao's round trip of ``x`` through format ``name``; None where torchao lacks it."""
    if name == "nvfp4":
        def run():
            scale = per_tensor_amax_to_scale(x.abs().amax())
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)
        return run
    if name in TORCHAO_MX:
        def run():
            mx = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=TORCHAO_MX[name])
            return mx.dequantize(x.dtype)
        return run
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager reference")
    parser.add_argument("--tiny", action="store_true",
                        help=f"run on {TINY} with eager kernels, in seconds")
    args = parser.parse_args()
    if args.tiny:
        vars(args).update(TINY)
    compiled = not args.tiny
    device = torch.device(args.device)
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"size={args.size}x{args.size} repeats={args.repeats} (min time)")
    header = (f"{'format':<15}{'dtype':<6}{'ours ms':>9}{'eager ms':>10}{'torchao ms':>11}"
              f"{'torchao/ours':>13}{'ours/clone':>11}{'ours/copy_':>11}{'compile s':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(args.size, args.size, device=device).to(dtype)
        out = torch.empty_like(x)
        clone = best_time(x.clone, args.repeats, device)
        copy = best_time(partial(out.copy_, x), args.repeats, device)
        print(f"\n{dtype}: clone {clone * 1e3:.1f} ms, copy_ {copy * 1e3:.1f} ms")
        print(header)
        for name in names:
            F.set_compile(compiled)
            start = time.perf_counter()
            F.fake_quantize(x, name)
            compile_s = time.perf_counter() - start
            ours = best_time(partial(F.fake_quantize, x, name), args.repeats, device)
            eager = float("nan")
            if not args.no_eager:
                F.set_compile(False)
                eager = best_time(partial(F.fake_quantize, x, name),
                                  max(2, args.repeats // 3), device)
                F.set_compile(compiled)
            ref = torchao_fn(name, x)
            tao = best_time(ref, max(2, args.repeats // 3), device) if ref else float("nan")
            ratio = f"{tao / ours:13.1f}" if ref else f"{'-':>13}"
            print(f"{name:<15}{str(dtype).replace('torch.', ''):<6}{ours * 1e3:9.1f}"
                  f"{eager * 1e3:10.1f}{tao * 1e3:11.1f}{ratio}{ours / clone:11.2f}"
                  f"{ours / copy:11.2f}{compile_s:10.1f}")
    if F.dispatch._broken:
        print("\nWARNING: torch.compile failed; the 'ours' column is the eager path")


if __name__ == "__main__":
    main()
