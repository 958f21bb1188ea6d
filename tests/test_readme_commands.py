"""The README's command lines, run as written (from a folder beside ``shared/``)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from kbbq_pl.cli.commands import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = SHARED_DATA / "tiny_llama_aidreams260K"


def readme_commands(section: str) -> list[list[str]]:
    """The ``kbbq-pl`` command lines of the bash blocks of a README section, as argv lists."""
    body = README.read_text(encoding="utf-8").split(f"\n## {section}\n")[1].split("\n## ")[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("kbbq-pl "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def test_tiny_llama_convert_quantize_eval(tmp_path, monkeypatch, capsys):
    """Convert the tiny llama2.c model, quantize it (its tokenizer has no pad token in
    llama2.c), evaluate the quantized folder: the CLI's numbers are those of
    ``from_pretrained`` + :func:`kbbq_pl.eval.benchmarks.run_benchmarks`."""
    if not (TINY / "aidreams260K.bin").is_file():
        pytest.skip(f"the tiny llama2.c model is absent ({TINY})")
    from transformers import AutoTokenizer

    from kbbq_pl import from_pretrained
    from kbbq_pl.eval.benchmarks import run_benchmarks

    (tmp_path / "shared").symlink_to(SHARED_DATA.parent, target_is_directory=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("KBBQ_PL_CACHE", str(tmp_path / "cache"))
    commands = readme_commands("Converting llama2.c checkpoints")
    assert [argv[0] for argv in commands] == ["convert-llama2c", "quantize", "eval"]
    for argv in commands:
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])
    evaluate = build_parser().parse_args(commands[2])
    printed = json.loads(Path(evaluate.out).read_text(encoding="utf-8"))
    model_dir = Path(evaluate.model)
    expected = run_benchmarks(from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir),
                              evaluate.tasks.split(","), limit=evaluate.limit,
                              data_dir=evaluate.data_dir, batch_size=evaluate.batch_size)
    for task in evaluate.tasks.split(","):
        assert printed[task]["n_docs"] == 20
        assert {k: v for k, v in printed[task].items() if k != "lm_eval"} == \
            {k: v for k, v in expected[task].items() if k != "lm_eval"}
