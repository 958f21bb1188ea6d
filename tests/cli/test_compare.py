"""``kbbq-pl compare`` (kbbq_pl.cli.compare) on the real tiny llama2.c model."""

from __future__ import annotations

import json

import pytest

from kbbq_pl.cli import main
from kbbq_pl.cli.compare import compare_markdown, recovery, table_recipes, task_average
from kbbq_pl.io.fileio import OutputPathError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_table_pieces():
    assert recovery(45.0, 50.0) == pytest.approx(90.0)
    assert recovery(None, 50.0) is None and recovery(45.0, 0.0) is None
    assert task_average({"a": 40.0, "b": 60.0}) == 50.0 and task_average({}) is None
    names = table_recipes()
    assert len(names) == 18 and names[3] == "rtn_kbbq_nvfp4_lam0.75" and names[-1] == \
        "gptq_kbbq_mxfp4"
    table = compare_markdown([{"format": "nvfp4", "method": "I", "perplexity": 30.0,
                               "kl": 0.4, "tasks": {"piqa": 60.0}, "average": 60.0,
                               "recovery": 95.25}], ["ppl", "kl", "piqa"])
    assert table.splitlines()[0] == "| Format | Method | PPL | KL | piqa | Average | Recovery |"
    assert "95.2%" in table or "95.3%" in table


def test_calibration_overrides_reach_every_recipe(tmp_path):
    """--calibration-source / -tokens / -text-key / -streaming override the recipe's data
    module (a chats file's ``messages``, say; a Hub dataset read as a stream); a source that
    is no file is refused then, before any work."""
    from kbbq_pl.cli.compare import load_recipe

    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    data, _, stem = load_recipe("gptq_kbbq_nvfp4", "smollm2", {
        "source": str(chats), "n_tokens": 512, "text_key": "messages"})
    assert (data.source, data.n_tokens, data.text_key, stem) == (
        str(chats), 512, "messages", "gptq_kbbq_nvfp4")
    with pytest.raises(FileNotFoundError, match="missing.jsonl' is not a file"):
        load_recipe("gptq_kbbq_nvfp4", "smollm2", {"source": str(tmp_path / "missing.jsonl")})
    assert load_recipe("gptq_kbbq_nvfp4", "smollm2", {})[0].text_key == "text"
    streamed = load_recipe("gptq_kbbq_nvfp4", "smollm2", {"source": "hf:allenai/c4:en",
                                                            "streaming": True})[0]
    assert (streamed.source, streamed.streaming) == ("hf:allenai/c4:en", True)
    assert load_recipe("gptq_kbbq_nvfp4", "smollm2", {})[0].streaming is False


def test_compare_writes_the_table_and_resumes(tiny_llama2c_folder, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("Lily and Ben went to the park. They saw a big dog and a small cat. " * 40,
                    encoding="utf-8")
    out = tmp_path / "cmp"
    argv = ["compare", "--model", str(tiny_llama2c_folder), "--recipes",
            "i_nvfp4,rtn_kbbq_nvfp4_lam0.75", "--tasks", "ppl,kl", "--text", str(text),
            "--context", "64", "--stride", "32",
            "--max-tokens", "200", "--calibration-source", str(text),
            "--calibration-tokens", "256", "--output_dir", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| Format | Method | PPL | KL | Average | Recovery |" in printed
    document = json.loads((out / "compare.json").read_text(encoding="utf-8"))
    fp, identity, kbbq = document["rows"]
    assert fp["method"] == "FP" and fp["kl"] < 1e-9
    assert identity["method"] == "I" and kbbq["method"] == "RTN-KBBQ (0.75)"
    for row in (identity, kbbq):
        assert row["kl"] > 1e-4 and row["perplexity"] > 1.0 and row["scored_tokens"] == 200
        assert row["kl_max"] > row["kl"]
        assert row["calibration"]["n_tokens"] == 256 and row["calibration"]["text_key"] == "text"
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "compare.md").read_text(encoding="utf-8").startswith("# kbbq-pl compare")

    # a finished folder is not overwritten by accident
    assert main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    # resumed: no row is recomputed (same files, same figures)
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir()}
    assert main([*argv, "--resume"]) == 0
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir()}
    again = json.loads((out / "compare.json").read_text(encoding="utf-8"))
    assert [r["kl"] for r in again["rows"]] == [r["kl"] for r in document["rows"]]
    # a changed calibration budget recomputes the recipes, not the FP row
    changed = [a if a != "256" else "512" for a in argv]
    assert main([*changed, "--resume"]) == 0
    after = {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir()}
    assert after["fp.json"] == stamps["fp.json"]
    assert after["i_nvfp4.json"] != stamps["i_nvfp4.json"]
    # a text of the same name but other content recomputes every row, the FP row too
    text.write_text("Sue had a red kite. The wind took it up into the sky. " * 40,
                    encoding="utf-8")
    assert main([*changed, "--resume"]) == 0
    assert all(after[p.name] != p.stat().st_mtime_ns for p in (out / "rows").iterdir())


def test_compare_refuses_what_it_did_not_write(tiny_llama2c_folder, tmp_path):
    from kbbq_pl.cli.compare import run_compare

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(OutputPathError, match="did not write"):
        run_compare(str(tiny_llama2c_folder), ["i_nvfp4"], foreign, resume=True, tasks=["ppl"],
                    text=foreign / "notes.txt")
    with pytest.raises(FileNotFoundError, match="packaged recipe"):
        run_compare(str(tiny_llama2c_folder), ["no_such_recipe"], tmp_path / "x", tasks=["ppl"],
                    text=foreign / "notes.txt")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [None, "i_nvfp4"])
def test_finetune_example_runs_on_the_tiny_model(tiny_llama2c_folder, tmp_path, recipe):
    """examples/finetune_smollm2.py end to end on the tiny llama2.c model (a few steps): its
    recipe (RTN-KBBQ), and plain NVFP4, whose q/k/v and gate/up share a per-tensor scale
    refreshed as the weights move (validation computes what the stored codes compute)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    settings = yaml.safe_load((root / "examples" / "finetune_smollm2.yaml").read_text())
    settings.update(model=str(tiny_llama2c_folder), calibration_tokens=512, steps=3, seq_len=64,
                    heldout_tokens=256, context=64, stride=32, val_every=1)
    config = tmp_path / "ft.yaml"
    config.write_text(yaml.safe_dump(settings))
    out = tmp_path / "ft.json"
    subprocess.run([sys.executable, str(root / "examples" / "finetune_smollm2.py"), "--config",
                    str(config), "--out", str(out), *(["--recipe", recipe] if recipe else [])],
                   check=True, cwd=root, capture_output=True)
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["fp"]["kl"] < 1e-9
    assert result["ptq"]["kl"] > 1e-4 and result["finetuned"]["kl"] > 0
    assert result["finetuned"]["kl"] != result["ptq"]["kl"]  # the weights moved
    # validated on the held-out windows after every step (TokenPerplexity, TokenKL logged by
    # Lightning); the last validation is the fine-tuned model's
    assert [row["step"] for row in result["validation"]] == [1, 2, 3]
    last = result["validation"][-1]
    assert last["perplexity"] == pytest.approx(result["finetuned"]["perplexity"], rel=1e-6)
    assert last["kl"] == pytest.approx(result["finetuned"]["kl"], rel=1e-6)
