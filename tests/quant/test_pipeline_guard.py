"""Bit-identity guard: every shipped recipe quantizes the tiny seeded model of
``tests/data/make_pipeline_guard.py`` to the same FP4 codes, block scales, global scales,
transforms and activation scales as the code that wrote ``tests/data/pipeline_guard.json``
(its docstring says which commit, and why the digests are computed with pinned CPU kernels)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
_spec = importlib.util.spec_from_file_location("make_pipeline_guard",
                                               DATA / "make_pipeline_guard.py")
guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guard)

EXPECTED = json.loads(guard.GUARD.read_text())
CONFIGS = guard.recipe_configs()


@pytest.fixture(scope="module")
def digests():
    return guard.pinned_digests()  # every recipe, in one child process (about 30 s)


def test_the_guard_covers_every_shipped_recipe():
    assert sorted(EXPECTED) == sorted(CONFIGS)
    methods = {CONFIGS[name].label.split(",")[0] for name in CONFIGS}
    assert {"I nvfp4", "I mxfp4", "RTN-KBBQ nvfp4", "RTN-WUSH mxfp4", "GPTQ nvfp4",
            "GPTQ-KBBQ mxfp4", "MR-GPTQ nvfp4"} <= methods
    assert any(config.auto and config.weight_quantizer == "gptq" for config in CONFIGS.values())
    assert any(config.auto and config.weight_quantizer == "rtn" for config in CONFIGS.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_quantizes_bit_identically(name, digests):
    got = digests[name]
    assert got["weight_packed"][0] == 14  # every linear of both blocks is quantized
    changed = {part: (got[part], EXPECTED[name][part]) for part in EXPECTED[name]
               if got[part] != EXPECTED[name][part]}
    assert not changed, f"{name}: {sorted(changed)} differ from the guard (got, stored): {changed}"
