"""One block-sequential pipeline for every method (kbbq_pl.quant.pipeline): the weight quantizer
is a strategy object, the next block's inputs come from the full-precision or the quantized
block (``propagate``), and only the current block is moved to the compute device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from kbbq_pl.formats import quantize
from kbbq_pl.quant import (
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.experts import expert_projections
from kbbq_pl.quant.gptq.quantizer import GPTQ
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears
from kbbq_pl.quant.modules import fused_groups, linear_weight
from kbbq_pl.quant.pipeline import WEIGHT_QUANTIZERS
from kbbq_pl.quant.rtn.quantizer import RTN
from kbbq_pl.quant.scales import weight_global_scale
from kbbq_pl.quant.weight_quantizer import WeightQuantizer
from kbbq_pl.transforms.fit import fit_transform, transform_weight

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKS = ["model.layers.0", "model.layers.1"]


def _batches(rows: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (rows, 32), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[i:i + 2]} for i in range(0, rows, 2)]


def _codes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: layer.weight.qdata for name, layer in quantized_linears(model).items()}


def _recording(base: type[WeightQuantizer]) -> type[WeightQuantizer]:
    class Recording(base):
        """Records the block and the linears each calibration run sees."""

        seen: list[tuple[str, list[str]]]

        def calibrate(self, block, keep_outputs):
            self.__dict__.setdefault("seen", []).append(
                (block.step.name, sorted(block.linears)))
            return super().calibrate(block, keep_outputs)

    return Recording


@pytest.mark.parametrize("config", [
    QuantizationConfig(transform=TransformConfig("kbbq", 0.5)),
    QuantizationConfig(transform=TransformConfig("kbbq", "auto")),
    QuantizationConfig(transform=TransformConfig("kbbq"), weights=WeightsConfig("gptq")),
    QuantizationConfig(transform=TransformConfig("hadamard"),
                       weights=WeightsConfig("gptq", scale_search="mse"))])
def test_every_method_runs_block_by_block_through_its_weight_quantizer(config):
    strategy = WEIGHT_QUANTIZERS[config.weights.quantizer]
    quantizer = _recording(strategy)(config)
    model = tiny_model("llama")
    report = quantize_model(model, _batches(), config, weight_quantizer=quantizer,
                            progress=False)
    assert [name for name, _ in quantizer.seen] == BLOCKS
    for block, linears in quantizer.seen:
        assert len(linears) == 7 and all(n.startswith(block + ".") for n in linears)
    assert len(quantized_linears(model)) == 14 and report.model["blocks"] == 2
    assert report.model["propagate"] == strategy.propagate
    assert {RTN: "fp", GPTQ: "quantized"}[strategy] == strategy.propagate


@pytest.mark.parametrize("config", [
    QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                       transform=TransformConfig("kbbq", 0.5)),
    QuantizationConfig(transform=TransformConfig("kbbq", "auto")),
    QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("haar"))])
def test_full_precision_propagation_equals_one_pass_over_the_whole_model(config):
    """Targeting the LM head (outside the blocks) makes the pipeline run the whole model as one
    block; with ``propagate="fp"`` (RTN's default) every layer of the blocks gets the same
    statistics, hence the same codes, block scales and activation scales, block by block."""
    blockwise, whole = tiny_model("llama"), tiny_model("llama")
    quantize_model(blockwise, _batches(), config, progress=False)
    whole_model = replace(config, layers=LayersConfig(ignore=["embed"]))
    report = quantize_model(whole, _batches(), whole_model, progress=False)
    assert "lm_head" in report.model["whole_model"] and report.model["blocks"] == 1
    assert isinstance(whole.lm_head, QuantizedLinear)
    layers, reference = quantized_linears(whole), quantized_linears(blockwise)
    assert set(reference) < set(layers)
    for name, layer in reference.items():
        assert torch.equal(layers[name].weight.qdata, layer.weight.qdata), name
        assert torch.equal(layers[name].weight.scale.view(torch.uint8),
                           layer.weight.scale.view(torch.uint8)), name
        scales = layers[name].act_global_scale, layer.act_global_scale
        assert scales == (None, None) or torch.equal(*scales), name


@pytest.mark.parametrize("config,passes", [
    (QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                        transform=TransformConfig("kbbq", 0.5)), 1),
    (QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                        transform=TransformConfig("kbbq", "auto")), 1),
    (QuantizationConfig(format=FormatConfig("nvfp4", "static"), transform=TransformConfig("kbbq"),
                        weights=WeightsConfig("gptq")), 2),
    (QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                        transform=TransformConfig("kbbq", "auto"),
                        weights=WeightsConfig("gptq")), 2)])
def test_each_block_runs_the_fewest_passes_its_method_needs(config, passes):
    """Static activation scales come from the inputs kept in the calibration pass, the
    auto-brake's held-out statistics from the same pass, and with ``propagate="fp"`` the next
    block's inputs are that pass's outputs: RTN runs each block once per batch, GPTQ twice
    (calibration, then the quantized block for the next block's inputs)."""
    model = tiny_model("llama")
    calls = {name: 0 for name in BLOCKS}
    for name in BLOCKS:
        model.get_submodule(name).register_forward_hook(  # completed runs only
            lambda module, args, output, name=name: calls.__setitem__(name, calls[name] + 1))
    batches = _batches(rows=8)
    quantize_model(model, batches, config, progress=False)
    last = BLOCKS[-1]  # nothing runs after the last block: its outputs feed no one
    assert calls == {name: len(batches) * (1 if name == last else passes) for name in BLOCKS}


@pytest.mark.parametrize("weight_quantizer,other", [("rtn", "quantized"), ("gptq", "fp")])
def test_propagate_chooses_where_the_next_blocks_inputs_come_from(weight_quantizer, other):
    base = QuantizationConfig(transform=TransformConfig("kbbq", 0.5),
                              weights=WeightsConfig(weight_quantizer))
    default, changed = tiny_model("llama"), tiny_model("llama")
    quantize_model(default, _batches(), base, progress=False)
    report = quantize_model(changed, _batches(),
                            replace(base, weights=WeightsConfig(weight_quantizer, propagate=other)),
                            progress=False)
    assert report.model["propagate"] == other
    first, second = _codes(default), _codes(changed)
    for name in first:  # the first block's inputs are the embeddings either way
        same = torch.equal(first[name], second[name])
        assert same if name.startswith(BLOCKS[0] + ".") else True, name
    later = [n for n in first if n.startswith(BLOCKS[1] + ".")]
    assert any(not torch.equal(first[n], second[n]) for n in later)


def test_propagate_and_the_weight_quantizer_are_validated():
    with pytest.raises(ValueError, match="propagate must be one of"):
        QuantizationConfig(weights=WeightsConfig(propagate="int8"))
    other = RTN(QuantizationConfig(format=FormatConfig("mxfp4")))
    with pytest.raises(ValueError, match="built for another recipe"):
        quantize_model(tiny_model("llama"), _batches(), QuantizationConfig(),
                       weight_quantizer=other, progress=False)


def test_gptq_quantizes_layers_outside_the_blocks_with_the_model_as_one_block():
    model = tiny_model("llama")
    config = QuantizationConfig(transform=TransformConfig("identity"),
                                weights=WeightsConfig("gptq"),
                                layers=LayersConfig(ignore=["embed"]))
    report = quantize_model(model, _batches(), config, progress=False)
    assert isinstance(model.lm_head, QuantizedLinear) and len(report.layers) == 15
    assert report.model["blocks"] == 1 and "lm_head" in report.model["whole_model"]


def test_a_model_without_a_stack_of_blocks_runs_as_one_block():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))

    class Wrapped(nn.Module):  # takes keyword inputs, like a HuggingFace model
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x)

    wrapped = Wrapped()
    batches = [{"x": torch.randn(8, 64, generator=torch.Generator().manual_seed(i))}
               for i in range(2)]
    wush = QuantizationConfig(transform=TransformConfig("wush"))
    report = quantize_model(wrapped, batches, wush, progress=False)
    assert report.model["blocks"] == 1 and "no stack" in report.model["whole_model"]
    assert len(quantized_linears(wrapped)) == 2


def test_only_the_current_block_is_moved_to_the_compute_device(monkeypatch):
    """The offload mechanism on the CPU: every block is moved to ``device`` for its step and
    back before the next one; the model as a whole is never moved.  (On a GPU the same run
    quantizes a model larger than the device's memory: ``tests/kernels/test_gpu.py``.)"""
    model = tiny_model("llama")
    names = {id(module): name for name, module in model.named_modules()}
    moves: list[tuple[str, str]] = []
    original = nn.Module.to

    def to(self, *args, **kwargs):
        name = names.get(id(self))
        if name is not None and (name in BLOCKS or self is model):
            moves.append((name or "model", str(torch.device(*args[:1]) if args else kwargs)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", to)
    quantize_model(model, _batches(), QuantizationConfig(weights=WeightsConfig("gptq")),
                   device="cpu", progress=False)
    assert moves == [(BLOCKS[0], "cpu"), (BLOCKS[0], "cpu"), (BLOCKS[1], "cpu"),
                     (BLOCKS[1], "cpu")]


@pytest.mark.parametrize("weight_quantizer", ["rtn", "gptq"])
def test_modules_keep_their_modes_and_new_layers_can_be_fine_tuned(weight_quantizer):
    """HuggingFace models load in eval mode and Lightning keeps each module's mode: the new
    layers are in training mode so that a fine-tuning step reaches the first block (a layer in
    eval mode rounds its inputs without the straight-through gradient)."""
    model = tiny_model("llama")
    model.model.norm.train()
    before = {name: m.training for name, m in model.named_modules()}
    quantize_model(model, _batches(), QuantizationConfig(weights=WeightsConfig(weight_quantizer)),
                   trainable=weight_quantizer == "rtn", progress=False)
    layers = quantized_linears(model)
    after = {name: m.training for name, m in model.named_modules()}
    assert all(after[name] == mode for name, mode in before.items() if name in after
               and not any(name.startswith(n) for n in layers))
    assert all(layer.training for layer in layers.values())
    ids = _batches()[0]["input_ids"]
    model.model.embed_tokens.weight.requires_grad_(True)
    model(input_ids=ids, labels=ids).loss.backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_fused_groups_are_the_sibling_layers_vllm_runs_as_one():
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    names += [f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")]
    names += ["model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa",
              "model.layers.1.self_attn.q_b_proj", "model.layers.2.self_attn.q_proj"]
    assert fused_groups(names) == [
        [f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")],
        ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
        ["model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa"],
    ]  # a q_proj without its k_proj and v_proj (layer 2) runs alone


@pytest.mark.parametrize("config", [
    QuantizationConfig(transform=TransformConfig("identity")),
    QuantizationConfig(transform=TransformConfig("identity"), weights=WeightsConfig("gptq")),
    QuantizationConfig(transform=TransformConfig("haar")),
])
def test_layers_vllm_fuses_share_the_largest_nvfp4_per_tensor_scale(config):
    """vLLM decodes q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``) with one NVFP4
    per-tensor scale: layers sharing a data-free transform get the largest of their own, as
    llm-compressor gives them; the others keep their own."""
    model = tiny_model("llama")
    weights = {name: linear_weight(module).detach().float()
               for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    own = {name: weight_global_scale(transform_weight(w, fit_transform(
        config.transform.name, w, None, block=16, seed=config.transform.seed)), config.fmt)
        for name, w in weights.items()}
    plain = {name: quantize(w, "nvfp4") for name, w in weights.items()}
    quantize_model(model, _batches(), config, progress=False)
    layers = quantized_linears(model)
    groups = fused_groups(layers)
    assert len(groups) == 4  # q/k/v and gate/up of two blocks
    for group in groups:
        assert len({float(own[name]) for name in group}) == len(group), group  # could fail
        largest = max(group, key=lambda name: float(own[name]))
        for name in group:
            assert torch.equal(layers[name].weight.global_scale, own[largest]), name
        if config.transform.name == "identity" and config.weights.quantizer == "rtn":
            # the layer whose scale it is rounds as on its own, bit for bit
            assert torch.equal(layers[largest].weight.qdata, plain[largest].qdata)
            assert torch.equal(layers[largest].weight.scale.view(torch.uint8),
                               plain[largest].scale.view(torch.uint8))
    alone = [name for name in layers if not any(name in group for group in groups)]
    assert len(alone) == 4  # o_proj and down_proj: vLLM runs them alone
    for name in alone:
        assert torch.equal(layers[name].weight.global_scale, own[name]), name


def test_fitted_transforms_keep_each_layers_own_per_tensor_scale():
    """KBBQ's transform is fitted per layer (no stock server applies it; the export refuses it
    under --strict): q/k/v keep their own scales."""
    model = tiny_model("llama")
    quantize_model(model, _batches(), QuantizationConfig(transform=TransformConfig("kbbq", 0.5)),
                   progress=False)
    layers = quantized_linears(model)
    for group in fused_groups(layers):
        assert len({float(layers[name].weight.global_scale) for name in group}) == len(group)


def test_mxfp4_has_no_per_tensor_scale_to_share():
    model = tiny_model("llama")
    quantize_model(model, _batches(), QuantizationConfig(format=FormatConfig("mxfp4"),
                                                         transform=TransformConfig("identity")),
                   progress=False)
    assert all(layer.weight.global_scale is None for layer in quantized_linears(model).values())


def test_expert_projections_group_one_projection_of_one_experts_module():
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3)
               for p in ("gate_up_proj", "down_proj")]
    stack = ["model.layers.0.fc1", "model.layers.1.fc1"]  # numbered, but no experts module
    assert expert_projections(experts + stack, {"model.layers.0.mlp.experts"}.__contains__) == [
        experts[0::2], experts[1::2]]


def test_experts_share_one_activation_scale_per_projection():
    """vLLM's mixture-of-experts layer rounds the inputs of every expert's gate/up projection,
    and of every expert's down projection, under one NVFP4 per-tensor scale: each projection's
    static scale is the one of the largest amax over the experts (the down projections' inputs
    differ per expert)."""
    model = tiny_model("qwen3_moe")
    quantize_model(model, _batches(), QuantizationConfig(transform=TransformConfig("identity")),
                   progress=False)
    layers = quantized_linears(model)
    groups = expert_projections(layers, lambda name: name.endswith("mlp.experts"))
    assert [group[0].rsplit(".", 1)[1] for group in groups] == ["gate_up_proj", "down_proj"] * 2
    for group in groups:
        assert len(group) == 8  # every expert
        assert len({float(layers[name].act_global_scale) for name in group}) == 1, group
