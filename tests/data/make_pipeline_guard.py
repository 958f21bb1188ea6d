"""Writes ``tests/data/pipeline_guard.json``, the bit-identity guard of
``tests/quant/test_pipeline_guard.py``.

Every shipped recipe (``recipes/*.yaml``: RTN I / HAAR / WUSH / KBBQ at each lambda and ``auto``,
GPTQ, MR-GPTQ, GPTQ-WUSH, GPTQ-KBBQ (fixed and auto), NVFP4 and MXFP4) quantizes the same tiny
seeded Llama (two blocks, so the GPTQ loop feeds a quantized block's outputs to the next one) on
the same random calibration tokens; the guard stores, per recipe and per kind of tensor of the
quantized layers (FP4 codes, block scales, global scales, transforms, static activation scales),
the number of such tensors and one SHA-256 over their names, dtypes, shapes and bytes.  The
codes, scales and transforms of a later version must match bit for bit.

Written by the code before the package was reorganized into subpackages, from the repository
root::

    python tests/data/make_pipeline_guard.py

Rerunning with later code would only test that code against itself: regenerate only when a
change of results is intended, and say so in the commit.

The static activation scales and the fitted transforms come out of float32 matrix products and
eigendecompositions, whose last bits depend on the CPU kernels torch and MKL pick (AVX-512 or
AVX2): on an AVX2-only CPU 20 of the 28 recipes differ from the file above in their last bits,
deterministically.  So a CPU whose ``torch.backends.cpu.get_cpu_capability()`` has its own file,
``pipeline_guard.<capability>.json``, is checked against that one (:func:`guard_path`):
``pipeline_guard.AVX2.json`` was written on an AVX2 machine by code that matched
``pipeline_guard.json`` on the machines before (``--capability-file``).

An AVX-512 CPU writes both files: ``pipeline_guard.json`` as it is, the AVX2 one with ATen,
MKL and oneDNN held to AVX2 (on an AMD EPYC with AVX-512, this reproduced all 28 digests
that the AVX2 machine had written)::

    KBBQ_PL_COMPILE=0 python tests/data/make_pipeline_guard.py
    KBBQ_PL_COMPILE=0 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        ONEDNN_MAX_CPU_ISA=AVX2 python tests/data/make_pipeline_guard.py --capability-file

Rewritten since, in both files: the six GPTQ recipes that refit their transforms in the loop
(``gptq_wush_*``, ``gptq_kbbq_*``), when GPTQ's inverse-Hessian factor came to be formed
from one Cholesky factorization instead of three (2026-11-26): the factor moved in its last
bits, and so did the transforms fitted from the error-updated weights.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
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
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)
LAYER_TENSORS = ("weight_packed", "weight_scale", "weight_global_scale", "transform",
                 "input_global_scale")


def guard_path() -> Path:
    """The guard for this CPU: ``pipeline_guard.<capability>.json`` where it exists, else
    ``pipeline_guard.json``."""
    own = GUARD.with_name(f"{GUARD.stem}.{torch.backends.cpu.get_cpu_capability()}.json")
    return own if own.is_file() else GUARD


def recipe_configs() -> dict[str, QuantizationConfig]:
    """The recipe of every shipped recipe file (its ``recipe:`` section; the files that wrote
    the guard held the same fields, flat, under ``quantizer: init_args:``), by file name."""
    return {path.stem: QuantizationConfig.from_dict(yaml.safe_load(path.read_text())["recipe"])
            for path in sorted((ROOT / "recipes").glob("*.yaml"))}


def quantized_digests(config: QuantizationConfig) -> dict[str, dict[str, Any]]:
    """Per kind of quantized-layer tensor (:data:`LAYER_TENSORS`) of the tiny model quantized
    by ``config``: ``[how many layers store one, the SHA-256 of them all, layer by layer]``.

    A recipe with ``autobrake.scope: model`` or ``best`` is guarded through its first run, the
    per-layer auto-brake whose scores choose the lambda (the recipe before the scope existed):
    its second run is the fixed-lambda recipe at that lambda, bit for bit, and ``best`` keeps
    one of the two runs' models (``tests/transforms/test_autobrake.py``); the fixed recipes
    guard the second run's path."""
    if config.auto and config.autobrake.scope != "layer":
        config = replace(config, autobrake=replace(config.autobrake, scope="layer", finalists=1))
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


def main() -> None:
    torch.set_num_threads(1)
    out = GUARD
    if "--capability-file" in sys.argv:  # this CPU's own guard file
        out = GUARD.with_name(f"{GUARD.stem}.{torch.backends.cpu.get_cpu_capability()}.json")
    guard = {name: quantized_digests(config) for name, config in recipe_configs().items()}
    lines = [f" {json.dumps(name)}: {json.dumps(parts, sort_keys=True)}"
             for name, parts in sorted(guard.items())]
    out.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {out} ({len(guard)} recipes)", file=sys.stderr)


if __name__ == "__main__":
    main()
