"""``kbbq-pl serve`` and ``kbbq-pl chat``: use a quantized model as people use models.

``kbbq-pl serve FOLDER`` runs transformers' own OpenAI-compatible server (``transformers
serve``: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``) pinned to
the model of ``FOLDER``, which it loads through ``from_pretrained`` with kbbq-pl's quantizer
registered (:mod:`kbbq_pl.io.hf_quantizer`; in the model's own process, :mod:`.serving`); chat
requests go through the tokenizer's chat template.  SIGTERM or Ctrl-C stops it after the
requests in flight (exit code 0).

``kbbq-pl chat FOLDER`` loads the model the same way and talks with it in the terminal:
``--prompt TEXT`` for one answer, else a conversation on standard input (one message per line,
until end of input or ``/exit``).

Bad input (a missing folder, one that is not a causal LM, a checkpoint transformers cannot
read, a port in use, the ``serve`` extra not installed) is found before any model is loaded and
reported by :func:`kbbq_pl.cli.commands.main` as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import torch

CHAT_EXIT = "/exit"


def add_parsers(sub: Any) -> None:
    """Add the ``serve`` and ``chat`` subcommands to ``sub`` (argparse subparsers)."""
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible chat/completions server for a model folder "
                      "(transformers serve; needs the [serve] extra)")
    serve.add_argument("folder", help="a kbbq-pl checkpoint (or any HF causal-LM folder)")
    serve.add_argument("--host", default="localhost", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    _add_model_options(serve)
    serve.add_argument("--log-level", default="warning",
                       help="transformers' log level (debug, info, warning, error)")
    serve.set_defaults(run=run_serve)

    chat = sub.add_parser("chat", help="talk with a model folder in the terminal (its chat "
                                       "template; --prompt for one answer)")
    chat.add_argument("folder", help="a kbbq-pl checkpoint (or any HF causal-LM folder)")
    chat.add_argument("--prompt", default=None,
                      help="answer this one message and exit (default: read messages from "
                           f"standard input, one per line, until its end or {CHAT_EXIT})")
    chat.add_argument("--system", default=None, help="a system message first")
    chat.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.0,
                      help="0 (default): greedy decoding; above: sampling")
    chat.add_argument("--seed", type=int, default=0, help="sampling seed")
    _add_model_options(chat)
    chat.set_defaults(run=run_chat)


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """``--trust_remote_code`` (``--trust-remote-code``) of every command that loads a model."""
    parser.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                        help="run the model folder's own code (config.json's auto_map), as "
                             "transformers' trust_remote_code=True")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when there is one, else cpu)")
    parser.add_argument("--dtype", default="auto",
                        help="dtype of the layers outside the quantized ones: auto (as stored; "
                             "a compressed-tensors folder stored in float32: bfloat16), "
                             "bfloat16, float16 or float32")
    parser.add_argument("--compile", action="store_true",
                        help="decode with a static KV cache, whose steps transformers compiles "
                             "on a GPU (torch.compile with CUDA graphs: faster tokens after a "
                             "slower first answer); on the CPU only the static cache")
    add_trust_remote_code(parser)
    parser.add_argument("--no-weight-cache", action="store_true",
                        help="on the CPU, decode each quantized weight in every call instead of "
                             "keeping its decoded FP32 copy (4 bytes per weight; about twice "
                             "as fast a token)")


def weight_cache(device: torch.device, disabled: bool) -> contextlib.AbstractContextManager:
    """:func:`kbbq_pl.quant.w4a4.cache_decoded_weights` for the CPU's emulated products,
    unless ``disabled`` (the kernels of a GPU decode nothing)."""
    from ..quant.w4a4 import cache_decoded_weights

    if disabled or device.type != "cpu":
        return contextlib.nullcontext()
    return cache_decoded_weights()


# ---------------------------------------------------------------------- checks


def chat_model_folder(path: str | Path, trust_remote_code: bool = False) -> tuple[Path, str]:
    """The folder of a causal LM with a tokenizer that transformers can load once kbbq-pl is
    imported (``trust_remote_code``: running the folder's own code), and what it holds in
    words; a one-line error otherwise (FileNotFoundError for a missing folder, ValueError for
    the rest: a kbbq-pl checkpoint's tensor files are checked against the sizes and SHA-256
    its ``quantization_config.json`` lists, as ``kbbq_pl.from_pretrained`` checks them)."""
    from ..io.checkpoint import is_causal_lm_config, model_config, read_metadata
    from ..io.models import (
        load_tokenizer,
        quantized_checkpoint,
        quantized_folder_kind,
        resolve_model_path,
    )

    folder = resolve_model_path(path)
    kind = quantized_folder_kind(folder)
    metadata = quantized_checkpoint(folder)
    if metadata is not None and metadata.get("version", 1) < 2:
        raise ValueError(
            f"{path} is a kbbq-pl checkpoint of format {metadata.get('version', 1)}, which "
            "transformers cannot load; convert it once with: python -c \"import kbbq_pl; "
            f"kbbq_pl.upgrade_checkpoint('{path}', 'NEW_FOLDER')\"")
    if metadata is not None:
        read_metadata(folder)  # a corrupted or truncated tensor file: a CheckpointError
    config = model_config(folder, trust_remote_code)
    if not is_causal_lm_config(config):
        name = (config.architectures or [config.model_type])[0]
        raise ValueError(f"{path} holds a {name}, not a causal language model: there is "
                         "nothing to chat with")
    if load_tokenizer(folder, trust_remote_code=trust_remote_code) is None:
        raise ValueError(f"{path} has no tokenizer: save the model's tokenizer into it")
    return folder, kind or "full precision"


def model_device(device: str | None) -> torch.device:
    """``--device``, checked (:func:`kbbq_pl.io.models.parse_device`); by default cuda when
    this machine has it, else cpu."""
    from ..io.models import parse_device

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(device)


def folder_dtype(folder: Path, kind: str, dtype: torch.dtype | str,
                 trust_remote_code: bool = False) -> torch.dtype | str:
    """The dtype to load ``folder`` in for ``--dtype`` (:func:`model_dtype`): ``auto`` loads a
    compressed-tensors folder that declares float32 (a float32 kbbq-pl folder exported) in
    bfloat16, as vLLM does, since transformers decompresses its FP4 layers to bfloat16 beside
    float32 ones, which cannot multiply."""
    from ..io.checkpoint import declared_dtype, model_config
    from ..io.models import COMPRESSED_TENSORS_KIND

    if dtype == "auto" and kind == COMPRESSED_TENSORS_KIND and declared_dtype(
            model_config(folder, trust_remote_code)) == torch.float32:
        return torch.bfloat16
    return dtype


def model_dtype(dtype: str) -> torch.dtype | str:
    """``--dtype`` as transformers takes it: ``"auto"`` or a floating-point torch dtype."""
    if dtype == "auto":
        return dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"--dtype {dtype!r}: use auto, bfloat16, float16 or float32")
    return value


def check_port(host: str, port: int) -> None:
    """An OSError naming ``host:port`` when a server cannot listen there (it is in use)."""
    if not 0 < port < 65536:
        raise ValueError(f"--port {port}: a port is 1 to 65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(error.errno, f"cannot listen on {host}:{port} ({error.strerror}); "
                                       "pass another --port") from None


def _has_chat_template(folder: Path, trust_remote_code: bool) -> bool:
    from ..io.models import load_tokenizer

    tokenizer = load_tokenizer(folder, trust_remote_code=trust_remote_code)
    return bool(tokenizer is not None and tokenizer.chat_template)


def _require_serving() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError("kbbq-pl serve runs transformers' server, which needs FastAPI, "
                          "uvicorn and openai: pip install 'kbbq-pl[serve]'")


# ---------------------------------------------------------------------- serve


class _Stop(Exception):
    """SIGTERM: stop serving (raised in the main thread by the signal handler)."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stop


def run_serve(args: argparse.Namespace) -> int:
    """``kbbq-pl serve``: transformers' server pinned to the model of ``args.folder``."""
    _require_serving()
    folder, kind = chat_model_folder(args.folder, args.trust_remote_code)
    device = model_device(args.device)
    dtype = folder_dtype(folder, kind, model_dtype(args.dtype), args.trust_remote_code)
    check_port(args.host, args.port)
    from .serving import KbbqServe

    name = str(folder)
    print(f"kbbq-pl serve: loading {name} ({kind}) on {device}; then serving it at "
          f"http://{args.host}:{args.port}/v1 as model {name!r} (/v1/chat/completions, "
          "/v1/completions, /v1/models, /health); stop with SIGTERM or Ctrl-C", flush=True)
    if not _has_chat_template(folder, args.trust_remote_code):
        print(f"kbbq-pl serve: warning: the tokenizer of {name} has no chat template: "
              "/v1/chat/completions will fail, /v1/completions works", file=sys.stderr,
              flush=True)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        # uvicorn handles SIGTERM and Ctrl-C while it serves (finishing the requests in
        # flight), then raises the signal again: SIGTERM reaches _stop, Ctrl-C the default
        # KeyboardInterrupt
        KbbqServe(force_model=name, host=args.host, port=args.port, device=str(device),
                  compile=args.compile, trust_remote_code=args.trust_remote_code,
                  dtype=dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
                  log_level=args.log_level,
                  cache_weights=device.type == "cpu" and not args.no_weight_cache)
    except (_Stop, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        # the server froze the garbage collector and, stopped by a signal, did not thaw it: a
        # process ending frozen has triton's bindings report their objects as leaked
        gc.unfreeze()
    print("kbbq-pl serve: stopped", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------- chat


def load_chat_model(folder: Path, device: torch.device, dtype: torch.dtype | str,
                    trust_remote_code: bool = False) -> tuple[Any, Any]:
    """The causal LM of ``folder`` through transformers' ``from_pretrained`` (kbbq-pl's
    quantizer is registered when :mod:`kbbq_pl` is imported) on ``device``, in eval mode, and
    its tokenizer (``trust_remote_code``: running the folder's own code)."""
    from transformers import AutoTokenizer

    from ..io.checkpoint import auto_class, model_config

    loader = auto_class(model_config(folder, trust_remote_code), causal=True)
    model = loader.from_pretrained(folder, dtype=dtype, device_map=str(device),
                                   trust_remote_code=trust_remote_code)
    return model.eval(), AutoTokenizer.from_pretrained(folder,
                                                       trust_remote_code=trust_remote_code)


def chat_inputs(tokenizer: Any, messages: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """The model's input for a conversation: its chat template with the generation prompt, or
    for a tokenizer without one the last message as plain text to continue."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
    return tokenizer(messages[-1]["content"], return_tensors="pt")


def answer(model: Any, tokenizer: Any, messages: list[dict[str, str]], *,
           max_new_tokens: int = 128, temperature: float = 0.0,
           static_cache: bool = False) -> str:
    """The model's answer to the conversation ``messages`` (greedy when ``temperature`` is 0;
    ``static_cache``: the KV cache transformers compiles the decode steps with, on a GPU)."""
    inputs = {k: v.to(model.device) for k, v in chat_inputs(tokenizer, messages).items()}
    sampling = ({"do_sample": True, "temperature": temperature} if temperature > 0
                else {"do_sample": False})
    if static_cache:
        sampling["cache_implementation"] = "static"
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                             **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def run_chat(args: argparse.Namespace) -> int:
    """``kbbq-pl chat``: one answer to ``--prompt``, or a conversation on standard input."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    folder, kind = chat_model_folder(args.folder, args.trust_remote_code)
    device = model_device(args.device)
    dtype = folder_dtype(folder, kind, model_dtype(args.dtype), args.trust_remote_code)
    with _quiet_progress():
        model, tokenizer = load_chat_model(folder, device, dtype, args.trust_remote_code)
    print(f"kbbq-pl chat: {folder} ({kind}) on {device}", file=sys.stderr, flush=True)
    if not tokenizer.chat_template:
        print("kbbq-pl chat: the tokenizer has no chat template: each message is continued as "
              "plain text", file=sys.stderr, flush=True)
    with weight_cache(device, args.no_weight_cache):
        return _converse(args, model, tokenizer)


@contextlib.contextmanager
def _quiet_progress() -> Any:
    """No "Loading weights" bar from transformers inside the block."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _converse(args: argparse.Namespace, model: Any, tokenizer: Any) -> int:
    torch.manual_seed(args.seed)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def reply(text: str) -> str:
        messages.append({"role": "user", "content": text})
        response = answer(model, tokenizer, messages, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, static_cache=args.compile)
        messages.append({"role": "assistant", "content": response})
        return response

    if args.prompt is not None:
        print(reply(args.prompt))
        return 0
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == CHAT_EXIT:
            return 0
        if line.strip():
            print(reply(line.strip()), flush=True)
