"""Sibling linears (q/k/v, gate/up) in one pair of launches (issue 45): kbbq_pl.kernels.
linear_w4a4_siblings and the model hooks of kbbq_pl.quant.siblings, under Triton's interpreter
on the CPU (tests/conftest.py).  Each sibling's output must be the bits of its own call (the
interpreter's pinned tile, one K split at these sizes), from one activation launch and one
decode GEMM for all of them; anything the grouped launch does not take runs each layer alone."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_kernels import make_transform
from tiny_models import tiny_model
from torch import nn

from kbbq_pl import formats as F
from kbbq_pl import kernels as K

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


def needs_kernels():
    if not K.available(CPU):
        pytest.skip("kbbq_pl.kernels do not run on the CPU here (TRITON_INTERPRET=1 unset)")


def siblings(fmt: str, widths: tuple[int, ...], k: int, static: bool, seed: int = 0,
             transforms: bool = True) -> list[K.SiblingLinear]:
    """Layers of ``widths`` outputs over ``K`` inputs, each with its own transform (so each
    rounds the shared input its own way), per-tensor scales, static activation scale and bias."""
    gen = torch.Generator().manual_seed(seed)
    d = F.get_format(fmt).block_size
    layers = []
    for i, n in enumerate(widths):
        q = F.quantize(torch.randn(n, k, generator=gen) * (0.5 + i), fmt)
        t = make_transform("random", k, d, seed=seed + i) if transforms else None
        scale = torch.tensor(0.003 * (1 + 0.37 * i)) if static else None  # no ratio of 2^n
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        layers.append(K.SiblingLinear(q.qdata, q.scale, q.global_scale, t, scale, bias))
    return layers


class Counted:
    """Wraps ``module.name`` and counts its calls."""

    def __init__(self, module, name: str):
        self.real, self.calls = getattr(module, name), 0
        self.patch = mock.patch.object(module, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def assert_each_layers_bits(x, layers, fmt, outputs):
    for i, (layer, y) in enumerate(zip(layers, outputs)):
        alone = K.linear_w4a4(x, layer.weight_codes, layer.weight_scales, layer.weight_global,
                              fmt, layer.transform, layer.act_global_scale, layer.bias)
        assert y.shape == alone.shape and y.dtype == alone.dtype, i
        assert torch.equal(y.view(torch.int16), alone.view(torch.int16)), f"sibling {i}"


@pytest.mark.parametrize("fmt, static", [("nvfp4", True), ("nvfp4", False), ("mxfp4", False)])
def test_siblings_run_in_two_launches_with_each_layers_bits(fmt, static):
    """Two and three siblings of different widths, a padded input of 1 and 6 rows: one
    activation launch (two passes for dynamic NVFP4) and one decode GEMM give every sibling
    the bits of its own call."""
    needs_kernels()
    from kbbq_pl.kernels import skinny as S
    from kbbq_pl.kernels import triton_kernels as tk

    k = 256
    for widths, rows in (((48, 16, 40), 1), ((32, 24), 6)):
        layers = siblings(fmt, widths, k, static, seed=len(widths))
        x = (torch.randn(rows, k - 7) * 2).to(torch.bfloat16)
        act, gemm = Counted(tk, "quantize_activations"), Counted(S, "skinny_matmul")
        with act.patch, gemm.patch:
            outputs = K.linear_w4a4_siblings(x, layers, fmt)
        assert (act.calls, gemm.calls) == (1, 1)
        assert [tuple(y.shape) for y in outputs] == [(rows, n) for n in widths]
        assert_each_layers_bits(x, layers, fmt, outputs)


@pytest.mark.parametrize("fmt, static", [("nvfp4", True), ("nvfp4", False), ("mxfp4", False)])
def test_one_row_dp4a_siblings_run_in_two_launches_with_each_layers_bits(fmt, static):
    """With the one-row DP4A product switched on, three siblings at one row still take one
    activation launch (int8 ``2q`` and block scales for each) and one DP4A decode GEMM, each
    output the bits of its own DP4A call; K split in two as well (each split's partials in
    order, the counters left at zero)."""
    needs_kernels()
    from kbbq_pl.kernels import skinny as S
    from kbbq_pl.kernels import triton_kernels as tk

    k = 1024
    layers = siblings(fmt, (48, 16, 40), k, static, seed=7)
    x = (torch.randn(1, k - 9) * 2).to(torch.bfloat16)
    act, gemm = Counted(tk, "quantize_activations"), Counted(S, "skinny_matmul")
    products = []
    real = S.skinny_matmul

    def spy(*args, **kwargs):
        products.append(kwargs.get("a_scales") is not None)
        return real(*args, **kwargs)

    with mock.patch.object(S, "ONE_ROW_PRODUCT", S.PRODUCT_DP4A):
        with act.patch, gemm.patch, mock.patch.object(S, "skinny_matmul", spy):
            outputs = K.linear_w4a4_siblings(x, layers, fmt)
        assert (act.calls, products) == (1, [True])
        assert_each_layers_bits(x, layers, fmt, outputs)
    kind, rounding, gain = K._scale_meta(F.get_format(fmt))
    d = F.get_format(fmt).block_size
    x = torch.randn(1, k).to(torch.bfloat16)
    _, a_scales, pts, doubled = tk.quantize_activations(
        x, [layer.transform for layer in layers], d, kind, rounding, gain,
        [layer.act_global_scale for layer in layers] if static else None,
        values_dtype=torch.int8, codes=False)
    assert doubled.shape == (3, 1, k) and a_scales.shape == (3, 1, k // d)
    codes = [layer.weight_codes for layer in layers]
    scales = [layer.weight_scales.view(torch.uint8) for layer in layers]
    w_global = [layer.weight_global for layer in layers]
    biases = [layer.bias for layer in layers]
    shift = K.prepare_weight(codes[0], layers[0].weight_scales, None, fmt).shift(
        layers[0].weight_scales)
    pts = pts if pts is not None else [None] * 3
    grouped = S.skinny_matmul(doubled, 1, codes, scales, pts, w_global, d, kind, gain, shift,
                              biases, torch.float32, split_k=2, a_scales=a_scales)
    for g, y in enumerate(grouped):
        alone = S.skinny_matmul(doubled[g], 1, codes[g], scales[g], pts[g], w_global[g], d,
                                kind, gain, shift, biases[g], torch.float32, split_k=2,
                                a_scales=a_scales[g])
        assert torch.equal(y, alone), g
    assert int(S._counter(CPU).abs().sum()) == 0
    with pytest.raises(ValueError, match="block scales"):
        S.skinny_matmul(doubled, 1, codes, scales, pts, w_global, d, kind, gain, shift, biases,
                        torch.float32, a_scales=a_scales[:2])


def test_siblings_that_cannot_launch_together_run_alone():
    """A transform on one sibling only, a static scale on one only, MX weights of different
    decode shifts, biases of two dtypes (one kernel pointer type), rows on the prefill path,
    one layer or four: each layer its own call, the same outputs."""
    needs_kernels()
    k = 64
    x = torch.randn(2, k).to(torch.bfloat16)
    nv = siblings("nvfp4", (16, 32), k, static=True)
    mx = siblings("mxfp4", (16, 32), k, static=False)
    far = F.quantize(torch.randn(16, k) * 2.0**6, "mxfp4")  # block scales above 2: shift > 0
    assert K.prepare_weight(far.qdata, far.scale, None, "mxfp4").shift(far.scale) > 0
    cases = {
        "one transform": ("nvfp4", [nv[0], nv[1]._replace(transform=None)], x),
        "one static scale": ("nvfp4", [nv[0], nv[1]._replace(act_global_scale=None)], x),
        "two shifts": ("mxfp4", [mx[0], mx[1]._replace(weight_codes=far.qdata,
                                                        weight_scales=far.scale,
                                                        bias=mx[1].bias[:16])], x),
        "bias dtypes": ("nvfp4", [nv[0], nv[1]._replace(bias=nv[1].bias.float())], x),
        "prefill rows": ("mxfp4", mx, torch.randn(300, k).to(torch.bfloat16)),
        "one layer": ("mxfp4", mx[:1], x),
        "four layers": ("mxfp4", mx + mx, x),
    }
    for case, (fmt, layers, rows) in cases.items():
        alone = Counted(K, "linear_w4a4")
        with alone.patch:
            outputs = K.linear_w4a4_siblings(rows, layers, fmt)
        assert alone.calls == len(layers), case
        assert_each_layers_bits(rows, layers, fmt, outputs)
    with pytest.raises(ValueError, match="no layers"):
        K.linear_w4a4_siblings(x, [], "mxfp4")


def test_split_siblings_sum_each_partial_in_order():
    """Three siblings with K split in two: each output tile's partials (in one buffer for all
    the siblings) summed in split order, the bits of each layer's own launch at the same
    splits, every split-K counter left at zero.  (The interpreter runs a column tile's
    programs one after another, so siblings' partials written over each other would pass
    here: the GPU test below, splitting K at 4096, would not.)"""
    needs_kernels()
    from kbbq_pl.kernels import skinny as S
    from kbbq_pl.kernels import triton_kernels as tk

    fmt, k, rows = "nvfp4", 1024, 3
    layers = siblings(fmt, (16, 12, 9), k, static=False, seed=5)
    x = torch.randn(rows, k).to(torch.bfloat16)
    kind, rounding, gain = K._scale_meta(F.get_format(fmt))
    _, _, pts, values = tk.quantize_activations(
        x, [layer.transform for layer in layers], 16, kind, rounding, gain, None,
        values_dtype=S.activation_dtype(kind), codes=False, word_order=True)
    codes = [layer.weight_codes for layer in layers]
    scales = [layer.weight_scales.view(torch.uint8) for layer in layers]
    w_global = [layer.weight_global for layer in layers]
    biases = [layer.bias for layer in layers]
    grouped = S.skinny_matmul(values, rows, codes, scales, pts, w_global, 16, kind, gain, 0,
                              biases, torch.float32, split_k=2)
    for g, y in enumerate(grouped):
        alone = S.skinny_matmul(values[g], rows, codes[g], scales[g], pts[g], w_global[g], 16,
                                kind, gain, 0, biases[g], torch.float32, split_k=2)
        assert torch.equal(y, alone), g
    assert int(S._counter(CPU).abs().sum()) == 0


def quantized_llama(fmt: str) -> nn.Module:
    """The tiny Llama with every decoder linear a W4A4 weight of its own random block
    transform (static NVFP4 activation scales: the recipes' default)."""
    from kbbq_pl.quant.layers import w4a4_weight

    model = tiny_model("llama").to(torch.bfloat16)
    d = F.get_format(fmt).block_size
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and ".layers." in n]
    for i, (name, module) in enumerate(linears):
        t = make_transform("random", module.in_features, d, seed=i)
        static = F.get_format(fmt).global_scale
        weight = w4a4_weight(module, fmt, t, act_scale="static" if static else "dynamic",
                             act_global_scale=torch.tensor(0.004 * (1 + 0.37 * (i % 3))) if static
                             else None, name=name)
        module.weight = nn.Parameter(weight, requires_grad=False)
    return model


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hooked_llama_runs_q_k_v_and_gate_up_together(fmt):
    """With :func:`group_sibling_linears`, a decode step of the tiny Llama on the kernels (the
    CPU standing in for CUDA) runs q/k/v and gate/up as one grouped call each (o and down
    alone): 8 products for 2 layers instead of 14, the same logits; a second call hooks
    nothing more; removed, every layer runs alone again."""
    needs_kernels()
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.siblings import group_sibling_linears

    model = quantized_llama(fmt)
    ids = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        alone_calls = Counted(K, "linear_w4a4")
        with alone_calls.patch:
            alone = model(ids).logits
        assert alone_calls.calls == 14
        hooks = group_sibling_linears(model)
        assert group_sibling_linears(model).groups == []  # already hooked
        assert sorted(g[-1].rpartition(".")[2] for g in hooks.groups) == [
            "up_proj", "up_proj", "v_proj", "v_proj"]
        each, grouped = Counted(K, "linear_w4a4"), Counted(K, "linear_w4a4_siblings")
        with each.patch, grouped.patch:
            together = model(ids).logits
        assert (each.calls, grouped.calls) == (4, 4)
        assert torch.equal(together, alone)
        assert w4a4.sibling_scopes.stack == []
        hooks.remove()
        each = Counted(K, "linear_w4a4")
        with each.patch:
            assert torch.equal(model(ids).logits, alone)
        assert each.calls == 14


class _Attention(nn.Module):
    """q, k, v reading one input, which ``between`` may change in place after q's call."""

    def __init__(self, layers: dict[str, nn.Linear], between=None):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = layers["q"], layers["k"], layers["v"]
        self.between = between

    def forward(self, x):
        q = self.q_proj(x)
        if self.between is not None:
            self.between(x)
        return q, self.k_proj(x), self.v_proj(x)


def mx_linears(names: str = "qkv", plain: str = "", out: int = 32) -> dict[str, nn.Linear]:
    """q, k, v: MX layers with their own random transforms (none for those in ``plain``), of
    one decode shift (0), so that they launch together."""
    from kbbq_pl.quant.layers import w4a4_weight

    torch.manual_seed(0)
    layers = {}
    for i, name in enumerate(names):
        linear = nn.Linear(64, out).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.mul_(0.05)  # W T^-1 of a random T: block scales below 2
        t = None if name in plain else make_transform("random", 64, 32, seed=i)
        weight = w4a4_weight(linear, "mxfp4", t, act_scale="dynamic", name=f"{name}_proj")
        assert K.prepare_weight(weight.qdata, weight.scale, None, "mxfp4").shift(
            weight.scale) == 0
        linear.weight = nn.Parameter(weight, requires_grad=False)
        layers[name] = linear
    return layers


def test_a_copy_groups_its_own_layers():
    """The hooks name the siblings by attribute: a deep copy of a hooked module groups its own
    layers, and a model saved whole (``torch.save``) loads with its hooks and the compiler's
    pass."""
    needs_kernels()
    import copy
    import io

    from torch._inductor import config

    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.siblings import SiblingLinearPass, group_sibling_linears

    attention = _Attention(mx_linears())
    group_sibling_linears(attention)
    twin = copy.deepcopy(attention)
    x = torch.randn(1, 64).to(torch.bfloat16)
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        want = attention(x)
        grouped, alone = Counted(K, "linear_w4a4_siblings"), Counted(K, "linear_w4a4")
        with grouped.patch, alone.patch:
            got = twin(x)
        assert (grouped.calls, alone.calls) == (1, 0)
        for y, ref in zip(got, want):
            assert torch.equal(y, ref)
        buffer = io.BytesIO()
        torch.save(attention, buffer)
        buffer.seek(0)
        with config.patch(post_grad_custom_post_pass=None):  # a new process: the pass too
            again = torch.load(buffer, weights_only=False)
            assert isinstance(config.post_grad_custom_post_pass, SiblingLinearPass)
        grouped = Counted(K, "linear_w4a4_siblings")
        with grouped.patch:
            again(x)
        assert grouped.calls == 1


class _CrossAttention(_Attention):
    """q reads the decoder's input, k and v the encoder's states (another tensor)."""

    def forward(self, x, states):
        return self.q_proj(x), self.k_proj(states), self.v_proj(states)


def test_siblings_reading_different_inputs_run_alone():
    """Cross-attention's keys and values read another tensor than the queries: their kept
    outputs serve nothing, so they run alone (not the group again), and from the next call
    on the group runs alone, at no cost of its own."""
    needs_kernels()
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.siblings import group_sibling_linears

    layers = mx_linears()
    x, states = torch.randn(1, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    attention = _CrossAttention(layers)
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        want = [layers["q"](x), layers["k"](states), layers["v"](states)]
        group_sibling_linears(attention)
        for call, counts in enumerate(((1, 2), (0, 3))):
            grouped, alone = Counted(K, "linear_w4a4_siblings"), Counted(K, "linear_w4a4")
            with grouped.patch, alone.patch:
                got = attention(x, states)
            assert (grouped.calls, alone.calls) == counts, call
            for y, ref in zip(got, want):
                assert torch.equal(y, ref)


def test_a_kept_output_serves_only_the_unchanged_input():
    """An output computed with the first sibling's serves its own call only for the same
    tensor, unchanged since (its version counter): after an input changed in place between
    the calls, the others are multiplied anew, alone; an error inside the parent leaves no
    scope behind."""
    needs_kernels()
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.siblings import group_sibling_linears

    layers = mx_linears()
    x = torch.randn(2, 64).to(torch.bfloat16)
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        want = [layers[name](x * 2 if name != "q" else x) for name in "qkv"]
        attention = _Attention(layers, lambda h: h.mul_(2))
        group_sibling_linears(attention)
        grouped, alone = Counted(K, "linear_w4a4_siblings"), Counted(K, "linear_w4a4")
        with grouped.patch, alone.patch:
            got = attention(x.clone())
        assert (grouped.calls, alone.calls) == (1, 2)  # q's; then k and v alone, anew
        for name, y, ref in zip("qkv", got, want):
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), name

        def fail(h):
            raise RuntimeError("inside the parent")

        attention.between = fail
        with pytest.raises(RuntimeError, match="inside the parent"):
            attention(x)
        assert w4a4.sibling_scopes.stack == []


def compiled_with_the_pass(module: nn.Module, counts: list) -> nn.Module:
    """``module`` compiled to ATen graphs run as they are (no Inductor: its fusions of the
    other operations round their own way) after :func:`merge_sibling_linears`; ``counts``
    gets, per graph, the grouped calls made and the single operators left."""
    from torch._dynamo.backends.common import aot_autograd

    from kbbq_pl.quant.siblings import merge_sibling_linears

    def forward_compiler(gm, example_inputs):
        made = merge_sibling_linears(gm.graph)
        gm.recompile()
        single = torch.ops.kbbq_pl.w4a4_linear.default
        counts.append((made, sum(n.target is single for n in gm.graph.nodes)))
        return gm

    torch._dynamo.reset()
    return torch.compile(module, backend=aot_autograd(fw_compiler=forward_compiler),
                         fullgraph=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compiled_llama_runs_q_k_v_and_gate_up_as_one_operator(fmt):
    """Under ``torch.compile`` the hooks stand aside; the post-grad pass puts one
    ``kbbq_pl::w4a4_linear_siblings`` in place of q/k/v's and gate/up's operators: 4 grouped
    calls and 4 single ones for 2 layers, the eager logits bit for bit."""
    needs_kernels()
    from kbbq_pl.quant import w4a4

    model = quantized_llama(fmt)
    ids = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(1))
    counts: list = []
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        eager = model(ids).logits
        compiled = compiled_with_the_pass(model, counts)
        each, grouped = Counted(K, "linear_w4a4"), Counted(K, "linear_w4a4_siblings")
        with each.patch, grouped.patch:
            logits = compiled(ids).logits
    assert counts == [(4, 4)]
    assert (each.calls, grouped.calls) == (4, 4)
    assert torch.equal(logits, eager)


class _Readers(nn.Module):
    """Layers reading one input; ``late`` takes a bias the graph computes after the first
    layer's call."""

    def __init__(self, layers: dict[str, nn.Linear], late: str = ""):
        super().__init__()
        self.layers, self.late = nn.ModuleDict(layers), late

    def forward(self, x):
        return [torch.nn.functional.linear(x, layer.weight, layer.bias * 2)
                if name in self.late else layer(x) for name, layer in self.layers.items()]


@pytest.mark.parametrize("names, plain, late, made_left, calls", [
    ("qkvg", "", "", (1, 1), (1, 1)),  # at most 3 together
    ("qkv", "k", "", (1, 1), (1, 1)),  # k without a transform: not k's siblings
    ("qkv", "", "v", (1, 1), (1, 1)),  # v's bias computed after q's call: alone
    ("qk", "", "", (1, 0), (1, 0)),
    ("qkv", "qkv", "", (1, 0), (1, 0)),  # none with a transform: together
])
def test_the_pass_groups_only_what_can_run_as_one_call(names, plain, late, made_left, calls):
    needs_kernels()
    from kbbq_pl.quant import w4a4

    layers = mx_linears(names, plain)
    readers = _Readers(layers, late)
    x = torch.randn(2, 64).to(torch.bfloat16)
    counts: list = []
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        want = readers(x)
        compiled = compiled_with_the_pass(readers, counts)
        grouped, alone = Counted(K, "linear_w4a4_siblings"), Counted(K, "linear_w4a4")
        with grouped.patch, alone.patch:
            got = compiled(x)
    assert counts == [made_left]
    assert (grouped.calls, alone.calls) == calls
    for name, y, ref in zip(names, got, want):
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), name


class _Chain(nn.Module):
    """a and b read the input; c and d read a's output."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.ModuleDict(mx_linears("ab", out=64)), \
            nn.ModuleDict(mx_linears("cd"))

    def forward(self, x):
        a, b = (layer(x) for layer in self.first.values())
        return [b, *(layer(a) for layer in self.second.values())]


def test_siblings_reading_a_grouped_output_run_as_one_call_too():
    needs_kernels()
    from kbbq_pl.quant import w4a4

    chain = _Chain()
    x = torch.randn(1, 64).to(torch.bfloat16)
    counts: list = []
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)):
        want = chain(x)
        grouped = Counted(K, "linear_w4a4_siblings")
        with grouped.patch:
            got = compiled_with_the_pass(chain, counts)(x)
    assert counts == [(2, 0)] and grouped.calls == 2
    for y, ref in zip(got, want):
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


def test_inductor_runs_the_pass_the_hooks_install():
    """:func:`group_sibling_linears` (what the loaders call) makes the pass Inductor's
    post-grad pass unless another holds it; a model compiled by Inductor then runs its
    siblings as one call each, to the logits of Inductor without the pass."""
    needs_kernels()
    from torch._inductor import config

    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.siblings import (
        SiblingLinearPass,
        group_sibling_linears,
        install_compile_pass,
    )

    def other(graph):
        pass

    with config.patch(post_grad_custom_post_pass=other), \
            pytest.warns(UserWarning, match="merge_sibling_linears"):
        assert not install_compile_pass() and config.post_grad_custom_post_pass is other
    model = quantized_llama("nvfp4")
    ids = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(1))
    logits, calls = [], []
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)), \
            config.patch(post_grad_custom_post_pass=None, fx_graph_cache=False):
        for hooked in (False, True):
            if hooked:
                group_sibling_linears(model)
                assert isinstance(config.post_grad_custom_post_pass, SiblingLinearPass)
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True)
            each, grouped = Counted(K, "linear_w4a4"), Counted(K, "linear_w4a4_siblings")
            with each.patch, grouped.patch:
                logits.append(compiled(ids).logits)
            calls.append((each.calls, grouped.calls))
    assert calls == [(14, 0), (4, 4)]
    assert torch.equal(*logits)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_siblings_match_the_exact_product(fmt):
    """On a CUDA device, q/k/v of a Llama-8B layer (4096 -> 4096, 1024, 1024) at 1 and 16 rows:
    each grouped output within one bf16 rounding of the exact product of its layer's codes
    (the grouped launch may split K otherwise than each layer's own), and a CUDA graph of the
    grouped call replays its bits."""
    from test_kernels import assert_within_one_bf16_rounding

    device = torch.device("cuda")
    if not K.available(device):
        pytest.skip("kbbq_pl.kernels do not run on CUDA here")
    layers = siblings(fmt, (4096, 1024, 1024), 4096, static=F.get_format(fmt).global_scale)
    on_device = [K.SiblingLinear(*(f.to(device) if isinstance(f, torch.Tensor) else f
                                   for f in layer)) for layer in layers]
    for rows in (1, 16):
        x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows))
        x = x.to(torch.bfloat16)
        outputs = K.linear_w4a4_siblings(x.to(device), on_device, fmt)
        for layer, y in zip(layers, outputs):
            ref = K.reference_linear_w4a4(x.float(), layer.weight_codes, layer.weight_scales,
                                          layer.weight_global, fmt, layer.transform,
                                          layer.act_global_scale, layer.bias.float())
            assert_within_one_bf16_rounding(y.cpu(), ref.double())
    x = x.to(device)  # prepared weights: no host reads (MX's shift) inside the capture
    on_device = [layer._replace(prepared=K.prepare_weight(
        layer.weight_codes, layer.weight_scales, layer.weight_global, fmt,
        layer.act_global_scale)) for layer in on_device]
    eager = K.linear_w4a4_siblings(x, on_device, fmt)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.linear_w4a4_siblings(x, on_device, fmt)
    graph.replay()
    torch.cuda.synchronize()
    for y, want in zip(captured, eager):
        assert torch.equal(y, want)
