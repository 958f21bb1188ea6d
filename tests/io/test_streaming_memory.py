"""A model larger than the memory allowed: streamed from disk it quantizes, in memory it cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kbbq_pl.io.checkpoint import read_tensors, save_quantized
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import QuantizationConfig, quantize_model

SCRIPT = Path(__file__).with_name("capped_quantize.py")

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").is_file(),
                                reason="the memory cap reads /proc/self/statm (Linux)")


def _run(mode: str, source: Path, out: Path, cap_mb: float) -> tuple[int, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    result = subprocess.run([sys.executable, str(SCRIPT), mode, str(source), str(out),
                             str(cap_mb)], capture_output=True, text=True, env=env, timeout=600,
                            check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-2000:]
    return result.returncode, json.loads(lines[-1])


def test_a_model_larger_than_the_cap_quantizes_streamed_and_matches(tmp_path, one_thread):
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = tmp_path / "llama-32"
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=32,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                         tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        source, max_shard_size="64MB")
    weights_mb = sum(p.stat().st_size for p in source.glob("*.safetensors")) / 2**20
    # half the bf16 weights on disk (86 MiB), a quarter of them in float32; streamed, the run
    # grew by 54 to 55 MiB with 24, 32 or 48 blocks (2026-12-01)
    cap_mb = 0.5 * weights_mb

    code, streamed = _run("streamed", source, tmp_path / "streamed", cap_mb)
    assert code == 0 and not streamed["capped"], streamed
    code, memory = _run("memory", source, tmp_path / "memory", cap_mb)
    assert code == 75 and memory["capped"], memory  # what the in-memory pipeline cannot do
    assert not (tmp_path / "memory").exists()

    model, _ = load_model(source)  # the uncapped run, in this process, on one thread as there
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 512, (2, 64), generator=generator)}
               for _ in range(2)]
    quantize_model(model, batches,
                   QuantizationConfig.from_dict({"transform": {"name": "kbbq", "lam": 0.75}}),
                   progress=False)
    save_quantized(model, tmp_path / "uncapped")
    expected, got = read_tensors(tmp_path / "uncapped"), read_tensors(tmp_path / "streamed")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
