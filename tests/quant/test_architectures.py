"""The architectures users quantize, as tiny random models: every linear layer of their blocks
is quantized but routers, and the checkpoint reloads through transformers bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny_models import small_model
from transformers import AutoModelForCausalLM

import kbbq_pl
from kbbq_pl.quant import QuantizationConfig, quantize_model
from kbbq_pl.quant.layers import quantized_linears
from kbbq_pl.quant.modules import find_linears

ARCHITECTURES = [
    # dense
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma4_text", "phi3",
    "olmo2", "granite", "cohere2", "smollm3", "glm4", "falcon", "gpt_neox",
    # mixture of experts
    "deepseek_v3", "glm4_moe", "minimax_m2", "ernie4_5_moe", "olmoe", "phimoe", "longcat_flash",
    "dbrx", "lfm2_moe", "jetmoe",
    # sparse attention (DeepSeek's lightning indexer, DeepSeek-V4's compressors)
    "deepseek_v32", "glm_moe_dsa", "deepseek_v4",
    # hybrid: linear attention or Mamba layers
    "qwen3_next", "nemotron_h", "falcon_h1", "granitemoehybrid", "jamba", "lfm2", "kimi_linear",
    "bailing_hybrid", "zamba2", "mamba2",
    # per-layer embeddings, AltUp and LAuReL
    "gemma3n_text",
]
IDS = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_architecture_quantizes_and_reloads_through_transformers(tmp_path, arch):
    model = small_model(arch)
    with torch.no_grad():
        reference = model(IDS).logits
    linears = list(find_linears(model))
    report = quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(), progress=False)
    layers = quantized_linears(model)
    left = [name for name in linears if name not in layers]
    assert all(name in report.skipped for name in left), left
    assert all("router" in report.skipped[name] or name.endswith("dt_proj")
               or name.endswith("o_a_proj") for name in left)  # DeepSeek-V4's grouped linear
    with torch.no_grad():
        quantized = model(IDS).logits
    assert torch.isfinite(quantized).all()
    # Gemma 4 scales its attention logits by 1 after q / k norms: a random model's attention
    # is sharp, and quantizing q_proj alone moves its logits by 0.58 of their norm
    assert (quantized - reference).norm() < (0.9 if arch == "gemma4_text" else 0.5) * (
        reference.norm())
    kbbq_pl.save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cpu")
    assert set(quantized_linears(reloaded)) == set(layers)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, quantized)


def test_routers_beside_stacked_experts_stay_in_full_precision():
    """JetMoE holds its experts stacked (``input_linear``, ``[experts, out, in]``) and routes
    with ``router.layer``, in its MLP and in its attention: the four routers are named and left
    in full precision."""
    model = small_model("jetmoe")
    report = quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(), progress=False)
    routers = [f"model.layers.{i}.{where}.router.layer" for i in range(2)
               for where in ("mlp", "self_attention.experts")]
    assert all("router" in report.skipped[name] for name in routers), report.skipped
    assert not set(routers) & set(quantized_linears(model))


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa", "deepseek_v4"])
def test_sparse_attention_scoring_layers_stay_in_full_precision(arch):
    """vLLM builds the lightning indexer's ``wk`` and ``weights_proj`` (one unquantized GEMM)
    and DeepSeek-V4's KV compressors unquantized: a checkpoint holding them in FP4 would not
    load there."""
    model = small_model(arch)
    quantize_model(model, [{"input_ids": IDS}], QuantizationConfig(), progress=False)
    layers = quantized_linears(model)
    kept = [name for name in find_linears(model, ignore=[])
            if name.endswith(("weights_proj", "indexer.wk", "compressor.kv_proj",
                              "compressor.gate_proj", "indexer.kv_proj", "indexer.gate_proj"))]
    assert kept and not set(kept) & set(layers)
    assert arch == "deepseek_v4" or any(name.endswith("indexer.wk") for name in kept)
    assert any(name.endswith(("indexer.wq_b", "indexer.q_b_proj")) for name in layers)
