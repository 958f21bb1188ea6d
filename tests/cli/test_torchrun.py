"""``torchrun --nproc_per_node 2 kbbq-pl quantize``: two gloo processes on the CPU give the
one-process checkpoint (RTN bit for bit; GPTQ within the round-off of summing Hessians)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from console_scripts import installed_command
from tiny_models import tiny_model

from kbbq_pl.cli.commands import main
from kbbq_pl.io.checkpoint import read_tensors
from kbbq_pl.io.models import from_pretrained

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or installed_command("kbbq-pl")
                                is None, reason="needs torch.distributed and the kbbq-pl script")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("src") / "llama"
    model = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(processes), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               installed_command("kbbq-pl"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _args(llama_dir: Path, recipe: str, out: Path, *extra: str) -> list[str]:
    return ["quantize", "--config", recipe, "--model", str(llama_dir), "--data.n_tokens", "512",
            "--data.seq_len", "32", "--data.batch_size", "2", "--output_dir", str(out), *extra]


MODES = {"two": (), "two-streamed": ("--stream",)}


@pytest.mark.parametrize("recipe, modes", [
    ("rtn_kbbq_nvfp4_lam0.75", ["two", "two-streamed"]),  # the default recipe: both pipelines
    ("i_mxfp4", ["two"]),
    ("rtn_kbbq_nvfp4_auto", ["two-streamed"]),
])
def test_two_processes_write_the_one_process_checkpoint_bit_for_bit(llama_dir, tmp_path,
                                                                    recipe, modes):
    assert main(_args(llama_dir, recipe, tmp_path / "one")) == 0
    for mode in modes:
        result = _torchrun(_args(llama_dir, recipe, tmp_path / mode, *MODES[mode]))
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("done in") == 1  # rank 0 alone reports and writes
        one, two = read_tensors(tmp_path / "one"), read_tensors(tmp_path / mode)
        assert one.keys() == two.keys()
        assert all(torch.equal(one[k], two[k]) for k in one), mode
    report = (tmp_path / modes[0] / "report.md").read_text()
    assert "| processes | 2 |" in report
    # the report's output SNRs are measured on every rank's kept tokens, one process's sample
    snrs = [{row["name"]: row["output_snr_db"] for row in
             json.loads((tmp_path / run / "report.json").read_text())["layers"]}
            for run in ("one", modes[0])]
    assert snrs[1] == pytest.approx(snrs[0], rel=1e-5)


def test_two_processes_gptq_agrees_within_the_summation_round_off(llama_dir, tmp_path):
    recipe = "gptq_kbbq_nvfp4"
    assert main(_args(llama_dir, recipe, tmp_path / "one")) == 0
    result = _torchrun(_args(llama_dir, recipe, tmp_path / "two"))
    assert result.returncode == 0, result.stderr[-3000:]
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=True)
        full.load_state_dict({k: v.float() for k, v in read_tensors_fp(llama_dir).items()},
                             strict=False)
        full.tie_weights()
        logp = {name: m(input_ids=ids).logits.log_softmax(-1) for name, m in
                (("fp", full), ("one", from_pretrained(tmp_path / "one")),
                 ("two", from_pretrained(tmp_path / "two")))}

    def kl(p: str, q: str) -> float:
        return float((logp[p].exp() * (logp[p] - logp[q])).sum(-1).mean())

    # the Hessians differ in the order of their float64 sums only: the two quantized models
    # are a hundred times closer to each other than to the full-precision one
    assert kl("one", "two") < 0.01 * kl("fp", "one")


def read_tensors_fp(folder: Path) -> dict[str, torch.Tensor]:
    from kbbq_pl.io.streaming import SafetensorsSource

    source = SafetensorsSource(folder)
    return source.read(list(source.files))


def test_more_processes_than_batches_is_an_error_before_any_work(llama_dir, tmp_path):
    result = _torchrun(["quantize", "--model", str(llama_dir), "--data.n_tokens", "64",
                        "--data.seq_len", "32", "--data.batch_size", "2",
                        "--output_dir", str(tmp_path / "out")], processes=2)
    assert result.returncode != 0
    assert "2 processes need at least one calibration batch each; the calibration set has 1" \
        in result.stderr
    assert not (tmp_path / "out").exists()


DIE_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # the second process dies reading its second block
    from kbbq_pl.io import streaming
    _load = streaming.StreamedBlocks.load
    def _dying(self, step):
        if step.index == 1:
            os._exit(3)
        _load(self, step)
    streaming.StreamedBlocks.load = _dying
"""


def test_a_rank_that_dies_leaves_no_output(llama_dir, tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(DIE_ON_RANK_1)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "out"
    result = _torchrun(_args(llama_dir, "rtn_kbbq_nvfp4_lam0.75", out, "--stream"))
    assert result.returncode != 0
    assert "exitcode  : 3" in result.stderr, result.stderr[-2000:]  # torchrun names the rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hooks"]  # no folder, no staging
