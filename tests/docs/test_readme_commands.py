"""The documentation's command lines: those of README.md and docs/**/*.md.

* the llama2.c walkthrough runs as written (from a folder beside ``shared/``);
* every ``kbbq-pl`` command line of every bash block parses (its subcommand and options exist);
* CI (``.ci/run``) runs the README's install-and-test command line as written;
* every relative link (file and ``#anchor``) and every repository path in backticks exists.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from kbbq_pl.cli.commands import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TINY = SHARED_DATA / "tiny_llama_aidreams260K"


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def markdown_section(section: str) -> tuple[Path, str]:
    """The body of the ``## section`` of the first document (README.md, then docs/**/*.md) that
    has one, up to the next ``## `` heading."""
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        if f"\n## {section}\n" in text:
            return path, text.split(f"\n## {section}\n")[1].split("\n## ")[0]
    raise AssertionError(f"no document has a section '## {section}': "
                         f"{[_name(p) for p in DOCUMENTS]}")


def bash_commands(body: str) -> list[list[str]]:
    """The ``kbbq-pl`` command lines of the bash blocks of ``body``, as argv lists (without
    ``kbbq-pl``); a line chaining commands with ``&&`` counts each ``kbbq-pl`` part."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                if part.strip().startswith("kbbq-pl"):
                    commands.append(shlex.split(part, comments=True)[1:])
    return commands


def readme_commands(section: str) -> list[list[str]]:
    """The ``kbbq-pl`` command lines of the bash blocks of a documentation section."""
    return bash_commands(markdown_section(section)[1])


DOCUMENTED = [(f"{_name(path)}:{' '.join(argv)[:60]}", argv) for path in DOCUMENTS
              for argv in bash_commands(path.read_text(encoding="utf-8"))]


def test_the_documents_have_commands():
    assert len(DOCUMENTED) >= 20, DOCUMENTED
    assert ["quantize"] in [argv for _, argv in DOCUMENTED]  # the main job, no arguments


class _Parsed(Exception):
    """Raised instead of loading a model, once a recipe command's arguments are parsed."""


@pytest.mark.parametrize("argv", [argv for _, argv in DOCUMENTED],
                         ids=[name for name, _ in DOCUMENTED])
def test_documented_command_parses(argv, monkeypatch):
    """Every documented ``kbbq-pl`` line names a subcommand and options that exist, with values
    of the right types; recipe commands also resolve their ``--config`` and build the recipe
    (paths are read from the repository root, as the README's commands are)."""
    monkeypatch.chdir(ROOT)
    if argv[0] == "quantize":
        from kbbq_pl.cli import quantize
        from kbbq_pl.cli.launch import Launch

        def parsed(*args, **kwargs):
            raise _Parsed

        monkeypatch.setattr(quantize, "_source_and_output", parsed)  # before any loading
        # --device cuda is documented for GPU machines: the device is not checked here
        monkeypatch.setattr(quantize, "launched", lambda device: contextlib.nullcontext(Launch()))
        with pytest.raises(_Parsed):
            quantize.main(argv)
    else:
        args = build_parser().parse_args(argv)
        assert callable(args.run)


def test_ci_runs_the_readme_install_and_test_command():
    """``.ci/run`` installs the project the way README.md says and runs its test command."""
    body = markdown_section("Install and test")[1]
    block = re.findall(r"```bash\n(.*?)```", body, re.S)[0].splitlines()
    line = block[block.index("# install and run the tests") + 1]
    assert line.startswith("python3 -m venv .venv"), line
    assert line.endswith("python -m pytest -n 2 --dist loadfile"), line
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert line in ci, (line, ci)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S),
                              re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


# paths the documents name as removed or renamed
GONE = {"kbbq_pl/formats/kernels.py", "formats/kernels.py", "kbbq_pl/_aliases.py",
        "kbbq_pl/quant/gptq.py", "kbbq_pl/quant/gptq_quantizer.py", "kbbq_pl/quant/rtn.py",
        "kbbq_pl/eval/report.py"}


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_links_and_paths_exist(path):
    """Relative links point to files (and headings) that exist, and every repository path in
    backticks (``kbbq_pl/...``, ``tests/...``, ``bench/...``, ...) exists."""
    text = path.read_text(encoding="utf-8")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and \
                anchor not in _anchors(linked.read_text(encoding="utf-8")):
            broken.append(target)
    for cited in re.findall(r"`((?:kbbq_pl|tests|bench|scripts|examples|recipes|callbacks)"
                            r"/[\w./-]*)", prose):
        cited = cited.rstrip(".")
        if cited not in GONE and "<" not in cited and "*" not in cited \
                and not (ROOT / cited).exists():
            broken.append(cited)
    assert not broken, broken


def test_tiny_llama_convert_quantize_eval(tmp_path, monkeypatch, capsys):
    """Convert the tiny llama2.c model, quantize it (its tokenizer has no pad token in
    llama2.c), evaluate the quantized folder: the CLI's numbers are those of
    ``from_pretrained`` + :func:`kbbq_pl.eval.tasks.run_benchmarks`."""
    if not (TINY / "aidreams260K.bin").is_file():
        pytest.skip(f"the tiny llama2.c model is absent ({TINY})")
    from transformers import AutoTokenizer

    from kbbq_pl import from_pretrained
    from kbbq_pl.eval.tasks import run_benchmarks

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
