"""Writes ``tests/data/pipeline_guard.json``, the bit-identity guard of
``tests/quant/test_pipeline_guard.py``.

Every shipped recipe (``recipes/*.yaml``) quantizes the same tiny seeded Llama (two blocks, so
the GPTQ loop feeds a quantized block's outputs to the next one) on the same random calibration
tokens; the guard stores, per recipe and per kind of tensor of the quantized layers (FP4 codes,
block scales, global scales, transforms, static activation scales), the number of such tensors
and one SHA-256 over their names, dtypes, shapes and bytes.  The codes, scales and transforms of
a later version must match bit for bit.

**The same bits on every x86 CPU.**  The transforms and the static activation scales come out of
float32 matrix products and eigendecompositions whose last bits depend on the kernels torch and
MKL pick for the CPU at hand (AVX-512 or AVX2, and Intel or AMD: the per-CPU files the guard
had until 2026-11-27 failed on an Intel Xeon with AVX-512 at the commit that wrote them on an
AMD EPYC).  So the digests are computed in a child process whose kernels are pinned
(:data:`PINNED`: ATen's scalar kernels, MKL's conditional numerical reproducibility path, one
thread, eager rounding), which gives the same bits whatever the CPU.

Regenerate only when a change of results is intended, and say so in the commit (rerunning with
later code would only test that code against itself); from the repository root::

    python tests/data/make_pipeline_guard.py

Written at a31ce25 (2026-11-27, before the auto-brake was cut to its per-layer core): a
``scope: model`` / ``best`` recipe of that code was guarded through its per-layer run, which is
what every auto recipe is now.  The earlier guard (written at e6ca8dc, the six GPTQ recipes that
refit in the loop rewritten at 5594156) is in the history.  Regenerated on 2026-11-29 by the
commit that gave the layers vLLM fuses (q/k/v, gate/up) one NVFP4 per-tensor scale: the four
NVFP4 recipes with a data-free transform (``i_nvfp4``, ``haar_nvfp4``, ``gptq_nvfp4``,
``mr_gptq_nvfp4``) changed, the other 24 kept their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from kbbq_pl.io.checkpoint import checkpoint_contents
from kbbq_pl.quant import QuantizationConfig, quantize_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, run as a script too
from tiny_models import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GUARD = Path(__file__).resolve().parent / "pipeline_guard.json"
PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
          "ONEDNN_MAX_CPU_ISA": "SSE41", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
          "KBBQ_PL_COMPILE": "0"}
"""The environment of the child process that computes the digests (module docstring): read by
torch, MKL and oneDNN when they load, so it is set before the process starts."""
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)
LAYER_TENSORS = ("weight_packed", "weight_scale", "weight_global_scale", "transform",
                 "input_global_scale")


def recipe_configs() -> dict[str, QuantizationConfig]:
    """The recipe of every shipped recipe file (its ``recipe:`` section; the files that wrote
    the guard held the same fields, flat, under ``quantizer: init_args:``), by file name."""
    return {path.stem: QuantizationConfig.from_dict(yaml.safe_load(path.read_text())["recipe"])
            for path in sorted((ROOT / "recipes").glob("*.yaml"))}


def quantized_digests(config: QuantizationConfig) -> dict[str, dict[str, Any]]:
    """Per kind of quantized-layer tensor (:data:`LAYER_TENSORS`) of the tiny model quantized
    by ``config``: ``[how many layers store one, the SHA-256 of them all, layer by layer]``."""
    torch.manual_seed(0)
    model = tiny_model("llama", seed=0, **TINY)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (8, 32), generator=generator)
    batches = [{"input_ids": tokens[i:i + 2]} for i in range(0, 8, 2)]
    quantize_model(model, batches, config, progress=False)
    tensors, layers, _ = checkpoint_contents(model)
    digests = {}
    for part in LAYER_TENSORS:
        keys = [f"{name}.{part}" for name in sorted(layers) if f"{name}.{part}" in tensors]
        sha = hashlib.sha256()
        for key in keys:
            tensor = tensors[key].contiguous()
            sha.update(f"{key} {tensor.dtype} {list(tensor.shape)}\n".encode())
            sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[part] = [len(keys), sha.hexdigest()]
    return digests


def pinned_digests() -> dict[str, dict[str, Any]]:
    """:func:`quantized_digests` of every shipped recipe, computed in a child process with the
    kernels pinned (:data:`PINNED`)."""
    result = subprocess.run([sys.executable, __file__, "--print"], check=True,
                            capture_output=True, text=True, env={**os.environ, **PINNED})
    return json.loads(result.stdout)


def main() -> None:
    if "--print" in sys.argv:  # the child process of pinned_digests
        torch.set_num_threads(1)
        guard = {name: quantized_digests(config) for name, config in recipe_configs().items()}
        print(json.dumps(guard))
        return
    guard = pinned_digests()
    lines = [f" {json.dumps(name)}: {json.dumps(parts, sort_keys=True)}"
             for name, parts in sorted(guard.items())]
    GUARD.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {GUARD} ({len(guard)} recipes)", file=sys.stderr)


if __name__ == "__main__":
    main()
