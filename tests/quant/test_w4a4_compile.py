"""``torch.compile`` over W4A4 weights: one graph (the product is one custom operator), the
same bits as eager, the kernels reached with their prepared weight."""

from __future__ import annotations

import sys

import pytest
import torch
from test_w4a4 import FakeKernels, hadamard_linear
from tiny_models import tiny_model
from torch import nn

from kbbq_pl.quant import FormatConfig, QuantizationConfig, quantize_model, w4a4
from kbbq_pl.quant.w4a4 import W4A4Weight

pytestmark = pytest.mark.usefixtures("one_thread")

OP = "kbbq_pl.w4a4_linear"


def graphs_of(module: nn.Module, *args) -> list[str]:
    """The code of each ATen-level graph ``torch.compile`` makes of ``module(*args)`` (no
    gradient; more than one means a graph break)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[str] = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=aot_autograd(fw_compiler=forward_compiler))(*args)
    return graphs


class TwoLinears(nn.Module):
    """Two W4A4 linears with elementwise ops between them (which Inductor fuses), exact ones:
    the compiled model's bits are then the linears' own (Inductor's ``silu`` on the CPU rounds
    differently from eager's in torch 2.10)."""

    def __init__(self, fmt: str, **kwargs) -> None:
        super().__init__()
        self.up, _, _ = hadamard_linear(64, 96, fmt, **kwargs)
        self.down, _, _ = hadamard_linear(96, 40, fmt, **kwargs)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * 2.0)


@pytest.mark.parametrize("fmt, act_scale, dtype", [
    ("nvfp4", "static", torch.bfloat16), ("nvfp4", "dynamic", torch.float32),
    ("mxfp4", "dynamic", torch.bfloat16)])
def test_compiled_linears_are_one_graph_with_the_eager_bits(fmt, act_scale, dtype):
    model = TwoLinears(fmt, act_scale=act_scale, act_global_scale=torch.tensor(0.004))
    x = torch.randn(3, 5, 64).to(dtype)
    with torch.no_grad():
        eager, eager_row = model(x), model(x[:1])  # a dynamic scale is each call's own
    graphs = graphs_of(model, x)
    assert len(graphs) == 1 and graphs[0].count(OP) == 2, graphs
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        first, second = compiled(x), compiled(x[:1])  # a second shape: a recompile, same bits
    assert first.dtype == dtype and torch.equal(first, eager)
    assert torch.equal(second, eager_row)


def test_the_compile_cache_key_follows_every_field():
    _, weight, _ = hadamard_linear(act_scale="static", act_global_scale=torch.tensor(0.02))
    key = weight._stable_hash_for_caching()
    assert key == weight.replace()._stable_hash_for_caching()  # the same fields
    for changed in (weight.replace(act_scale="dynamic", act_global_scale=None),
                    weight.replace(layer_name="other"), weight.replace(transform=None),
                    weight.replace(scale=weight.scale.t().contiguous().t())):
        assert changed._stable_hash_for_caching() != key


def test_an_exported_program_holds_the_operator_and_gives_the_eager_bits():
    model = TwoLinears("mxfp4", act_scale="dynamic")
    x = torch.randn(3, 64)
    with torch.no_grad():
        program = torch.export.export(model, (x,))
        eager = model(x)
        assert torch.equal(program.module()(x), eager)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count("kbbq_pl.w4a4_linear.default") == 2, targets


def test_fake_inputs_take_the_traceable_paths_whatever_is_compiling_says(monkeypatch):
    """The compiler traces ``F.linear`` of a ``W4A4Weight`` by running its handler on fake
    tensors, where torch 2.11 says ``is_compiling()`` False: the product still becomes the
    operator, with or without a gradient, reading no value."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kbbq_pl._compat import tracing

    linear, _, _ = hadamard_linear()
    assert not tracing()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert tracing()
        x = mode.from_tensor(torch.randn(3, 64))
        with torch.no_grad():
            assert linear(x).shape == (3, 24)
        y = linear(x.requires_grad_())
        assert y.shape == (3, 24) and y.requires_grad


def test_compiled_products_reach_the_kernels_with_one_prepared_weight(monkeypatch):
    fake = FakeKernels()
    monkeypatch.setitem(sys.modules, "kbbq_pl.kernels", fake)
    monkeypatch.setattr(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",))
    scale = torch.tensor(0.02)
    linear, weight, t = hadamard_linear(act_scale="static", act_global_scale=scale)
    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        y = compiled(x)
        compiled(x)
    assert torch.equal(y, torch.full((3, 5, 24), 7.0))
    first, second = fake.calls
    assert first[1] is linear.weight.qdata and first[2] is linear.weight.scale
    assert first[4] == weight.fmt and torch.equal(first[5], t.float())
    assert torch.equal(first[6], scale) and torch.equal(first[7], linear.bias)
    assert first[8][0] == "prepared" and second[8] is first[8]  # prepared once, kept


@pytest.mark.parametrize("transform, dtype", [
    ("blocks", torch.float32), ("dense", torch.bfloat16), ("none", torch.bfloat16)])
def test_the_operator_s_gradients_are_the_emulation_s(transform, dtype):
    """A gradient to the input and the bias of a frozen W4A4 layer (an adapter trained around
    it): through the operator (its registered backward) the emulation's straight-through
    gradients bit for bit, the input padded to whole blocks (172 -> 176)."""
    linear, weight, _ = hadamard_linear(172, 40)
    if transform != "blocks":
        weight = weight.replace(transform=None if transform == "none" else
                                torch.linalg.qr(torch.randn(176, 176))[0])
    bias = linear.bias.detach().to(dtype).requires_grad_()
    x = torch.randn(3, 5, 172).to(dtype).requires_grad_()
    upstream = torch.randn(3, 5, 40).to(dtype)

    def gradients(product):
        x.grad = bias.grad = None
        y = product(x, weight, bias)
        y.backward(upstream)
        return y.detach(), x.grad, bias.grad

    expected = gradients(torch.nn.functional.linear)  # the emulation, through autograd
    assert expected[1].dtype == dtype and expected[1].abs().sum() > 0
    torch._dynamo.reset()  # aot_eager: Inductor sums the bias's gradient in its own order
    compiled = torch.compile(torch.nn.functional.linear, backend="aot_eager", fullgraph=True)
    for got in (gradients(w4a4.compiled_linear), gradients(compiled)):
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_gradient_to_the_input_compiles_to_the_operator():
    """With a gradient too, the compiled graph holds the operator, not the traced emulation,
    and its gradient is the eager one."""
    model = TwoLinears("nvfp4")
    x = torch.randn(4, 64, requires_grad=True)
    model(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[str] = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=forward_compiler,
                                                          bw_compiler=lambda gm, _: gm))
    compiled(x).square().sum().backward()
    assert torch.equal(x.grad, expected)
    assert len(graphs) == 1 and graphs[0].count(OP) == 2, graphs
    assert "fake_quantize" not in graphs[0] and "round" not in graphs[0]


def test_a_quantized_causal_lm_compiles_to_one_graph_with_the_eager_logits():
    """Every linear of the decoder is the operator in one graph, and the graph gives the eager
    logits bit for bit (``aot_eager``: Inductor's own fusions of the other operations, norms
    and softmax, round differently from eager, as for any compiled model)."""
    model = tiny_model("llama", intermediate_size=172)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(format=FormatConfig("nvfp4")),
                   progress=False)
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    graphs = graphs_of(model, ids)
    assert len(graphs) == 1 and graphs[0].count(OP) == 2 * 7, [g.count(OP) for g in graphs]
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager")(input_ids=ids).logits
    assert torch.equal(compiled, eager)


def test_compiled_linears_run_the_kernels_to_the_eager_bits(monkeypatch):
    """The real kbbq_pl.kernels (where present), under Triton's interpreter on the CPU: the
    decode path for a few rows, the prefill path for many, each the eager call's bits."""
    kernels = w4a4._kernels()
    if kernels is None or not kernels.available(torch.device("cpu")):
        pytest.skip("kbbq_pl.kernels is absent, or does not run on the CPU (TRITON_INTERPRET=1)")
    monkeypatch.setattr(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",))
    monkeypatch.setitem(kernels.PREFILL_MIN_M, "e4m3", 8)
    model = TwoLinears("nvfp4", act_scale="static", act_global_scale=torch.tensor(0.004))
    few, many = torch.randn(1, 3, 64).bfloat16(), torch.randn(2, 6, 64).bfloat16()
    with torch.no_grad():
        eager = [model(few), model(many)]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        assert all(torch.equal(compiled(x), y) for x, y in zip((few, many), eager))


def test_compiled_emulation_keeps_its_decoded_weights(monkeypatch):
    """Inside ``cache_decoded_weights`` a compiled layer decodes its weight once, as an eager
    one does, though the operator works on a weight rebuilt from the graph's tensors."""
    linear, weight, _ = hadamard_linear()
    decodes = []
    real = W4A4Weight.dequantize

    def counted(self, *args, **kwargs):
        decodes.append(self.qdata)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(W4A4Weight, "dequantize", counted)
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), w4a4.cache_decoded_weights():
        first, second = compiled(x), compiled(x)
    assert len(decodes) == 1 and decodes[0] is linear.weight.qdata
    assert torch.equal(first, second) and torch.equal(first, linear(x))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_compiled_with_cuda_graphs_gives_the_eager_bits(fmt):
    """On CUDA, ``mode="reduce-overhead"`` (CUDA graphs) over two chained W4A4 linears on the
    kernels: the eager bits at a decode step's rows and at a prefill's, replayed."""
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, _, _ = hadamard_linear(256, 512, fmt, act_scale="static",
                                               act_global_scale=torch.tensor(0.004))
            self.second, _, _ = hadamard_linear(512, 128, fmt, act_scale="static",
                                                act_global_scale=torch.tensor(0.004))

        def forward(self, x):
            return self.second(self.first(x))

    model = Chain().cuda()  # the weights' fields move with them (W4A4Weight's .to)
    for layer in (model.first, model.second):
        layer.bias.data = layer.bias.data.bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for rows in (1, 16, 2048):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            eager = model(x)
            for _ in range(3):  # warm-up, recording, replay
                got = compiled(x).clone()
        assert torch.equal(got, eager), (fmt, rows)


@pytest.mark.parametrize("act_scale", ["dynamic", "static"])
def test_a_trainable_layer_compiles_to_one_graph_with_the_eager_gradients(act_scale):
    """FP4 fine-tuning under ``torch.compile``: the master weight's straight-through product
    traces whole (``fullgraph=True``: its rounding checks are asserted in the graph, not read
    to the host), with the eager outputs and gradients."""
    from kbbq_pl.quant.layers import QuantizedLinear
    from kbbq_pl.transforms.fit import fit_transform

    linear = nn.Linear(64, 32)
    t = fit_transform("hadamard", linear.weight.detach(), block=16)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", t, act_scale=act_scale,
                                        trainable=True)
    if act_scale == "static":
        layer.act_global_scale = torch.tensor(0.004)
    x = torch.randn(4, 64, requires_grad=True)
    grads = []
    for run in (layer, torch.compile(layer, fullgraph=True)):
        torch._dynamo.reset()
        layer.weight.grad, x.grad = None, None
        y = run(x)
        y.square().sum().backward()
        grads.append((y.detach(), layer.weight.grad.clone(), x.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_compiled_rounding_of_non_finite_values_still_fails():
    from kbbq_pl import formats as F

    rounding = torch.compile(lambda x: F.fake_quantize(x, "mxfp4", name="acts"), fullgraph=True)
    x = torch.randn(2, 64)
    assert torch.equal(rounding(x), F.fake_quantize(x, "mxfp4"))
    x[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="acts: non-finite values"):
        rounding(x)
