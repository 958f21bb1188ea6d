"""A small LightningModule around a tiny causal LM, importable by spawned DDP workers."""

from __future__ import annotations

from pathlib import Path

import torch
from kbbq_pl.callbacks import CalibrationStatistics, restore_quantized
from lightning.pytorch import Callback, LightningModule
from tiny_models import tiny_model


class TinyLM(LightningModule):
    """Causal-LM training on token blocks; ``forward`` takes keyword arguments."""

    def __init__(self, arch: str = "llama", lr: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_model(arch, seed=seed)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        out = self(**batch, labels=batch["input_ids"])
        self.log("train_loss", out.loss)
        return out.loss

    def validation_step(self, batch, batch_idx):
        out = self(**batch, labels=batch["input_ids"])
        self.log("val_loss", out.loss)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def on_load_checkpoint(self, checkpoint):
        restore_quantized(self, checkpoint)


class SaveStatistics(Callback):
    """Writes the reduced statistics of a CalibrationStatistics callback from rank 0."""

    def __init__(self, stats: CalibrationStatistics, path: Path) -> None:
        self.stats = stats
        self.path = path

    def setup(self, trainer, pl_module, stage):
        if trainer.is_global_zero:
            collector = self.stats.collector
            torch.save({name: (s.sigma_sum.cpu(), s.tokens.cpu(), s.output_energy.cpu())
                        for name, s in collector.stats.items()}, self.path)


class SaveQuantized(Callback):
    """One thread per process (the same GEMM kernels with one or two ranks); writes the
    quantized layers' codes, scales and transforms from rank 0 once the model is quantized."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)

    def on_validation_start(self, trainer, pl_module):
        from kbbq_pl.quant.layers import quantized_linears

        if trainer.is_global_zero:
            torch.save({name: (layer.weight.qdata, layer.weight.scale.view(torch.uint8),
                               layer.transform, layer.act_global_scale)
                        for name, layer in quantized_linears(pl_module).items()}, self.path)
