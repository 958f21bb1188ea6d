"""The CUDA path end to end: rounding bit-identical to the CPU's, compiled and
eager; quantization, the Lightning callback and checkpoints with the model on a GPU.

Skipped without a CUDA device (the conftest gives the reason).  On a GPU machine::

    python -m pytest -m gpu            # these and the other GPU tests of the suite

(``tests/cli/test_outputs.py`` runs ``kbbq-pl quantize / compare / law --device cuda``,
``tests/eval/test_tasks.py`` ``kbbq-pl eval --device cuda``,
``tests/kernels/test_kernels.py`` the Triton kernels on the GPU.)  The CPU half of these checks
is in tests/formats/test_device_rounding.py and tests/quant/test_device_placement.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from kbbq_pl.callbacks import KBBQ
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_helpers import TinyLM
from test_device_rounding import CASES, DTYPES, _all_outputs
from test_formats import ALL_FORMATS, bits
from test_kbbq import datamodule, trainer
from tiny_models import tiny_model
from torch import nn

from kbbq_pl import formats as F
from kbbq_pl.io.checkpoint import save_quantized
from kbbq_pl.io.models import from_pretrained
from kbbq_pl.quant import (
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
    w4a4,
)
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears, w4a4_weight

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
ACCELERATOR = "gpu"
COMPILED_FORMATS = ["nvfp4", "mxfp4", "mxfp4_rceil", "mxfp4_no_clip", "fp8_e4m3", "int4",
                    "int8_row", "e2m1_b64_fp32"]


# --------------------------------------------------------------------- 1. rounding


def _compare_with_cpu(name: str, dtype: torch.dtype, compiled: bool) -> None:
    for case, x in CASES.items():
        x = x.to(dtype)
        if not torch.isfinite(x).all():
            continue
        expected = _all_outputs(x, name)  # the CPU, eager (the suite's default)
        F.set_compile(compiled)
        try:
            got = [t.cpu() for t in _all_outputs(x.to(DEVICE), name)]
        finally:
            F.set_compile("0")
        for index, (e, g) in enumerate(zip(expected, got)):
            differ = int((bits(e) != bits(g)).sum())
            assert differ == 0, f"{name} {dtype} {case} output {index}: {differ} bytes differ"
    assert not F.dispatch._broken, "torch.compile failed and fell back to eager"


@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_rounding_on_the_gpu_is_bit_identical_to_the_cpu(name, dtype):
    """Codes, scales, per-tensor scales, dequantized and fake-quantized values, static scales:
    random, outlier, tie, subnormal-scale, tiny, huge and near-overflow inputs."""
    _compare_with_cpu(name, dtype, compiled=False)


# On an H200 (2026-11-26) these failed for the E2M1 formats, so KBBQ_PL_COMPILE=auto keeps CUDA
# eager.  Causes found so far: an FP8 -> FP64 cast Triton cannot lower (fixed), and on an H100
# the compiled decode gave +0 for code 8 (-0), Triton negating as 0 - x (fixed with copysign,
# not yet rerun on a GPU).  An XPASS here says the compiled E2M1 kernels may be switched back on.
_E2M1_COMPILED = pytest.mark.xfail(reason="compiled E2M1 rounding failed on an H200 and an H100 "
                                          "(2026-11-26); fixes not yet rerun on a GPU")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_E2M1_COMPILED)
                                  if n in ("nvfp4", "mxfp4", "mxfp4_rceil", "mxfp4_no_clip",
                                           "e2m1_b64_fp32") else n
                                  for n in COMPILED_FORMATS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_rounding_on_the_gpu_is_bit_identical_to_the_cpu(name, dtype):
    _compare_with_cpu(name, dtype, compiled=True)


def test_quantized_linear_on_cuda_matches_cpu():
    linear = nn.Linear(64, 32)
    layer = QuantizedLinear.from_linear(linear, "mxfp4", torch.eye(64))
    x = torch.randn(8, 64)
    expected = layer(x)
    layer.to(DEVICE)
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, act_scale", [("nvfp4", "static"), ("nvfp4", "dynamic"),
                                            ("mxfp4", "dynamic")])
def test_w4a4_weight_on_cuda_runs_the_kernels(fmt, act_scale, monkeypatch):
    if w4a4._kernels() is None:
        pytest.skip("kbbq_pl.kernels is not installed")
    linear_w4a4 = w4a4._kernels().linear_w4a4
    linear = nn.Linear(512, 256)
    block = F.get_format(fmt).block_size
    identity = torch.eye(block).expand(512 // block, block, block)  # T x exact in any order
    weight = w4a4_weight(linear, fmt, identity, act_scale=act_scale,
                         act_global_scale=torch.tensor(0.002))
    x = torch.randn(16, 512)
    expected = TF.linear(x, weight, linear.bias)  # CPU emulation
    on_gpu = weight.to(DEVICE)
    assert w4a4.uses_kernels(x.to(DEVICE), on_gpu)
    got = TF.linear(x.to(DEVICE), on_gpu, linear.bias.to(DEVICE)).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a gradient to the input: the kernels' forward, the emulation's backward (the CPU's)
    x.requires_grad_()
    TF.linear(x, weight, linear.bias).backward(torch.ones_like(expected))
    kernels, calls = w4a4._kernels(), []
    monkeypatch.setattr(kernels, "linear_w4a4",
                        lambda *a, **k: calls.append(1) or linear_w4a4(*a, **k))
    on_device = x.detach().to(DEVICE).requires_grad_()
    got = TF.linear(on_device, on_gpu, linear.bias.detach().to(DEVICE))
    torch.testing.assert_close(got.detach().cpu(), expected, rtol=1e-5, atol=1e-5)
    got.backward(torch.ones_like(got))
    assert calls == [1]
    torch.testing.assert_close(on_device.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- 2. quantize_model


def _batches(device: str, rows: int = 4) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (rows, 32), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": b.to(device), "attention_mask": torch.ones_like(b).to(device)}
            for b in ids.split(2)]


def _codes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every stored field of the quantized layers, as CPU bytes."""
    state = {}
    for name, layer in quantized_linears(model).items():
        weight = layer.weight
        fields = {"qdata": weight.qdata, "scale": weight.scale, "global": weight.global_scale,
                  "transform": layer.transform, "act_global": layer.act_global_scale}
        for key, value in fields.items():
            if value is not None:
                state[f"{name}.{key}"] = bits(value.detach().cpu())
    return state


def _on_device(model: nn.Module, device: str = DEVICE) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    for layer in quantized_linears(model).values():
        if isinstance(layer.weight, F.QuantizedTensor):  # frozen codes (a trainable layer's
            tensors += [layer.weight.qdata, layer.weight.scale]  # master weight is a parameter)
    return all(t.device.type == torch.device(device).type for t in tensors)


class _Placement(Callback):
    """Where the model's tensors are while it trains: Lightning's teardown moves the module back
    to the CPU when ``fit`` ends, so the GPU placement shows only from inside."""

    def __init__(self):
        self.on_device = []

    def on_train_start(self, trainer, pl_module):
        self.on_device.append(_on_device(pl_module))

    on_train_end = on_train_start


def _placed_on_the_gpu_then_returned(module: nn.Module, placement: _Placement) -> bool:
    return placement.on_device == [True, True] and _on_device(module, "cpu")


def test_rtn_on_the_gpu_rounds_the_weights_as_the_cpu_does():
    """Identity transform: the weight codes depend on the weights alone, so they are the CPU's
    bit for bit (activation scales come from GPU matmuls, which round differently)."""
    config = QuantizationConfig(format=FormatConfig("nvfp4", act_scale="dynamic"),
                                transform=TransformConfig("identity"))
    cpu = tiny_model("llama")
    quantize_model(cpu, _batches("cpu"), config, progress=False)
    gpu = tiny_model("llama").to(DEVICE)
    quantize_model(gpu, _batches(DEVICE), config, progress=False)
    assert _on_device(gpu)
    assert _codes(gpu).keys() == _codes(cpu).keys()
    for key, value in _codes(cpu).items():
        assert torch.equal(_codes(gpu)[key], value), key


@pytest.mark.parametrize("recipe", [
    QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("kbbq", 0.75)),
    QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("kbbq", "auto")),
    QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("kbbq"),
                       weights=WeightsConfig("gptq")),
    QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("kbbq", "auto"),
                       weights=WeightsConfig("gptq")),
], ids=["rtn-kbbq", "rtn-auto", "gptq-kbbq", "gptq-auto"])
def test_quantize_model_with_the_model_on_the_gpu(recipe):
    """RTN, the GPTQ family (block by block, every block input on the device) and lam auto."""
    model = tiny_model("llama").to(DEVICE)
    batches = _batches(DEVICE, rows=8)
    report = quantize_model(model, batches, recipe, progress=False)
    assert len(report.layers) == 14 and _on_device(model)
    with torch.no_grad():
        assert torch.isfinite(model(**batches[0]).logits).all()


@pytest.mark.parametrize("weight_quantizer", ["rtn", "gptq"])
def test_a_model_larger_than_the_gpus_memory_cap_quantizes_block_by_block(weight_quantizer):
    """The model stays on the CPU; ``device="cuda"`` runs one block at a time.  The process's
    CUDA memory is capped below the model's size (``set_per_process_memory_fraction``): moving
    the whole model to the GPU fails, the quantization does not."""
    model = tiny_model("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                       num_attention_heads=8, num_key_value_heads=8)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(0).total_memory
    cap = weight_bytes * 3 // 4  # room for one block, its statistics and Triton's autotuner
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            model.to(DEVICE)
        model.to("cpu")
        torch.cuda.empty_cache()
        config = QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("kbbq"),
                                    weights=WeightsConfig(weight_quantizer))
        report = quantize_model(model, _batches("cpu", rows=8), config, device=DEVICE,
                                progress=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert len(report.layers) == 16 * 7 and report.model["peak_cuda_mb"] * 2**20 < cap
    with torch.no_grad():
        assert torch.isfinite(model(**_batches("cpu")[0]).logits).all()


@pytest.mark.parametrize("weight_quantizer", ["rtn", "gptq"])
def test_streamed_from_disk_on_the_gpu_is_bit_for_bit_the_offloaded_run(tmp_path,
                                                                         weight_quantizer):
    """``kbbq-pl quantize --stream --device cuda``: each block read from the safetensors shards
    onto the GPU gives the checkpoint of the model in CPU memory run block by block on the GPU
    (``--offload``), bit for bit, with the auto-brake."""
    from kbbq_pl.io.checkpoint import read_tensors
    from kbbq_pl.io.models import load_model
    from kbbq_pl.io.streaming import quantize_checkpoint

    source = tmp_path / "llama"
    tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=True).to(
        torch.bfloat16).save_pretrained(source, max_shard_size="100KB")
    config = QuantizationConfig(format=FormatConfig("nvfp4"),
                                transform=TransformConfig("kbbq", "auto"),
                                weights=WeightsConfig(weight_quantizer))
    batches = _batches("cpu", rows=8)
    quantize_checkpoint(source, tmp_path / "streamed", config, batches, device=DEVICE,
                        progress=False)
    model, _ = load_model(source)
    quantize_model(model, batches, config, device=DEVICE, progress=False)
    save_quantized(model, tmp_path / "offloaded")
    streamed, offloaded = read_tensors(tmp_path / "streamed"), read_tensors(tmp_path / "offloaded")
    assert streamed.keys() == offloaded.keys()
    assert all(torch.equal(streamed[k], offloaded[k]) for k in streamed)


# --------------------------------------------------------------------- 3. Lightning


class _Seen(Callback):
    def on_train_start(self, trainer, pl_module):
        self.master = {n: layer.weight.detach().to("cpu", copy=True)  # compared after fit,
                       for n, layer in quantized_linears(pl_module).items()}  # on the CPU


def test_fit_through_fp4_on_the_gpu_in_bf16_mixed(tmp_path):
    module = TinyLM()
    seen, placement = _Seen(), _Placement()
    trainer(tmp_path, [KBBQ(QuantizationConfig(format=FormatConfig("nvfp4"),
                                               transform=TransformConfig("kbbq", lam=0.75))),
                       seen, placement],
            accelerator=ACCELERATOR, precision="bf16-mixed", max_steps=3,
            enable_checkpointing=False).fit(module, datamodule=datamodule())
    layers = quantized_linears(module)
    assert len(layers) == 14 and _placed_on_the_gpu_then_returned(module, placement)
    moved = [not torch.equal(seen.master[n], layer.weight.dequantize(torch.float32))
             for n, layer in layers.items()]
    assert any(moved), "fine-tuning did not change any quantized weight"


@pytest.mark.parametrize("weight_quantizer", ["rtn", "gptq"])
def test_calibrate_only_on_the_gpu(tmp_path, weight_quantizer):
    module, placement = TinyLM(), _Placement()
    fit = trainer(tmp_path, [KBBQ(QuantizationConfig(format=FormatConfig("mxfp4"),
                                                     weights=WeightsConfig(weight_quantizer)),
                                  calibrate_only=True), placement],
                  accelerator=ACCELERATOR, max_steps=5, enable_checkpointing=False)
    fit.fit(module, datamodule=datamodule())
    assert fit.global_step == 0 and len(quantized_linears(module)) == 14
    assert _placed_on_the_gpu_then_returned(module, placement)


def test_checkpoint_from_the_gpu_resumes_and_reloads_on_the_cpu(tmp_path):
    module = TinyLM()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, [KBBQ(), checkpoint], accelerator=ACCELERATOR,
            max_steps=2, enable_checkpointing=True).fit(module, datamodule=datamodule())
    path = checkpoint.last_model_path
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    module.to("cpu").eval()
    restored = TinyLM.load_from_checkpoint(path, map_location="cpu").eval()
    with torch.no_grad():  # the codes of the GPU run compute the same product on the CPU
        assert torch.equal(restored(input_ids=ids).logits, module(input_ids=ids).logits)
    again, placement = TinyLM(seed=2), _Placement()
    trainer(tmp_path, [KBBQ(calibration=[]), placement], accelerator=ACCELERATOR,
            max_steps=4, enable_checkpointing=False).fit(again, datamodule=datamodule(),
                                                         ckpt_path=path)
    assert len(quantized_linears(again)) == 14
    assert _placed_on_the_gpu_then_returned(again, placement)


# --------------------------------------------------------------------- 4. checkpoints


@pytest.mark.parametrize("written_on", ["gpu", "cpu"])
def test_checkpoints_move_between_devices_bit_identically(tmp_path, written_on):
    written_on = DEVICE if written_on == "gpu" else "cpu"
    model = tiny_model("llama").to(written_on)
    config = QuantizationConfig(format=FormatConfig("nvfp4"),
                                transform=TransformConfig("kbbq", lam=0.75))
    quantize_model(model, _batches(written_on), config, progress=False)
    save_quantized(model, tmp_path / "out", recipe=config.to_dict())
    expected = _codes(model)
    for device in ("cpu", DEVICE):
        reloaded = from_pretrained(tmp_path / "out", device=device)
        assert all(p.device.type == torch.device(device).type for p in reloaded.parameters())
        got = _codes(reloaded)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), \
                f"{key} (written on {written_on}, read on {device})"
    ids = _batches("cpu")[0]["input_ids"]
    with torch.no_grad():  # the same codes compute the same product on the CPU
        cpu_logits = from_pretrained(tmp_path / "out")(input_ids=ids).logits
        model_logits = model.to("cpu")(input_ids=ids).logits
    assert torch.equal(cpu_logits, model_logits)
