"""Format-1 checkpoints written by the code before the weight subclass owned the linear
(``tests/data/make_v1_checkpoints.py``) load bit-identically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kbbq_pl.io.models import from_pretrained
from kbbq_pl.quant.layers import quantized_linears

V1 = Path(__file__).resolve().parents[1] / "data" / "v1"
FIXTURES = ["nvfp4_kbbq_static", "mxfp4_haar_dynamic"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", FIXTURES)
def test_v1_folder_loads_with_its_tensors_and_logits(name):
    model = from_pretrained(V1 / name)
    stored = load_file(str(V1 / name / "model.safetensors"))
    layers = quantized_linears(model)
    assert len(layers) == 7
    for layer_name, layer in layers.items():
        weight = layer.weight
        assert torch.equal(bits(weight.qdata), bits(stored[f"{layer_name}.weight_packed"]))
        assert torch.equal(bits(weight.scale), bits(stored[f"{layer_name}.weight_scale"]))
        if f"{layer_name}.weight_global_scale" in stored:
            assert torch.equal(weight.global_scale.reshape(1),
                               stored[f"{layer_name}.weight_global_scale"])
        assert torch.equal(layer.transform, stored[f"{layer_name}.transform"])
        if "static" in name:
            assert torch.equal(layer.act_global_scale.reshape(1),
                               stored[f"{layer_name}.input_global_scale"])
        else:
            assert layer.act_global_scale is None
    down = layers["model.layers.0.mlp.down_proj"]
    assert (down.in_features, down.padded_in) == (44, 48 if "nvfp4" in name else 64)
    expected = load_file(str(V1 / f"{name}.expected.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    assert torch.equal(logits, expected["logits"])
