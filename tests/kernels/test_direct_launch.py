"""Direct launches (``kbbq_pl.kernels.direct_launch``): a launch Triton has made once is made again
with the compiled kernel and the arguments Triton passed it, and only where Triton would
specialize the same way.  Checked with the kernels compiled for sm_90 on the CPU and their
launches recorded (``bench/_no_gpu.py``), in a process without Triton's interpreter."""

from __future__ import annotations

from unittest import mock

import pytest
from test_kernels import run_compile_check

THROUGH_TRITON = """
import sys
sys.path.insert(0, {bench!r})
import torch
from triton.runtime.jit import JITFunction
from _no_gpu import no_gpu_launches
from kbbq_pl import formats as F
from kbbq_pl import kernels as K

through_triton = []  # every kernel a launch through Triton returned
run = JITFunction.run
def counted(self, *args, **kwargs):
    kernel = run(self, *args, **kwargs)
    through_triton.append(kernel)
    return kernel
JITFunction.run = counted
"""
"""The start of a check script: the kernels compiled for sm_90 on the CPU, each launched through
Triton kept in ``through_triton``."""

LAUNCH_CHECK = THROUGH_TRITON + """
from kbbq_pl.kernels import direct_launch as L

def same(first, again):
    # each launch: the kernel, the grid, and every argument Triton bound (a tensor made
    # afresh by the call: the same dtype, shape and strides; one held across calls: itself)
    assert len(first) == len(again) > 0, (len(first), len(again))
    for (name, grid, args), (name2, grid2, args2) in zip(first, again):
        assert (name, grid, len(args)) == (name2, grid2, len(args2)), (name, name2, grid, grid2)
        for i, (a, b) in enumerate(zip(args, args2)):
            if isinstance(a, torch.Tensor):
                assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), (name, i)
            else:
                assert type(a) is type(b) and a == b, (name, i, a, b)

torch.manual_seed(0)
k = 512
with no_gpu_launches() as launches:
    for fmt, rows in (("nvfp4", 1), ("mxfp4", 3)):
        d = F.get_format(fmt).block_size
        layers = []
        for n in (256, 128):
            q = F.quantize(torch.randn(n, k) * 0.02, fmt)
            scale = torch.tensor(0.01) if fmt == "nvfp4" else None
            layers.append(K.SiblingLinear(q.qdata, q.scale, q.global_scale,
                                          torch.randn(k // d, d, d), scale, None,
                                          K.prepare_weight(q.qdata, q.scale, q.global_scale,
                                                           fmt, scale)))
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        one = layers[0]

        def alone(x):
            return K.linear_w4a4(x, *one[:3], fmt, *one[3:6], prepared=one.prepared)

        for call in (lambda: alone(x),
                     lambda: K.linear_w4a4_siblings(x, layers, fmt)):
            start = len(launches)
            call()
            first, compiled = launches[start:], len(through_triton)
            call()
            same(first, launches[start + len(first):])
            assert len(through_triton) == compiled, "launched through Triton again"
        # an input Triton specializes otherwise (2 bytes off 16): its own compiled kernel,
        # while the GEMM after it (aligned values) is launched directly
        wide = torch.randn(rows, k + 8, dtype=torch.bfloat16)
        before = len(through_triton)
        for view in (wide[:, 1:k + 1], wide[:, 1:k + 1]):
            alone(view)
        misaligned = through_triton[before:]
        assert len(misaligned) == 1, len(misaligned)
        assert misaligned[0].name == "_quantize_activations_kernel"
        aligned = [kernel for kernel in through_triton[:before]
                   if kernel.name == "_quantize_activations_kernel"]
        assert all(misaligned[0] is not kernel for kernel in aligned)
    assert len(L._launches) == 10, len(L._launches)

    # another launch of the same autotuned GEMM between Triton's first launch of a key and
    # the entry made of it (a second thread while the first compiles), with timings that
    # choose 32 x 64 x 256 up to 32 rows and 64 x 128 x 128 above: the entry keeps the first
    # launch's kernel, grid and constants
    from unittest import mock
    from triton.runtime.autotuner import Autotuner

    def bench(self, *args, config, **kwargs):
        tall = args[self.arg_names.index("M")] > 32
        tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"])
        return [1.0 if tile == ((64, 128, 128) if tall else (32, 64, 256)) else 2.0] * 3

    def gemm(rows):
        start = len(launches)
        alone(torch.randn(rows, k, dtype=torch.bfloat16))
        return [launch for launch in launches[start:] if launch[0] == "_skinny_kernel"]

    direct, raced = L._direct, []

    def racing(compiled, grid, args):
        if compiled.name == "_skinny_kernel" and not raced:
            raced.append(None)  # the racing launch's own entry is made plainly
            raced[0] = gemm(63)
        return direct(compiled, grid, args)

    with mock.patch.object(Autotuner, "_bench", bench):
        gemm(64)
        with mock.patch.object(L, "_direct", racing):
            first = gemm(20)[:1]  # then the racing launch's
        assert raced[0][0][1] != first[0][1], "the racing launch ran the same grid"
        same(first, gemm(20))
print("ok")
"""


def test_direct_launches_repeat_tritons_launch_and_only_where_it_would():
    """A decode-path linear and a sibling group (NVFP4 at one row, MX at three, KBBQ blocks):
    called again, both kernels are launched directly (Triton binds nothing) with the grids and
    every argument Triton passed the first time; an input 2 bytes off 16 gets the activation
    kernel Triton compiles for it (a kernel of its own), the GEMM after it launched directly;
    another launch of the autotuned GEMM (another tile) between Triton's first launch and the
    entry made of it leaves the entry the first launch's."""
    pytest.importorskip("triton")
    run_compile_check(LAUNCH_CHECK)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_direct_launches_give_tritons_bits(fmt):
    """On a GPU: a decode-path linear and three siblings at 1, 16 and 64 rows, launched
    directly (after their first launch) and in a CUDA graph, give the bits of the same calls
    launched through Triton every time."""
    import torch
    from test_fast_paths import decode_operands, needs_kernels
    from test_kernels import block, make_transform

    from kbbq_pl import kernels as K
    from kbbq_pl.kernels import direct_launch

    device = torch.device("cuda")
    needs_kernels(device)
    d, k = block(fmt), 1024
    layers = []
    for i, n in enumerate((512, 128, 128)):
        _, q = decode_operands(fmt, 1, n, k, seed=i)
        operands = [v.to(device) if v is not None else None
                    for v in (q.qdata, q.scale, q.global_scale)]
        layers.append(K.SiblingLinear(*operands, make_transform("random", k, d, i).to(device),
                                      prepared=K.prepare_weight(*operands, fmt)))
    for m in (1, 16, 64):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

        def call(x=x):
            one = layers[0]
            return [K.linear_w4a4(x, *one[:3], fmt, *one[3:6], prepared=one.prepared),
                    *K.linear_w4a4_siblings(x, layers, fmt)]

        with mock.patch.object(direct_launch, "DIRECT", False):
            want = call()
        call()
        assert all(torch.equal(a, b) for a, b in zip(call(), want)), (fmt, m, "eager")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, want)), (fmt, m, "graph")


FUSION_CHECK = """
import os, warnings
os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"  # Triton 3.10's default: no contraction
""" + THROUGH_TRITON + """
from kbbq_pl.kernels import skinny

torch.manual_seed(0)
k, n = 256, 128
warnings.simplefilter("error")  # Triton 3.9 warns where a launch leaves fusion to its default
with no_gpu_launches():
    for fmt in ("nvfp4", "mxfp4"):
        d = F.get_format(fmt).block_size
        q = F.quantize(torch.randn(n, k) * 0.02, fmt)
        t = torch.randn(k // d, d, d)
        layer = K.SiblingLinear(q.qdata, q.scale, q.global_scale, t)
        for rows, path in ((1, None), (3, None), (3, "tiled"), (40, "tiled"), (40, "prefill")):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            K.linear_w4a4(x, *layer[:3], fmt, t, path=path, prefill_product="triton")
        K.linear_w4a4_siblings(torch.randn(2, k, dtype=torch.bfloat16), [layer, layer], fmt)
        codes, scales, pts = K.quantize_activations(torch.randn(3, k), t, fmt)
        K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, fmt, split_k=2)
    skinny.ONE_ROW_PRODUCT = skinny.PRODUCT_DP4A
    K.linear_w4a4(torch.randn(1, k, dtype=torch.bfloat16), *layer[:3], "mxfp4", t)
    q = F.quantize(torch.randn(n, k) * 0.02, "mxfp4")
    K._fold_weight(q.qdata, q.scale.view(torch.uint8), F.get_format("mxfp4"),
                   torch.zeros(1, dtype=torch.int32))

def product(kernel):
    names = kernel.src.fn.arg_names
    return {{names[i[0]]: v for i, v in kernel.src.constants.items()}}.get("PRODUCT")
names = {{kernel.name for kernel in through_triton}}
expected = {{"_quantize_activations_kernel", "_skinny_kernel", "_w4a4_kernel", "_split_k_sum",
             "_decode_kernel", "_fold_e4m3_kernel"}}
assert expected <= names, sorted(expected - names)
assert {{product(kernel) for kernel in through_triton if kernel.name == "_skinny_kernel"}} == {{
    skinny.PRODUCT_DOT, skinny.PRODUCT_DP4A}}
unfused = sorted({{kernel.name for kernel in through_triton
                  if not kernel.metadata.enable_fp_fusion}})
assert not unfused, unfused
print("ok")
"""


def test_every_kernel_compiles_with_fp_fusion_whatever_tritons_default():
    """Every kernel of the decode, tiled and prefill paths (siblings, split-K, the one-row
    DP4A product, the FP8 fold) compiles with FP fusion on, as its bits and compile reports
    were made, under Triton's default turned off (Triton 3.10's; 3.9 warns that it will
    change, a warning that fails this check)."""
    pytest.importorskip("triton")
    run_compile_check(FUSION_CHECK)
