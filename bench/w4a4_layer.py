"""Memory and emulated speed of one W4A4 layer, side by side with the dense layer it replaces.

    python bench/w4a4_layer.py [--features 4096] [--tokens 1,16,512] [--format nvfp4]
                               [--dtype bf16] [--repeats 5] [--device cpu]
    python bench/w4a4_layer.py --tiny     # K = N = 64, M = 1 and 16, one repeat, eager kernels

Memory: the bytes of every tensor the layer holds (parameters, buffers and the plain tensors
inside the ``W4A4Weight``): the dense ``nn.Linear``; the quantized layer (codes, scales, the
per-block transform, the activation scale, the bias); and, for comparison, the dense decoded
copy the layer used to keep beside its codes (``weight.dequantize(dtype)``, what ``_dense``
held before the weight owned the product).  Time: one forward of the dense layer, of the
quantized layer (exact emulation: transform, activation rounding, the weight decoded in the
call) and of the same inside ``cache_decoded_weights()`` (decoded once), minimum over repeats;
ratios within the run.  On a GPU with ``kbbq_pl.kernels`` the quantized
forward runs the kernels instead (see the kernels' own ``bench/gpu.py``).  ``--tiny`` only
checks that the script runs (tests/bench/test_tiny_modes.py).
"""

from __future__ import annotations

import argparse
from functools import partial

import _tiny
import torch
from formats import best_time
from torch import nn

from kbbq_pl.quant.layers import QuantizedLinear
from kbbq_pl.quant.w4a4 import W4A4Weight, cache_decoded_weights, uses_kernels
from kbbq_pl.transforms.fit import fit_transform

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TINY = {"features": 64, "tokens": "1,16", "repeats": 1, "device": "cpu"}


def held_bytes(module: nn.Module) -> int:
    """Bytes of the tensors ``module`` holds (the plain tensors inside a W4A4Weight)."""
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if isinstance(tensor, W4A4Weight):
            names, _ = tensor.__tensor_flatten__()
            total += sum(getattr(tensor, name).nbytes for name in names)
        else:
            total += tensor.nbytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", type=int, default=4096, help="K = N")
    parser.add_argument("--tokens", default="1,16,512")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true",
                        help=f"run on {TINY} with eager kernels, in seconds")
    args = parser.parse_args()
    if args.tiny:
        vars(args).update(TINY)
        _tiny.eager()
    device, dtype, k = torch.device(args.device), DTYPES[args.dtype], args.features
    torch.manual_seed(0)
    dense = nn.Linear(k, k).to(device, dtype)
    block = 16 if args.format == "nvfp4" else 32
    sigma = torch.eye(block, dtype=torch.float64).expand(k // block, block, block)
    transform = fit_transform("kbbq", dense.weight.detach().float(), sigma.to(device),
                              block=block, lam=0.75)
    layer = QuantizedLinear.from_linear(dense, args.format, transform, name="layer").to(device)
    former_copy = layer.weight.dequantize(dtype).nbytes
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"K=N={k} format={args.format} dtype={args.dtype} repeats={args.repeats} (min time)")
    print("\n| layer | bytes held | / dense |\n|---|---|---|")
    rows = [("dense nn.Linear", held_bytes(dense)), ("W4A4 layer", held_bytes(layer)),
            ("W4A4 layer + former dense copy", held_bytes(layer) + former_copy)]
    for name, size in rows:
        print(f"| {name} | {size / 2**20:.2f} MiB | {size / rows[0][1]:.3f} |")

    print("\n| tokens M | dense | W4A4 (decode per call) | W4A4 (cached decode) | "
          "per call / dense | cached / dense |\n|---|---|---|---|---|---|")
    with torch.no_grad():
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, device=device, dtype=dtype)
            path = "kernels" if uses_kernels(x, layer.weight) else "emulation"
            times = [best_time(partial(dense, x), args.repeats, device),
                     best_time(partial(layer, x), args.repeats, device)]
            with cache_decoded_weights():
                layer(x)  # decode once
                times.append(best_time(partial(layer, x), args.repeats, device))
            print(f"| {m} | {times[0] * 1e3:.2f} ms | {times[1] * 1e3:.2f} ms ({path}) | "
                  f"{times[2] * 1e3:.2f} ms | {times[1] / times[0]:.1f}x | "
                  f"{times[2] / times[0]:.1f}x |")


if __name__ == "__main__":
    main()
