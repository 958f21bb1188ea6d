"""Every Python block of the documentation runs as written: README.md and docs/*.md, each block
as a script of its own, in a fresh process, from a folder beside
``shared/`` (as a user in a clone next to the data would). Fragments not meant to run are
written as ```text blocks."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path = README) -> list[tuple[str, str]]:
    """``(section/index, code)`` of every ```python block of a markdown file."""
    blocks, section, counts = [], "top", {}
    lines = iter(path.read_text(encoding="utf-8").splitlines())
    for line in lines:
        if line.startswith("## "):
            section = re.sub(r"[^a-z0-9]+", "-", line[3:].lower()).strip("-")
        elif line.strip() == "```python":
            code = []
            for body in lines:
                if body.strip() == "```":
                    break
                code.append(body)
            counts[section] = counts.get(section, 0) + 1
            blocks.append((f"{section}/{counts[section]}", "\n".join(code) + "\n"))
    return blocks


def _document(path: Path) -> str:
    return path.relative_to(ROOT).with_suffix("").as_posix()


BLOCKS = [(f"{_document(path)}/{name}", code) for path in DOCUMENTS
          for name, code in python_blocks(path)]


def test_the_documents_have_python_blocks():
    readme = [name for name, _ in BLOCKS if name.startswith("README/")]
    assert len(readme) >= 3, readme
    assert len(BLOCKS) >= 8, [name for name, _ in BLOCKS]


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_python_block_runs_as_written(code, tmp_path):
    if "../shared" in code and not SHARED_DATA.is_dir():
        pytest.skip(f"the block reads ../shared/data, which is absent ({SHARED_DATA})")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KBBQ_PL_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if "kernels as K" in code:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("the kernels block needs triton (the [test] extra installs it)")
        env["TRITON_INTERPRET"] = "1"  # no GPU here: Triton's interpreter runs the kernels
    if SHARED_DATA.is_dir():
        (tmp_path / "shared").symlink_to(SHARED_DATA.parent, target_is_directory=True)
    work = tmp_path / "work"
    work.mkdir()
    script = work / "snippet.py"
    script.write_text(code, encoding="utf-8")
    run = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, f"{code}\n--- stderr ---\n{run.stderr[-4000:]}"
