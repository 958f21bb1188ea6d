"""Inputs follow the model's device (issue 11), the parts a CPU can check.

The end-to-end runs with the model on a GPU are in tests/test_gpu.py; here the sequential
runner's offloading is checked with the ``meta`` device standing in for a second device.
"""

from __future__ import annotations

import torch

from kbbq_pl.models import tiny_model
from kbbq_pl.sequential import SequentialRunner


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def test_sequential_runner_moves_every_block_input_to_the_offload_device():
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    runner = SequentialRunner(model, batches, offload_device="meta")
    cached = runner.inputs[0]
    tensors = [*_tensors(cached.args), *_tensors(cached.kwargs)]
    # hidden states, rotary position embeddings (cos, sin), cache positions, ...
    assert len(tensors) >= 3 and "position_embeddings" in cached.kwargs
    assert {t.device.type for t in tensors} == {"meta"}
