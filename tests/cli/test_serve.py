"""``kbbq-pl serve`` (transformers' OpenAI-compatible server, a real process and real HTTP
requests through the ``openai`` client) and ``kbbq-pl chat``; their bad input, one line each."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from kbbq_pl.cli.commands import main

V1 = Path(__file__).resolve().parents[1] / "data" / "v1"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("kbbq-pl ")]
    assert lines and lines[-1].startswith(f"kbbq-pl {command}: error: "), err
    assert "Traceback" not in err, err
    return lines[-1]


def greedy_reply(folder: Path, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """What ``generate`` answers (greedy) to ``messages`` through the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def wait_until_healthy(process: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kbbq-pl serve exited with {process.returncode}: "
                        f"{process.stderr.read() if process.stderr else ''}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"kbbq-pl serve did not answer /health within {timeout} s")


def test_serve_answers_a_chat_completion_as_generate_and_stops_on_sigterm(
        tiny_chat_quantized):
    openai = pytest.importorskip("openai")
    for module in ("fastapi", "uvicorn"):
        pytest.importorskip(module)
    folder = tiny_chat_quantized
    expected = greedy_reply(folder, MESSAGES, 12)
    port = free_port()
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "kbbq_pl.cli", "serve", str(folder), "--host", "127.0.0.1",
         "--port", str(port), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_until_healthy(process, port, timeout=50)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=30, max_retries=0)
        assert [model.id for model in client.models.list().data] == [str(folder)]
        completion = client.chat.completions.create(
            model=str(folder), messages=MESSAGES, temperature=0, max_tokens=12)
        assert completion.choices[0].message.content == expected
        assert completion.usage.completion_tokens == 12
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"kbbq-pl serve did not stop within 20 s of SIGTERM: {err}")
    elapsed = time.monotonic() - start
    assert process.returncode == 0, err
    assert "Traceback" not in err, err
    assert err.rstrip().endswith("kbbq-pl serve: stopped"), err
    assert f"http://127.0.0.1:{port}/v1" in out
    assert elapsed < 60, elapsed


def test_serve_refuses_bad_input_in_one_line(tiny_chat_quantized, tmp_path, capsys):
    from transformers import BertConfig, BertModel

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "missing' is not a local model folder" in one_line_error(capsys, "serve")

    encoder = tmp_path / "encoder"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, vocab_size=64)).save_pretrained(encoder)
    assert main(["serve", str(encoder)]) == 2
    assert "holds a BertModel, not a causal language model" in one_line_error(capsys, "serve")

    assert main(["serve", str(V1 / "nvfp4_kbbq_static")]) == 2
    error = one_line_error(capsys, "serve")
    assert "format 1, which transformers cannot load" in error
    assert "kbbq_pl.upgrade_checkpoint(" in error

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", str(tiny_chat_quantized), "--host", "127.0.0.1",
                     "--port", str(port)]) == 2
        assert time.monotonic() - start < 10  # refused before the model is loaded
    assert f"cannot listen on 127.0.0.1:{port}" in one_line_error(capsys, "serve")


def test_serve_without_the_serving_extra_names_it(tiny_chat_quantized, capsys, monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    assert main(["serve", str(tiny_chat_quantized)]) == 2
    assert "pip install 'kbbq-pl[serve]'" in one_line_error(capsys, "serve")


def test_chat_answers_a_prompt_as_generate(tiny_chat_quantized, capsys):
    expected = greedy_reply(tiny_chat_quantized, MESSAGES, 12)
    capsys.readouterr()
    assert main(["chat", str(tiny_chat_quantized), "--prompt", MESSAGES[0]["content"],
                 "--max-new-tokens", "12", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert "quantized by kbbq-pl (RTN-KBBQ nvfp4, lambda 0.75" in captured.err
    assert "Loading weights" not in captured.err


def test_compile_decodes_with_a_static_cache_and_reaches_the_server(tiny_chat_quantized, capsys,
                                                                   monkeypatch):
    """``--compile``: chat's answer with transformers' static cache (compiled on a GPU; on the
    CPU the cache alone) is the same greedy answer; serve hands the flag to transformers'
    server, and the weight cache (on the CPU, unless ``--no-weight-cache``) to the process
    that loads the model."""
    expected = greedy_reply(tiny_chat_quantized, MESSAGES, 12)
    from transformers.generation import utils as generation

    caches = []
    real = generation.GenerationMixin._prepare_cache_for_generation

    def spy(self, generation_config, *args, **kwargs):
        caches.append(generation_config.cache_implementation)
        return real(self, generation_config, *args, **kwargs)

    monkeypatch.setattr(generation.GenerationMixin, "_prepare_cache_for_generation", spy)
    capsys.readouterr()
    assert main(["chat", str(tiny_chat_quantized), "--prompt", MESSAGES[0]["content"],
                 "--max-new-tokens", "12", "--device", "cpu", "--compile"]) == 0
    assert capsys.readouterr().out == expected + "\n" and caches == ["static"]
    pytest.importorskip("fastapi")
    from kbbq_pl.cli import serving

    served = {}
    monkeypatch.setattr(serving, "KbbqServe", lambda **kwargs: served.update(kwargs))
    assert main(["serve", str(tiny_chat_quantized), "--port", str(free_port()), "--device",
                 "cpu", "--compile"]) == 0
    assert served["compile"] is True and served["force_model"] == str(tiny_chat_quantized)
    assert served["cache_weights"] is True  # the CPU's emulation, in the model's process
    assert main(["serve", str(tiny_chat_quantized), "--port", str(free_port()), "--device",
                 "cpu", "--no-weight-cache"]) == 0
    assert served["cache_weights"] is False and served["compile"] is False


def test_chat_keeps_the_conversation_from_standard_input(tiny_chat_quantized, capsys,
                                                          monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a story.\n\nAnd then?\n/exit\nNo\n"))
    assert main(["chat", str(tiny_chat_quantized), "--max-new-tokens", "8"]) == 0
    replies = capsys.readouterr().out.splitlines()
    first = greedy_reply(tiny_chat_quantized, MESSAGES, 8)
    history = [*MESSAGES, {"role": "assistant", "content": first},
               {"role": "user", "content": "And then?"}]
    assert replies == [first, greedy_reply(tiny_chat_quantized, history, 8)]


def test_chat_refuses_bad_options_in_one_line(tiny_chat_quantized, capsys):
    assert main(["chat", str(tiny_chat_quantized), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in one_line_error(capsys, "chat")
    assert main(["chat", str(tiny_chat_quantized), "--dtype", "int8", "--prompt", "x"]) == 2
    assert "--dtype 'int8'" in one_line_error(capsys, "chat")


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_corrupted_checkpoint_is_refused_before_loading(tiny_chat_quantized, tmp_path, capsys,
                                                          command):
    """One byte of a stored tensor changed (the file still loads: its header is intact):
    refused with the file named, as ``kbbq_pl.from_pretrained`` and ``kbbq-pl eval`` refuse
    it, not served with other weights."""
    import shutil

    folder = Path(shutil.copytree(tiny_chat_quantized, tmp_path / "q"))
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x10
    weights.write_bytes(bytes(data))
    options = ["--port", str(free_port())] if command == "serve" else ["--prompt", "x"]
    assert main([command, str(folder), *options]) == 2
    error = one_line_error(capsys, command)
    assert f"{weights} is corrupted: its SHA-256 does not match" in error


def test_chat_answers_from_the_compressed_tensors_export_of_a_float32_folder(
        tiny_chat_quantized, tmp_path, capsys):
    """transformers decompresses an export's FP4 layers to bfloat16: ``--dtype auto`` loads a
    folder declared float32 in bfloat16 (as vLLM does) instead of failing at the first
    product."""
    import json

    exported = tmp_path / "ct"
    assert json.loads((tiny_chat_quantized / "config.json").read_text())["dtype"] == "float32"
    assert main(["export", str(tiny_chat_quantized), str(exported), "--format",
                 "compressed-tensors"]) == 0
    capsys.readouterr()
    assert main(["chat", str(exported), "--prompt", MESSAGES[0]["content"],
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "compressed-tensors" in captured.err


def test_the_model_s_process_loads_with_kbbq_pl_and_keeps_the_decoded_weights(
        tiny_chat_quantized):
    """transformers' server loads the model in a spawned process, which unpickles its loader:
    kbbq-pl's loader brings kbbq-pl (the "kbbq" method) with it, keeps its setting, loads the
    quantized layers and, on the CPU, keeps their decoded weights for the process's life."""
    import pickle

    pytest.importorskip("fastapi")
    from transformers.utils import logging as hf_logging

    from kbbq_pl.cli.serving import KbbqModelLoader
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.layers import quantized_linears

    loader = KbbqModelLoader(device="cpu")
    loader.cache_weights = True
    copy = pickle.loads(pickle.dumps(loader))  # what the spawned process receives
    assert type(copy) is KbbqModelLoader and copy.cache_weights is True
    assert w4a4._decoded is None
    try:
        model, _ = copy.load_model_and_processor(str(tiny_chat_quantized))
        assert quantized_linears(model) and w4a4._decoded is not None
    finally:
        copy._cache.close()
        hf_logging.enable_progress_bar()  # the model's process shows no loading bar
    assert w4a4._decoded is None
