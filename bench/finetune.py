"""Fine-tuning step time through FP4 (``KBBQ`` callback, ``Trainer.fit``) against full precision.

    python bench/finetune.py                          # GPU: hidden 1024, 8 layers, batch 8 x 512
    python bench/finetune.py --hidden 256 --layers 2 --batch 2 --seq 128 --steps 6   # a CPU
    python bench/finetune.py --tiny       # hidden 64, one layer, 1 x 16 tokens, 1 + 1 steps

Two ``Trainer.fit`` runs of the same random-init Llama on the same random-token batches: one
plain, one with RTN-KBBQ(0.75) in ``--format`` (straight-through rounding of
the master weights and the activations in every forward).  Each step is timed from
``on_train_batch_start`` to ``on_train_batch_end`` (the device synchronized at both ends) after
``--warmup`` steps, which take the compilations; the table prints the median step of each run
and their ratio (the issue's target: KBBQ within 3x of full precision on a GPU), the warm-up
steps' total (the one-time compilation of the rounding kernels lands there; the fit total also
holds the calibration, the quantization and the rounding into codes at the end), and the graphs
``torch.compile`` built (in all, and during the timed steps, where it should be 0).  ``--tiny``
only checks that the script runs (tests/bench/test_tiny_modes.py), with eager kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

TINY = {"hidden": 64, "layers": 1, "batch": 1, "seq": 16, "vocab": 256, "steps": 1, "warmup": 1,
        "precision": "32-true", "compile": "0"}


def llama(args: argparse.Namespace) -> torch.nn.Module:
    """The random-initialized Llama of ``args`` (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, args.hidden // 64)
    config = LlamaConfig(hidden_size=args.hidden,
                         intermediate_size=int(args.hidden * 2.75) // 16 * 16,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         num_hidden_layers=args.layers, vocab_size=args.vocab,
                         max_position_embeddings=max(2048, args.seq))
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def run(args: argparse.Namespace, quantized: bool) -> dict:
    """One ``Trainer.fit``, with the KBBQ callback where ``quantized``: its step times."""
    from kbbq_pl.callbacks import KBBQ
    from lightning.pytorch import Callback, LightningModule, Trainer

    from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig

    class LM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama(args)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    cuda = torch.cuda.is_available()

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.warmup_s = 0.0
            self.graphs_at_warm = 0
            self.graphs_timed = 0

        def _sync(self) -> None:
            if cuda:
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.graphs_at_warm = _graphs()
            self._sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._sync()
            seconds = time.perf_counter() - self.start
            if batch_idx >= args.warmup:
                self.times.append(seconds)
                self.graphs_timed = _graphs() - self.graphs_at_warm
            else:
                self.warmup_s += seconds

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
               for _ in range(args.warmup + args.steps)]
    calibration = [{"input_ids": b[:2], "attention_mask": torch.ones_like(b[:2])}
                   for b in batches[:2]]
    timer = StepTimer()
    callbacks = [timer]
    if quantized:
        callbacks.insert(0, KBBQ(QuantizationConfig(format=FormatConfig(args.format),
                                                    transform=TransformConfig("kbbq", lam=0.75)),
                                 calibration=calibration))
    trainer = Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision=args.precision,
                      max_steps=args.warmup + args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)
    graphs = _graphs()
    start = time.perf_counter()
    trainer.fit(LM(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return {"step_s": statistics.median(timer.times), "total_s": time.perf_counter() - start,
            "warmup_s": timer.warmup_s, "graphs": _graphs() - graphs,
            "graphs_timed": timer.graphs_timed}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--precision", default="bf16-mixed" if cuda else "32-true")
    parser.add_argument("--compile", choices=("auto", "1", "0"), default=None,
                        help="KBBQ_PL_COMPILE for the rounding kernels (default: as set)")
    parser.add_argument("--tiny", action="store_true", help=f"run on {TINY}, in seconds")
    args = parser.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    if args.compile is not None:
        from kbbq_pl.formats import set_compile

        set_compile(args.compile)
    from kbbq_pl.formats import compile_rule

    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name(device) if cuda else (
        f"CPU ({torch.get_num_threads()} threads): not a GPU figure")
    print(f"{where}, torch {torch.__version__}, precision {args.precision}, rounding kernels: "
          f"{compile_rule(device)}")
    print(f"random Llama: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
          f"{args.seq}; {args.warmup} warm-up + {args.steps} timed steps\n")
    full = run(args, quantized=False)
    kbbq = run(args, quantized=True)
    print("| run | median step (ms) | x full precision | warm-up steps (s) | fit total (s) | "
          "graphs compiled (all / in timed steps) |")
    print("|---|---|---|---|---|---|")
    for name, result in (("full precision", full), (f"KBBQ {args.format} (fit)", kbbq)):
        print(f"| {name} | {result['step_s'] * 1e3:.1f} | "
              f"{result['step_s'] / full['step_s']:.2f} | {result['warmup_s']:.1f} | "
              f"{result['total_s']:.1f} | {result['graphs']} / {result['graphs_timed']} |")


if __name__ == "__main__":
    main()
