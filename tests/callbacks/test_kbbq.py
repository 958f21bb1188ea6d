"""Lightning integration: KBBQ with Trainer.fit, checkpoints, other callbacks, DDP statistics."""

from __future__ import annotations

import os

import pytest
import torch
from kbbq_pl.callbacks import KBBQ, CalibrationStatistics
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning_helpers import SaveQuantized, SaveStatistics, TinyLM

from kbbq_pl.formats import QuantizedTensor
from kbbq_pl.io.data import CalibrationDataModule
from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig, WeightsConfig
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears

MXFP4 = QuantizationConfig(format=FormatConfig("mxfp4"))


def datamodule(n_tokens: int = 512, seed: int = 0) -> CalibrationDataModule:
    return CalibrationDataModule("random", None, n_tokens=n_tokens, seq_len=32, batch_size=4,
                                 seed=seed, vocab_size=256)


def trainer(tmp_path, callbacks, **kwargs) -> Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=tmp_path)
    return Trainer(callbacks=callbacks, **{**defaults, **kwargs})


def test_fit_quantizes_before_training_and_fine_tunes_through_fp4(tmp_path):
    module = TinyLM()
    dm = datamodule()
    kbbq = KBBQ(QuantizationConfig(format=FormatConfig("nvfp4"),
                                   transform=TransformConfig("kbbq", lam=0.75)))
    seen = {}

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            layers = quantized_linears(pl_module)
            seen["layers"] = len(layers)
            seen["master"] = {n: layer.weight.detach().clone() for n, layer in layers.items()}
            seen["optimized"] = {id(p) for g in trainer.optimizers[0].param_groups
                                 for p in g["params"]}
            seen["trainable"] = all(id(layer.weight) in seen["optimized"]
                                    for layer in layers.values())

    trainer(tmp_path, [kbbq, Probe()], max_steps=4, enable_checkpointing=False).fit(
        module, datamodule=dm)
    assert seen["layers"] == 14 and seen["trainable"]
    layers = quantized_linears(module)
    assert all(isinstance(layer.weight, QuantizedTensor) for layer in layers.values())
    moved = [not torch.equal(seen["master"][n], layers[n].weight.dequantize(torch.float32))
             for n in layers]
    assert any(moved), "fine-tuning did not change any quantized weight"
    assert kbbq.report is not None and len(kbbq.report.layers) == 14


def test_calibrate_only_fit_runs_no_step_and_validate_quantizes(tmp_path):
    module = TinyLM()
    fit = trainer(tmp_path, [KBBQ(MXFP4, calibrate_only=True)], max_steps=5,
                  enable_checkpointing=False)
    fit.fit(module, datamodule=datamodule())
    assert fit.global_step == 0
    assert all(isinstance(layer.weight, QuantizedTensor)
               for layer in quantized_linears(module).values())
    other = TinyLM()
    dm = datamodule()
    trainer(tmp_path, [KBBQ(MXFP4, calibration=dm)]).validate(
        other, dataloaders=dm.calibration_dataloader())
    assert len(quantized_linears(other)) == 14


def test_offload_quantizes_block_by_block_to_the_same_codes(tmp_path):
    """``KBBQ(offload=True)``: the model stays on the CPU while each block runs on the trainer's
    device (the CPU here: the path and the result are checked, not the memory), then the
    quantized model moves to the device."""
    codes = []
    for offload in (False, True):
        module = TinyLM()
        kbbq = KBBQ(QuantizationConfig(weights=WeightsConfig("gptq")), calibrate_only=True,
                    offload=offload)
        trainer(tmp_path, [kbbq], enable_checkpointing=False).fit(module,
                                                                   datamodule=datamodule())
        assert kbbq.report.model["blocks"] == 2
        codes.append({n: layer.weight.qdata for n, layer in quantized_linears(module).items()})
    assert codes[0].keys() == codes[1].keys() and len(codes[0]) == 14
    assert all(torch.equal(codes[0][n], codes[1][n]) for n in codes[0])


def test_checkpoint_reload_after_convert(tmp_path):
    module = TinyLM()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    accumulate = GradientAccumulationScheduler(scheduling={0: 2})
    fit = trainer(tmp_path, [KBBQ(), checkpoint, accumulate],
                  max_steps=3, enable_checkpointing=True)
    fit.fit(module, datamodule=datamodule())
    path = checkpoint.last_model_path
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    module.eval()
    with torch.no_grad():
        expected = module(input_ids=ids).logits

    # 1. load_from_checkpoint (the module's on_load_checkpoint calls restore_quantized)
    restored = TinyLM.load_from_checkpoint(path)
    restored.eval()
    with torch.no_grad():
        assert torch.equal(restored(input_ids=ids).logits, expected)

    # 2. a new trainer resuming from the checkpoint rebuilds the layers without calibrating
    fresh = TinyLM(seed=1)
    resumed = KBBQ(calibration=[])  # would fail if it tried to calibrate
    trainer(tmp_path, [resumed]).validate(fresh, dataloaders=datamodule().calibration_dataloader(),
                                          ckpt_path=path)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, expected)

    # 3. resuming training continues from the quantized state
    again = TinyLM(seed=2)
    trainer(tmp_path, [KBBQ(calibration=[])], max_steps=5,
            enable_checkpointing=False).fit(again, datamodule=datamodule(), ckpt_path=path)
    assert len(quantized_linears(again)) == 14


def test_a_checkpoint_of_stored_codes_loads_through_lightning(tmp_path):
    """A checkpoint saved after ``fit`` (the layers hold stored codes) loads where Lightning
    loads it, with a callable ``map_location`` (``load_from_checkpoint``, ``ckpt_path=``)."""
    module = TinyLM()
    fit = trainer(tmp_path, [KBBQ()], max_steps=2, enable_checkpointing=False)
    fit.fit(module, datamodule=datamodule())
    assert not any(layer.trainable for layer in quantized_linears(module).values())
    path = tmp_path / "after-fit.ckpt"
    fit.save_checkpoint(path)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    module.eval()
    with torch.no_grad():
        expected = module(input_ids=ids).logits
        restored = TinyLM.load_from_checkpoint(path).eval()
        assert torch.equal(restored(input_ids=ids).logits, expected)
    fresh = TinyLM(seed=1)
    trainer(tmp_path, [KBBQ(calibration=[])]).validate(
        fresh, dataloaders=datamodule().calibration_dataloader(), ckpt_path=path)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(input_ids=ids).logits, expected)


def test_a_weights_only_checkpoint_is_a_clear_error(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True,
                                 save_weights_only=True)
    trainer(tmp_path, [KBBQ(), checkpoint], max_steps=1).fit(TinyLM(),
                                                             datamodule=datamodule())
    with pytest.raises(ValueError, match="saved with weights_only"):
        TinyLM.load_from_checkpoint(checkpoint.last_model_path)


def test_calibrate_only_trains_nothing_under_min_epochs(tmp_path):
    module = TinyLM()
    embeddings = module.model.model.embed_tokens.weight.detach().clone()
    fit = trainer(tmp_path, [KBBQ(calibrate_only=True)], min_epochs=1, max_epochs=2,
                  enable_checkpointing=False)
    fit.fit(module, datamodule=datamodule())
    assert fit.global_step == 0
    assert torch.equal(module.model.model.embed_tokens.weight, embeddings)


def test_what_kbbq_cannot_calibrate_is_named(tmp_path):
    class Elsewhere(TinyLM):
        def __init__(self):
            super().__init__()
            self.net = self.model
            del self.model

    with pytest.raises(ValueError, match=r"no submodule 'model'.*submodules: \['net'\]"):
        trainer(tmp_path, [KBBQ(calibrate_only=True)], enable_checkpointing=False).fit(
            Elsewhere(), datamodule=datamodule())
    ids = datamodule().calibration_dataloader()
    tensors = [batch["input_ids"] for batch in ids]
    with pytest.raises(ValueError, match="dict batches with input_ids.*got Tensor"):
        trainer(tmp_path, [KBBQ(calibration=tensors)]).validate(TinyLM(), dataloaders=ids)


def test_kbbq_errors_without_calibration_data(tmp_path):
    with pytest.raises(ValueError, match="needs calibration data"):
        loader = datamodule().calibration_dataloader()
        trainer(tmp_path, [KBBQ()]).validate(TinyLM(), dataloaders=loader)


@pytest.mark.parametrize("arch", ["gpt2"])
def test_forward_kwargs_and_conv1d_under_fit(tmp_path, arch):
    module = TinyLM(arch=arch)
    wush = QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("wush"))
    trainer(tmp_path, [KBBQ(wush)], max_steps=2,
            enable_checkpointing=False).fit(module, datamodule=datamodule())
    layers = quantized_linears(module)
    assert len(layers) == 8
    assert all(isinstance(layer, QuantizedLinear) for layer in layers.values())


def test_ddp_statistics_equal_single_process(tmp_path):
    dm = datamodule(n_tokens=1024)
    loader = dm.calibration_dataloader()
    single_path, ddp_path = tmp_path / "single.pt", tmp_path / "ddp.pt"
    for devices, strategy, path in ((1, "auto", single_path), (2, "ddp_spawn", ddp_path)):
        stats = CalibrationStatistics(block=16, calibration=loader)
        trainer(tmp_path, [stats, SaveStatistics(stats, path)], devices=devices,
                strategy=strategy).validate(TinyLM(), dataloaders=loader)
    single, ddp = torch.load(single_path), torch.load(ddp_path)
    assert single.keys() == ddp.keys() and len(single) == 14
    for name in single:
        sigma_1, tokens_1, energy_1 = single[name]
        sigma_2, tokens_2, energy_2 = ddp[name]
        assert tokens_1 == tokens_2 == 1024
        # the same sums added in another order: equal up to float64 round-off of the largest term
        torch.testing.assert_close(sigma_2, sigma_1, rtol=0, atol=1e-13 * sigma_1.abs().max())
        torch.testing.assert_close(energy_2, energy_1, rtol=1e-13, atol=0)
        assert not torch.equal(sigma_1, torch.zeros_like(sigma_1))


def test_ddp_gptq_equals_single_process(tmp_path):
    loader = datamodule(n_tokens=512).calibration_dataloader()
    paths = {1: tmp_path / "single.pt", 2: tmp_path / "ddp.pt"}
    for devices, strategy in ((1, "auto"), (2, "ddp_spawn")):
        kbbq = KBBQ(QuantizationConfig(format=FormatConfig("nvfp4"),
                                       transform=TransformConfig("kbbq", lam=0.5),
                                       weights=WeightsConfig("gptq")),
                    calibration=loader)
        trainer(tmp_path, [kbbq, SaveQuantized(paths[devices])], devices=devices,
                strategy=strategy).validate(TinyLM(), dataloaders=loader)
    single, ddp = torch.load(paths[1]), torch.load(paths[2])
    assert single.keys() == ddp.keys() and len(single) == 14
    for name, fields in single.items():
        for a, b in zip(fields, ddp[name]):
            assert torch.equal(a, b), name


def test_nan_during_fit_is_an_error_naming_the_layer_before_the_weights_change(tmp_path):
    """The rounding's NaN/Inf checks are read once per optimizer step (no host synchronization
    in every forward): the error names the layer and no optimizer step has run."""
    module = TinyLM()
    name = "model.layers.1.mlp.down_proj"
    seen = {}

    class Poison(Callback):
        def on_train_start(self, trainer, pl_module):
            layer = pl_module.model.get_submodule(name)
            seen["weight"] = layer.weight.detach().clone()

            def nan(mod, args):
                x = args[0].clone()
                x[..., 3] = float("nan")
                return (x, *args[1:])

            layer.register_forward_pre_hook(nan)

    with pytest.raises(ValueError, match=rf"{name}\.input: non-finite values .* calls checked"):
        trainer(tmp_path, [KBBQ(), Poison()], max_steps=2,
                enable_checkpointing=False).fit(module, datamodule=datamodule())
    assert torch.equal(module.model.get_submodule(name).weight.detach(), seen["weight"])


def test_fit_with_stored_codes_decodes_each_weight_once(tmp_path, monkeypatch):
    """GPTQ's codes stay fixed while the rest of the model trains: the emulated product (the
    input needs a gradient) decodes each weight in the first step only."""
    from kbbq_pl.quant.w4a4 import W4A4Weight

    decodes = []
    dequantize = W4A4Weight.dequantize
    monkeypatch.setattr(W4A4Weight, "dequantize",
                        lambda self, *a, **k: decodes.append(1) or dequantize(self, *a, **k))
    per_step = []

    class Count(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            decodes.clear()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            per_step.append(len(decodes))

    module = TinyLM()
    gptq = QuantizationConfig(format=FormatConfig("mxfp4"), weights=WeightsConfig("gptq"))
    trainer(tmp_path, [KBBQ(gptq), Count()], max_steps=3,
            enable_checkpointing=False).fit(module, datamodule=datamodule())
    assert per_step == [14, 0, 0]


def test_calibration_batches_settle_packing_for_the_model():
    """The trainer's ``CalibrationDataModule`` with ``packing`` unset reads whole records for an
    encoder and packed blocks for a causal LM (``for_model``)."""
    from types import SimpleNamespace

    from kbbq_pl.callbacks import calibration_batches
    from transformers import LlamaConfig, LlamaForCausalLM

    from kbbq_pl.io.models import load_model

    encoder, tokenizer = load_model("minilm")
    causal = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2))
    for model, packed in ((encoder, False), (causal, True)):
        data = CalibrationDataModule("mixed", tokenizer, n_tokens=300, seq_len=64)
        trainer = SimpleNamespace(datamodule=data, global_rank=0, world_size=1)
        lengths = {b["input_ids"].shape[1] for b in calibration_batches(trainer, None, model)}
        assert data.packing is packed
        assert (lengths == {64}) if packed else (len(lengths) > 1 and max(lengths) <= 64)



def test_the_datamodule_is_read_after_the_callback_settles_it_for_the_model(tmp_path):
    """Lightning sets the datamodule up before the callback sees the model: its blocks are built
    after ``for_model``, so they are cut to the model's positions (they were built at the
    datamodule's ``seq_len`` first, and kept), and a datamodule without a tokenizer reads the
    text with the one saved with the model (it was an error)."""
    from lightning.pytorch import LightningModule
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from kbbq_pl.io.data import token_blocks
    from kbbq_pl.io.models import load_model

    _, tokenizer = load_model("minilm")
    folder = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=32)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    read = []

    class FromFolder(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(folder)
            self.model.register_forward_pre_hook(
                lambda module, args, kwargs: read.append(kwargs["input_ids"].shape[1]),
                with_kwargs=True)

        def training_step(self, batch, batch_idx):
            return self.model(**batch, labels=batch["input_ids"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    data = CalibrationDataModule("mixed", None, n_tokens=256, seq_len=64)
    trainer(tmp_path, [KBBQ(calibrate_only=True)], max_steps=1,
            enable_checkpointing=False).fit(FromFolder(), datamodule=data)
    assert data.seq_len == 32 and set(read) == {32}, read
    assert data.tokenizer is not None and data.tokenizer.name_or_path == str(folder)
    assert torch.equal(data.blocks, token_blocks("mixed", tokenizer, n_tokens=256, seq_len=32))

def test_moe_experts_fine_tune_through_fp4_and_reload_from_the_checkpoint(tmp_path):
    """A mixture-of-experts model: its fused experts become linear layers, quantized and
    trained like the others; the Lightning checkpoint rebuilds them."""
    module = TinyLM(arch="qwen3_moe")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, [KBBQ(), checkpoint], max_steps=2,
            enable_checkpointing=True).fit(module, datamodule=datamodule())
    layers = quantized_linears(module)
    assert len(layers) == 2 * (4 + 8 * 2)  # blocks x (attention + experts x (up, down))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    module.eval()
    restored = TinyLM.load_from_checkpoint(checkpoint.last_model_path, arch="qwen3_moe")
    restored.eval()
    with torch.no_grad():
        assert torch.equal(restored(input_ids=ids).logits, module(input_ids=ids).logits)


def test_fine_tuned_fused_layers_share_one_nvfp4_scale_and_export_for_vllm(tmp_path):
    """vLLM runs q/k/v and gate/up as one linear under one NVFP4 per-tensor scale: while
    fine-tuning, and into the stored codes at the end, each such group's master weights are
    rounded under the largest of their own scales (as ``quantize_model`` shares them), the other
    layers under their own, so the model exports to compressed-tensors with ``strict``."""
    from kbbq_pl.formats import quantize
    from kbbq_pl.io.compressed_tensors import save_compressed_tensors
    from kbbq_pl.quant.modules import fused_groups
    from kbbq_pl.quant.scales import weight_global_scale

    module = TinyLM()
    config = QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("identity"))
    masters, in_training = {}, []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # after KBBQ's
            for group in fused_groups(quantized_linears(pl_module)):
                layers = [pl_module.get_submodule(name) for name in group]
                largest = torch.stack([weight_global_scale(layer.weight, config.fmt)
                                       for layer in layers]).amax()
                in_training.extend([torch.equal(layer.weight_global_scale, largest)
                                    for layer in layers])

        def on_train_end(self, trainer, pl_module):  # before KBBQ's on_fit_end rounds them
            masters.update({n: layer.weight.detach().clone()
                            for n, layer in quantized_linears(pl_module).items()})

    trainer(tmp_path, [KBBQ(config), Probe()], max_steps=3, enable_checkpointing=False).fit(
        module, datamodule=datamodule())
    assert len(in_training) == 3 * 10 and all(in_training)  # 3 steps x 10 fused layers
    layers = quantized_linears(module)
    groups = fused_groups(layers)
    assert len(groups) == 4  # q/k/v and gate/up of two blocks
    differ = 0
    for name, layer in layers.items():
        group = next((g for g in groups if name in g), [name])
        own = weight_global_scale(masters[name], config.fmt)
        shared = torch.stack([weight_global_scale(masters[n], config.fmt) for n in group]).amax()
        differ += not torch.equal(own, shared)
        expected = quantize(masters[name], "nvfp4", global_scale=shared)
        for field in ("qdata", "scale", "global_scale"):
            assert torch.equal(getattr(layer.weight, field), getattr(expected, field)), name
    assert differ >= 4, "no fused layer's own scale differed from its group's: nothing tested"
    save_compressed_tensors(module.model, tmp_path / "ct", strict=True)


def test_a_checkpoint_of_the_fit_evaluates_and_resumes_on_the_module_fit_froze(tmp_path):
    """After ``fit`` (its layers frozen into codes), ``validate(ckpt_path="last")`` on the same
    Trainer and module rebuilds the layers as the checkpoint holds them (master weights),
    evaluates them frozen (the logits ``fit`` left), and ``fit`` resumes from it; the
    checkpoint's shared NVFP4 scales of q/k/v and gate/up are its own master weights'."""
    from kbbq_pl.quant.modules import fused_groups
    from kbbq_pl.quant.scales import weight_global_scale

    module = TinyLM()
    config = QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("identity"))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit = trainer(tmp_path, [KBBQ(config), checkpoint], max_steps=3)
    fit.fit(module, datamodule=datamodule())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = module.eval()(input_ids=ids).logits
    state = torch.load(checkpoint.last_model_path, weights_only=False)["state_dict"]
    groups = fused_groups(quantized_linears(module))
    assert len(groups) == 4
    for group in groups:
        largest = torch.stack([weight_global_scale(state[f"{name}.weight"], config.fmt)
                               for name in group]).amax()
        assert all(torch.equal(state[f"{name}.weight_global_scale"], largest) for name in group)
    fit.validate(module, dataloaders=datamodule().calibration_dataloader(), ckpt_path="last")
    layers = quantized_linears(module)
    assert len(layers) == 14 and not any(layer.trainable for layer in layers.values())
    with torch.no_grad():
        assert torch.equal(module.eval()(input_ids=ids).logits, expected)
    trainer(tmp_path, [KBBQ(config, calibration=[])], max_steps=4,
            enable_checkpointing=False).fit(module, datamodule=datamodule(),
                                            ckpt_path=checkpoint.last_model_path)
    assert len(quantized_linears(module)) == 14


def test_master_weights_left_out_of_the_optimizer_are_named(tmp_path, caplog):
    class OnlyTheRest(TinyLM):  # the embeddings, norms and head: every projection left out
        def configure_optimizers(self):
            return torch.optim.Adam([p for n, p in self.named_parameters() if "_proj." not in n],
                                    lr=1e-3)

    with caplog.at_level("WARNING", logger="kbbq_pl.callbacks.kbbq"):
        trainer(tmp_path, [KBBQ()], max_steps=1, enable_checkpointing=False).fit(
            OnlyTheRest(), datamodule=datamodule())
    assert "14 trainable quantized layers (model.model.layers.0.self_attn.q_proj, ...) have " \
           "their master weight in no optimizer" in caplog.text


def test_model_attr_names_a_nested_submodule():
    from kbbq_pl.callbacks import kbbq

    module = TinyLM()
    assert kbbq.hf_model(module, "model.model") is module.model.model
    with pytest.raises(ValueError, match=r"no submodule 'model.encoder' to quantize"):
        kbbq.hf_model(module, "model.encoder")


class TrainableOnly(TinyLM):
    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.parametrize("module_class", [TinyLM, TrainableOnly])
def test_fit_resumes_from_a_checkpoint_saved_after_fit(tmp_path, module_class):
    """After ``fit`` the optimizer keeps only what still trains (the master weights became
    codes), so a checkpoint saved then resumes whether ``configure_optimizers`` lists every
    parameter (the codes among them) or those that require grad: the rest of the model
    continues from its optimizer state."""
    fit = trainer(tmp_path, [KBBQ()], max_steps=2, enable_checkpointing=False)
    fit.fit(module_class(), datamodule=datamodule())
    (group,) = fit.optimizers[0].param_groups
    assert len(group["params"]) == 7 and not any(isinstance(p, QuantizedTensor)
                                                 for p in group["params"])
    fit.save_checkpoint(tmp_path / "after.ckpt")
    resumed = module_class(seed=1)
    again = trainer(tmp_path, [KBBQ(calibration=[])], max_steps=3, enable_checkpointing=False)
    again.fit(resumed, datamodule=datamodule(), ckpt_path=tmp_path / "after.ckpt")
    embedding = resumed.model.model.embed_tokens.weight
    assert int(again.optimizers[0].state[embedding]["step"]) == 3  # 2 restored + 1


def test_a_strategy_that_shards_the_parameters_is_refused(tmp_path):
    """Under FSDP2 (``ModelParallelStrategy``) the layers KBBQ swaps in after
    ``configure_model`` were trained by each rank alone (two CPU processes ended ``fit`` with
    different master weights): such strategies are refused before anything is quantized."""
    import torch.distributed as dist
    from kbbq_pl.callbacks.kbbq import refuse_sharding_strategy
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        with pytest.raises(ValueError, match=f"KBBQ: {type(strategy).__name__} shards the "
                                             "model's parameters.*under DDP"):
            refuse_sharding_strategy(strategy)
    refuse_sharding_strategy(DDPStrategy())  # every process holds the whole model

    module, environment = TinyLM(), os.environ.copy()
    try:
        with pytest.raises(ValueError, match="ModelParallelStrategy shards"):
            trainer(tmp_path, [KBBQ()], strategy=ModelParallelStrategy(),
                    max_steps=1).fit(module, datamodule=datamodule())
    finally:  # the strategy set up a process group (and LOCAL_RANK, ...) before the callback
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    assert not quantized_linears(module)


def test_fit_under_a_launcher_that_trains_in_worker_processes_is_refused(tmp_path):
    """Under ``ddp_spawn`` / ``ddp_fork`` Lightning loads the workers' weights into the main
    process's model at the end of ``fit``, which KBBQ never reaches (a two-process fit trained,
    then failed loading its codes into the unquantized model): refused before any work, unless
    the model is quantized already."""
    from kbbq_pl.callbacks.kbbq import refuse_spawned_fit

    for strategy in ("ddp_spawn", "ddp_fork"):
        spawned = trainer(tmp_path, [], devices=2, strategy=strategy)
        with pytest.raises(ValueError, match=r"KBBQ: fit under DDPStrategy with start method "
                                             r"'(spawn|fork)'.*use strategy='ddp'"):
            refuse_spawned_fit(spawned.strategy)
    refuse_spawned_fit(trainer(tmp_path, [], devices=2, strategy="ddp").strategy)


def test_a_fit_that_failed_before_the_strategy_set_up_leaves_the_trainer_usable(tmp_path):
    """A wrong ``ckpt_path`` fails between the callback's setup and the strategy's; the next
    ``fit`` on the same Trainer runs (it failed on the strategy methods the first left
    patched)."""
    module, dm = TinyLM(), datamodule()
    fit = trainer(tmp_path, [KBBQ()], max_steps=1, enable_checkpointing=False)
    with pytest.raises(FileNotFoundError):
        fit.fit(module, datamodule=dm, ckpt_path=tmp_path / "missing.ckpt")
    fit.fit(module, datamodule=dm)
    assert fit.global_step == 1 and len(quantized_linears(module)) == 14


def test_a_resume_takes_the_checkpoint_s_recipe_and_names_the_callback_s(tmp_path, caplog):
    """Resuming MXFP4 layers under a callback given NVFP4: the layers resume as the checkpoint
    holds them, a warning names the difference, and later checkpoints record the recipe the
    layers have (they recorded the callback's)."""
    first = trainer(tmp_path, [KBBQ(MXFP4)], max_steps=1, enable_checkpointing=False)
    first.fit(TinyLM(), datamodule=datamodule())
    first.save_checkpoint(tmp_path / "mx.ckpt")
    module, kbbq = TinyLM(seed=1), KBBQ(calibration=[])
    resumed = trainer(tmp_path, [kbbq], max_steps=2, enable_checkpointing=False)
    with caplog.at_level("WARNING", logger="kbbq_pl.callbacks.kbbq"):
        resumed.fit(module, datamodule=datamodule(), ckpt_path=tmp_path / "mx.ckpt")
    assert "another recipe than the callback's (format.name: mxfp4, not nvfp4)" in caplog.text
    assert {layer.fmt.name for layer in quantized_linears(module).values()} == {"mxfp4"}
    resumed.save_checkpoint(tmp_path / "again.ckpt")
    saved = torch.load(tmp_path / "again.ckpt", weights_only=False)["kbbq"]["config"]
    assert saved["format"]["name"] == "mxfp4" and kbbq.config == MXFP4
    # a recipe field of an earlier kbbq-pl: the layers resume, under the callback's recipe
    old = torch.load(tmp_path / "mx.ckpt", weights_only=False)
    old["kbbq"]["config"]["autobrake"]["scope"] = "model"
    torch.save(old, tmp_path / "old.ckpt")
    caplog.clear()
    with caplog.at_level("WARNING", logger="kbbq_pl.callbacks.kbbq"):
        trainer(tmp_path, [KBBQ(calibration=[])], max_steps=2, enable_checkpointing=False).fit(
            module := TinyLM(seed=1), datamodule=datamodule(), ckpt_path=tmp_path / "old.ckpt")
    assert "does not read as a recipe of this kbbq-pl (unknown recipe fields" in caplog.text
    assert {layer.fmt.name for layer in quantized_linears(module).values()} == {"mxfp4"}


def test_a_resume_from_a_full_precision_checkpoint_drops_the_state_of_the_quantized_weights(
        tmp_path, caplog):
    """A checkpoint of a fit without KBBQ resumed with it: the layers quantize the restored
    weights, and their optimizer state (Adam's moments of ``W``, while the layers train
    ``W T^-1``) starts afresh, with a warning; the rest of the model keeps its state."""
    dense = trainer(tmp_path, [], max_steps=2, enable_checkpointing=False)
    dense.fit(TinyLM(), datamodule=datamodule())
    dense.save_checkpoint(tmp_path / "dense.ckpt")
    states = {}

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            model = pl_module.model.model
            optimizer_state = trainer.optimizers[0].state
            states["q_proj"] = dict(optimizer_state[model.layers[0].self_attn.q_proj.weight])
            states["embedding"] = int(optimizer_state[model.embed_tokens.weight]["step"])

    resumed = trainer(tmp_path, [KBBQ(), Probe()], max_steps=3, enable_checkpointing=False)
    with caplog.at_level("WARNING", logger="kbbq_pl.callbacks.kbbq"):
        resumed.fit(TinyLM(seed=1), datamodule=datamodule(), ckpt_path=tmp_path / "dense.ckpt")
    assert "the optimizer state of 14 quantized layers' weights" in caplog.text
    assert states == {"q_proj": {}, "embedding": 2}


def test_qlora_through_the_callback_quantizes_the_base_layers_and_trains_the_adapters(
        tmp_path, caplog):
    """A module holding a peft model (LoRA on every linear): the callback quantizes the base
    layers, which peft froze, as stored codes that stay frozen, and leaves the adapters in full
    precision to train (they were quantized to FP4 too, and the base layers' master weights made
    trainable: full FP4 fine-tuning where LoRA was asked for).  The same rule holds without
    peft: a layer whose weight does not require grad is quantized frozen."""
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed")

    class LoRA(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.model = peft.get_peft_model(self.model, peft.LoraConfig(
                r=4, target_modules="all-linear", task_type="CAUSAL_LM"))

        def configure_optimizers(self):
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    from kbbq_pl.quant import w4a4

    module, cached = LoRA(), []
    adapters = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}
    kbbq = KBBQ()

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            cached.append(w4a4._decoded is not None)

    with caplog.at_level("WARNING", logger="kbbq_pl.callbacks.kbbq"):
        fit = trainer(tmp_path, [kbbq, Probe()], max_steps=3, enable_checkpointing=False)
        fit.fit(module, datamodule=datamodule())
    assert cached == [False] * 3  # decoded per call: no dense FP32 copy of the base (QLoRA)
    layers = quantized_linears(module)
    assert len(layers) == 14 and all(name.endswith(".base_layer") for name in layers)
    assert all(not layer.trainable for layer in layers.values())  # codes since calibration
    assert sum("peft adapter" in reason for reason in kbbq.report.skipped.values()) == 28
    assert adapters.keys() == {n for n, p in module.named_parameters() if p.requires_grad}
    assert any(not torch.equal(p.detach(), adapters[n]) for n, p in module.named_parameters()
               if "lora_B" in n)
    assert not caplog.records  # no "stored codes ... only the rest trains" warning
    # resumed from a checkpoint of that fit: again no dense copy and no warning (it kept one)
    fit.save_checkpoint(tmp_path / "qlora.ckpt")
    cached.clear()
    caplog.clear()
    with caplog.at_level("WARNING", logger="kbbq_pl.callbacks.kbbq"):
        trainer(tmp_path, [KBBQ(calibration=[]), Probe()], max_steps=5,
                enable_checkpointing=False).fit(LoRA(), datamodule=datamodule(),
                                                ckpt_path=tmp_path / "qlora.ckpt")
    assert cached == [False] * 2
    assert not [record for record in caplog.records if record.name.startswith("kbbq_pl")]

    frozen, seen = TinyLM(), {}
    frozen.model.model.layers[0].requires_grad_(False)

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update({n: layer.trainable for n, layer in quantized_linears(pl_module).items()})

    trainer(tmp_path, [KBBQ(), Probe()], max_steps=1, enable_checkpointing=False).fit(
        frozen, datamodule=datamodule())
    assert len(seen) == 14 and {n for n, trains in seen.items() if not trains} == {
        n for n in seen if ".layers.0." in n}
