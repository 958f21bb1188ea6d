"""Nothing lost, nothing silently wrong: output folders, loading quantized folders, checkpoint
metadata, reports and one-line CLI errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.cli.commands import main
from kbbq_pl.io import fileio
from kbbq_pl.io.checkpoint import CheckpointError, save_quantized
from kbbq_pl.io.fileio import MARKER_NAME, OutputPathError, check_output, write_folder
from kbbq_pl.io.models import from_pretrained, load_model
from kbbq_pl.quant import (
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)

QUICK = ["--data.init_args.n_tokens", "64", "--data.init_args.seq_len", "32",
         "--eval_sentences", "4"]


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or the file itself), byte for byte."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


@pytest.fixture
def tiny_llama_dir(tmp_path):
    folder = tmp_path / "parent" / "model"
    tiny_model("llama").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """A tiny Llama quantized by ``kbbq-pl quantize``, and its source folder."""
    root = tmp_path_factory.mktemp("quantized")
    source = root / "model"
    tiny_model("llama").save_pretrained(source)
    out = root / "q"
    assert main(["quantize", "--model", str(source), "--output_dir", str(out), *QUICK]) == 0
    return out, source


def one_line_error(capsys, command: str) -> str:
    """The error: the last line on stderr (above it, at most progress bars), no traceback."""
    err = capsys.readouterr().err
    error = err.strip().splitlines()[-1]
    assert error.startswith(f"kbbq-pl {command}: error: "), err
    assert "Traceback" not in err, err
    return error


# --- the policy, in fileio ----------------------------------------------------------------

def write_two(folder: Path) -> None:
    (folder / "a.txt").write_text("a")
    (folder / "sub").mkdir()
    (folder / "sub" / "b.txt").write_text("b")


def test_a_folder_written_by_kbbq_pl_lists_its_files_and_is_replaced_only_with_overwrite(
        tmp_path):
    out = write_folder(tmp_path / "out", write_two, kind="test")
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["written_by"] == "kbbq-pl" and marker["kind"] == "test"
    assert marker["files"] == ["a.txt", "sub/b.txt"]
    with pytest.raises(OutputPathError, match="exists and is not empty; pass --overwrite"):
        write_folder(out, write_two, kind="test")
    write_folder(out, lambda f: (f / "c.txt").write_text("c"), kind="test", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["c.txt", MARKER_NAME]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind


def test_an_empty_folder_is_written_without_overwrite(tmp_path):
    (tmp_path / "empty").mkdir()
    write_folder(tmp_path / "empty", write_two, kind="test")
    assert (tmp_path / "empty" / "sub" / "b.txt").read_text() == "b"


@pytest.mark.parametrize("overwrite", [False, True])
def test_what_kbbq_pl_did_not_write_is_never_replaced(tmp_path, overwrite):
    regular = tmp_path / "file.bin"
    regular.write_bytes(b"\x00user data")
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    ours_plus = write_folder(tmp_path / "ours", write_two, kind="test")
    (ours_plus / "added.txt").write_text("added by the user")
    before = {**digest(regular), **digest(foreign), **digest(ours_plus)}
    for path, match in [(regular, "is not a folder; refusing to replace it"),
                        (foreign, "is not empty" if not overwrite else
                         f"kbbq-pl did not write it \\(no {MARKER_NAME}\\)"),
                        (ours_plus, "is not empty" if not overwrite else
                         r"holds files kbbq-pl did not write \(added.txt\)")]:
        with pytest.raises(OutputPathError, match=match):
            write_folder(path, write_two, kind="test", overwrite=overwrite)
    assert {**digest(regular), **digest(foreign), **digest(ours_plus)} == before


@pytest.mark.parametrize("relation, match", [
    ("same", "over its source"), ("inside", "inside the source"),
    ("contains", "contains the source")])
def test_an_output_equal_to_inside_or_around_a_source_is_refused(tmp_path, relation, match):
    source = tmp_path / "x" / "model"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    out = {"same": source, "inside": source / "q", "contains": tmp_path / "x"}[relation]
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match=match):
            check_output(out, overwrite=overwrite, sources=[source])
    assert digest(source) == {"model/config.json": hashlib.sha256(b"{}").hexdigest()}


def test_an_output_that_cannot_be_created_is_refused_before_the_work(tmp_path, monkeypatch):
    """A regular file above the output, or a folder above it that is not writable (a
    read-only mount: ``os.access`` says so, even to root), is refused by the check the
    commands make before any work, not when the finished output is moved into place."""
    regular = tmp_path / "afile"
    regular.write_text("precious")
    with pytest.raises(OutputPathError, match=f"{regular} is a file, not a folder"):
        check_output(regular / "deeper" / "out")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = fileio.os.access
    monkeypatch.setattr(fileio.os, "access",
                        lambda path, mode: Path(path) != locked and real_access(path, mode))
    with pytest.raises(OutputPathError, match=f"the folder {locked} is not writable"):
        check_output(locked / "new" / "out")
    assert regular.read_text() == "precious" and list(locked.iterdir()) == []
    assert check_output(tmp_path / "new" / "out") == tmp_path / "new" / "out"


def test_a_json_output_file_is_replaced_only_when_kbbq_pl_wrote_it(tmp_path):
    mine = tmp_path / "results.json"
    mine.write_text('{"mine": 1}')
    with pytest.raises(OutputPathError, match="exists; pass --overwrite"):
        fileio.write_output_json(mine, {"a": 1})
    with pytest.raises(OutputPathError, match="kbbq-pl did not write it"):
        fileio.write_output_json(mine, {"a": 1}, overwrite=True)
    assert mine.read_text() == '{"mine": 1}'
    ours = fileio.write_output_json(tmp_path / "ours.json", {"a": 1})
    fileio.write_output_json(ours, {"a": 2}, overwrite=True)
    assert json.loads(ours.read_text()) == {"written_by": "kbbq-pl", "a": 2}


# --- every writer -------------------------------------------------------------------------

def test_quantize_refuses_before_any_work(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Three refused outputs: an existing regular file, a folder with other files, and the
    source model's parent folder; nothing is loaded, nothing is touched."""
    import kbbq_pl.cli.quantize as cli

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(cli, "load_model", never)
    regular = tmp_path / "out.bin"
    regular.write_bytes(b"precious")
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    parent = tiny_llama_dir.parent
    before = {**digest(regular), **digest(folder), **digest(parent)}
    cases = [(regular, "is not a folder"), (folder, "kbbq-pl did not write it"),
             (parent, "contains the source")]
    for out, match in cases:
        for flags in ([], ["--overwrite"]):
            code = main(["quantize", "--model", str(tiny_llama_dir), "--output_dir", str(out),
                         *flags, *QUICK])
            assert code == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("kbbq-pl quantize: error: "), err
            assert match in err or "is not empty" in err
    assert {**digest(regular), **digest(folder), **digest(parent)} == before


def test_a_truncated_model_file_is_named_in_one_line(tiny_llama_dir, tmp_path, capsys):
    weights = tiny_llama_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    before = digest(tiny_llama_dir)
    assert main(["quantize", "--model", str(tiny_llama_dir), "--output_dir",
                 str(tmp_path / "q"), *QUICK]) == 2
    assert f"{weights} cannot be read (" in one_line_error(capsys, "quantize")
    assert digest(tiny_llama_dir) == before and not (tmp_path / "q").exists()


def test_quantize_twice_needs_overwrite(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "q"
    args = ["quantize", "--model", str(tiny_llama_dir), "--output_dir", str(out), *QUICK]
    assert main(args) == 0
    first = digest(out)
    capsys.readouterr()
    assert main(args) == 2
    assert "pass --overwrite" in one_line_error(capsys, "quantize")
    assert digest(out) == first
    assert main([*args, "--overwrite"]) == 0
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["kind"] == "checkpoint" and "report.md" in marker["files"]
    assert {p.name for p in out.iterdir()} == {MARKER_NAME, *marker["files"]}


def test_compare_law_convert_and_eval_refuse_a_user_folder(tiny_llama_dir, tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("precious")
    before = digest(theirs)
    runs = {
        "compare": ["compare", "--model", str(tiny_llama_dir), "--output_dir", str(theirs),
                    "--recipes", "rtn_kbbq_nvfp4_lam0.75", "--lams", "0.5", "--tasks",
                    "fidelity", "--calibration-tokens", "64"],
        "law": ["law", "--model", str(tiny_llama_dir), "--data", "random", "--out",
                str(theirs), "--no-progress"],
        "convert-llama2c": ["convert-llama2c", "--checkpoint", str(tmp_path / "missing.bin"),
                            "--tokenizer", str(tmp_path / "tok.bin"), "--out", str(theirs)],
        "eval": ["eval", "--model", str(tiny_llama_dir), "--out", str(theirs / "keep.txt")],
    }
    for command, argv in runs.items():
        for flags in ([], ["--overwrite"]):
            assert main([*argv, *flags]) == 2, command
            error = one_line_error(capsys, command)
            assert "kbbq-pl did not write it" in error or "pass --overwrite" in error, error
    assert digest(theirs) == before
    assert main(["law", "--model", str(tiny_llama_dir), "--data", "random", "--out",
                 str(tiny_llama_dir / "law"), "--no-progress"]) == 2
    assert "inside the source" in one_line_error(capsys, "law")


def test_save_quantized_does_not_overwrite_by_default(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    out = save_quantized(model, tmp_path / "q")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        save_quantized(model, out)
    assert save_quantized(model, out, overwrite=True) == out


def test_save_quantized_writes_its_extra_files_inside_its_folder_only(tmp_path):
    """``extra_files`` names plain files: one naming a path outside (or a file of the
    checkpoint itself) is refused, and nothing is written anywhere."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    for name in ("../victim.txt", str(victim), "sub/notes.md", "..", MARKER_NAME):
        with pytest.raises(ValueError, match="extra_files: .* plain file name|of the checkpoint"):
            save_quantized(model, tmp_path / "q", extra_files={name: "clobbered"})
    with pytest.raises(ValueError, match="'model.safetensors' is a file of the checkpoint"):
        save_quantized(model, tmp_path / "q", extra_files={"model.safetensors": "junk"})
    assert victim.read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
    out = save_quantized(model, tmp_path / "q", extra_files={"notes.md": "mine"})
    assert (out / "notes.md").read_text() == "mine"


def test_save_quantized_refuses_the_folder_the_model_was_loaded_from(tiny_llama_dir):
    """Without ``source_dir``, the folder the model's ``name_or_path`` names is the source:
    writing inside it is refused as ``kbbq-pl quantize`` refuses it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    quantize_model(model, [{"input_ids": torch.randint(0, 256, (2, 16))}], QuantizationConfig(),
                   progress=False)
    before = digest(tiny_llama_dir)
    with pytest.raises(OutputPathError, match="inside the source"):
        save_quantized(model, tiny_llama_dir / "q")
    assert digest(tiny_llama_dir) == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_mode_the_umask_gives(quantized_dir, tmp_path, umask):
    """A server under another account reads what kbbq-pl writes: every file of a quantized
    folder (``model.safetensors`` included, which safetensors creates 0600) and of its
    compressed-tensors export has the mode a new file gets under the user's umask."""
    import os
    import stat

    from kbbq_pl.io.compressed_tensors import export_compressed_tensors

    out, _ = quantized_dir
    previous = os.umask(umask)
    try:
        folder = save_quantized(from_pretrained(out), tmp_path / "q")
        exported = export_compressed_tensors(out, tmp_path / "ct")
    finally:
        os.umask(previous)
    for root in (folder, exported):
        paths = [root, *root.rglob("*")]
        assert any(p.name == "model.safetensors" for p in paths)
        modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in paths}
        assert modes == {name: (0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask
                         for name in modes}


def test_the_last_line_lists_every_file_written(quantized_dir, tmp_path, capsys):
    source = quantized_dir[1]
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(source), "--output_dir", str(out), *QUICK]) == 0
    printed = capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    assert len(files) >= 8
    line = next(line for line in printed.splitlines() if line.startswith(f"wrote {out}/"))
    assert f"({len(files)} files, " in line
    assert line.split(": ", 1)[1].split(", ") == files


def test_importing_kbbq_pl_and_running_a_command_print_nothing_but_their_output(tmp_path):
    """torchao's CUDA-extension and pytree warnings are not the user's business."""
    import subprocess
    import sys

    for code in ("import kbbq_pl", "from kbbq_pl.cli.commands import main; main(['recipes'])"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
        assert run.returncode == 0 and run.stderr == "", run.stderr


# --- one loader ---------------------------------------------------------------------------

def test_load_model_reads_a_quantized_folder_through_from_pretrained(quantized_dir):
    out, _ = quantized_dir
    model, tokenizer = load_model(out)
    reference = from_pretrained(out)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert tokenizer is None  # the tiny random Llama has none
    with pytest.raises(ValueError, match="device 'tpu' is not a device: use cpu, cuda"):
        from_pretrained(out, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': CUDA is not available on this "
                                             "machine .*; use device cpu"):
            from_pretrained(out, device="cuda")


def test_quantizing_a_quantized_model_is_refused(quantized_dir, tmp_path, capsys):
    out, source = quantized_dir
    for command, argv in [("quantize", ["--output_dir", str(tmp_path / "a"), *QUICK]),
                          ("compare", ["--output_dir", str(tmp_path / "b"), "--tasks",
                                       "fidelity", "--recipes", "i_nvfp4"])]:
        assert main([command, "--model", str(out), *argv]) == 2
        error = one_line_error(capsys, command)
        assert "is already quantized by kbbq-pl (RTN-KBBQ nvfp4, lambda 0.75 of " in error
        assert str(source) in error
    # the noise law of a quantized folder is measured on its dequantized weights
    assert main(["law", "--model", str(out), "--data", "random", "--tokens", "256",
                 "--seq-len", "64", "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "law.json").is_file()
    with pytest.raises(ValueError, match="already quantized .* e.g. model.layers.0"):
        quantize_model(from_pretrained(out), [{"input_ids": torch.ones(1, 8, dtype=torch.long)}],
                       QuantizationConfig(), progress=False)


# --- checkpoint metadata against the tensors ----------------------------------------------

@pytest.mark.parametrize("edit, match", [
    (dict(format="mxfp4"), r"weight_scale is \[64, 4\] float8_e4m3fn, but format mxfp4 .* "
                           r"stores \[64, 2\] float8_e8m0fnu"),
    (dict(padded_in=80), r"padded_in 80 is not in_features 64 rounded up"),
    (dict(in_features=80, padded_in=80), r"weight_packed is \[64, 32\] uint8, .* padded_in 80 "
                                         r"stores \[64, 40\] uint8"),
    (dict(out_features=32), r"weight_packed is \[64, 32\] uint8, .*out_features 32"),
    (dict(transform=[2, 32, 32]), r"transform is \[4, 16, 16\], metadata says \[2, 32, 32\]"),
    (dict(transform=None), r"transform is stored, but the metadata says None"),
    (dict(dtype="int8"), r"dtype 'int8' is not float32"),
    (dict(format="e2m1_b16_fp32"), r"weight_scale is \[64, 4\] float8_e4m3fn, but format "
                                   r"e2m1_b16_fp32 .* stores \[64, 4\] float32"),
    (dict(format="fp9"), r"unusable metadata"),
])
def test_metadata_that_disagrees_with_the_tensors_names_layer_and_values(quantized_dir, tmp_path,
                                                                         edit, match):
    import shutil

    out, _ = quantized_dir
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config_path = copy / "quantization_config.json"
    metadata = json.loads(config_path.read_text())
    metadata["layers"]["model.layers.1.self_attn.q_proj"].update(edit)
    config_path.write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.self_attn\.q_proj: " + match):
        from_pretrained(copy)


# --- reports ------------------------------------------------------------------------------

def test_gptq_report_is_labelled_from_the_whole_recipe(tiny_llama_dir, tmp_path):
    out = tmp_path / "gptq"
    assert main(["quantize", "--config", "gptq_kbbq_nvfp4", "--model", str(tiny_llama_dir),
                 "--output_dir", str(out), "--recipe.layers.targets", "[layers\\.0\\.]",
                 *QUICK]) == 0
    text = (out / "report.md").read_text()
    assert "**GPTQ-KBBQ nvfp4, lambda 0.75**" in text and "RTN-KBBQ" not in text
    assert "- GPTQ: 7 layers, Hessian damping" in text
    table = text.split("## Model")[1].split("## Summary")[0]
    assert max(len(line) for line in table.splitlines()) < 120
    report = json.loads((out / "report.json").read_text())
    assert len(report["model"]["gptq"]) == 7  # the whole structure, in report.json


def test_labels():
    auto = QuantizationConfig(transform=TransformConfig(lam="auto"))
    assert auto.label == "RTN-KBBQ nvfp4, lambda auto"
    mr_gptq = QuantizationConfig(format=FormatConfig("mxfp4"),
                                 transform=TransformConfig("hadamard"),
                                 weights=WeightsConfig("gptq", scale_search="mse"))
    assert mr_gptq.label == "MR-GPTQ mxfp4"


def test_eval_sentences_records_what_was_used(tmp_path, capsys):
    from kbbq_pl.cli.quantize import EMBEDDED
    from kbbq_pl.resources import eval_sentences

    assert len(eval_sentences()) == EMBEDDED
    args = ["quantize", "--data.init_args.n_tokens", "128", "--data.init_args.seq_len", "64",
            "--recipe.layers.targets", "[layer\\.0\\.attention\\.self\\.query]"]
    assert main([*args, "--output_dir", str(tmp_path / "a"), "--eval_sentences", "256"]) == 2
    assert "the embedded set holds 64 sentences" in one_line_error(capsys, "quantize")
    assert not (tmp_path / "a").exists()
    assert main([*args, "--output_dir", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["model"]["fidelity_samples"] == 64
    assert "eval_sentences: 64" in (tmp_path / "b" / "recipe.yaml").read_text()


# --- errors -------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("command", ["quantize", "compare", "law", "eval"])
def test_device_cuda_without_cuda_is_one_line(command, tiny_llama_dir, tmp_path, capsys):
    extra = {"quantize": [], "law": ["--data", "random", "--out", str(tmp_path / "o")],
             "compare": ["--tasks", "fidelity", "--output_dir", str(tmp_path / "c")],
             "eval": []}[command]
    assert main([command, "--model", str(tiny_llama_dir), "--device", "cuda", *extra]) == 2
    assert "CUDA is not available on this machine" in one_line_error(capsys, command)
    with pytest.raises(ValueError, match="CUDA is not available"):
        main([command, "--model", str(tiny_llama_dir), "--device", "cuda", *extra, "--debug"])


def test_bad_arguments_and_internal_errors_are_one_line(capsys, monkeypatch, tmp_path):
    assert main(["quantize", "--no_such_flag", "1"]) == 2
    assert "unrecognized arguments" in one_line_error(capsys, "quantize")
    assert main(["law", "--model", "minilm"]) == 2
    assert "(see kbbq-pl law -h)" in one_line_error(capsys, "law")
    assert main(["eval", "--model", "minilm", "--device", "tpu"]) == 2
    assert "'tpu' is not a device: use cpu, cuda or cuda:N" in one_line_error(capsys, "eval")
    assert main(["eval", "--model", "minilm", "--device", "mps"]) == 2
    assert "kbbq-pl runs on cpu or cuda" in one_line_error(capsys, "eval")
    encoder = str(load_model("minilm")[0].name_or_path)  # a local folder: before the data
    assert main(["eval", "--model", encoder]) == 2
    assert ("holds a BertModel, not a causal language model" in
            (error := one_line_error(capsys, "eval")) and "--tasks fidelity" in error)
    assert main(["eval", "--model", "minilm", "--tasks", "ppl"]) == 2  # a name: once resolved
    assert "minilm holds a BertModel" in one_line_error(capsys, "eval")
    assert main(["compare", "--model", "minilm", "--lams", "0,abc", "--output-dir",
                 str(tmp_path / "c")]) == 2
    assert "--lams '0,abc': comma-separated numbers in [0, 1]" in one_line_error(capsys, "compare")
    assert main(["formats", "--size", "-16"]) == 2
    assert "--size must be >= 1, got -16" in one_line_error(capsys, "formats")
    for field, value, got in (("batch_size", "0", "4096, 256 and 0"),
                              ("seq_len", "1", "4096, 1 and 8")):
        assert main(["quantize", f"--data.init_args.{field}", value]) == 2
        assert ("need n_tokens >= 1, seq_len >= 2 and batch_size >= 1, got " + got in
                one_line_error(capsys, "quantize"))

    import kbbq_pl.cli.commands as cli

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_formats_demo", broken)
    assert main(["formats"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("kbbq-pl formats: internal error (KeyError)") and "\n" not in error
    assert "--debug" in error
    with pytest.raises(KeyError):
        main(["formats", "--debug"])


# --- tokenizers without a pad token -------------------------------------------------------

def test_a_tokenizer_without_pad_token_pads_for_the_probe_and_is_left_as_it_was():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kbbq_pl.eval.evaluation import mean_pooled_embeddings

    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(100)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="</s>")
    assert tokenizer.pad_token is None
    sentences = ["w1 w2 w3 w4 w5 w6", "w7 w8", "w9 w10 w11", "w12"]
    body = tiny_model("llama").model
    batched = mean_pooled_embeddings(body, tokenizer, sentences, batch_size=4)
    one_by_one = mean_pooled_embeddings(body, tokenizer, sentences, batch_size=1)
    assert torch.allclose(batched, one_by_one, atol=1e-5)  # the padding is masked out
    assert tokenizer.pad_token is None
    with pytest.raises(ValueError, match="Asking to pad"):
        tokenizer(sentences, padding=True)


@pytest.mark.gpu
def test_recipe_and_law_commands_on_cuda(tiny_llama_dir, tmp_path):
    """--device cuda: calibration batches and the probe's token blocks follow the model (the
    tiny Llama has no tokenizer: the probe runs on random-token blocks)."""
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_llama_dir), "--output_dir", str(out),
                 "--device", "cuda", *QUICK, "--debug"]) == 0
    assert json.loads((out / "report.json").read_text())["model"]["fidelity_mean_cosine"] > 0.5
    assert main(["compare", "--model", str(tiny_llama_dir), "--output_dir", str(tmp_path / "s"),
                 "--recipes", "rtn_kbbq_nvfp4_lam0.75", "--lams", "0.5", "--tasks", "fidelity",
                 "--calibration-tokens", "64", "--device", "cuda", "--debug"]) == 0
    assert main(["law", "--model", str(tiny_llama_dir), "--data", "random", "--tokens", "64",
                 "--seq-len", "32", "--formats", "nvfp4", "--out", str(tmp_path / "law"),
                 "--device", "cuda", "--no-progress", "--debug"]) == 0
    model, _ = load_model(out, device="cuda")
    assert next(model.parameters()).device.type == "cuda"


@pytest.mark.parametrize("fmt, act_scale, says", [
    ("mxfp4", "static", "block scales only (no per-tensor scale)"),  # no static scale to have
    ("nvfp4", "static", "static per-tensor scale"),
    ("nvfp4", "dynamic", "dynamic per-tensor scale")])
def test_the_report_names_the_activation_scale_the_layers_have(fmt, act_scale, says):
    from kbbq_pl.eval.report_files import report_markdown
    from kbbq_pl.quant import FormatConfig, QuantizationConfig
    from kbbq_pl.quant.report import QuantizationReport

    recipe = QuantizationConfig(format=FormatConfig(fmt, act_scale=act_scale))
    header = report_markdown(QuantizationReport(config=recipe.to_dict(), skipped={}))
    assert header.splitlines()[2].endswith(f", activations: {says}")
