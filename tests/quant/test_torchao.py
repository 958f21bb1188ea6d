"""torchao integration: ``quantize_(model, KBBQConfig(step=...))`` equals ``quantize_model``."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model
from torch import nn
from torchao.quantization import quantize_

from kbbq_pl.quant import (
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    quantize_model,
)
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears
from kbbq_pl.quant.stats import run_calibration
from kbbq_pl.quant.torchao import OBSERVER_ATTR, KBBQConfig
from kbbq_pl.quant.w4a4 import W4A4Weight

pytestmark = pytest.mark.usefixtures("one_thread")
LIGHTNING_DOC = Path(__file__).resolve().parents[2] / "docs" / "lightning.md"


def calibration() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i:i + 2]} for i in range(0, 4, 2)]


def torchao_quantize(model: nn.Module, batches, recipe: QuantizationConfig) -> None:
    prepare = KBBQConfig(recipe, step="prepare")
    quantize_(model, prepare, filter_fn=prepare.filter_fn)
    run_calibration(model, batches)
    quantize_(model, KBBQConfig(recipe, step="convert"))


@pytest.mark.parametrize("recipe", [
    QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                       transform=TransformConfig("kbbq", 0.75)),
    QuantizationConfig(format=FormatConfig("nvfp4", "dynamic"),
                       transform=TransformConfig("kbbq", 0.75)),
    QuantizationConfig(format=FormatConfig("mxfp4", "dynamic"),
                       transform=TransformConfig("hadamard")),
    QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                       transform=TransformConfig("hadamard")),  # q/k/v, gate/up share a scale
], ids=["nvfp4-kbbq-static", "nvfp4-kbbq-dynamic", "mxfp4-hadamard", "nvfp4-hadamard-static"])
def test_quantize_equals_quantize_model(recipe):
    model = tiny_model("llama", intermediate_size=172)  # the down projection is padded
    reference = copy.deepcopy(model)
    batches = calibration()
    quantize_model(reference, batches, recipe, progress=False)
    torchao_quantize(model, batches, recipe)
    layers = quantized_linears(reference)
    assert len(layers) == 14
    for name, layer in layers.items():
        module = model.get_submodule(name)
        assert type(module) is nn.Linear and isinstance(module.weight, W4A4Weight), name
        assert not hasattr(module, OBSERVER_ATTR) and not module._forward_hooks
        assert not module._forward_pre_hooks
        for field in ("qdata", "scale", "global_scale", "transform", "act_global_scale"):
            ours, theirs = getattr(module.weight, field), getattr(layer.weight, field)
            assert (ours is None and theirs is None) or torch.equal(
                ours.view(torch.uint8) if ours.element_size() == 1 else ours,
                theirs.view(torch.uint8) if theirs.element_size() == 1 else theirs), field
            assert module.weight.layer_name == layer.weight.layer_name == name  # errors name it
    assert type(model.lm_head.weight) is nn.Parameter  # not targeted, as in quantize_model
    probe = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=probe).logits, reference(input_ids=probe).logits)
    model.load_state_dict(reference.state_dict())  # the same weights, attributes and all


def test_padded_batches_calibrate_as_in_quantize_model():
    """Padded batches run through ``run_calibration``: the observers leave the padding out as
    ``quantize_model`` does (the same bits)."""
    recipe = QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                                transform=TransformConfig("kbbq", 0.75))
    batches = calibration()
    for batch in batches:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, 11:] = 0
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    quantize_model(reference, batches, recipe, progress=False)
    torchao_quantize(model, batches, recipe)
    for name, layer in quantized_linears(reference).items():
        ours = model.get_submodule(name).weight
        assert torch.equal(ours.act_global_scale, layer.weight.act_global_scale), name
        assert torch.equal(ours.transform, layer.weight.transform), name


def test_state_dict_reloads_into_a_fresh_model(tmp_path):
    model = tiny_model("llama")
    torchao_quantize(model, calibration(),
                     QuantizationConfig(format=FormatConfig("nvfp4", "static")))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = tiny_model("llama", seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), assign=True)
    probe = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=probe).logits, model(input_ids=probe).logits)


def test_save_quantized_writes_a_folder_that_loads_as_the_quantize_model_one(tmp_path):
    """A model ``quantize_`` converted saves with ``kbbq_pl.save_quantized`` (and as
    compressed-tensors): its layers stay ``nn.Linear``, the folder holds what ``quantize_model``'s
    model would write (the padded down projection too), and loads in kbbq-pl and transformers
    with the same logits."""
    from transformers import AutoModelForCausalLM

    import kbbq_pl
    from kbbq_pl.io.checkpoint import read_metadata
    from kbbq_pl.io.compressed_tensors import save_compressed_tensors

    recipe = QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                                transform=TransformConfig("kbbq", 0.75))
    model = tiny_model("llama", intermediate_size=172)
    reference = copy.deepcopy(model)
    quantize_model(reference, calibration(), recipe, progress=False)
    torchao_quantize(model, calibration(), recipe)
    kbbq_pl.save_quantized(model, tmp_path / "torchao")
    kbbq_pl.save_quantized(reference, tmp_path / "reference")
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert (read_metadata(tmp_path / "torchao")["layers"]
            == read_metadata(tmp_path / "reference")["layers"])
    probe = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=probe).logits
        for loaded in (kbbq_pl.from_pretrained(tmp_path / "torchao"),
                       AutoModelForCausalLM.from_pretrained(tmp_path / "torchao")):
            assert len(quantized_linears(loaded)) == 14
            assert torch.equal(loaded(input_ids=probe).logits, logits)
    pytest.importorskip("compressed_tensors")
    save_compressed_tensors(model, tmp_path / "served")
    assert (tmp_path / "served" / "model.safetensors").is_file()


def test_steps_and_recipes_are_checked():
    with pytest.raises(ValueError, match="step must be 'prepare' or 'convert'"):
        KBBQConfig(step="prepare_for_loading")
    with pytest.raises(ValueError, match="lam='auto'.*quantize_model"):
        KBBQConfig(QuantizationConfig(transform=TransformConfig(lam="auto")), step="prepare")
    with pytest.raises(ValueError, match="W4A4 needs a block FP4 format"):
        KBBQConfig(QuantizationConfig(format=FormatConfig("fp8_e4m3")), step="prepare")
    model = tiny_model("llama")
    hadamard = QuantizationConfig(format=FormatConfig("nvfp4"),
                                  transform=TransformConfig("hadamard"))
    prepare = KBBQConfig(hadamard, step="prepare")
    quantize_(model, prepare, filter_fn=prepare.filter_fn)
    q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="prepare and convert must agree on format"):
        quantize_(model, KBBQConfig(replace(hadamard, format=FormatConfig("mxfp4")),
                                    step="convert"))
    with pytest.raises(ValueError, match="fitted from input statistics"):
        quantize_(model, KBBQConfig(replace(hadamard, transform=TransformConfig("kbbq")),
                                    step="convert"))
    with pytest.raises(ValueError, match=r"nn\.Linear\(in_features=64, out_features=64\): no "
                                         r"calibration batch reached this layer"):
        quantize_(model, KBBQConfig(hadamard, step="convert"))
    assert not isinstance(q_proj.weight, W4A4Weight)
    with pytest.raises(TypeError, match="KBBQConfig quantizes nn.Linear layers"):
        quantize_(model, KBBQConfig(step="prepare"), filter_fn=lambda m, fqn: fqn == "model.norm")


def test_unprepared_layers_are_left_and_filters_follow_the_recipe(caplog):
    """``convert`` quantizes what ``prepare`` reached, silently leaving the layers its filter
    left out; a model never prepared (also ``TorchAoConfig(KBBQConfig(...))`` in
    ``from_pretrained``, which cannot calibrate) is left in full precision with one warning
    (it was an info line, the model silently unquantized)."""
    unprepared = tiny_model("llama")
    convert = KBBQConfig(step="convert")
    with caplog.at_level("WARNING", logger="kbbq_pl.quant.torchao"):
        quantize_(unprepared, convert)
    assert not any(isinstance(m.weight, W4A4Weight) for m in unprepared.modules()
                   if isinstance(m, nn.Linear))
    assert [r.getMessage().split(" has ")[1][:32] for r in caplog.records] == [
        "no KBBQ observer (step='prepare'"]
    caplog.clear()
    model = tiny_model("llama", intermediate_size=172)
    prepare = KBBQConfig(QuantizationConfig(format=FormatConfig(act_scale="dynamic",
                                                                unaligned="skip"),
                                            layers=LayersConfig(ignore=[r"lm_head", r"o_proj"])),
                         step="prepare")
    quantize_(model, prepare, filter_fn=prepare.filter_fn)
    run_calibration(model, calibration())
    with caplog.at_level("WARNING", logger="kbbq_pl.quant.torchao"):
        quantize_(model, KBBQConfig(QuantizationConfig(format=FormatConfig(act_scale="dynamic")),
                                    step="convert"))
    assert not caplog.records  # o_proj, down_proj (padded) and the LM head left as filtered
    quantized = {name for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and isinstance(m.weight, W4A4Weight)}
    assert quantized == {f"model.layers.{i}.{part}" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
        "mlp.up_proj")}



def test_a_quantized_model_is_not_quantized_again():
    """``QuantizedLinear`` is an ``nn.Linear`` (peft's ``"all-linear"`` takes it) that
    quantizers leave: ``quantize_model`` and ``KBBQConfig`` find nothing more to quantize, and
    torchao's ``quantize_`` with another config (its default filter) quantizes only the layers
    left in full precision (the head, here), the FP4 codes and the logits of the rest kept."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.utils import TorchAOBaseTensor

    model = tiny_model("llama")
    quantize_model(model, calibration(), QuantizationConfig(), progress=False)
    layers = quantized_linears(model)
    assert layers and all(isinstance(layer, nn.Linear) for layer in layers.values())
    codes = {name: layer.weight for name, layer in layers.items()}
    with pytest.raises(ValueError, match=r"already quantized \(14 quantized layers"):
        quantize_model(model, calibration(), QuantizationConfig(), progress=False)
    prepare = KBBQConfig(QuantizationConfig(), step="prepare")
    quantize_(model, prepare, filter_fn=prepare.filter_fn)
    assert not [name for name, m in model.named_modules() if hasattr(m, OBSERVER_ATTR)]
    with pytest.raises(ValueError, match="it is quantized already"):
        quantize_(model, prepare, filter_fn=lambda m, fqn: fqn.endswith("q_proj"))

    # a fine-tuned layer's master weight is no QuantizedTensor: the layer is left all the same
    master = QuantizedLinear.from_linear(nn.Linear(64, 64), "nvfp4", trainable=True)
    assert not prepare.filter_fn(master, "model.layers.0.self_attn.q_proj")
    with pytest.raises(ValueError, match="it is quantized already"):
        quantize_(nn.Sequential(master), prepare, filter_fn=lambda m, fqn: fqn == "0")

    model = tiny_model("llama")
    quantize_model(model, calibration(), QuantizationConfig(), progress=False)
    codes = {name: layer.weight for name, layer in quantized_linears(model).items()}
    quantize_(model, Int8WeightOnlyConfig())
    assert isinstance(model.lm_head.weight, TorchAOBaseTensor)
    assert all(layer.weight is codes[name] for name, layer in quantized_linears(model).items())


def documented_example() -> str:
    text = LIGHTNING_DOC.read_text()
    section = text[text.index("## torchao: `quantize_`"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(documented_example(), "docs/lightning.md", "exec"), namespace)
    model = namespace["model"]
    down = model.model.layers[0].mlp.down_proj
    assert type(down) is nn.Linear and isinstance(down.weight, W4A4Weight)
    assert down.weight.act_scale == "static" and down.weight.act_global_scale is not None
    assert torch.isfinite(namespace["logits"]).all()
    assert torch.equal(namespace["reloaded_logits"], namespace["logits"])
