"""Auto-brake: the held-out split, realized-error scoring and the choice of lambda."""

from __future__ import annotations

import pytest
import torch

from kbbq_pl.formats import fake_quantize
from kbbq_pl.law import noise_law as law
from kbbq_pl.transforms.autobrake import (
    DEFAULT_GRID,
    choice_histogram,
    realized_output_error,
    select_lambda,
    split_sequences,
)
from kbbq_pl.transforms.fit import kbbq_basis, transform_inputs, transform_weight


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
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_sequences(batches, 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        split_sequences([{"input_ids": ids[:1]}], 0.5)


def test_realized_error_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 32, generator=g)
    x = torch.randn(64, 32, generator=g)
    basis = kbbq_basis(weight, law.diagonal_blocks(law.second_moment(x), 16))
    t = basis.transform(0.5)
    h = transform_inputs(x, t)
    scale = h.abs().max() / 2688
    y_hat = fake_quantize(h, "nvfp4", global_scale=scale).double() @ fake_quantize(
        transform_weight(weight, t), "nvfp4").double().T
    y = x.double() @ weight.double().T
    expected = float((y_hat - y).square().mean() / y.square().mean())
    assert realized_output_error(weight, x, t, "nvfp4") == pytest.approx(expected, rel=1e-4)


def test_select_lambda_takes_the_smallest_held_out_error():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=g)
    weight[:, 3] *= 10
    scales = torch.exp(torch.randn(64, generator=g))
    x = torch.randn(512, 64, generator=g) * scales
    fit, held = x[:256], x[256:]
    basis = kbbq_basis(weight, law.diagonal_blocks(law.second_moment(fit), 16))
    choice = select_lambda(weight, basis, held, "mxfp4")
    assert set(choice.errors) == set(DEFAULT_GRID)
    assert choice.errors[choice.lam] == min(choice.errors.values())
    assert all(v < 0 for v in choice.errors_db.values())
    text = choice_histogram({"a": choice, "b": choice}, DEFAULT_GRID)
    assert f"lambda {choice.lam:<6g}" in text and text.count("\n") == len(DEFAULT_GRID) - 1
    with pytest.raises(ValueError, match="no held-out tokens"):
        select_lambda(weight, basis, held[:0], "mxfp4")


def test_auto_lambda_in_the_pipeline_reports_choices():
    from tiny_models import tiny_model

    from kbbq_pl.eval.report_files import report_markdown
    from kbbq_pl.quant import QuantizationConfig, TransformConfig, quantize_model

    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids[i:i + 2]} for i in range(0, 8, 2)]
    reports = []
    for _ in range(2):
        model = tiny_model("llama")
        auto = QuantizationConfig(transform=TransformConfig(lam="auto"))
        reports.append(quantize_model(model, batches, auto, expected_tokens=256,
                                      progress=False))
    report = reports[0]
    assert [r.lam for r in report.layers] == [r.lam for r in reports[1].layers]
    assert len(report.autobrake) == 14
    for row in report.layers:
        choice = report.autobrake[row.name]
        assert row.lam == choice.lam and row.lam in DEFAULT_GRID
        assert choice.errors[choice.lam] == min(choice.errors.values())
    data = report.to_dict()
    assert set(data["autobrake"]["model.layers.0.mlp.up_proj"]["held_out_error_db"]) == set(
        DEFAULT_GRID)
    text = report_markdown(report)
    assert "## Auto-brake" in text and "lambda 0.625" in text


def test_auto_lambda_configuration_errors():
    from kbbq_pl.quant.config import AutoBrakeConfig, QuantizationConfig, TransformConfig

    with pytest.raises(ValueError, match="chooses KBBQ's brake"):
        QuantizationConfig(transform=TransformConfig("wush", lam="auto"))
    with pytest.raises(ValueError, match="autobrake.grid holds lambdas"):
        QuantizationConfig(transform=TransformConfig(lam="auto"),
                           autobrake=AutoBrakeConfig(grid=(0.5, 2.0)))
    with pytest.raises(ValueError, match="lies in \\[0, 1\\] or is 'auto'"):
        QuantizationConfig(transform=TransformConfig(lam="best"))


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
