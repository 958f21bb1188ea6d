"""``kbbq-pl quantize``: recipes in LightningCLI style, run post-training.

A recipe is YAML: the calibration data (a ``class_path`` / ``init_args`` entry, the data module
a Lightning user composes in Python) and the ``recipe``, a
:class:`~kbbq_pl.quant.config.QuantizationConfig` in its groups (the ``KBBQ`` callback and
torchao's ``KBBQConfig`` take the same object)::

    model: minilm                              # a local HF folder, "minilm" or "smollm2"
    data:                                      # calibration data
      class_path: kbbq_pl.io.data.CalibrationDataModule
      init_args: {source: mixed, n_tokens: 4096, seq_len: 256, batch_size: 8}
    recipe:                                    # what to quantize and how
      format: {name: nvfp4, act_scale: static}
      transform: {name: kbbq, lam: 0.75}
    output_dir: null                           # kbbq-out/<model>-<recipe>

``kbbq-pl quantize --config recipes/rtn_kbbq_nvfp4_lam0.75.yaml --recipe.transform.lam 0.5``
overrides any field (``kbbq-pl quantize -h`` describes each).  With no arguments it runs the
embedded default above: all-MiniLM-L6-v2 to NVFP4 with RTN-KBBQ, calibrated on the shipped
mixed-domain corpus (``source: random`` is the paper's random-token ablation), fidelity
measured on the embedded sentences; it writes the quantized checkpoint and ``report.json`` /
``report.md`` to ``output_dir`` and prints the report.  The output folder is checked before any
work (:func:`kbbq_pl.io.fileio.check_output`: an existing one needs ``--overwrite`` and is
replaced only when kbbq-pl wrote it); an already quantized ``--model`` is refused.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser, lazy_instance
from torch import nn

from ..eval.report_files import report_files, report_markdown
from ..io.checkpoint import save_quantized
from ..io.data import MIXED, RANDOM, CalibrationDataModule, token_blocks
from ..io.fileio import check_output, written_summary
from ..io.models import detach_from_files, load_model, parse_device, resolve_model_path
from ..quant import QuantizationConfig, quantize_model
from ..quant.sequential import computed_in
from ..quant.stats import model_device
from ..quant.tokens import count_tokens
from .launch import Launch, launched

log = logging.getLogger(__name__)

OUTPUT_ROOT = "kbbq-out"
EMBEDDED = 64  # sentences in kbbq_pl/resources/eval_sentences.txt (checked by a test)
EVAL_DATA_SENTENCES = 256
RANDOM_BLOCKS = 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPUTE_DTYPE = torch.float32
"""What every block computes in, whatever the dtype the model is held in."""


def _parser(prog: str) -> ArgumentParser:
    from kbbq_pl.recipes import packaged_recipes

    parser = ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], exit_on_error=False,
        epilog=f"packaged recipes (--config NAME; `kbbq-pl recipes` says what each does): "
               f"{', '.join(packaged_recipes())}")
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a recipe: a YAML file, or the name of a packaged recipe")
    parser.add_argument("--model", type=str, default="minilm",
                        help="a local HuggingFace model folder, or a named model: 'minilm' "
                             "(all-MiniLM-L6-v2, the [minilm] extra) or 'smollm2' "
                             "(SmolLM2-135M-Instruct, the [smollm2] extra)")
    parser.add_argument("--trust_remote_code", "--trust-remote-code",
                        action=ActionYesNo(no_prefix="no-"), default=False,
                        help="run the model folder's own code (its config.json's auto_map) "
                             "for a model transformers does not hold, as transformers' "
                             "from_pretrained(trust_remote_code=True); the checkpoint holds "
                             "that code")
    parser.add_subclass_arguments(
        CalibrationDataModule, "data", skip={"tokenizer"}, required=False,
        default=lazy_instance(CalibrationDataModule, source=MIXED, n_tokens=4096,
                              seq_len=256, batch_size=8))
    parser.add_class_arguments(QuantizationConfig, "recipe")
    parser.add_argument("--output_dir", "--output-dir", type=str | None, default=None,
                        help=f"the folder to write (default: {OUTPUT_ROOT}/MODEL-RECIPE, e.g. "
                             f"{OUTPUT_ROOT}/smollm2-gptq-kbbq-nvfp4-lam0.75)")
    parser.add_argument("--overwrite", action=ActionYesNo(no_prefix="no-"), default=False,
                        help="replace an existing --output_dir, if kbbq-pl wrote it")
    parser.add_argument("--eval_data", "--eval-data", type=str | None, default=None,
                        help="WikiText-style text file for the fidelity metric "
                             "(default: the embedded sentences)")
    parser.add_argument("--eval_sentences", "--eval-sentences", type=int | None, default=None,
                        help=f"sentences of the fidelity metric (default: all {EMBEDDED} "
                             f"embedded ones, {EVAL_DATA_SENTENCES} from --eval_data; without "
                             f"a tokenizer, {RANDOM_BLOCKS} random-token blocks)")
    parser.add_argument("--device", type=str, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--offload", action=ActionYesNo(no_prefix="no-"), default=False,
                        help="keep the model on the CPU and move one block at a time to "
                             "--device (a model larger than the device's memory)")
    parser.add_argument("--stream", action=ActionYesNo(no_prefix="no-"), default=None,
                        help="read each block's weights from the model's safetensors files "
                             "when it is quantized and write it out after (a model larger "
                             "than the machine's memory; bit for bit the in-memory "
                             "checkpoint, written in shards; the fidelity line is left to "
                             "kbbq-pl eval, for an encoder to --no-stream); default: streamed "
                             "when the weights exceed half of the memory available")
    parser.add_argument("--dtype", type=Literal[("auto", *DTYPES)], default="auto",
                        help="the dtype the model is held in while it is quantized (auto: as "
                             "its weights are stored); every block computes in float32 either "
                             "way")
    return parser


class FidelityProbe:
    """The model-level fidelity metric: mean cosine similarity of mean-pooled final hidden
    states (for all-MiniLM-L6-v2: its sentence embeddings) to the full-precision model, on
    ``n`` sentences (or random-token blocks of 64 when the model has no tokenizer); ``n`` None
    takes the defaults of :func:`_parser`'s ``--eval_sentences``, and more sentences than the
    source holds is an error.  The model computes in float32, whatever the dtype it is held in
    (:func:`~kbbq_pl.quant.sequential.computed_in`)."""

    def __init__(self, model: nn.Module, tokenizer: Any, eval_data: str | None, n: int | None,
                 seed: int = 0) -> None:
        from ..eval.evaluation import mean_pooled_embeddings, wikitext_sentences
        from ..resources import eval_sentences

        if n is not None and n < 1:
            raise ValueError(f"--eval_sentences must be at least 1, got {n}")
        self.tokenizer = tokenizer
        if tokenizer is None:
            vocab = model.config.get_text_config().vocab_size
            blocks = n or RANDOM_BLOCKS
            self.blocks = token_blocks("random", None, n_tokens=64 * blocks, seq_len=64,
                                       seed=seed + 1, vocab_size=vocab)
            self.sentences = None
            self.source = "random tokens"
        elif eval_data:
            self.sentences = wikitext_sentences(eval_data, n or EVAL_DATA_SENTENCES)
            self.source = eval_data
        else:
            embedded = eval_sentences()
            if n is not None and n > len(embedded):
                raise ValueError(f"--eval_sentences {n}: the embedded set holds {len(embedded)} "
                                 "sentences; ask for fewer, or pass --eval_data FILE")
            self.sentences = embedded[:n]
            self.source = "embedded sentences"
        self._embed_text = mean_pooled_embeddings
        self.reference = self.embed(model)

    def embed(self, model: nn.Module) -> torch.Tensor:
        body = _backbone(model)
        with computed_in(model, COMPUTE_DTYPE):
            if self.sentences is not None:
                return self._embed_text(body, self.tokenizer, self.sentences)
            with torch.no_grad():
                ids = self.blocks.to(model_device(body))
                return body(input_ids=ids).last_hidden_state.float().mean(1).cpu()

    def measure(self, model: nn.Module) -> dict[str, Any]:
        from ..eval.evaluation import cosine_summary

        summary = cosine_summary(self.embed(model), self.reference)
        return {"fidelity_mean_cosine": summary["mean_cosine"],
                "fidelity_min_cosine": summary["min_cosine"],
                "fidelity_samples": summary["n_sentences"], "fidelity_data": self.source}


def _backbone(model: nn.Module) -> nn.Module:
    """The model under its head, whose output has ``last_hidden_state``: ``base_model``, or
    where that is the model itself (Llama 4's causal LM names a ``language_model`` it does not
    have), its first child that is a transformers model."""
    from transformers import PreTrainedModel

    body = getattr(model, "base_model", model)
    if body is model:
        body = next((child for child in model.children()
                     if isinstance(child, PreTrainedModel)), model)
    return body


def default_output_dir(model: str, recipe: str) -> Path:
    """``kbbq-out/<model>-<recipe>``: the model's name (a named model, or the last part of its
    folder or id) and the recipe's (``QuantizationConfig.label`` as a file name, e.g.
    ``smollm2-gptq-kbbq-nvfp4-lam0.75``), so that two models or two recipes never share a
    default folder."""
    path = Path(model)
    name = (path.resolve().name if path.exists() else path.name) or "model"
    recipe = recipe.lower().replace(", lambda auto", " auto").replace("lambda ", "lam")
    return Path(OUTPUT_ROOT) / re.sub(r"[^a-z0-9._]+", "-", f"{name}-{recipe}".lower()).strip("-")


def _prepare(args, recipe: str, device: torch.device | None = None
             ) -> tuple[nn.Module, Any, list, Path, Path]:
    """Check the device and the output folder (``recipe``: the name of the default one), then
    load the model (an already quantized one is refused) and cut the calibration batches, on
    the model's device (``device``, default ``--device``)."""
    device = device or parse_device(args.device)
    if args.offload:  # the model on the CPU; quantize_model moves one block at a time
        device = torch.device("cpu")
    source, out = _source_and_output(args, recipe)
    model, tokenizer = load_model(args.model, DTYPES.get(args.dtype), device=device,
                                  quantized="refuse", trust_remote_code=args.trust_remote_code)
    detach_from_files(model)
    batches = calibration_batches(args.data, model, tokenizer, device, args.model)
    return model, tokenizer, batches, source, out


def _source_and_output(args, recipe: str) -> tuple[Path, Path]:
    source = resolve_model_path(args.model)
    return source, check_output(args.output_dir or default_output_dir(args.model, recipe),
                                overwrite=args.overwrite, sources=[source])


def settle_data(data: CalibrationDataModule, model: nn.Module, tokenizer: Any,
                name: str) -> None:
    """Make ``data`` ready for ``model`` (called ``name`` in a warning): the model's tokenizer,
    or without one the random-token corpus and the model's vocabulary, and the packing of the
    model's kind."""
    if data.tokenizer is None and tokenizer is not None:
        data.tokenizer = tokenizer
    if data.tokenizer is None and data.source == MIXED:
        log.warning("%s has no tokenizer: calibrating on the random-token corpus instead of "
                    "the mixed text corpus", name)
        data.source = RANDOM
    if tokenizer is None and data.vocab_size is None:
        data.vocab_size = model.config.get_text_config().vocab_size
    data.for_model(model)


def calibration_batches(data: CalibrationDataModule, model: nn.Module, tokenizer: Any,
                        device: torch.device, name: str) -> list:
    """The calibration batches of ``data`` (:func:`settle_data`) for ``model``, on
    ``device``."""
    settle_data(data, model, tokenizer, name)
    return [{key: value.to(device) if isinstance(value, torch.Tensor) else value
             for key, value in batch.items()} for batch in data.calibration_dataloader()]


def _calibration_shape(args, config) -> dict[str, str]:
    """The calibration source and how it was cut, for the report; the settled ``packing`` and
    ``seq_len`` also go into the written ``recipe.yaml`` (rerunning it gives the same
    batches)."""
    data = args.data
    config.data.init_args.packing = data.packing
    config.data.init_args.seq_len = data.seq_len
    return {"calibration_source": str(data.source),
            "calibration_records": data.read or f"random tokens (seed {data.seed})",
            "calibration_sequences": (f"packed blocks of {data.seq_len} tokens" if data.packs
                                      else f"whole records (at most {data.seq_len} tokens)")}


def run_quantize(argv: list[str]) -> int:
    parser = _parser("kbbq-pl quantize")
    config = parser.parse_args(argv)
    args = parser.instantiate(config)
    start = time.perf_counter()
    with launched(args.device) as launch:
        if _streams(args, launch):
            return _quantize_streamed(args, parser, config, start, launch)
        return _quantize_in_memory(args, parser, config, start, launch)


def _streams(args, launch: Launch) -> bool:
    """``--stream`` / ``--no-stream``, else whether the model is too large to hold
    (:func:`kbbq_pl.io.streaming.streams_by_default`, decided by rank 0 for every rank), said
    in one line."""
    from ..io.streaming import streams_by_default

    if args.stream is not None or args.offload:
        return bool(args.stream)
    decision = None
    if launch.writes:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        source, _ = _source_and_output(args, args.recipe.label)  # the errors of a bad path
        decision = streams_by_default(source, processes)
    stream, why = launch.collectives.broadcast(decision, 0)
    if stream and launch.writes:
        print(f"kbbq-pl quantize: {why}", flush=True)
    return stream


def recorded_model(model: str | Path) -> str:
    """The source model a checkpoint records (``kbbq-pl eval --tasks kl``'s default
    reference): a local folder as an absolute path, so it is found from any directory; a
    model name as given."""
    return str(Path(model).resolve()) if Path(model).is_dir() else str(model)


def _quantize_in_memory(args, parser: ArgumentParser, config, start: float,
                        launch: Launch) -> int:
    recipe: QuantizationConfig = args.recipe
    model, tokenizer, batches, source, out = _prepare(args, recipe.label, launch.device)
    probe = (FidelityProbe(model, tokenizer, args.eval_data, args.eval_sentences)
             if launch.writes else None)
    tokens = count_tokens(batches)
    report = quantize_model(model, batches, recipe, device=launch.device,
                            collectives=launch.collectives, shard=launch.shard,
                            compute_dtype=COMPUTE_DTYPE)
    if not launch.writes:
        return 0
    report.model.update(probe.measure(model), model=str(args.model), calibration_tokens=tokens,
                        **_calibration_shape(args, config), processes=launch.world_size)
    metadata = {"config": recipe.to_dict(), "model": recorded_model(args.model)}
    report.seconds["command"] = time.perf_counter() - start
    config.eval_sentences = report.model["fidelity_samples"]  # what was used, not asked
    save_quantized(model, out, tokenizer=tokenizer, recipe=metadata, source_dir=source,
                   overwrite=args.overwrite,
                   extra_files={"recipe.yaml": parser.dump(config), **report_files(report)})
    print(report_markdown(report))
    print(f"\n{written_summary(out)}\ndone in {time.perf_counter() - start:.1f} s")
    return 0


def _quantize_streamed(args, parser: ArgumentParser, config, start: float,
                       launch: Launch) -> int:
    """``quantize --stream``: the model's blocks read from disk one at a time and written out
    as they are quantized (:func:`kbbq_pl.io.streaming.quantize_checkpoint`)."""
    from ..io.models import load_tokenizer, quantized_folder_kind, refuse_quantized
    from ..io.streaming import quantize_checkpoint

    if args.offload:
        raise ValueError("--stream and --offload: choose one (--stream keeps one block in "
                         "memory, --offload the whole model in CPU memory)")
    recipe: QuantizationConfig = args.recipe
    source, out = _source_and_output(args, recipe.label)
    refuse_quantized(args.model, quantized_folder_kind(source))
    tokenizer = load_tokenizer(source, trust_remote_code=args.trust_remote_code)
    metadata = {"config": recipe.to_dict(), "model": recorded_model(args.model)}
    left = _left_to_eval(source, out, args.trust_remote_code)
    tokens: dict[str, int] = {}

    def batches(model: nn.Module) -> list:
        every = calibration_batches(args.data, model, tokenizer, torch.device("cpu"), args.model)
        tokens["all"] = count_tokens(every)
        return every

    def reports(report) -> dict[str, str]:
        report.model.update(fidelity=left, model=str(args.model),
                            calibration_tokens=tokens["all"],
                            **_calibration_shape(args, config), processes=launch.world_size)
        report.seconds["command"] = time.perf_counter() - start
        return {"recipe.yaml": parser.dump(config), **report_files(report)}

    report = quantize_checkpoint(source, out, recipe, batches, device=launch.device,
                                 tokenizer=tokenizer, recipe=metadata, extra_files=reports,
                                 overwrite=args.overwrite, collectives=launch.collectives,
                                 shard=launch.shard, dtype=DTYPES.get(args.dtype),
                                 compute_dtype=COMPUTE_DTYPE,
                                 trust_remote_code=args.trust_remote_code)
    if not launch.writes:
        return 0
    print(report_markdown(report))
    print(f"\n{written_summary(out)}\nfidelity: {left}"
          f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0


def _left_to_eval(source: Path, out: Path, trust_remote_code: bool) -> str:
    """What a streamed run does not measure (the model is never whole in memory), and the
    command that measures it."""
    from ..io.checkpoint import is_causal_lm_config, model_config

    if is_causal_lm_config(model_config(source, trust_remote_code)):
        return (f"not measured when streaming; perplexity and KL to {source}: "
                f"kbbq-pl eval --model {out} --tasks ppl,kl")
    return ("not measured when streaming (the embedding fidelity needs the whole model in "
            f"memory: kbbq-pl quantize --no-stream, or kbbq_pl.from_pretrained({str(out)!r}))")


def resolve_recipes(argv: list[str]) -> list[str]:
    """``argv`` with its recipes first: ``--config NAME`` may name a packaged recipe
    (``rtn_kbbq_nvfp4_lam0.75``) instead of a file, which resolves to the copy shipped in
    ``kbbq_pl.recipes`` (a name that is neither is an error suggesting the closest packaged
    names); and every ``--config`` moves before the other options, so that an option given on
    the command line overrides the recipe wherever it stands (jsonargparse applies arguments in
    order: ``--model DIR --config RECIPE`` would quantize the recipe's model)."""
    from kbbq_pl.recipes import recipe_path

    def recipe(name: str) -> list[str]:
        return ["--config", name if Path(name).exists() else str(recipe_path(name))]

    recipes: list[str] = []
    rest: list[str] = []
    values = iter(argv)
    for value in values:
        if value.startswith("--config="):
            recipes += recipe(value[len("--config="):])
        elif value == "--config":
            name = next(values, None)
            recipes += [value] if name is None else recipe(name)
        else:
            rest.append(value)
    return recipes + rest


def main(argv: list[str] | None = None) -> int:
    """``kbbq-pl quantize ARGS``; errors propagate to :func:`kbbq_pl.cli.main`, which prints
    them as one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_quantize(resolve_recipes(argv[1:] if argv[:1] == ["quantize"] else argv))
