"""Tiny random-initialized causal LMs for tests: ``tiny_model("llama" | "qwen3" | "gpt2" |
"qwen3_moe" | "mixtral" | "gpt_oss" | "qwen2_moe" | "llama4_text" | "hunyuan_v1_moe")`` builds a
small model of each causal-LM architecture from a config, with no download."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  max_position_embeddings=256),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                 bos_token_id=255, eos_token_id=255),
    # mixture-of-experts: transformers holds the experts as 3-D weights
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=256, max_position_embeddings=256, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                    max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
                    eos_token_id=255, pad_token_id=0),
    # routers as linear layers: Qwen2-MoE's shared_expert_gate (one output), Llama 4's router
    # (an nn.Linear subclass returning a tuple; experts fed every token, scaled by its score),
    # Hunyuan's gate.wg (a linear alone in its module)
    "qwen2_moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=256, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=256, max_position_embeddings=256,
                        num_local_experts=4, num_experts_per_tok=1, pad_token_id=0),
    "hunyuan_v1_moe": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           vocab_size=256, max_position_embeddings=256, num_experts=4,
                           moe_topk=2, pad_token_id=0, eos_token_id=255),
}


def tiny_config(arch: str, **overrides: Any):
    """A small config of a causal-LM architecture (``llama``, ``qwen3``, ``gpt2``; with
    mixture-of-experts layers ``qwen3_moe``, ``mixtral``, ``gpt_oss``, ``qwen2_moe``,
    ``llama4_text``, ``hunyuan_v1_moe``)."""
    from transformers import AutoConfig

    classes = {arch: type(AutoConfig.for_model(arch)) for arch in TINY_CONFIGS}
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(classes)}")
    return classes[arch](**{**TINY_CONFIGS[arch], **overrides})


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random-initialized causal LM of ``arch`` built from :func:`tiny_config`, eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    return model


_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=32, patch_size=8)
IMAGE_TOKEN = 500
"""The image token id of :func:`tiny_multimodal` models."""


def tiny_multimodal(arch: str, seed: int = 0) -> nn.Module:
    """A random-initialized image-text-to-text model (``llava``, ``gemma3``, ``qwen2_5_vl``:
    a vision tower of 2 blocks, a projector and a language model of 2 blocks, vocabulary 512,
    images of 32 x 32 pixels), eval mode."""
    import transformers as T

    if arch == "llava":
        config = T.LlavaConfig(text_config=T.LlamaConfig(**_TEXT).to_dict(),
                               vision_config={"model_type": "clip_vision_model", **_VISION},
                               image_token_index=IMAGE_TOKEN)
    elif arch == "gemma3":
        config = T.Gemma3Config(text_config={**_TEXT, "model_type": "gemma3_text"},
                                vision_config=_VISION, mm_tokens_per_image=4,
                                image_token_index=IMAGE_TOKEN, boi_token_index=501,
                                eoi_token_index=502)
    elif arch == "qwen2_5_vl":
        text = {k: v for k, v in _TEXT.items() if k != "head_dim"}
        config = T.Qwen2_5_VLConfig(
            text_config={**text, "model_type": "qwen2_5_vl_text", "bos_token_id": 0,
                         "eos_token_id": 1,
                         "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "out_hidden_size": 64, "fullatt_block_indexes": [1]},
            image_token_id=IMAGE_TOKEN, video_token_id=501, vision_start_token_id=502)
    else:
        raise ValueError(f"unknown tiny multimodal architecture {arch!r}")
    torch.manual_seed(seed)
    model = T.AutoModelForImageTextToText.from_config(config)
    model.eval()
    return model


_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
              moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
              num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1,
              n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
_SMALL_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"head_dim": None},  # the rope head dim, set by the config
    "falcon": {"head_dim": None},
    "gemma4_text": {"head_dim": None},  # per layer
    "qwen3_next": {"num_hidden_layers": 4},  # a full-attention layer every fourth
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8,
                             mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                             shared_intermediate_size=128),
    # sparse attention: the lightning indexer (DeepSeek-V3.2, GLM-5), DeepSeek-V4's compressors
    "deepseek_v32": dict(head_dim=8, num_key_value_heads=4, index_n_heads=4, index_head_dim=16,
                         index_topk=8),
    "glm_moe_dsa": dict(head_dim=8, num_key_value_heads=4, index_n_heads=4, index_head_dim=16,
                        index_topk=8),
    "deepseek_v4": dict(layer_types=["compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        num_key_value_heads=1, o_lora_rank=16, o_groups=2, index_n_heads=4,
                        index_head_dim=16, index_topk=8, sliding_window=8),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=128, expert_ffn_hidden_size=32,
                          moe_topk=2, zero_expert_num=2, head_dim=8),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2,
                             "hidden_size": 64}),
    "gemma3n_text": dict(intermediate_size=[128, 128], num_kv_shared_layers=0,
                         layer_types=["sliding_attention", "full_attention"], laurel_rank=8,
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
                         activation_sparsity_pattern=[0.0, 0.0], sliding_window=8),
    # hybrid: linear attention or state-space layers
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"], linear_head_dim=16,
                        linear_num_heads=4, num_experts_per_token=2, head_dim=None),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse"], linear_head_dim=16,
                           linear_num_heads=4, num_experts_per_token=2, layer_group_size=2,
                           head_dim=None, num_expert_group=1, topk_group=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, mamba_d_state=16,
                   attention_head_dim=None, mamba_headdim=None, adapter_rank=8),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, time_step_rank=8,
                   chunk_size=16),
}


def small_model(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random-initialized causal LM of any transformers ``model_type``, its config's fields
    that :data:`_SMALL` names made small (with the few overrides an architecture needs, and
    ``overrides``), eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cls = type(AutoConfig.for_model(model_type))
    fields = cls().to_dict()
    values = {**{k: v for k, v in _SMALL.items() if k in fields},
              **_SMALL_OVERRIDES.get(model_type, {}), **overrides}
    config = cls(**{k: v for k, v in values.items() if v is not None})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


_SMALL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, depth=2,
                     num_attention_heads=2, num_heads=2, num_key_value_heads=2, head_dim=16,
                     image_size=32, patch_size=8, out_hidden_size=64, embed_dim=32,
                     position_embedding_size=64, pooling_kernel_size=2)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
_SMALL_MULTIMODAL: dict[str, dict[str, dict[str, Any]]] = {
    "kimi_k25": {"text_config": {"head_dim": 8, "num_key_value_heads": 4}},  # DeepSeek-V3
    "qwen3_5_moe": {"text_config": {"num_hidden_layers": 4}},  # a full-attention layer
    "glm4v_moe": {"text_config": {"rope_parameters": {**_MROPE, "mrope_section": [2, 1, 1],
                                                      "partial_rotary_factor": 0.5}}},
    "glm4v": {"text_config": {"rope_parameters": _MROPE}},
    "step3p7": {"text_config": {"sliding_window": 8}},
}
_VISION_OFF_BY_DEFAULT = {"gemma4": ("vision_config",)}


def small_multimodal(model_type: str, seed: int = 0) -> nn.Module:
    """A random-initialized image-text-to-text model of any transformers ``model_type``: each
    of its sub-configs made small (the text config's fields that :data:`_SMALL` names,
    vocabulary 512; the vision and other encoders' that :data:`_SMALL_VISION` names), eval
    mode.  Text only: builds the model, not its image inputs."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    cls = type(AutoConfig.for_model(model_type))
    default = cls()
    overrides = _SMALL_MULTIMODAL.get(model_type, {})
    kwargs = {}
    for name, sub_class in (getattr(cls, "sub_configs", None) or {}).items():
        sub = getattr(default, name, None)
        if sub is None and name in _VISION_OFF_BY_DEFAULT.get(model_type, ()):
            sub = sub_class()
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        small = {**_SMALL, "vocab_size": 512} if name == "text_config" else _SMALL_VISION
        fields = sub.to_dict()
        values = {**{k: v for k, v in small.items() if k in fields}, **overrides.get(name, {})}
        kwargs[name] = {**{k: v for k, v in values.items() if v is not None},
                        "model_type": sub.model_type}
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(cls(**kwargs)).eval()
