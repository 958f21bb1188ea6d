"""The GPU path, the parts a CPU can check: inputs follow the model's device, and a
fine-tuning step reads nothing back from the device.

The end-to-end runs with the model on a GPU are in tests/kernels/test_gpu.py; here the sequential
runner's offloading is checked with the ``meta`` device standing in for a second device, and
host synchronizations are counted as the reads of a tensor's value that cause them.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from kbbq_pl import formats as F
from kbbq_pl.formats import deferred_checks
from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig, quantize_model
from kbbq_pl.quant.layers import quantized_linears
from kbbq_pl.quant.sequential import SequentialRunner


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


# ------------------------------------------------------ no host synchronization in training


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``.item()``, ``bool()``, ``float()``:
    on a GPU each one waits for the device's queue to drain)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _train_step_reads(model, ids) -> int:
    with deferred_checks(), _HostReads() as reads:
        model(input_ids=ids, labels=ids).loss.backward()
    return reads.count


def test_a_fine_tuning_step_through_fp4_reads_nothing_more_back_than_full_precision():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    full = tiny_model("llama").train()
    quantized = tiny_model("llama")
    quantize_model(quantized, batches, QuantizationConfig(format=FormatConfig("nvfp4", "static"),
                                                          transform=TransformConfig("kbbq")),
                   trainable=True, progress=False)
    quantized.train()
    assert len(quantized_linears(quantized)) == 14
    assert _train_step_reads(quantized, ids) == _train_step_reads(full, ids)
    # without the deferral every rounding call reads its finite flag and its static scale
    with _HostReads() as reads:
        quantized(input_ids=ids, labels=ids).loss.backward()
    assert reads.count >= 2 * 14


def test_deferred_checks_raise_at_the_check_naming_the_tensor():
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    message = r"layer\.input: non-finite values .*shape \(4, 32\) on cpu; 1 of the 2"
    with pytest.raises(ValueError, match=message), F.deferred_checks() as checks:
        F.fake_quantize(torch.randn(4, 32), "nvfp4", name="fine")
        F.fake_quantize(x, "nvfp4", name="layer.input")  # no error yet
        assert len(checks.pending) == 2
    infinite = torch.tensor(float("inf"))
    with pytest.raises(ValueError, match="global_scale must be finite"), F.deferred_checks():
        F.fake_quantize(torch.randn(4, 32), "nvfp4", global_scale=infinite)
    with F.deferred_checks() as checks:  # nested blocks share the outer one
        with F.deferred_checks() as inner:
            F.fake_quantize(x, "mxfp4", name="w")
        assert inner is checks and len(checks.pending) == 1
        checks.pending.clear()
    with pytest.raises(ValueError, match="1 NaN"):  # outside: immediate, with the counts
        F.fake_quantize(x, "nvfp4")


def test_compiled_rounding_compiles_once_under_autocast_and_for_master_weights():
    """bf16-mixed training calls the rounding under autocast and on weights that require grad:
    neither may cost another graph (each is seconds of compilation on a GPU)."""
    if not F.dispatch._backend_available("cpu"):
        pytest.skip("no C++ compiler for torch.compile on this machine")
    from torch._dynamo.utils import counters

    x = torch.randn(64, 128)
    F.set_compile(True)
    try:
        expected = F.fake_quantize(x, "nvfp4")
        graphs = counters["stats"]["unique_graphs"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = F.fake_quantize(x, "nvfp4")
        master = F.ste_fake_quantize(torch.randn(32, 128).requires_grad_(), "nvfp4")
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        F.set_compile("0")
    assert not F.dispatch._broken
    assert torch.equal(under_autocast, expected) and master.requires_grad
