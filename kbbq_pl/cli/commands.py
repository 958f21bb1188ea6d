"""The ``kbbq-pl`` command.

Every error of every subcommand ends here (:func:`main`): one line on stderr naming the command,
exit code 2 (1 for an unexpected exception); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kbbq_pl.cli.serve import add_parsers as add_serve_parsers
from kbbq_pl.cli.serve import add_trust_remote_code
from kbbq_pl.io.fileio import written_summary


def _formats_demo(args: argparse.Namespace) -> int:
    """Round Gaussian and heavy-tailed tensors onto every format and print what it costs."""
    from kbbq_pl import formats as F

    if args.size < 1:
        raise ValueError(f"--size must be >= 1, got {args.size}")
    torch.manual_seed(args.seed)
    gaussian = torch.randn(args.size, args.size)
    heavy = torch.distributions.StudentT(3.0).sample((args.size, args.size))
    names = args.formats.split(",") if args.formats else [
        "fp8_e4m3", "nvfp4", "mxfp4", "mxfp4_no_clip", "mxfp4_rceil", "int8", "int4",
    ]
    print(f"kbbq-pl formats: {args.size}x{args.size} tensors, seed {args.seed}, "
          f"rounding kernels: {F.compile_rule(gaussian.device)}")
    print(f"{'format':<15}{'bits/elem':>10}{'sigma2 pred':>12}{'sigma2 gauss':>13}"
          f"{'SNR gauss dB':>13}{'SNR t3 dB':>11}{'ms':>8}")
    for name in names:
        fmt = F.get_format(name)
        predicted = f"{F.sigma2_fmt(fmt):12.2e}" if fmt.is_float else f"{'-':>12}"
        start = time.perf_counter()
        F.fake_quantize(gaussian, fmt)
        elapsed = (time.perf_counter() - start) * 1e3
        measured = F.measure_sigma2(gaussian, fmt)
        snr_g = -10 * math.log10(F.measure_sigma2(gaussian, fmt, weighting="energy"))
        snr_t = -10 * math.log10(F.measure_sigma2(heavy, fmt, weighting="energy"))
        print(f"{name:<15}{fmt.bits_per_element():10.2f}{predicted}{measured:13.2e}"
              f"{snr_g:13.2f}{snr_t:11.2f}{elapsed:8.1f}")
    print("sigma2 pred: paper Eq. sigmafmt (log-uniform mantissas); SNR: tensor energy over "
          "rounding-error energy; ms: first call (includes compilation when compiled)")
    return 0


def _convert_llama2c(args: argparse.Namespace) -> int:
    """Convert a llama2.c checkpoint and tokenizer into a HuggingFace Llama folder."""
    from kbbq_pl.io.llama2c import convert_llama2c

    out = convert_llama2c(args.checkpoint, args.tokenizer, args.out, overwrite=args.overwrite)
    print(written_summary(out))
    return 0


def _add_text_options(parser: argparse.ArgumentParser) -> None:
    """The text ``ppl`` and ``kl`` score and its rolling windows (``eval`` and ``compare``)."""
    parser.add_argument("--text", default=None, help=TEXT_HELP)
    parser.add_argument("--context", type=int, default=None,
                        help="ppl/kl: tokens a rolling window reads (default 512, or the "
                             "model's max_position_embeddings where smaller)")
    parser.add_argument("--stride", type=int, default=None,
                        help="ppl/kl: positions each window scores after the first (default "
                             "half the context: 256)")
    parser.add_argument("--max-tokens", type=_max_tokens, default=2048,
                        help="ppl/kl: score the first N tokens of --text (default 2048; 0: "
                             "the whole text)")


def _parse_shots(text: str) -> dict[str, int]:
    from kbbq_pl.eval.tasks import BENCHMARKS

    shots = {}
    for item in filter(None, text.split(",")):
        task, _, count = item.partition("=")
        if not count.isdigit():
            raise ValueError(f"--num-fewshot: expected task=N, got {item!r}")
        if task.strip() not in BENCHMARKS:
            raise ValueError(f"--num-fewshot: unknown benchmark {task.strip()!r}; choose from "
                             f"{list(BENCHMARKS)}")
        shots[task.strip()] = int(count)
    return shots


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--limit must be > 0, got {text}")
    return int(value) if value >= 1 else value


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


LM_METRICS = ("ppl", "kl")
TEXT_HELP = ("text of ppl/kl: a text file, or a .jsonl, .json, .parquet or .csv file's 'text' "
             "column (default: DATA_DIR/wikitext2/test.txt if it exists, else "
             "the first 24 KB of it shipped with kbbq-pl, about 5,800 SmolLM2 tokens: its "
             "tokens are the full file's first ones, so the default --max-tokens 2048 scores "
             "the same tokens either way); the text scored is printed first")


def _max_tokens(text: str) -> int | None:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-tokens must be >= 0, got {text}")
    return value or None  # 0: the whole text


def _scored_text(args: argparse.Namespace, tasks: list[str]) -> Path | None:
    """The text ``ppl``/``kl`` score (``--text``, else :func:`kbbq_pl.eval.lm_metrics.
    default_text` of ``--data-dir``), checked and announced before anything is loaded; None
    without those tasks."""
    from kbbq_pl.eval.lm_metrics import default_text
    from kbbq_pl.resources import eval_text

    if not any(t in LM_METRICS for t in tasks):
        return None
    if args.text:
        text = Path(args.text)
        if not text.is_file() or not text.stat().st_size:
            state = ("is empty" if text.is_file() else "is a folder" if text.is_dir()
                     else "does not exist")
            raise FileNotFoundError(f"--text {text} {state} (--tasks ppl/kl score it); "
                                    "pass --text FILE, or leave --text out to score "
                                    "DATA_DIR/wikitext2/test.txt or kbbq-pl's excerpt of it")
        print(f"ppl/kl text: {text} (--text)")
        return text
    text = default_text(args.data_dir)
    print(f"ppl/kl text: {text} " + (
        f"(kbbq-pl's packaged first {text.stat().st_size // 1000} KB of WikiText-2 test: "
        f"--data-dir {args.data_dir} has no wikitext2/test.txt)" if text == eval_text()
        else "(--data-dir)"))
    return text


def _reference_model(args: argparse.Namespace) -> str:
    """``--reference``, else the source model a kbbq-pl quantized ``--model`` names."""
    from kbbq_pl.io.models import quantized_checkpoint, resolve_model_path

    if args.reference:
        return args.reference
    metadata = quantized_checkpoint(resolve_model_path(args.model)) or {}
    source = (metadata.get("recipe") or {}).get("model")
    if not source:
        raise ValueError(f"--tasks kl: {args.model} does not name its full-precision model; "
                         "pass --reference MODEL")
    try:
        resolve_model_path(source)
    except FileNotFoundError as error:
        raise ValueError(f"--tasks kl: {args.model} was quantized from {source!r}, which is not "
                         f"found from here ({error}); pass --reference MODEL") from None
    return str(source)


def _eval(args: argparse.Namespace) -> int:
    """Score a local causal LM: perplexity and KL to a reference on a text file (``ppl``,
    ``kl``), lm-eval benchmarks (the rest); write the metrics as JSON."""
    from kbbq_pl.cli.compare import FIDELITY
    from kbbq_pl.eval.evaluation import default_window
    from kbbq_pl.eval.lm_metrics import lm_metrics
    from kbbq_pl.eval.tasks import check_data, run_benchmarks
    from kbbq_pl.io.checkpoint import declared_kind, is_causal_lm_config, model_config
    from kbbq_pl.io.fileio import check_output, write_output_json
    from kbbq_pl.io.models import load_model, parse_device, resolve_model_path
    from kbbq_pl.quant.w4a4 import cache_decoded_weights

    device = parse_device(args.device)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r} names no task (e.g. ppl,kl,hellaswag)")
    benchmarks = [t for t in tasks if t not in LM_METRICS]
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise ValueError("--fewshot-as-multiturn true needs --apply-chat-template")
    def require_causal(config: Any) -> None:
        if config.architectures and not is_causal_lm_config(config):
            raise ValueError(
                f"{args.model} holds a {config.architectures[0]}, not a causal language model: "
                "eval scores next tokens (ppl, kl, benchmarks); a sentence encoder's fidelity "
                "(mean cosine of its embeddings to the source's) is in the report.json kbbq-pl "
                f"quantize wrote, and kbbq-pl compare --model SOURCE --tasks {FIDELITY} "
                "measures it for every method")

    # every path is checked before a model is loaded or lm-eval imported: the output first
    if args.out:
        check_output(args.out, overwrite=args.overwrite, kind="file")
    local = Path(args.model) / "config.json"  # a local folder's kind comes first
    if local.is_file():
        require_causal(declared_kind(local))
    check_data(benchmarks, args.data_dir,
               args.mmlu_subjects.split(",") if args.mmlu_subjects else None,
               option="--data-dir")
    text = _scored_text(args, tasks)
    source = resolve_model_path(args.model)  # a named model may be converted (SmolLM2)
    require_causal(model_config(source, args.trust_remote_code))
    if args.out:
        check_output(args.out, overwrite=args.overwrite, sources=[source], kind="file")
    model, tokenizer = load_model(args.model, causal=True, device=device,
                                  trust_remote_code=args.trust_remote_code)
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer in the model folder")
    start = time.perf_counter()
    results: dict = {}
    if text is not None:
        reference = None
        if "kl" in tasks:
            reference_name = _reference_model(args)
            reference, reference_tokenizer = load_model(
                reference_name, causal=True, device=device,
                trust_remote_code=args.trust_remote_code)
            if reference_tokenizer is not None and \
                    reference_tokenizer.get_vocab() != tokenizer.get_vocab():
                raise ValueError(f"--tasks kl: the tokenizer of {reference_name} differs from "
                                 f"{args.model}'s: KL compares next-token distributions over "
                                 "one vocabulary; pass the model it was quantized from as "
                                 "--reference")
        context, stride = default_window(model, args.context, args.stride)
        with cache_decoded_weights():
            metrics = lm_metrics(model, tokenizer, text, reference=reference,
                                 context=context, stride=stride,
                                 max_tokens=args.max_tokens, batch_size=args.batch_size)
        metrics["text"] = str(text)
        if reference is not None:
            metrics["reference"] = reference_name
        results["lm_metrics"] = metrics
        del reference
    if benchmarks:
        with cache_decoded_weights():
            results.update(run_benchmarks(
                model, tokenizer, tasks=benchmarks, limit=args.limit, data_dir=args.data_dir,
                num_fewshot=_parse_shots(args.num_fewshot), batch_size=args.batch_size,
                cache_dir=args.cache_dir, max_gen_toks=args.max_gen_toks,
                mmlu_subjects=args.mmlu_subjects.split(",") if args.mmlu_subjects else None,
                allow_code_execution=args.allow_code_execution,
                apply_chat_template=args.apply_chat_template,
                fewshot_as_multiturn=args.fewshot_as_multiturn,
                system_instruction=args.system_instruction,
            ))
    results["wall_time_s"] = time.perf_counter() - start
    results["model"] = str(args.model)
    results["device"] = str(device)
    if "lm_metrics" in results:
        m = results["lm_metrics"]
        print(f"{m['text']}: {m['n_tokens']} tokens scored, context {m['context']}, "
              f"stride {m['stride']}")
        print(f"perplexity {m['perplexity']:.4f}" + (
            f"  KL to {m['reference']} {m['kl']:.5f} nats/token" if m["kl"] is not None else ""))
    if benchmarks:
        scored = results[benchmarks[0]]
        if scored["chat_template"]:
            print("benchmarks scored through the tokenizer's chat template"
                  + (", shots as turns" if scored["fewshot_as_multiturn"] else ""))
        print(f"{'task':<14}{'metric':<28}{'score':>8}{'docs':>7}{'shots':>7}")
    for task, entry in results.items():
        if isinstance(entry, dict) and "score" in entry:
            print(f"{task:<14}{entry['metric']:<28}{entry['score']:8.4f}{entry['n_docs']:7d}"
                  f"{entry['num_fewshot']:7d}")
    if args.out:
        out = write_output_json(args.out, results, overwrite=args.overwrite, sources=[source])
        print(written_summary(out))
    return 0


def _compare(args: argparse.Namespace) -> int:
    """Quantize one model with several recipes (and lambdas); write the paper's Table w4a4 and
    a plot, and with --save-closest the model closest to full precision."""
    from kbbq_pl.cli.compare import FIDELITY, default_tasks, run_compare, table_recipes
    from kbbq_pl.eval.tasks import check_data

    recipes = ([r.strip() for r in args.recipes.split(",") if r.strip()] if args.recipes
               else table_recipes([f.strip() for f in args.formats.split(",") if f.strip()]))
    calibration = {key: value for key, value in (("source", args.calibration_source),
                                                 ("n_tokens", args.calibration_tokens),
                                                 ("text_key", args.calibration_text_key),
                                                 ("streaming", args.calibration_streaming or None))
                   if value is not None}
    tasks = ([t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks
             else default_tasks(args.model, args.trust_remote_code))
    try:
        lams = [float(lam) for lam in args.lams.split(",") if lam.strip()] if args.lams else []
    except ValueError:
        raise ValueError(f"--lams {args.lams!r}: comma-separated numbers in [0, 1]") from None
    # every path is checked before a model is loaded or lm-eval imported
    check_data([t for t in tasks if t not in (*LM_METRICS, FIDELITY)], args.data_dir,
               option="--data-dir")
    text = _scored_text(args, tasks)
    out, _ = run_compare(
        args.model, recipes, args.output_dir, tasks=tasks, text=text,
        context=args.context, stride=args.stride, max_tokens=args.max_tokens, limit=args.limit,
        data_dir=args.data_dir, calibration=calibration, lams=lams, batch_size=args.batch_size,
        cache_dir=args.cache_dir, device=args.device, resume=args.resume,
        overwrite=args.overwrite, progress=not args.no_progress, save_closest=args.save_closest,
        trust_remote_code=args.trust_remote_code,
    )
    print((out / "compare.md").read_text(encoding="utf-8"))
    print(written_summary(out))
    return 0


def _law(args: argparse.Namespace) -> int:
    """Measure the noise law per GEMM cell and write law.json, law.md, law.png, kappa.md."""
    from kbbq_pl.eval.law_report import run_law

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    paths, summary = run_law(
        args.model, args.data, args.out, formats=formats, tokens=args.tokens,
        seq_len=args.seq_len, rows=args.rows, seed=args.seed, batch_size=args.batch_size,
        block_size=args.block_size, targets=args.targets, ignore=args.ignore,
        progress=not args.no_progress, overwrite=args.overwrite, device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
    print(f"{'format':<12}{'records':>8}{'slope/dec':>10}{'intercept':>10}{'median r':>9}"
          f"{'RMS r':>7}{'C_fmt':>7}")
    for name, fit in summary["formats"].items():
        def show(value, width):
            return f"{value:{width}.2f}" if value is not None else f"{'n/a':>{width}}"
        print(f"{name:<12}{fit['records']:8d}{show(fit['slope_per_decade'], 10)}"
              f"{show(fit['intercept'], 10)}{show(fit['median_r'], 9)}{show(fit['rms_r'], 7)}"
              f"{show(fit['predicted_c_fmt'], 7)}")
    for spacing in summary["spacing"]:
        median, predicted = spacing["median_db"], spacing["predicted_db"]
        print(f"spacing {' - '.join(spacing['formats'])}: median "
              f"{'n/a' if median is None else f'{median:.2f}'} dB, predicted "
              f"{'n/a' if predicted is None else f'{predicted:.2f}'} dB")
    print(written_summary(next(iter(paths.values())).parent))
    return 0


def _recipes(args: argparse.Namespace) -> int:
    """List the packaged recipes, each with what it does."""
    from kbbq_pl.recipes import packaged_recipes

    recipes = packaged_recipes()
    width = max(map(len, recipes))
    for name, description in recipes.items():
        print(f"{name:<{width}}  {description}")
    print("\nkbbq-pl quantize --config NAME [--model MODEL] runs one; `kbbq-pl quantize -h` "
          "shows every field a recipe sets")
    return 0


def _export(args: argparse.Namespace) -> int:
    """Convert a kbbq-pl checkpoint folder for a serving stack (compressed-tensors, or
    gpt-oss's own mxfp4)."""
    from kbbq_pl.io.compressed_tensors import export_compressed_tensors
    from kbbq_pl.io.mxfp4 import export_mxfp4

    export = export_mxfp4 if args.format == "mxfp4" else export_compressed_tensors
    out = export(args.in_dir, args.out_dir, weight_only=args.weight_only, strict=args.strict,
                 overwrite=args.overwrite)
    print(written_summary(out))
    return 0


class UsageError(ValueError):
    """Bad command-line arguments (argparse's and jsonargparse's errors, as an exception)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with errors raised for :func:`main` and ``--an_option`` read as
    ``--an-option`` (users of lm-eval type ``--batch_size``; vLLM's parser does the same)."""

    def error(self, message: str):  # argparse prints usage and exits; raise for main instead
        raise UsageError(f"{message} (see {self.prog} -h)")

    def parse_known_args(self, args=None, namespace=None):
        if args is not None:
            args = [_hyphenated(arg) for arg in args]
        return super().parse_known_args(args, namespace)


def _hyphenated(arg: str) -> str:
    """``--an_option[=value]`` as ``--an-option[=value]``; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


def _add_overwrite(parser: argparse.ArgumentParser, option: str) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace an existing {option}, if kbbq-pl wrote it")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kbbq-pl", description="FP4 W4A4 quantization with KBBQ (see README.md)",
        epilog="--debug (anywhere): show the traceback of an error",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("quantize", help="quantize a model with a recipe (see: kbbq-pl quantize -h)")
    sub.add_parser("recipes", help="list the packaged recipes and what each does"
                   ).set_defaults(run=_recipes)
    formats = sub.add_parser("formats", help="round test tensors onto every format, print a table")
    formats.add_argument("--size", type=int, default=1024)
    formats.add_argument("--seed", type=int, default=0)
    formats.add_argument("--formats", default="", help="comma-separated names (default: a set)")
    formats.set_defaults(run=_formats_demo)

    convert = sub.add_parser(
        "convert-llama2c", help="convert a llama2.c v0 checkpoint + tokenizer.bin to a HF folder"
    )
    convert.add_argument("--checkpoint", required=True, help="llama2.c v0 model .bin")
    convert.add_argument("--tokenizer", required=True, help="llama2.c tokenizer .bin")
    convert.add_argument("--out", required=True, help="output folder (new, or empty)")
    _add_overwrite(convert, "--out")
    convert.set_defaults(run=_convert_llama2c)

    evaluate = sub.add_parser(
        "eval", help="perplexity, KL to full precision, and benchmarks via lm-eval, offline"
    )
    evaluate.add_argument("--model", required=True,
                          help="a causal LM: a local HF folder, a Hub id, 'smollm2', or a kbbq-pl "
                               "quantized one")
    add_trust_remote_code(evaluate)
    evaluate.add_argument("--tasks", default="mmlu,gsm8k,hellaswag,winogrande",
                          help="comma-separated, from ppl,kl (on --text) and "
                               "mmlu,gsm8k,hellaswag,winogrande,mbpp,arc_easy,arc_challenge,"
                               "piqa,lambada")
    evaluate.add_argument("--limit", type=_limit, default=None,
                          help="documents per task (MMLU: per subject); <1: a fraction")
    evaluate.add_argument("--data-dir", default="../shared/data",
                          help="folder with mmlu/ gsm8k/ hellaswag/ winogrande/ mbpp/ "
                               "llm_foundry_eval/ wikitext2/")
    _add_text_options(evaluate)
    evaluate.add_argument("--reference", default=None,
                          help="kl: the full-precision model (default: the one a kbbq-pl "
                               "quantized --model was made from)")
    evaluate.add_argument("--out", default=None, help="write the results here as JSON")
    _add_overwrite(evaluate, "--out")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    evaluate.add_argument("--num-fewshot", default="", help="overrides, e.g. mmlu=0,gsm8k=4")
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--max-gen-toks", type=int, default=256)
    evaluate.add_argument("--apply-chat-template", action="store_true",
                          help="benchmarks: render each prompt with the tokenizer's chat "
                               "template, as an instruct model is served (lm-eval's "
                               "--apply_chat_template)")
    evaluate.add_argument("--fewshot-as-multiturn", type=_boolean, default=None,
                          metavar="{true,false}",
                          help="benchmarks: the shots as earlier turns of the chat (default: "
                               "with --apply-chat-template)")
    evaluate.add_argument("--system-instruction", default=None,
                          help="benchmarks: a system message before each prompt")
    evaluate.add_argument("--mmlu-subjects", default="", help="comma-separated (default: all)")
    evaluate.add_argument("--cache-dir", default=None, help="converted data (default: "
                          "$KBBQ_PL_CACHE/eval_data or ~/.cache/kbbq_pl/eval_data)")
    evaluate.add_argument("--allow-code-execution", action="store_true",
                          help="needed for mbpp: runs model-generated code, unsandboxed")
    evaluate.set_defaults(run=_eval)
    compare = sub.add_parser(
        "compare", help="quantize one model with several recipes or lambdas: the paper's Table "
                        "w4a4 (per task, Average, Recovery), compare.json/.md, a plot, and the "
                        "closest model (--save-closest)")
    compare.add_argument("--model", required=True,
                         help="local full-precision model folder, 'minilm' or 'smollm2'")
    add_trust_remote_code(compare)
    compare.add_argument("--recipes", default="",
                         help="comma-separated packaged recipe names or YAML files (default: "
                              "the paper's nine methods in each of --formats)")
    compare.add_argument("--formats", default="nvfp4,mxfp4",
                         help="formats of the default recipe list")
    compare.add_argument("--lams", default="",
                         help="comma-separated lambdas: every fixed-lambda KBBQ recipe runs once "
                              "per lambda (a sweep of the brake)")
    compare.add_argument("--tasks", default=None,
                         help="comma-separated, from ppl,kl (causal LMs), fidelity (mean cosine "
                              "of the last hidden states, any model) and the kbbq-pl eval "
                              "benchmarks (default: ppl,kl for a causal LM, else fidelity)")
    compare.add_argument("--save-closest", default=None, metavar="DIR",
                         help="write the quantized model closest to full precision (smallest "
                              "KL, else highest fidelity, else lowest perplexity) to DIR as a "
                              "checkpoint; score it on text held out from the calibration")
    compare.add_argument("--limit", type=_limit, default=None,
                         help="documents per benchmark (MMLU: per subject); <1: a fraction")
    compare.add_argument("--data-dir", default="../shared/data")
    _add_text_options(compare)
    compare.add_argument("--calibration-source", default=None,
                         help="override every recipe's calibration source (mixed, random, a "
                              "file, hf:<dataset>[:<config>][:<split>])")
    compare.add_argument("--calibration-tokens", type=int, default=None,
                         help="override every recipe's calibration token budget")
    compare.add_argument("--calibration-text-key", default=None,
                         help="the calibration source's field (a jsonl or dataset's; a "
                              "conversation is rendered by the chat template)")
    compare.add_argument("--calibration-streaming", action="store_true",
                         help="read an hf:<dataset> calibration source as a stream: its first "
                              "records, not the whole split downloaded")
    compare.add_argument("--batch-size", type=int, default=4)
    compare.add_argument("--cache-dir", default=None, help="converted benchmark data")
    compare.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    compare.add_argument("--output-dir", dest="output_dir", required=True,
                         help="output folder (new, empty, or one to --resume)")
    compare.add_argument("--resume", action="store_true",
                         help="continue an interrupted compare folder: finished recipes with "
                              "unchanged settings are not recomputed")
    _add_overwrite(compare, "--output_dir")
    compare.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare.set_defaults(run=_compare)
    law = sub.add_parser(
        "law", help="measure the noise law per GEMM cell (kappa, SNR per format), write a report"
    )
    law.add_argument("--model", required=True,
                     help="local model folder (full precision or kbbq-pl quantized), or a "
                          "named model: 'minilm' or 'smollm2'")
    add_trust_remote_code(law)
    law.add_argument("--data", required=True,
                     help="calibration text: a .txt, .jsonl, .json, .parquet, .csv or .arrow "
                          "file, hf:<dataset>, or 'random' "
                          "(the paper's random-token corpus)")
    law.add_argument("--formats", default="fp8_e4m3,nvfp4,mxfp4",
                     help="comma-separated format names")
    law.add_argument("--tokens", type=int, default=4096, help="calibration tokens in all")
    law.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    law.add_argument("--batch-size", type=int, default=4,
                     help="sequences per forward call (one activation scale per call)")
    law.add_argument("--rows", type=int, default=8, help="sampled weight rows per cell")
    law.add_argument("--block-size", type=int, default=16, help="block of the kappa_b* ceiling")
    law.add_argument("--seed", type=int, default=0)
    law.add_argument("--targets", nargs="+", action="extend", metavar="REGEX",
                     help="linear layers to measure (default: all in the blocks)")
    law.add_argument("--ignore", nargs="+", action="extend", metavar="REGEX",
                     help="linear layers to skip (default: lm_head, embeddings, pooler)")
    law.add_argument("--out", required=True, help="output folder (new, or empty)")
    _add_overwrite(law, "--out")
    law.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    law.add_argument("--no-progress", action="store_true", help="no progress bar")
    law.set_defaults(run=_law)
    export = sub.add_parser(
        "export", help="convert a kbbq-pl checkpoint for vLLM / HF transformers "
                       "(compressed-tensors, or gpt-oss's own mxfp4)")
    export.add_argument("--format", required=True, choices=["compressed-tensors", "mxfp4"],
                        help="the serving format (mxfp4: gpt-oss's MXFP4 experts, weights only)")
    export.add_argument("in_dir", help="a kbbq-pl checkpoint folder (kbbq-pl quantize), or its "
                                       "HuggingFace Hub id")
    export.add_argument("out_dir", help="the folder to write (not inside in_dir)")
    export.add_argument("--weight-only", action="store_true",
                        help="declare weights only (NVFP4A16 / MXFP4A16; mxfp4 needs it): "
                             "activations unquantized")
    export.add_argument("--strict", action="store_true",
                        help="refuse what stock readers would not decode or transform as "
                             "kbbq-pl does (without it: a warning naming the layers; "
                             "activations are each reader's to round, MXFP4's otherwise "
                             "than kbbq-pl's): per-block transforms "
                             "(KBBQ, WUSH, HAAR), the block Hadamard of MR-GPTQ / RTN-HADAMARD "
                             "(vLLM applies it, transformers drops it), padded layers written "
                             "dense; mxfp4: quantized layers outside the experts written dense")
    _add_overwrite(export, "out_dir")
    export.set_defaults(run=_export)
    add_serve_parsers(sub)
    return parser


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "quantize":  # recipes parse with jsonargparse
        from .quantize import main as recipe_main

        return recipe_main(argv)
    args = build_parser().parse_args(argv)
    return args.run(args)


def main(argv: list[str] | None = None) -> int:
    """Run ``kbbq-pl ARGS``; an error is one line on stderr and exit code 2 (1 when it is not
    one of the expected kinds of bad input), unless ``--debug`` asks for the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = argv[0] if argv and not argv[0].startswith("-") else "kbbq-pl"
    try:
        return _run(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"kbbq-pl {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the one place that turns errors into a line
        if debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, argparse.ArgumentError):  # jsonargparse's bad arguments
            message += f" (see kbbq-pl {command} -h)"
        if isinstance(error, (ValueError, OSError, ImportError, argparse.ArgumentError)):
            print(f"kbbq-pl {command}: error: {message}", file=sys.stderr)
            return 2
        print(f"kbbq-pl {command}: internal error ({type(error).__name__}): {message} "
              "(--debug shows the traceback)", file=sys.stderr)
        return 1
