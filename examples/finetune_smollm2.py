"""FP4 fine-tuning on a real causal LM: SmolLM2-135M-Instruct, NVFP4 RTN-KBBQ, then ``Trainer.fit``.

    python examples/finetune_smollm2.py [--config examples/finetune_smollm2.yaml]
        [--recipe i_nvfp4] [--train-seed 2] [--steps 30] [--lr 1e-5] [--batch-size 2]
        [--val-every 5] [--out result.json]

1. The KBBQ callback of the shipped recipe (``rtn_kbbq_nvfp4_lam0.75``: calibration on the
   mixed corpus, lambda 0.75) quantizes the model when ``fit`` starts, keeping trainable master
   weights (``trainable`` is the default during ``fit``).
2. On train start, the post-training (PTQ) model is scored on held-out text (the beginning of
   WikiText-2 test that kbbq-pl ships, :func:`kbbq_pl.resources.eval_text`, unless
   ``heldout_text`` names another file; not in the corpus): perplexity and mean KL to the FP
   model (:mod:`kbbq_pl.eval.lm_metrics`).
3. ``fit`` trains through FP4 (straight-through rounding of the master weights, the fitted
   transforms and activation scales kept) for ``steps`` steps on fresh blocks of the mixed
   corpus (another seed), with a distillation loss: KL(p_FP || p_FP4) per token.  Every
   ``val_every`` steps it validates on the same held-out windows: perplexity and KL to the FP
   teacher, torchmetrics metrics (:mod:`kbbq_pl.eval.metrics`) logged with ``self.log`` (on the
   progress bar, and printed), so held-out quality shows while FP4 fine-tuning runs.
4. The fine-tuned model (its master weights rounded into stored codes at the end of ``fit``) is
   scored on the same held-out text.  Prints before/after, steps, time and peak memory (RSS).
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import time
from pathlib import Path

import torch
import yaml
from kbbq_pl.callbacks import KBBQ
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from kbbq_pl.cli.compare import load_recipe
from kbbq_pl.eval.evaluation import (
    prepare_stream,
    rolling_windows,
    scored_positions,
    window_batches,
)
from kbbq_pl.eval.lm_metrics import lm_metrics, reference_log_probs
from kbbq_pl.eval.metrics import TokenKL, TokenPerplexity
from kbbq_pl.io.data import CalibrationDataModule
from kbbq_pl.io.models import load_model
from kbbq_pl.resources import eval_text

HERE = Path(__file__).resolve().parent


class Distill(LightningModule):
    """Student ``model`` (quantized by the KBBQ callback) trained to match a frozen teacher,
    validated on held-out windows (:func:`~kbbq_pl.eval.evaluation.window_batches`)."""

    def __init__(self, model: torch.nn.Module, teacher: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "teacher", teacher)  # not a submodule: never quantized
        self.lr = lr
        # attributes, so that Lightning moves them with the module and resets them per epoch
        self.val_perplexity = TokenPerplexity()
        self.val_kl = TokenKL()

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"]).logits.float()
        with torch.no_grad():
            target = torch.log_softmax(self.teacher(input_ids=batch["input_ids"]).logits.float(),
                                       -1)
        log_p = torch.log_softmax(logits, -1)
        loss = (target.exp() * (target - log_p)).sum(-1).mean()
        self.log("kl", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"]).logits
        teacher = self.teacher(input_ids=batch["input_ids"]).logits
        for (targets, predicted), (_, fp) in zip(scored_positions(batch, logits),
                                                 scored_positions(batch, teacher)):
            self.val_perplexity.update(predicted, targets)
            self.val_kl.update(torch.log_softmax(fp, -1), predicted)
        self.log("val_perplexity", self.val_perplexity, prog_bar=True)
        self.log("val_kl", self.val_kl, prog_bar=True)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)


class HeldOut(Callback):
    """Scores the model on held-out text when training starts (the PTQ model)."""

    def __init__(self, score) -> None:
        self.score = score
        self.before: dict | None = None

    def on_train_start(self, trainer, pl_module):
        self.before = self.score(pl_module.model)


class ValidationHistory(Callback):
    """Records (and prints) the held-out figures each validation logged."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        logged = trainer.callback_metrics
        row = {"step": trainer.global_step, "perplexity": float(logged["val_perplexity"]),
               "kl": float(logged["val_kl"])}
        self.rows.append(row)
        print(f"step {row['step']}: held-out perplexity {row['perplexity']:.3f}, "
              f"KL to FP {row['kl']:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(HERE / "finetune_smollm2.yaml"))
    parser.add_argument("--recipe", help="a packaged recipe or recipe file (default: the config's)")
    parser.add_argument("--train-seed", type=int, help="the seed of the training blocks")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--val-every", type=int, help="validate every N steps")
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    settings = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))
    settings.setdefault("val_every", 5)
    for key in ("recipe", "train_seed", "steps", "lr", "batch_size", "val_every"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    torch.manual_seed(0)
    start = time.perf_counter()
    teacher, tokenizer = load_model(settings["model"], causal=True)
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    student = copy.deepcopy(teacher).train()
    for parameter in student.parameters():
        parameter.requires_grad_(True)
    window = {"context": settings["context"], "stride": settings["stride"],
              "max_tokens": settings["heldout_tokens"]}
    text = settings.get("heldout_text") or eval_text()
    reference = reference_log_probs(teacher, tokenizer, text, **window)

    def score(model):
        return lm_metrics(model, tokenizer, text, reference=reference, **window)

    fp = score(teacher)
    calibration, config, recipe = load_recipe(
        settings["recipe"], settings["model"], {"n_tokens": settings["calibration_tokens"]})
    calibration.tokenizer = tokenizer
    quantizer = KBBQ(config, calibration=calibration)
    train = CalibrationDataModule(
        settings["train_source"], tokenizer, seed=settings["train_seed"],
        n_tokens=settings["steps"] * settings["batch_size"] * settings["seq_len"],
        seq_len=settings["seq_len"], batch_size=settings["batch_size"])
    # the held-out windows of `score`, batched as lm_metrics runs them
    stream = prepare_stream(teacher, tokenizer, text, window["max_tokens"])
    validation = DataLoader(window_batches(stream, rolling_windows(
        len(stream), window["context"], window["stride"])), batch_size=None)
    heldout, history = HeldOut(score), ValidationHistory()
    trainer = Trainer(max_steps=settings["steps"], callbacks=[quantizer, heldout, history],
                      accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_model_summary=False, log_every_n_steps=1,
                      val_check_interval=settings["val_every"], check_val_every_n_epoch=None,
                      num_sanity_val_steps=0)
    module = Distill(student, teacher, settings["lr"])
    fit_start = time.perf_counter()
    trainer.fit(module, train_dataloaders=train.train_dataloader(),
                val_dataloaders=validation)
    fit_seconds = time.perf_counter() - fit_start
    after = score(module.model)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    before = heldout.before
    assert before is not None
    result = {"settings": settings, "recipe": recipe, "fp": fp, "ptq": before,
              "finetuned": after, "validation": history.rows, "steps": trainer.global_step,
              "fit_seconds": fit_seconds, "total_seconds": time.perf_counter() - start,
              "peak_rss_mib": peak_mib}
    print(f"held-out: first {settings['heldout_tokens']} tokens of {text}, context "
          f"{settings['context']}, stride {settings['stride']}")
    print(f"{'model':<34}{'perplexity':>12}{'KL to FP':>10}")
    for name, row in ((f"FP ({settings['model']})", fp), (f"PTQ {recipe}", before),
                      (f"fine-tuned, {trainer.global_step} steps", after)):
        print(f"{name:<34}{row['perplexity']:12.3f}{row['kl']:10.4f}")
    print(f"fit (calibration + quantization + {trainer.global_step} steps of "
          f"{settings['batch_size']} x {settings['seq_len']} tokens): {fit_seconds:.0f} s; "
          f"peak RSS {peak_mib:.0f} MiB")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n",
                                  encoding="utf-8")


if __name__ == "__main__":
    main()
