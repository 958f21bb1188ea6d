"""Per-cell measurement of the noise law on real and tiny models, the report and the CLI."""

from __future__ import annotations

import copy
import gc
import json
import math
import weakref

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl import formats as F
from kbbq_pl.cli.commands import main
from kbbq_pl.eval import law_cells
from kbbq_pl.eval.law_cells import measure_law, quantized_rows
from kbbq_pl.eval.law_report import summarize, write_report
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import load_model
from kbbq_pl.law import noise_law as law
from kbbq_pl.quant.modules import linear_weight

FORMATS = ["fp8_e4m3", "nvfp4"]


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")


def batches_of(ids: torch.Tensor, size: int = 1) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids[i:i + size], "attention_mask": torch.ones_like(ids[i:i + size])}
            for i in range(0, len(ids), size)]


def minilm_batches(tokenizer, tokens: int = 128, seq_len: int = 64, seed: int = 0):
    return batches_of(token_blocks("random", tokenizer, n_tokens=tokens, seq_len=seq_len,
                                   seed=seed))


def reference_cells(model, batches, measurement, formats):
    """The cells measured the plain way: one full forward with hooks on each cell's first
    member, the whole fused weight quantized, each batch's input quantized as one tensor.
    Returns ``{cell: (records, kappa, {format: snr})}``."""
    modules = dict(model.named_modules())
    captured = {cell.cell: [] for cell in measurement.cells}
    handles = [
        modules[cell.members[0]].register_forward_pre_hook(
            lambda module, args, name=cell.cell: captured[name].append(
                args[0].reshape(-1, args[0].shape[-1])))
        for cell in measurement.cells
    ]
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for handle in handles:
        handle.remove()
    results = {}
    for cell in measurement.cells:
        records = [r for r in measurement.records if r.cell == cell.cell]
        rows = torch.tensor([r.row for r in records])
        weight = torch.cat([linear_weight(modules[m]).detach() for m in cell.members])
        x = torch.cat(captured[cell.cell]).double()
        kappa = law.kappa(weight[rows].double(), x.T @ x / x.shape[0])
        snr = {}
        for fmt in formats:
            w_hat = F.fake_quantize(weight, fmt, pad=True)[rows].double()
            signal = torch.zeros(len(rows), dtype=torch.float64)
            noise = torch.zeros(len(rows), dtype=torch.float64)
            for call in captured[cell.cell]:
                exact = call.double() @ weight[rows].double().T
                error = F.fake_quantize(call, fmt, pad=True).double() @ w_hat.T - exact
                signal += exact.square().sum(0)
                noise += error.square().sum(0)
            snr[fmt] = 10 * torch.log10(signal / noise)
        results[cell.cell] = (records, kappa, snr)
    return results


def assert_matches_reference(model, batches, measurement, formats):
    for records, kappa, snr in reference_cells(model, batches, measurement, formats).values():
        assert torch.allclose(torch.tensor([r.kappa for r in records], dtype=torch.float64),
                              kappa, rtol=1e-6)
        for fmt in formats:
            assert torch.allclose(torch.tensor([r.snr_db[fmt] for r in records],
                                               dtype=torch.float64), snr[fmt], atol=1e-4)


def test_quantized_rows_equal_rows_of_the_whole_quantized_matrix():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=g) * torch.logspace(-2, 1, 200)
    weight[123, 7] = 50.0  # the tensor amax, outside the sampled rows
    rows = torch.tensor([0, 5, 77, 299])
    for fmt in ["fp8_e4m3", "fp8_e4m3_row", "nvfp4", "mxfp4", "mxfp4_no_clip", "int8_tensor",
                "int4", "e2m1_b64_fp32"]:
        assert torch.equal(quantized_rows(weight, rows, fmt),
                           F.fake_quantize(weight, fmt, pad=True)[rows]), fmt


def test_minilm_cells_records_and_reference(minilm):
    model, tokenizer = minilm
    batches = minilm_batches(tokenizer)
    first_blocks = [r"layer\.[01]\."]  # all 24 cells: test_cli_end_to_end_on_minilm
    measurement = measure_law(model, batches, FORMATS, rows=4, seed=1, targets=first_blocks)
    assert [c.kind for c in measurement.cells] == ["qkv", "out", "up", "down"] * 2
    qkv = measurement.cells[0]
    assert qkv.members == [f"encoder.layer.0.attention.self.{n}" for n in ("query", "key", "value")]
    assert (qkv.in_features, qkv.out_features, qkv.tokens, qkv.calls) == (384, 1152, 128, 2)
    down = measurement.cells[3]
    assert (down.in_features, down.out_features) == (1536, 384)
    assert len(measurement.records) == 8 * 4 and measurement.skipped_linears == []
    for record in measurement.records:
        assert 0 < record.kappa < 1536
        for fmt in FORMATS:
            assert math.isfinite(record.snr_db[fmt])
            assert math.isclose(record.r_db[fmt],
                                record.snr_db[fmt] - 10 * math.log10(record.kappa), abs_tol=1e-9)
        assert record.snr_db["fp8_e4m3"] > record.snr_db["nvfp4"]
    # the streamed, block-by-block measurement equals the plain one, cell by cell
    assert_matches_reference(model, batches, measurement, FORMATS)
    # deterministic for a seed; another seed samples other rows
    again = measure_law(model, batches, FORMATS, rows=4, seed=1, targets=first_blocks)
    assert [(r.cell, r.row, r.kappa, r.snr_db) for r in again.records] == [
        (r.cell, r.row, r.kappa, r.snr_db) for r in measurement.records]
    other = measure_law(model, batches, ["fp8_e4m3"], rows=4, seed=2, targets=[r"layer\.0\."])
    assert [r.row for r in other.records] != [r.row for r in measurement.records[:16]]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_tiny_causal_models(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 255, (4, 32), generator=torch.Generator().manual_seed(0))
    batches = batches_of(ids, 2)
    measurement = measure_law(model, batches, FORMATS, rows=8, seed=0)
    assert [c.kind for c in measurement.cells] == ["qkv", "out", "up", "down"] * 2
    shapes = {c.kind: (c.in_features, c.out_features) for c in measurement.cells[:4]}
    if arch == "gpt2":  # Conv1D weights are stored [in, out]: the cells must read [out, in]
        assert shapes == {"qkv": (64, 192), "out": (64, 64), "up": (64, 256), "down": (256, 64)}
    else:  # q 64 + k 32 + v 32 (two key-value heads); gate 128 + up 128
        assert shapes == {"qkv": (64, 128), "out": (64, 64), "up": (64, 256), "down": (128, 64)}
    assert len(measurement.records) == 8 * 8
    assert_matches_reference(model, batches, measurement, FORMATS)
    summary = summarize(measurement)
    assert summary["formats"]["fp8_e4m3"]["records"] == 64
    assert all(row["kappa_identity"] is not None for row in summary["kappa"]["cells"])


def test_input_features_in_no_whole_block_are_reported_as_excluded():
    """kappa_b* reads whole blocks: with blocks of 48, the last 16 of 64 input features (and
    all 64 with blocks of 128) are named among the exclusions, not silently left out."""
    model = tiny_model("llama")
    ids = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
    for block_size, first in ((48, 48), (128, 0)):
        measurement = measure_law(model, batches_of(ids, 2), FORMATS, rows=2, seed=0,
                                  targets=[r"layers\.0\.self_attn\.o_proj"],
                                  block_size=block_size)
        (cell,) = measurement.cells
        assert cell.uncovered_features == 64 - first
        blocks = summarize(measurement)["excluded"]["blocks"]
        assert blocks == [{"cell": cell.cell, "block_size": block_size, "features": [first, 63],
                           "reason": f"the last {64 - first} of 64 input features fill no "
                                     f"whole block of {block_size}: kappa_b* leaves them out"}]
        assert (cell.block_kappa_star is None) == (first == 0)


def test_memory_holds_one_block_of_statistics(monkeypatch):
    """No second moment outlives its block: the number of live cell accumulators when a
    block starts does not grow with depth."""
    live: weakref.WeakSet = weakref.WeakSet()
    original = law_cells._CellAccumulator.__init__

    def tracked(self, *args, **kwargs):
        original(self, *args, **kwargs)
        live.add(self)

    monkeypatch.setattr(law_cells._CellAccumulator, "__init__", tracked)
    seen = []
    run = law_cells._BlockMeasurement.run

    def counting(self):
        gc.collect()
        seen.append(len(live))
        return run(self)

    monkeypatch.setattr(law_cells._BlockMeasurement, "run", counting)
    model = tiny_model("llama", num_hidden_layers=5)
    measure_law(model, batches_of(torch.randint(0, 255, (2, 16))), ["fp8_e4m3"], rows=2)
    assert seen == [0] * 5


@pytest.mark.parametrize("value, count", [(float("nan"), r"64 NaN and 0 Inf"),
                                          (float("inf"), r"0 NaN and 64 Inf")])
def test_non_finite_activations_name_the_layer(minilm, poison_input, value, count):
    model = copy.deepcopy(minilm[0])
    poison_input(model.encoder.layer[1].output.dense, 5, value)  # one coordinate, 64 tokens
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.dense: .*" + count):
        measure_law(model, minilm_batches(minilm[1], 64), ["fp8_e4m3"], rows=2)


def test_zero_variance_coordinates_and_dead_cells_are_reported(minilm, tmp_path):
    model = copy.deepcopy(minilm[0])
    with torch.no_grad():
        norm = model.encoder.layer[0].attention.output.LayerNorm  # feeds layer 0's up cell
        norm.weight[:17] = 0
        norm.bias[:16] = 0  # coordinates 0-15 always zero: the first block of 16 has no energy
        norm.bias[16] = 0.5  # coordinate 16 constant
        model.encoder.layer[3].attention.output.dense.weight.zero_()  # no signal in any row
    measurement = measure_law(model, minilm_batches(minilm[1], 64), FORMATS, rows=4,
                              targets=[r"layer\.[03]\."])
    up = next(c for c in measurement.cells if c.cell == "encoder.layer.0.up")
    assert up.dead_coordinates == list(range(16)) and up.constant_coordinates == [16]
    assert up.excluded_blocks == [0] and up.block_kappa_star is not None
    dead = next(c for c in measurement.cells if c.cell == "encoder.layer.3.out")
    assert len(dead.excluded_rows) == 4 and "no signal" in dead.excluded_rows[0]["reason"]
    assert dead.kappa_identity is None and dead.kappa_rotation is None
    assert len(measurement.records) == 7 * 4
    config = {"model": "minilm", "data": "random", "sequences": 1, "seq_len": 64,
              "tokens_measured": 64, "rows": 4, "seed": 0, "batch_size": 1, "block_size": 16}
    paths = write_report(measurement, tmp_path, config)
    document = json.loads(paths["law.json"].read_text())  # strict JSON: no NaN
    excluded = document["excluded"]
    assert {"cell": "encoder.layer.0.up", "zero_second_moment": list(range(16)),
            "constant_nonzero": [16]} in excluded["zero_variance_coordinates"]
    assert excluded["blocks"][0]["cell"] == "encoder.layer.0.up"
    assert len(excluded["rows"]) == 4
    law_md, kappa_md = (paths[name].read_text() for name in ("law.md", "kappa.md"))
    for text in (law_md, kappa_md):
        assert "nan" not in text.lower() and "inf" not in text.lower()
        assert "`encoder.layer.0.up`: input coordinates with zero variance" in text
        assert "row 0 of `encoder.layer.3.out`" in text or "encoder.layer.3.out" in text
    assert "| encoder.layer.3.out | 384 | 384 | n/a | n/a | n/a (n/a) |" in kappa_md


def check_report(out, formats, records):
    names = sorted(p.name for p in out.iterdir())
    assert names == ["kappa.md", "kbbq-pl.json", "law.json", "law.md", "law.png"]  # no temp files
    assert (out / "law.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((out / "law.json").read_text())
    assert document["schema"] == "kbbq-pl/law/1"
    assert set(document) >= {"config", "definitions", "formats", "spacing", "kappa", "cells",
                             "excluded", "records"}
    assert len(document["records"]) == records
    record = document["records"][0]
    assert set(record) == {"block", "layer", "cell", "kind", "row", "kappa", "snr_db", "r_db"}
    assert set(record["snr_db"]) == set(formats) == set(document["formats"])
    for fmt in formats:
        fit = document["formats"][fmt]
        assert fit["records"] == records
        for key in ("slope_per_decade", "intercept", "median_r", "rms_r", "mean_r"):
            assert isinstance(fit[key], float)
        assert math.isclose(fit["predicted_c_fmt"], law.c_fmt(fmt))
    assert len(document["spacing"]) == len(formats) * (len(formats) - 1) // 2
    assert set(document["kappa"]["medians"]) == {"kappa_identity", "kappa_rotation", "ratio",
                                                 "dex", "kappa_star", "block_kappa_star"}
    law_md = (out / "law.md").read_text()
    assert "| records |" in law_md and "slope" in law_md and "RMS" in law_md
    assert "**median**" in (out / "kappa.md").read_text()
    return document


def test_cli_end_to_end_on_minilm(tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["law", "--model", "minilm", "--data", "random", "--formats",
                 "fp8_e4m3,nvfp4", "--tokens", "128", "--seq-len", "64", "--rows", "3",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fp8_e4m3" in printed and "spacing fp8_e4m3 - nvfp4" in printed
    document = check_report(out, FORMATS, 24 * 3)
    assert document["config"]["tokens_measured"] == 128 and document["config"]["sequences"] == 2
    assert len(document["kappa"]["cells"]) == 24


def test_cli_on_wikitext(shared_data, tmp_path):
    """The law on real text with a small budget: every record sits near the line."""
    out = tmp_path / "wiki"
    code = main(["law", "--model", "minilm", "--data", str(shared_data / "wikitext2" / "valid.txt"),
                 "--formats", "fp8_e4m3", "--tokens", "128", "--seq-len", "64", "--out",
                 str(out), "--no-progress", "--targets", r"layer\.[01]\."])
    assert code == 0
    document = check_report(out, ["fp8_e4m3"], 8 * 8)
    fit = document["formats"]["fp8_e4m3"]
    assert abs(fit["median_r"] - law.c_fmt("fp8_e4m3")) < 1.0
    assert 8 < fit["slope_per_decade"] < 12 and fit["rms_r"] < 2.0


def test_cli_bad_input_exits_with_a_message(tmp_path, capsys):
    code = main(["law", "--model", "minilm", "--data", "random", "--tokens", "64", "--seq-len",
                 "64", "--targets", "q_proj", "--out", str(tmp_path / "a"), "--no-progress"])
    error = capsys.readouterr().err
    assert code == 2 and "no linear layer of BertModel matches" in error
    assert "Traceback" not in error and not (tmp_path / "a").exists()
    code = main(["law", "--model", "minilm", "--data", str(tmp_path / "missing.txt"),
                 "--tokens", "64", "--out", str(tmp_path / "b"), "--no-progress"])
    assert code == 2 and "not a file" in capsys.readouterr().err
    code = main(["law", "--model", str(tmp_path), "--data", "random", "--out",
                 str(tmp_path / "c"), "--no-progress"])
    assert code == 2 and "not a local model folder" in capsys.readouterr().err
    code = main(["law", "--model", "minilm", "--data", "random", "--formats", "fp9",
                 "--out", str(tmp_path / "d"), "--no-progress"])
    assert code == 2 and "unknown format 'fp9'" in capsys.readouterr().err
    code = main(["law", "--model", str(tmp_path / "never-loaded"), "--data", "random",
                 "--seq-len", "1", "--out", str(tmp_path / "f"), "--no-progress"])
    assert code == 2 and "seq_len (--seq-len) at least 2, got 4096 and 1" in \
        capsys.readouterr().err
    code = main(["law", "--model", "minilm", "--data", "random", "--seq-len", "1024",
                 "--out", str(tmp_path / "e"), "--no-progress"])
    assert code == 2 and "sequences of 1024 tokens are longer than BertModel reads " \
                         "(max_position_embeddings 512): pass a --seq-len of at most 512" \
                         in capsys.readouterr().err


def test_cli_on_a_saved_model_without_tokenizer(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(folder)
    out = tmp_path / "out"
    assert main(["law", "--model", str(folder), "--data", "random", "--formats", "fp8_e4m3",
                 "--tokens", "64", "--seq-len", "32", "--rows", "2", "--out", str(out),
                 "--no-progress"]) == 0
    check_report(out, ["fp8_e4m3"], 8 * 2)
    text = tmp_path / "text.txt"
    text.write_text("some words " * 100)
    assert main(["law", "--model", str(folder), "--data", str(text), "--out",
                 str(tmp_path / "out2"), "--no-progress"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err
