"""The W4A4 weight subclass: F.linear on any module, fields through torch's machinery, the
kernel dispatch (with a fake kernel module), the opt-in decode cache, and no dense copies."""

from __future__ import annotations

import copy
import io
import sys
import types

import pytest
import torch
import torch.nn.functional as TF
from tiny_models import tiny_model
from torch import nn

from kbbq_pl import formats as F
from kbbq_pl import from_pretrained, save_quantized
from kbbq_pl.kernels import prepared
from kbbq_pl.quant import (
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    quantize_model,
    w4a4,
)
from kbbq_pl.quant.layers import (
    QuantizedLinear,
    freeze_layers,
    fused_trainable_groups,
    quantized_linears,
    share_fused_scales,
    w4a4_weight,
)
from kbbq_pl.quant.scales import weight_global_scale
from kbbq_pl.quant.w4a4 import MasterWeight, W4A4Weight, cache_decoded_weights, decoded_weight
from kbbq_pl.transforms.fit import fit_transform, transform_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def hadamard_linear(in_features: int = 64, out_features: int = 24, fmt: str = "nvfp4",
                    **kwargs) -> tuple[nn.Linear, W4A4Weight, torch.Tensor]:
    """A plain nn.Linear whose weight is replaced by its W4A4Weight (block Hadamard)."""
    linear = nn.Linear(in_features, out_features)
    block = F.get_format(fmt).block_size
    t = fit_transform("hadamard", TF.pad(linear.weight.detach(), (0, -in_features % block)),
                      block=block)
    weight = w4a4_weight(linear, fmt, t, name="layer", **kwargs)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear, weight, t


def reference(x, weight: W4A4Weight, t, bias, global_scale=None):
    """Q(W T^-1) Q(T x) + b from the formats' functions, in FP32."""
    h = TF.pad(x.reshape(-1, x.shape[-1]).float(), (0, weight.last_dim - x.shape[-1]))
    h = F.fake_quantize(transform_inputs(h, t.float()), weight.fmt, global_scale=global_scale)
    y = h @ F.dequantize(weight, torch.float32).T + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def test_plain_linear_computes_the_quantized_product():
    linear, weight, t = hadamard_linear()
    x = torch.randn(5, 7, 64)
    y = linear(x)
    assert type(linear) is nn.Linear and isinstance(linear.weight, F.QuantizedTensor)
    assert torch.equal(y, reference(x, weight, t, linear.bias))
    assert torch.equal(TF.linear(x, weight, linear.bias), y)
    assert torch.equal(torch.ops.aten.linear.default(x, weight, linear.bias), y)


def test_an_integer_input_is_refused_as_nn_linear_refuses_it():
    """Rounding an integer input would truncate the product to integers: an error naming the
    layer, the dtype and the shape, for the stored codes and a trainable master weight."""
    linear, _, _ = hadamard_linear()
    trainable = QuantizedLinear.from_linear(nn.Linear(64, 8), "nvfp4", act_scale="dynamic",
                                            trainable=True)
    x = torch.randint(-3, 4, (2, 64))
    with pytest.raises(TypeError, match=r"layer: input of dtype torch.int64 \(shape \(2, 64\)"):
        linear(x)
    with pytest.raises(TypeError, match="input of dtype torch.int64 .* floating-point inputs"):
        trainable(x)


def test_bf16_inputs_are_transformed_in_fp32():
    linear, weight, t = hadamard_linear()
    x = torch.randn(6, 64).bfloat16()
    y = linear(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, reference(x, weight, t, linear.bias))


def test_static_scale_unaligned_width_and_padded_inputs():
    linear = nn.Linear(172, 16)  # the real tiny Llama's FFN width: padded to 176
    t = fit_transform("hadamard", TF.pad(linear.weight.detach(), (0, 4)), block=16)
    scale = torch.tensor(0.004)
    weight = w4a4_weight(linear, "nvfp4", t, act_scale="static", act_global_scale=scale,
                         name="mlp.down_proj")
    assert (weight.in_features, weight.padded_in, tuple(weight.shape)) == (172, 176, (16, 176))
    x = torch.randn(3, 172)
    y = TF.linear(x, weight, linear.bias)
    assert torch.equal(y, reference(x, weight, t, linear.bias, global_scale=scale))
    assert torch.equal(TF.linear(TF.pad(x, (0, 4)), weight, linear.bias), y)
    dynamic = TF.linear(x, weight.replace(act_scale="dynamic", act_global_scale=None))
    assert not torch.equal(dynamic, y - linear.bias)
    with pytest.raises(RuntimeError, match=r"mlp\.down_proj: static activation scale not "):
        TF.linear(x, weight.replace(act_global_scale=None))
    with pytest.raises(ValueError, match=r"mlp\.down_proj: input of shape \(3, 170\) on cpu"):
        TF.linear(x[:, :170], weight)
    with pytest.raises(ValueError, match="does not pad to the codes' width 176"):
        weight.replace(in_features=150)
    with pytest.raises(ValueError, match=r"transform must be \[176, 176\] or \[176/d, d, d\]"):
        weight.replace(transform=torch.eye(16))
    mx = w4a4_weight(nn.Linear(64, 8), "mxfp4", act_scale="static")
    assert mx.act_scale == "dynamic" and mx.act_global_scale is None


def test_fields_survive_parameter_clone_to_deepcopy_and_save():
    linear, weight, t = hadamard_linear(act_scale="static", act_global_scale=torch.tensor(0.01))
    x = torch.randn(4, 64)
    y = linear(x)
    clone = linear.weight.clone()
    copied = copy.deepcopy(linear)
    moved = copy.deepcopy(linear).double().float()  # codes keep their dtype
    buffer = io.BytesIO()
    torch.save(linear.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = nn.Linear(64, 24)
    fresh.load_state_dict(state, assign=True)
    for module in (copied, moved, fresh):
        assert isinstance(module.weight, W4A4Weight) and torch.equal(module(x), y)
    for tensor in (clone, copied.weight, state["weight"]):
        assert tensor.layer_name == "layer" and tensor.act_scale == "static"
        assert torch.equal(tensor.transform, t.float())
        assert torch.equal(tensor.act_global_scale, torch.tensor(0.01))


def test_gradient_reaches_the_input_straight_through():
    linear, weight, t = hadamard_linear()
    x = torch.randn(4, 64, requires_grad=True)
    linear(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert linear.weight.grad is None


def test_decoded_weight_cache_is_opt_in():
    linear, weight, _ = hadamard_linear()
    x = torch.randn(4, 64)
    assert decoded_weight(weight) is not decoded_weight(weight)  # decoded anew, nothing kept
    y = linear(x)
    with cache_decoded_weights():
        first = decoded_weight(linear.weight)
        assert decoded_weight(linear.weight) is first
        with cache_decoded_weights():  # nested: the same cache
            assert decoded_weight(linear.weight) is first
        assert torch.equal(linear(x), y)
        # another weight on the same codes and scales shares the decode; other scales do not
        assert decoded_weight(linear.weight.replace(transform=None)) is first
        rescaled = linear.weight.replace(global_scale=linear.weight.global_scale * 2)
        assert torch.equal(decoded_weight(rescaled), 2 * first)
    assert w4a4._decoded is None


# ----------------------------------------------------------------------- kernel dispatch


class FakeKernels(types.ModuleType):
    """Stands for kbbq_pl.kernels (not on this branch): records its calls."""

    def __init__(self, available: bool = True) -> None:
        super().__init__("kbbq_pl.kernels")
        self.ok = available
        self.calls: list[tuple] = []

    def available(self, device) -> bool:
        return self.ok

    scale_source = staticmethod(prepared.scale_source)  # the kernels' own key of a scale

    def prepare_weight(self, codes, scales, global_scale, fmt, act_global_scale=None, *,
                       keep_decoded=False, prefill_product="auto"):
        assert prefill_product == w4a4.PREFILL_PRODUCT
        return ("prepared", codes, act_global_scale, keep_decoded)

    def linear_w4a4(self, x, codes, scales, global_scale, fmt, transform=None,
                    act_global_scale=None, bias=None, *, prepared=None, prefill_product="auto"):
        assert prefill_product == w4a4.PREFILL_PRODUCT
        self.calls.append((x, codes, scales, global_scale, fmt, transform, act_global_scale,
                           bias, prepared))
        return torch.full((*x.shape[:-1], codes.shape[0]), 7.0, dtype=x.dtype)


@pytest.fixture
def fake_kernels(monkeypatch):
    fake = FakeKernels()
    monkeypatch.setitem(sys.modules, "kbbq_pl.kernels", fake)
    monkeypatch.setattr(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",))
    return fake


def test_products_go_to_the_kernels_where_they_run(fake_kernels):
    scale = torch.tensor(0.02)
    linear, weight, t = hadamard_linear(act_scale="static", act_global_scale=scale)
    x = torch.randn(3, 5, 64)
    y = linear(x)
    assert torch.equal(y, torch.full((3, 5, 24), 7.0))
    (call,) = fake_kernels.calls
    assert call[0] is x and call[1] is linear.weight.qdata and call[2] is linear.weight.scale
    assert call[3] is linear.weight.global_scale and call[4].name == "nvfp4"
    assert torch.equal(call[5], t.float()) and torch.equal(call[6], scale)
    assert call[7] is linear.bias
    assert call[8][:3] == ("prepared", linear.weight.qdata, scale) and call[8][3] is False
    linear(x)  # the prepared weight is made once and kept with the codes
    assert fake_kernels.calls[-1][8] is call[8]
    TF.linear(x, linear.weight.replace(act_scale="dynamic", act_global_scale=None))
    assert fake_kernels.calls[-1][6] is None and fake_kernels.calls[-1][7] is None
    assert fake_kernels.calls[-1][8][2] is None  # another activation scale, another preparation


def test_emulation_where_the_kernels_do_not_apply(fake_kernels, monkeypatch):
    linear, weight, t = hadamard_linear()
    x = torch.randn(4, 64)
    expected = reference(x, weight, t, linear.bias)
    dense = weight.replace(transform=torch.eye(64))  # a dense (Haar-like) transform
    assert torch.equal(TF.linear(x, dense, linear.bias),
                       reference(x, dense, torch.eye(64), linear.bias))
    fake_kernels.ok = False
    assert torch.equal(linear(x), expected)
    monkeypatch.setitem(sys.modules, "kbbq_pl.kernels", None)  # import fails: ImportError
    assert w4a4._kernels() is None and torch.equal(linear(x), expected)
    assert fake_kernels.calls == []
    monkeypatch.setattr(w4a4, "KERNEL_DEVICE_TYPES", ("cuda",))
    monkeypatch.setitem(sys.modules, "kbbq_pl.kernels", fake_kernels)
    fake_kernels.ok = True
    assert torch.equal(linear(x), expected) and fake_kernels.calls == []  # CPU: emulation


def test_a_gradient_takes_the_kernels_forward_and_the_emulation_s_backward(fake_kernels):
    """A frozen layer's input needing a gradient (an adapter trained before it) still runs on
    the kernels, through the operator whose backward is the emulation's straight-through one."""
    linear, weight, _ = hadamard_linear()
    x = torch.randn(4, 64, requires_grad=True)
    upstream = torch.randn(4, 24)
    y = linear(x)
    assert torch.equal(y, torch.full((4, 24), 7.0)) and len(fake_kernels.calls) == 1
    y.backward(upstream)
    got = x.grad, linear.bias.grad
    x.grad = linear.bias.grad = None
    fake_kernels.ok = False
    linear(x).backward(upstream)
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], linear.bias.grad)
    assert len(fake_kernels.calls) == 1


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt, dtype, act_scale", [
    ("nvfp4", torch.float32, "static"), ("mxfp4", torch.bfloat16, "dynamic")])
def test_the_kernels_compute_what_the_emulation_does(monkeypatch, fmt, dtype, act_scale):
    """The real kbbq_pl.kernels (where present), under Triton's interpreter on the CPU."""
    kernels = w4a4._kernels()
    if kernels is None or not kernels.available(torch.device("cpu")):
        pytest.skip("kbbq_pl.kernels is absent, or does not run on the CPU (TRITON_INTERPRET=1)")
    linear, weight, t = hadamard_linear(172, 40, fmt, act_scale=act_scale,
                                        act_global_scale=torch.tensor(0.003))
    x = torch.randn(5, 172).to(dtype)
    bias = linear.bias.detach().to(dtype)
    emulated = TF.linear(x, weight, bias)
    identity = weight.replace(transform=None)
    emulated_identity = TF.linear(x, identity, bias)
    monkeypatch.setattr(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",))
    assert w4a4.uses_kernels(x, weight)
    fused = TF.linear(x, weight, bias)
    scale = weight.act_global_scale if act_scale == "static" else None
    expected = kernels.reference_linear_w4a4(x, weight.qdata, weight.scale,
                                             weight.global_scale, fmt, weight.transform, scale,
                                             bias)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8  # accumulation / one bf16 rounding
    assert fused.dtype == dtype and relative_error(fused, expected) <= tolerance
    # without a transform the activations' codes agree bit for bit: only accumulation differs
    assert relative_error(TF.linear(x, identity, bias), emulated_identity) <= tolerance
    # with one, T x's last bit follows the summation order and may flip a rare code
    assert relative_error(fused, emulated) <= 1e-2


# ----------------------------------------------------------------------- the module


def test_quantized_linear_forward_is_f_linear_of_its_weight():
    linear = nn.Linear(48, 16)
    layer = QuantizedLinear.from_linear(linear, "mxfp4", None, name="proj")
    x = torch.randn(2, 3, 48)
    assert isinstance(layer.weight, W4A4Weight) and layer.weight.layer_name == "proj"
    assert torch.equal(layer(x), TF.linear(x, layer.weight, layer.bias))
    assert layer.padded_in == 64 and layer.transform is None and layer.act_scale == "dynamic"


def test_a_static_scale_set_on_the_layer_reaches_its_weight():
    linear = nn.Linear(32, 8)
    t = fit_transform("hadamard", linear.weight.detach(), block=16)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", t, act_scale="static")
    x = torch.randn(5, 32)
    amax = transform_inputs(x, t.float()).abs().max()
    layer.act_global_scale = amax / (448 * 6)
    assert torch.equal(layer.weight.act_global_scale, amax / (448 * 6))
    assert torch.equal(layer(x), TF.linear(x, layer.weight, layer.bias))


def test_a_trainable_layer_computes_through_f_linear_on_its_master_weight():
    linear = nn.Linear(40, 8)  # 40 pads to 48
    t = fit_transform("hadamard", TF.pad(linear.weight.detach(), (0, 8)), block=16)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", t, act_scale="dynamic", trainable=True)
    assert type(layer.weight) is nn.Parameter and layer.trainable
    view = layer.product_weight()
    assert isinstance(view, MasterWeight) and view.master is layer.weight
    x = torch.randn(3, 5, 40, requires_grad=True)
    y = layer(x)
    h = F.fake_quantize(transform_inputs(TF.pad(x.detach().reshape(-1, 40), (0, 8)), t.float()),
                        "nvfp4")
    expected = TF.linear(h, F.fake_quantize(layer.weight.detach(), "nvfp4"), layer.bias)
    assert torch.equal(y.detach(), expected.reshape(3, 5, 8))
    y.sum().backward()  # straight through to the master weight and the input
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        trained = layer(x)
        layer.freeze()
        assert isinstance(layer.weight, W4A4Weight)
        assert torch.equal(layer(x), trained)  # the frozen codes compute the same product
    with pytest.raises(ValueError, match="in_features 40"):
        QuantizedLinear.from_linear(linear, "nvfp4", trainable=True)(torch.randn(2, 48))


def test_freeze_moves_the_activation_side_into_the_weight():
    linear = nn.Linear(32, 8)
    t = fit_transform("hadamard", linear.weight.detach(), block=16)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", t, act_scale="static",
                                        act_global_scale=torch.tensor(0.01), trainable=True)
    assert set(dict(layer.named_buffers())) == {"transform", "act_global_scale"}
    assert set(layer.state_dict()) == {"weight", "bias", "transform", "act_global_scale"}
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = layer(x)
        layer.freeze()
    assert isinstance(layer.weight, W4A4Weight) and not layer.trainable
    assert dict(layer.named_buffers()) == {} and set(layer.state_dict()) == {"weight", "bias"}
    assert torch.equal(layer.transform, t.float()) and layer.act_scale == "static"
    assert torch.equal(layer(x), before)


def test_fused_layers_train_and_freeze_under_one_per_tensor_scale():
    """``share_fused_scales`` gives q/k/v (one transform) the largest of their NVFP4 per-tensor
    scales, as vLLM runs them fused: the forward rounds each master weight under it, a state
    dict carries it, the frozen codes hold it and compute the product trained; o_proj, not
    fused, keeps its own."""
    torch.manual_seed(0)
    t = fit_transform("hadamard", torch.randn(8, 32), block=16)
    linears = {f"attn.{n}": nn.Linear(32, 8) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    with torch.no_grad():
        linears["attn.k_proj"].weight *= 5  # the group's largest scale
    layers = {name: QuantizedLinear.from_linear(linear, "nvfp4", t, trainable=True, name=name)
              for name, linear in linears.items()}
    share_fused_scales(fused_trainable_groups(layers))
    largest = weight_global_scale(layers["attn.k_proj"].weight, F.get_format("nvfp4"))
    for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
        assert torch.equal(layers[name].weight_global_scale, largest), name
    assert layers["attn.o_proj"].weight_global_scale is None
    q_proj, x = layers["attn.q_proj"], torch.randn(4, 32)
    h = F.fake_quantize(transform_inputs(x, t.float()), "nvfp4")
    with torch.no_grad():
        shared = TF.linear(h, F.fake_quantize(q_proj.weight, "nvfp4", global_scale=largest),
                           q_proj.bias)
        own = TF.linear(h, F.fake_quantize(q_proj.weight, "nvfp4"), q_proj.bias)
        assert torch.equal(q_proj(x), shared) and not torch.equal(shared, own)
        shell = QuantizedLinear.from_linear(nn.Linear(32, 8), "nvfp4", t, trainable=True)
        shell.load_state_dict(q_proj.state_dict())
        assert torch.equal(shell.weight_global_scale, largest)
        trained = {name: layer(x) for name, layer in layers.items()}
        freeze_layers(layers)
        for name, layer in layers.items():
            assert isinstance(layer.weight, W4A4Weight), name
            assert torch.equal(layer(x), trained[name]), name
    assert torch.equal(q_proj.weight.global_scale, largest)
    assert dict(q_proj.named_buffers()) == {}


def test_frozen_layers_of_a_trainable_quantization_store_codes_fused_under_one_scale():
    """``quantize_model(trainable=True)`` keeps master weights for the layers whose weight
    requires grad; a frozen block stores codes, and its q/k/v and gate/up (a data-free
    transform) share one NVFP4 per-tensor scale, as stored codes do."""
    model = tiny_model("llama")
    model.model.layers[0].requires_grad_(False)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(
        format=FormatConfig("nvfp4"), transform=TransformConfig("hadamard")), trainable=True,
        progress=False)
    layers = quantized_linears(model)
    assert {n for n, layer in layers.items() if not layer.trainable} == {
        n for n in layers if ".layers.0." in n}
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        scales = {float(layers[n].weight.global_scale) for n in layers
                  if ".layers.0." in n and n.rsplit(".", 1)[1] in group}
        assert len(scales) == 1, group


def test_format1_state_dict_loads_into_a_shell():
    """Format 1's layer state: plain codes beside transform and act_global_scale buffers."""
    linear = nn.Linear(32, 8)
    t = fit_transform("hadamard", linear.weight.detach(), block=16)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", t, act_scale="static",
                                        act_global_scale=torch.tensor(0.01))
    weight = layer.weight
    old = {"weight": F.QuantizedTensor(weight.qdata, weight.scale, weight.fmt, weight.orig_dtype,
                                       weight.last_dim, weight.global_scale),
           "bias": layer.bias.detach(), "transform": t.float(),
           "act_global_scale": torch.tensor(0.01)}
    shell = QuantizedLinear.from_linear(nn.Linear(32, 8), "nvfp4", None, act_scale="static")
    shell.load_state_dict(old)
    x = torch.randn(3, 32)
    assert isinstance(shell.weight, W4A4Weight) and torch.equal(shell(x), layer(x))
    fresh = QuantizedLinear.from_linear(nn.Linear(32, 8), "nvfp4", None, act_scale="static")
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), layer(x))


# ----------------------------------------------------------------------- no dense copies


def held_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """Every tensor a layer holds: parameters, buffers, plain attributes, and the plain
    tensors inside tensor subclasses."""
    found = [*layer.parameters(recurse=False), *layer.buffers(recurse=False),
             *(v for v in vars(layer).values() if isinstance(v, torch.Tensor))]
    plain = []
    for tensor in found:
        if isinstance(tensor, W4A4Weight):
            names, _ = tensor.__tensor_flatten__()
            plain += [getattr(tensor, name) for name in names]
        else:
            plain.append(tensor)
    return plain


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantized_model_holds_codes_scales_and_transforms_only(fmt):
    model = tiny_model("llama", intermediate_size=172)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(format=FormatConfig(fmt)),
                   progress=False)
    layers = quantized_linears(model)

    def check() -> None:
        for name, layer in layers.items():
            weight = layer.weight
            parts = [t for t in (weight.qdata, weight.scale, weight.global_scale,
                                 layer.transform, weight.act_global_scale, layer.bias)
                     if t is not None]
            tensors = held_tensors(layer)
            assert sorted(map(id, tensors)) == sorted(map(id, parts)), name
            dense_sizes = {layer.out_features * layer.in_features,
                           layer.out_features * layer.padded_in}
            assert not any(t.is_floating_point() and t.numel() in dense_sizes
                           for t in tensors if t is not layer.transform), name
            assert sum(t.nbytes for t in tensors) == sum(t.nbytes for t in parts), name
            # packed codes: half a byte per element; transform: d x d per block of d
            assert weight.qdata.nbytes * 2 == layer.out_features * layer.padded_in
            assert layer.transform.numel() == layer.padded_in * F.get_format(fmt).block_size

    check()
    with torch.no_grad():
        model(input_ids=ids)
    check()


def test_layers_reading_one_input_share_its_rounding_inside_the_decoded_cache(monkeypatch):
    """q/k/v-like layers (one input, no transform, equal static scales) round it once inside
    cache_decoded_weights; a different scale, an input changed in place, a gradient or no
    cache round it again.  The outputs are the unshared ones bit for bit."""
    torch.manual_seed(0)
    linears = [nn.Linear(64, 24) for _ in range(3)]
    weights = [w4a4_weight(lin, "nvfp4", None, act_scale="static",
                           act_global_scale=torch.tensor(scale), name=f"l{i}")
               for i, (lin, scale) in enumerate(zip(linears, (0.002, 0.002, 0.003)))]
    x = torch.randn(5, 64)
    expected = [TF.linear(x, w) for w in weights]
    calls = []
    rounded = w4a4._rounded_input
    monkeypatch.setattr(w4a4, "_rounded_input", lambda *a, **k: calls.append(1) or rounded(*a, **k))
    with torch.no_grad(), cache_decoded_weights():
        got = [TF.linear(x, w) for w in weights]
        assert len(calls) == 2  # the third layer's scale differs
        x.mul_(1.0)  # an in-place change: rounded anew
        TF.linear(x, weights[1])
        assert len(calls) == 3
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    with cache_decoded_weights():  # with autograd on: each layer rounds its own
        for w in weights[:2]:
            TF.linear(x, w)
    assert len(calls) == 5


def test_a_quantized_model_materializes_from_the_meta_device_and_reloads():
    """``model.to("meta")`` then ``to_empty`` (how a model is built without memory and then
    loaded) keeps each quantized weight's class and layout; its state dict loads back into it,
    the same logits; and a checkpoint loads with a callable ``map_location`` (Lightning's)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    model.to("meta").to_empty(device="cpu")
    weights = {name: layer.weight for name, layer in quantized_linears(model).items()}
    assert len(weights) == 14 and all(type(w) is W4A4Weight and w.qdata.device.type == "cpu"
                                      for w in weights.values())
    buffer.seek(0)
    model.load_state_dict(torch.load(buffer, weights_only=True, map_location=lambda s, _: s))
    model.model.rotary_emb.inv_freq.copy_(tiny_model("llama").model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


def test_codes_and_dense_weights_do_not_load_into_each_other():
    """``load_state_dict`` across a quantized and a full-precision model of one architecture:
    the error names the layer and which model takes which state dict (it was torchao's
    "'Parameter' object has no attribute 'tensor_data_names'" one way, its metadata mismatch
    printing both tensors the other), and the codes stay as they were."""
    dense, model = tiny_model("llama"), tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    codes = {name: layer.weight.qdata.clone() for name, layer in quantized_linears(model).items()}
    with pytest.raises(RuntimeError, match=r"q_proj: a nvfp4 QuantizedTensor of shape \(64, 64\) "
                       r"on cpu holds FP4 codes .* not the dense weight .* quantized model "
                       r"\(kbbq_pl.from_pretrained"):
        dense.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match=r"q_proj: a nvfp4 QuantizedTensor .* takes codes of "
                       r"its own layout, not a dense tensor of shape \(64, 64\) and dtype "
                       r"torch.float32: .* then quantize it"):
        model.load_state_dict(dense.state_dict())
    assert all(torch.equal(layer.weight.qdata, codes[name])
               for name, layer in quantized_linears(model).items())
    model.load_state_dict(copy.deepcopy(model).state_dict())  # codes into codes: as before


def test_a_state_dict_assigned_into_a_meta_model_keeps_its_codes():
    """``load_state_dict(sd, assign=True)`` into a model on the meta device (a skeleton built
    without memory) takes the loaded codes as they are, as it does a dense parameter (they
    stayed on meta: the next forward failed)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    skeleton = copy.deepcopy(model).to("meta")
    skeleton.load_state_dict(model.state_dict(), assign=True)
    assert all(layer.weight.qdata.device.type == "cpu"
               for layer in quantized_linears(skeleton).values())
    skeleton.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq  # not in a state dict
    with torch.no_grad():
        assert torch.equal(skeleton(input_ids=ids).logits, expected)


def test_codes_of_another_shape_or_format_are_a_mismatch_as_a_dense_weight_s_are():
    """A quantized layer loading codes of another shape or format reports it as torch reports
    a dense parameter's size mismatch, and keeps its own codes (it took them: the layer then
    failed in the next layer's forward, or saved a folder that did not load)."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    nv, mx = tiny_model("llama"), tiny_model("llama")
    quantize_model(nv, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    quantize_model(mx, [{"input_ids": ids}], QuantizationConfig(format=FormatConfig("mxfp4")),
                   progress=False)
    state = dict(nv.state_dict())
    key = "model.layers.0.self_attn.q_proj.weight"
    state[key] = state["model.layers.0.self_attn.k_proj.weight"]
    before = nv.get_parameter(key).qdata.clone()
    with pytest.raises(RuntimeError, match=rf"size mismatch for {key}: copying codes of shape "
                       r"\(32, 64\) \(in_features 64\) from checkpoint, the shape in current "
                       r"model is \(64, 64\)"):
        nv.load_state_dict(state)
    assert torch.equal(nv.get_parameter(key).qdata, before)
    with pytest.raises(RuntimeError, match=rf"format mismatch for {key}: copying nvfp4 codes "
                       "from checkpoint, the format in current model is mxfp4"):
        mx.load_state_dict(nv.state_dict())
    assert all(layer.weight.fmt.name == "mxfp4" for layer in quantized_linears(mx).values())


def test_codes_copy_between_layers_named_differently_and_name_what_differs():
    """A copy of codes into codes takes the data and keeps the target's name (a label of its
    errors; torchao's copy compared it, so state dicts of models converted with and without
    a filter did not load into each other); codes of another layout are refused, naming the
    fields."""
    _, weight, _ = hadamard_linear()
    target = weight.replace(layer_name="model.q_proj")
    source = copy.deepcopy(weight)
    source.qdata.zero_()
    target.copy_(source)
    assert torch.equal(target.qdata, source.qdata) and target.layer_name == "model.q_proj"
    other = hadamard_linear(fmt="mxfp4")[1]
    with pytest.raises(ValueError, match=r"model.q_proj: a nvfp4 W4A4Weight of shape \(24, 64\) "
                       r"on cpu does not take the codes of layer: a mxfp4 W4A4Weight .* "
                       r"another layout: fmt mxfp4, not nvfp4; scale \(24, 2\), not \(24, 4\)"):
        target.copy_(other)


def test_a_quantized_model_cast_to_bf16_presents_and_reloads_as_bf16(tmp_path):
    """``model.to(torch.bfloat16)`` casts each quantized weight as torchao's FP4 tensors cast:
    the dtype it presents and dequantizes to, not its codes; the folder saved from it reloads
    in bf16 throughout, with the same logits."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    codes = {name: layer.weight.qdata.clone() for name, layer in quantized_linears(model).items()}
    model.to(torch.bfloat16)
    model.model.rotary_emb.inv_freq = tiny_model("llama").model.rotary_emb.inv_freq  # as loaded
    for name, layer in quantized_linears(model).items():
        assert layer.weight.dtype == layer.weight.dequantize().dtype == torch.bfloat16, name
        assert torch.equal(layer.weight.qdata, codes[name]), name
    loaded = from_pretrained(save_quantized(model, tmp_path / "q"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
