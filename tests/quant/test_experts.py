"""Mixture-of-experts models: fused experts become linear layers, are quantized, and reload."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

import kbbq_pl
from kbbq_pl.quant import QuantizationConfig, TransformConfig, WeightsConfig, quantize_model
from kbbq_pl.quant.experts import (
    ExpertLinears,
    ScoredExpertLinears,
    calibrating_every_expert,
    fuse_experts,
    fused_experts,
    moe_routers,
    unfuse_experts,
)
from kbbq_pl.quant.layers import quantized_linears

MOE = ("qwen3_moe", "mixtral", "gpt_oss")
IDS = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))


def moe_model(arch: str) -> nn.Module:
    """A tiny MoE model whose experts run transformers' eager forward, with weights and biases
    away from their zero initialization."""
    model = tiny_model(arch)
    model.set_experts_implementation("eager")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model



@pytest.mark.parametrize("arch", [*MOE, "llama4_text"])
def test_fused_again_the_experts_are_the_module_they_were(arch):
    """``fuse_experts`` undoes ``unfuse_experts``: the same class, every parameter and flag
    bit for bit, the same logits; a parameter the linear layers do not keep is refused by
    name."""
    model = moe_model(arch)
    names = list(fused_experts(model))
    again = copy.deepcopy(model)
    unfuse_experts(again)
    assert fuse_experts(again) == names and len(names) == 2
    assert {n: type(m) for n, m in again.named_modules()} == {
        n: type(m) for n, m in model.named_modules()}
    state = model.state_dict()
    assert all(torch.equal(value, state[key]) for key, value in again.state_dict().items())
    assert again.state_dict().keys() == state.keys()
    for name in names:
        flags = {k: v for k, v in vars(model.get_submodule(name)).items()
                 if isinstance(v, (bool, int, float))}
        assert flags == {k: v for k, v in vars(again.get_submodule(name)).items() if k in flags}
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)

    model.get_submodule(names[0]).register_parameter("scale", nn.Parameter(torch.ones(3)))
    unfuse_experts(model)
    with pytest.raises(NotImplementedError, match="holds 'scale' beside its experts' weights"):
        fuse_experts(model)

@pytest.mark.parametrize("arch", MOE)
def test_unfused_experts_compute_the_fused_eager_forward(arch):
    model = moe_model(arch)
    fused = model.model.layers[0].mlp.experts
    unfused = copy.deepcopy(model)
    with torch.no_grad():  # as quantize_model calls it
        assert unfuse_experts(unfused) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert not fused_experts(unfused)
    experts = unfused.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertLinears) and experts.num_experts == fused.num_experts
    up = experts.get_submodule("1.gate_up_proj")
    stored = fused.gate_up_proj[1].T if fused.is_transposed else fused.gate_up_proj[1]
    assert isinstance(up, nn.Linear) and torch.equal(up.weight, stored)
    assert up.weight.requires_grad  # trainable as the fused parameter was
    assert (up.bias is not None) == fused.has_bias
    with torch.no_grad():
        if fused.has_bias:  # gpt-oss: x @ W + b there, one addmm here: the rounding order
            torch.testing.assert_close(unfused(IDS).logits, model(IDS).logits, rtol=0,
                                       atol=1e-6)
        else:
            assert torch.equal(unfused(IDS).logits, model(IDS).logits)


def test_every_expert_sees_every_calibration_token():
    model = tiny_model("qwen3_moe")
    unfuse_experts(model)
    experts = model.model.layers[0].mlp.experts
    seen = [0] * experts.num_experts

    def count(index):
        def hook(module, args):
            seen[index] += args[0].shape[0]
        return hook

    for index in range(experts.num_experts):
        experts.get_submodule(f"{index}.gate_up_proj").register_forward_pre_hook(count(index))
    with torch.no_grad():
        routed = model(IDS).logits
        assert sum(seen) == IDS.numel() * 2  # top-2 routing
        seen[:] = [0] * experts.num_experts
        with calibrating_every_expert(model):
            every = model(IDS).logits
        assert seen == [IDS.numel()] * experts.num_experts
        assert not experts.every_expert
    torch.testing.assert_close(every, routed, rtol=0, atol=1e-6)  # the output: routed experts


def test_every_experts_up_projection_shares_one_hessian_while_calibrating():
    """Calibrating every expert on every token, the experts' up projections read one tensor:
    one Hessian sum for all of them (one GPTQ group), each down_proj its own."""
    from kbbq_pl.quant.gptq.quantizer import HessianCollector

    model = tiny_model("qwen3_moe")
    unfuse_experts(model)
    mlp = model.model.layers[0].mlp
    linears = {name: m for name, m in mlp.experts.named_modules() if isinstance(m, nn.Linear)}
    collector = HessianCollector(linears, 16)
    x = torch.randn(12, 64)
    with torch.no_grad(), calibrating_every_expert(model), collector.hooks():
        mlp(x[None])
    collector.reduce(lambda t: t)
    experts = range(mlp.experts.num_experts)
    ups = sorted(f"{e}.gate_up_proj" for e in experts)
    assert sorted(map(sorted, collector.groups())) == sorted(
        [ups] + [[f"{e}.down_proj"] for e in experts])
    flat = x.double()
    assert torch.allclose(collector.hessian(ups[0]).double(), 2 * flat.T @ flat / 12, atol=1e-5)


@pytest.mark.parametrize("arch, config", [
    ("qwen3_moe", QuantizationConfig()),
    ("gpt_oss", QuantizationConfig(transform=TransformConfig(name="identity"),
                                   weights=WeightsConfig(quantizer="gptq"))),
])
def test_moe_experts_are_quantized_and_reload_bit_for_bit(tmp_path, arch, config):
    from transformers import AutoModelForCausalLM

    model = moe_model(arch)
    with torch.no_grad():
        reference = model(IDS).logits
    report = quantize_model(model, [{"input_ids": IDS}], config, progress=False)
    layers = quantized_linears(model)
    experts = [n for n in layers if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 2 or len(experts) == 2 * 8 * 2  # layers x experts x (up, down)
    assert {r.name for r in report.layers} == set(layers)
    router = next(n for n in report.skipped if n.endswith(("gate.weight", "router.weight")))
    assert "outside a linear layer" in report.skipped[router]
    with torch.no_grad():
        quantized = model(IDS).logits
    assert (quantized - reference).norm() < 0.3 * reference.norm()
    kbbq_pl.save_quantized(model, tmp_path / "q")
    loaded = kbbq_pl.from_pretrained(tmp_path / "q")
    through_transformers = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cpu")
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, quantized)
        assert torch.equal(through_transformers(IDS).logits, quantized)
    assert set(quantized_linears(through_transformers)) == set(layers)


ROUTERS = {  # architecture: its routers held as linear layers, per MoE layer
    "qwen2_moe": ["mlp.shared_expert_gate"],  # one output; mlp.gate is a bare parameter
    "llama4_text": ["feed_forward.router"],   # an nn.Linear subclass returning a tuple
    "hunyuan_v1_moe": ["mlp.gate.wg"],        # a linear alone in the router module
}


@pytest.mark.parametrize("arch", sorted(ROUTERS))
def test_routers_held_as_linear_layers_stay_in_full_precision(tmp_path, arch):
    """A router is not quantized (vLLM loads it unquantized; a quantized linear in place of
    Llama 4's would not return its tuple), is listed with its reason, and the model reloads
    bit for bit through kbbq-pl and transformers."""
    from transformers import AutoModelForCausalLM

    model = moe_model(arch)
    with torch.no_grad():
        reference = model(IDS).logits
    routers = [f"model.layers.{i}.{r}" for i in (0, 1) for r in ROUTERS[arch]]
    assert moe_routers(model) == routers
    weights = {name: model.get_submodule(name).weight.clone() for name in routers}
    report = quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(), progress=False)
    layers = quantized_linears(model)
    for name in routers:
        assert "router of a mixture-of-experts layer" in report.skipped[name]
        assert name not in layers
        assert torch.equal(model.get_submodule(name).weight, weights[name])
    assert sum(".experts." in name for name in layers) == 2 * 4 * 2  # layers x experts x 2
    shared = [n for n in layers if ".shared_expert" in n]  # a shared expert is quantized
    assert len(shared) == (0 if arch == "hunyuan_v1_moe" else 2 * 3)
    with torch.no_grad():
        quantized = model(IDS).logits
    assert (quantized - reference).norm() < 0.3 * reference.norm()
    kbbq_pl.save_quantized(model, tmp_path / "q")
    through_transformers = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cpu")
    with torch.no_grad():
        assert torch.equal(kbbq_pl.from_pretrained(tmp_path / "q")(IDS).logits, quantized)
        assert torch.equal(through_transformers(IDS).logits, quantized)


def test_llama4_experts_fed_scored_tokens_unfuse_to_the_same_logits():
    """Llama 4's experts read every token once per expert, scaled by its routing score:
    :class:`ScoredExpertLinears` computes what the fused module computes."""
    model = moe_model("llama4_text")
    fused = model.model.layers[0].feed_forward.experts
    unfused = copy.deepcopy(model)
    assert unfuse_experts(unfused) == [f"model.layers.{i}.feed_forward.experts" for i in (0, 1)]
    experts = unfused.model.layers[0].feed_forward.experts
    assert isinstance(experts, ScoredExpertLinears) and experts.num_experts == 4
    # stored [experts, in, out], gate and up halves of the columns
    assert torch.equal(experts.get_submodule("2.gate_up_proj").weight, fused.gate_up_proj[2].T)
    assert torch.equal(experts.get_submodule("2.down_proj").weight, fused.down_proj[2].T)
    with torch.no_grad():
        torch.testing.assert_close(unfused(IDS).logits, model(IDS).logits, rtol=0, atol=1e-6)


def test_weights_outside_linear_layers_are_reported_and_warned(caplog, monkeypatch):
    from kbbq_pl.quant import pipeline

    model = tiny_model("qwen3_moe")
    # as for experts of a layout that unfuse_experts does not know: left as they are
    monkeypatch.setattr(pipeline, "unfuse_experts", lambda model, stored=None: [])
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.quant.pipeline"):
        report = quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(),
                                progress=False)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert report.skipped[name] == ("a 3-D weight [8, 64, 64] outside a linear layer: kept in "
                                    "full precision")
    assert "weights outside linear layers stay in full precision" in caplog.text
    assert name in caplog.text


def test_torchao_quantize_of_unfused_experts_is_quantize_model():
    from torchao.quantization import quantize_

    from kbbq_pl.quant.torchao import KBBQConfig

    model, reference = tiny_model("qwen3_moe"), tiny_model("qwen3_moe")
    batches = [{"input_ids": ids} for ids in IDS.split(2)]
    recipe = QuantizationConfig()
    unfuse_experts(model)
    prepare = KBBQConfig(recipe, step="prepare")
    quantize_(model, prepare, filter_fn=prepare.filter_fn)
    with torch.no_grad(), calibrating_every_expert(model):
        for batch in batches:
            model(**batch)
    quantize_(model, KBBQConfig(recipe, step="convert"))
    quantize_model(reference, batches, recipe, progress=False)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_moe_experts_run_the_kernels_under_the_interpreter(monkeypatch):
    """The routed tokens of each expert (a few rows) go through kbbq-pl's kernels (Triton's
    interpreter on the CPU) and give the emulation's logits."""
    pytest.importorskip("triton")
    import kbbq_pl.kernels as K
    from kbbq_pl.quant import w4a4

    if not K.available("cpu"):
        pytest.skip("the kernels do not run on the CPU here (TRITON_INTERPRET unset)")
    model = tiny_model("qwen3_moe")
    quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(), progress=False)
    model.to(torch.bfloat16)
    ids = IDS[:1, :6]
    with torch.no_grad():
        emulated = model(ids).logits
        rows, grouped = [], []
        linear_w4a4, siblings = K.linear_w4a4, K.linear_w4a4_siblings
        monkeypatch.setattr(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",))
        monkeypatch.setattr(K, "linear_w4a4", lambda x, *args, **kwargs: (
            rows.append(x.numel() // x.shape[-1]), linear_w4a4(x, *args, **kwargs))[1])
        monkeypatch.setattr(K, "linear_w4a4_siblings", lambda x, layers, fmt: (
            grouped.append(len(layers)), siblings(x, layers, fmt))[1])
        assert torch.equal(model(ids).logits, emulated)
    # per block: q/k/v together and o on 6 tokens, each token's 2 experts (up and down)
    assert grouped == [3, 3]
    assert sum(rows) == 2 * (6 + 6 * 2 * 2) and min(rows) < 6


@pytest.mark.gpu
def test_moe_experts_run_the_kernels_on_a_gpu(tmp_path):
    """On a CUDA device the experts' layers run kbbq-pl's kernels, through transformers as
    through kbbq_pl.from_pretrained, with the same bits."""
    from transformers import AutoModelForCausalLM

    from kbbq_pl.quant.w4a4 import uses_kernels

    model = moe_model("qwen3_moe")
    quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(), progress=False)
    kbbq_pl.save_quantized(model, tmp_path / "q")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16,
                                                  device_map="cuda")
    reference = kbbq_pl.from_pretrained(tmp_path / "q", device="cuda", dtype=torch.bfloat16)
    layer = loaded.model.layers[0].mlp.experts.get_submodule("3.down_proj")
    assert uses_kernels(torch.zeros(1, 32, dtype=torch.bfloat16, device="cuda"), layer.weight)
    ids = IDS.cuda()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
        tokens = loaded.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
        assert torch.equal(tokens, reference.generate(ids[:1, :8], max_new_tokens=8,
                                                      do_sample=False))
