"""Auto-brake (``transform.lam: auto``): the held-out split, the realized-error scoring shared by
RTN and GPTQ, the choice of lambda per layer and its refit on every token."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.formats import fake_quantize
from kbbq_pl.io.fileio import json_text
from kbbq_pl.law import noise_law as law
from kbbq_pl.quant import (
    AutoBrakeConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.autobrake import DEFAULT_GRID, choice_histogram, choose_lambda, output_error
from kbbq_pl.quant.layers import quantized_linears
from kbbq_pl.quant.sequential import split_calibration, split_sequences
from kbbq_pl.quant.tokens import count_tokens
from kbbq_pl.transforms.fit import kbbq_basis, transform_inputs, transform_weight

pytestmark = pytest.mark.usefixtures("one_thread")


def _eight_sequences() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i:i + 2]} for i in range(0, 8, 2)]


def test_split_is_deterministic_disjoint_and_complete():
    ids = torch.arange(40).reshape(10, 4)
    batches = [{"input_ids": ids[i:i + 3]} for i in range(0, 10, 3)]
    fit, held = split_sequences(batches, 0.5, seed=1)
    again = split_sequences(batches, 0.5, seed=1)
    assert [b["input_ids"].tolist() for b in fit] == [b["input_ids"].tolist() for b in again[0]]
    fit_rows = torch.cat([b["input_ids"] for b in fit])
    held_rows = torch.cat([b["input_ids"] for b in held])
    assert len(fit_rows) == 5 and len(held_rows) == 5
    assert sorted(torch.cat([fit_rows, held_rows])[:, 0].tolist()) == list(range(0, 40, 4))
    assert max(len(b["input_ids"]) for b in fit + held) == 3
    other = split_sequences(batches, 0.5, seed=2)[1]
    assert torch.cat([b["input_ids"] for b in other]).tolist() != held_rows.tolist()
    with pytest.raises(ValueError, match="autobrake.holdout"):
        split_sequences(batches, 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        split_sequences([{"input_ids": ids[:1]}], 0.5)
    # a sequence that is all padding is in neither part (a part of it alone has no tokens)
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[1] = 0
    parts = split_sequences([{"input_ids": ids[:3], "attention_mask": mask}], 0.5)
    assert sorted(int(b["input_ids"][0, 0]) for part in parts for b in part) == [0, 8]
    with pytest.raises(ValueError, match="at least 2 calibration sequences with tokens, got 1"):
        split_sequences([{"input_ids": ids[:2], "attention_mask": mask[1:]}], 0.5)


def test_the_split_keeps_sequences_of_different_lengths_whole():
    lengths = [5, 9, 7, 5, 12, 6, 8, 5, 11, 7]
    batches = [{"input_ids": torch.arange(r, r + n)[None],
                "attention_mask": torch.ones(1, n, dtype=torch.long)}
               for r, n in enumerate(lengths)]
    batches.append({"input_ids": torch.stack([torch.arange(10, 16)] * 2),
                    "attention_mask": torch.ones(2, 6, dtype=torch.long)})
    parts = split_sequences(batches, 0.5, seed=3)
    rows = [row for part in parts for batch in part for row in batch["input_ids"]]
    assert sorted((len(r), int(r[0])) for r in rows) == sorted(
        [(n, r) for r, n in enumerate(lengths)] + [(6, 10), (6, 10)])
    for part in parts:
        for batch in part:
            assert batch["input_ids"].shape == batch["attention_mask"].shape
            assert batch["attention_mask"].all()  # nothing padded, nothing cut
            assert (batch["input_ids"][:, 1:] - batch["input_ids"][:, :-1] == 1).all()


def test_each_rank_keeps_its_share_of_each_part():
    batches = [{"input_ids": torch.full((2, 4), i)} for i in range(6)]
    whole, every = split_calibration(batches, 0.5, seed=0)
    mine = [split_calibration(batches, 0.5, seed=0, shard=(rank, 2)) for rank in range(2)]
    fits = [b for split, kept in mine for b in kept[:split.fit]]
    helds = [b for split, kept in mine for b in kept[split.fit:]]
    assert torch.equal(torch.cat([b["input_ids"] for b in fits]),
                       torch.cat([b["input_ids"] for b in every[:whole.fit]]))
    assert torch.equal(torch.cat([b["input_ids"] for b in helds]),
                       torch.cat([b["input_ids"] for b in every[whole.fit:]]))
    first_fit = mine[0][1][:mine[0][0].fit]
    assert mine[1][0].offsets[0] == sum(b["input_ids"].numel() for b in first_fit)
    assert all(split.part_tokens == whole.part_tokens for split, _ in mine)
    with pytest.raises(ValueError, match="3 processes need at least one calibration batch"):
        split_calibration(batches[:2], 0.5, shard=(0, 3))


def test_output_error_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 32, generator=g)
    x = torch.randn(64, 32, generator=g)
    basis = kbbq_basis(weight, law.diagonal_blocks(law.second_moment(x), 16))
    t = basis.transform(0.5)
    w_hat = fake_quantize(transform_weight(weight, t), "nvfp4")
    h = transform_inputs(x, t)
    scale = h.abs().max() / 2688
    y_hat = fake_quantize(h, "nvfp4", global_scale=scale).double() @ w_hat.double().T
    y = x.double() @ weight.double().T
    expected = float((y_hat - y).square().mean() / y.square().mean())
    assert output_error(weight, w_hat, x, t, "nvfp4") == pytest.approx(expected, rel=1e-4)
    dynamic = fake_quantize(h, "nvfp4").double() @ w_hat.double().T
    assert output_error(weight, w_hat, x, t, "nvfp4", "dynamic") == pytest.approx(
        float((dynamic - y).square().mean() / y.square().mean()), rel=1e-4)


def test_choose_lambda_takes_the_smallest_held_out_error_first_in_grid_order():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=g)
    weight[:, 3] *= 10
    x = torch.randn(512, 64, generator=g) * torch.exp(torch.randn(64, generator=g))
    fit, held = x[:256], x[256:]
    basis = kbbq_basis(weight, law.diagonal_blocks(law.second_moment(fit), 16))

    def candidate(lam):
        t = basis.transform(lam)
        return fake_quantize(transform_weight(weight, t), "mxfp4"), t

    choice = choose_lambda(weight, held, candidate, "mxfp4", act_scale="dynamic")
    assert set(choice.errors) == set(DEFAULT_GRID)
    assert choice.errors[choice.lam] == min(choice.errors.values())
    w_hat, t = candidate(0.5)
    assert choice.errors[0.5] == output_error(weight, w_hat, held, t, "mxfp4", "dynamic")
    assert all(v < 0 for v in choice.errors_db.values())
    text = choice_histogram({"a": choice, "b": choice}, DEFAULT_GRID)
    assert f"lambda {choice.lam:<6g}" in text and text.count("\n") == len(DEFAULT_GRID) - 1
    same = choose_lambda(weight, held, lambda lam: candidate(0.5), "mxfp4", grid=(1.0, 0.25))
    assert same.lam == 1.0  # every candidate alike: the first in grid order
    with pytest.raises(ValueError, match="no held-out tokens"):
        choose_lambda(weight, held[:0], candidate, "mxfp4")
    # held-out outputs without energy: every error is undefined (NaN, not -inf dB, which
    # would read as exact), the first lambda of the grid is kept, and report.json stays JSON
    dead = choose_lambda(weight, torch.zeros_like(held), candidate, "mxfp4", grid=(0.75, 0.25))
    assert dead.lam == 0.75 and all(math.isnan(e) for e in dead.errors_db.values())
    assert json.loads(json_text({"held_out_error_db": dead.errors_db})) == {
        "held_out_error_db": {"0.75": None, "0.25": None}}


@pytest.mark.parametrize("quantizer", ["rtn", "gptq"])
def test_auto_lambda_chooses_per_layer_and_refits_on_every_token(quantizer):
    """Every layer keeps the candidate of its smallest held-out error, and its transform is
    refitted on every token: block 0's layers (which see the same inputs in every recipe) equal
    the fixed-lambda recipe's at their chosen lambda, up to the order in which the fitting and
    held-out moments are summed.  Compared as ``T^T T`` within 1% (Frobenius): ``T``'s Hadamard
    factor mixes the eigenvectors of the paired spectrum, which near-degenerate eigenvalues
    leave free to turn with the last bits of the moments (one of ``o_proj``'s blocks here: its
    ``T`` moved by 0.4% and ``T^T T`` by 0.1% on an AMD EPYC, not on an Intel Xeon), while a
    transform fitted on half of the tokens moves ``T^T T`` by 5% or more in every layer."""
    from kbbq_pl.eval.report_files import report_markdown

    batches = _eight_sequences()
    grid = (0.25, 0.75, 1.0)
    auto = QuantizationConfig(transform=TransformConfig(lam="auto"),
                              weights=WeightsConfig(quantizer),
                              autobrake=AutoBrakeConfig(grid=grid))
    model = tiny_model("llama")
    report = quantize_model(model, batches, auto, progress=False)
    again = quantize_model(tiny_model("llama"), batches, auto, progress=False)
    assert report.to_dict()["autobrake"] == again.to_dict()["autobrake"]  # deterministic
    assert len(report.autobrake) == 14
    assert {row.tokens for row in report.layers} == {count_tokens(batches)}  # both parts
    for row in report.layers:
        choice = report.autobrake[row.name]
        assert row.lam == choice.lam and set(choice.errors) == set(grid)
        assert choice.errors[choice.lam] == min(choice.errors.values())
    assert "## Auto-brake" in report_markdown(report)
    ours = quantized_linears(model)
    for lam in sorted({row.lam for row in report.layers if ".layers.0." in row.name}):
        fixed = tiny_model("llama")
        quantize_model(fixed, batches, QuantizationConfig(
            transform=TransformConfig(lam=lam), weights=WeightsConfig(quantizer)),
            progress=False)
        theirs = quantized_linears(fixed)
        for row in report.layers:
            if row.lam == lam and ".layers.0." in row.name:
                ours_gram, theirs_gram = (t.transpose(-1, -2) @ t for t in (
                    ours[row.name].transform, theirs[row.name].transform))
                moved = float((ours_gram - theirs_gram).norm() / theirs_gram.norm())
                assert moved <= 1e-2, (row.name, moved)


def test_rtn_auto_lambda_scores_candidates_rounded_with_the_stored_scales(monkeypatch):
    """With ``weights.scale_search: mse`` every candidate is scored rounded with the MSE block
    scales its layer is stored with, not with min-max ones (max difference 0.75 of a weight
    before)."""
    import kbbq_pl.quant.rtn.quantizer as rtn_quantizer
    from kbbq_pl.quant.rtn import rtn

    scored = []

    def recording(weight, samples, candidate, *args):
        for lam in (0.25, 1.0):
            w_hat, transform = candidate(lam)
            scored.append((w_hat, transform_weight(weight.float(), transform)))
        return choose_lambda(weight, samples, candidate, *args)

    monkeypatch.setattr(rtn_quantizer, "choose_lambda", recording)
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                weights=WeightsConfig(scale_search="mse"),
                                autobrake=AutoBrakeConfig(grid=(0.25, 1.0)))
    quantize_model(tiny_model("llama"), _eight_sequences(), config, progress=False)
    assert len(scored) == 28
    assert all(torch.equal(w_hat, rtn(w, "nvfp4", search="mse")[1]) for w_hat, w in scored)
    assert any(not torch.equal(w_hat, fake_quantize(w, "nvfp4")) for w_hat, w in scored)


def test_auto_lambda_calibrates_on_sequences_of_different_lengths():
    """An encoder calibrated on whole sentences, one per batch: the split keeps them whole and
    the choice is deterministic."""
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(0, 256, (1, n), generator=g),
                "attention_mask": torch.ones(1, n, dtype=torch.long)}
               for n in (12, 30, 17, 25, 9, 21, 14, 28)]
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                autobrake=AutoBrakeConfig(grid=(0.25, 0.75)))
    report = quantize_model(tiny_model("llama"), batches, config, progress=False)
    again = quantize_model(tiny_model("llama"), batches, config, progress=False)
    assert report.to_dict()["autobrake"] == again.to_dict()["autobrake"]
    assert {row.lam for row in report.layers} <= {0.25, 0.75}


def test_auto_lambda_configuration_errors():
    with pytest.raises(ValueError, match="chooses KBBQ's brake"):
        QuantizationConfig(transform=TransformConfig("wush", lam="auto"))
    with pytest.raises(ValueError, match="autobrake.grid holds lambdas"):
        AutoBrakeConfig(grid=(0.5, 2.0))
    with pytest.raises(ValueError, match="autobrake.holdout is a fraction"):
        AutoBrakeConfig(holdout=1.0)
    with pytest.raises(ValueError, match="autobrake.tokens is a positive integer"):
        AutoBrakeConfig(tokens=0)
    with pytest.raises(ValueError, match="lies in \\[0, 1\\] or is 'auto'"):
        QuantizationConfig(transform=TransformConfig(lam="best"))
    with pytest.raises(ValueError, match="autobrake.scope: lam: auto chooses per layer"):
        QuantizationConfig.from_dict({"autobrake": {"scope": "model"}})


def test_samples_are_spread_over_every_sequence_position():
    from kbbq_pl.quant.stats import spread_sample

    # 64 blocks of 256 tokens, one in four kept: every position (the last one, [SEP], too)
    # is kept about 16 times; every 4th token would never keep position 255
    chosen = torch.nonzero(spread_sample(0, 64 * 256, 4)).flatten()
    assert abs(len(chosen) - 64 * 64) <= 2
    per_position = torch.bincount(chosen % 256, minlength=256)
    assert per_position.min() >= 8 and per_position.max() <= 24
    # a function of the global index: split calls pick the same tokens as one call
    assert torch.equal(torch.cat([spread_sample(0, 1000, 3), spread_sample(1000, 24, 3)]),
                       spread_sample(0, 1024, 3))
    assert spread_sample(5, 7, 1).all()
