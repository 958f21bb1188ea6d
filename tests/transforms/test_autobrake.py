"""Auto-brake: the held-out split, realized-error scoring and the choice of lambda."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model
from torch import Tensor, nn

from kbbq_pl.formats import fake_quantize
from kbbq_pl.law import noise_law as law
from kbbq_pl.transforms.autobrake import (
    DEFAULT_GRID,
    choice_histogram,
    cross_fitted_lambda,
    LambdaChoice,
    fold_sequences,
    model_finalists,
    model_lambda,
    realized_output_error,
    select_lambda,
    split_sequences,
)
from kbbq_pl.quant import (
    AutoBrakeConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.layers import quantized_linears
from kbbq_pl.quant.divergence import held_out_divergence
from kbbq_pl.transforms.fit import kbbq_basis, transform_inputs, transform_weight


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
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_sequences(batches, 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        split_sequences([{"input_ids": ids[:1]}], 0.5)


def test_folds_are_deterministic_disjoint_balanced_and_complete():
    ids = torch.arange(44).reshape(11, 4)
    batches = [{"input_ids": ids[i:i + 3]} for i in range(0, 11, 3)]
    folds = fold_sequences(batches, 4, seed=1)
    again = fold_sequences(batches, 4, seed=1)
    rows = [torch.cat([b["input_ids"] for b in fold]) for fold in folds]
    assert [r.tolist() for r in rows] == [
        torch.cat([b["input_ids"] for b in fold]).tolist() for fold in again]
    assert sorted(len(r) for r in rows) == [2, 3, 3, 3]
    assert sorted(torch.cat(rows)[:, 0].tolist()) == list(range(0, 44, 4))
    assert all(r[:, 0].tolist() == sorted(r[:, 0].tolist()) for r in rows)  # original order
    assert max(len(b["input_ids"]) for fold in folds for b in fold) == 3
    assert [r.tolist() for r in rows] != [
        torch.cat([b["input_ids"] for b in fold]).tolist()
        for fold in fold_sequences(batches, 4, seed=2)]
    with pytest.raises(ValueError, match="at least 2 folds"):
        fold_sequences(batches, 1)
    with pytest.raises(ValueError, match="needs at least 12 calibration sequences, got 11"):
        fold_sequences(batches, 12)


def _sentences(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """One unpadded sequence per batch, of the given lengths (an encoder calibrated on
    sentences); row ``r`` starts with token ``r``."""
    return [{"input_ids": torch.arange(r, r + n)[None],
             "attention_mask": torch.ones(1, n, dtype=torch.long)}
            for r, n in enumerate(lengths)]


def test_split_and_folds_keep_sequences_of_different_lengths_whole():
    lengths = [5, 9, 7, 5, 12, 6, 8, 5, 11, 7]
    batches = _sentences(lengths) + [{"input_ids": torch.stack([torch.arange(10, 16)] * 2),
                                      "attention_mask": torch.ones(2, 6, dtype=torch.long)}]
    for parts in (split_sequences(batches, 0.5, seed=3), fold_sequences(batches, 3, seed=3)):
        rows = [row for part in parts for batch in part for row in batch["input_ids"]]
        assert sorted((len(r), int(r[0])) for r in rows) == sorted(
            [(n, r) for r, n in enumerate(lengths)] + [(6, 10), (6, 10)])
        for part in parts:
            for batch in part:
                assert batch["input_ids"].shape == batch["attention_mask"].shape
                assert batch["attention_mask"].all()  # nothing padded, nothing cut
                assert (batch["input_ids"][:, 1:] - batch["input_ids"][:, :-1] == 1).all()


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_auto_lambda_calibrates_on_sequences_of_different_lengths(scope):
    """An encoder calibrated on whole sentences, one per batch: the auto-brake splits and
    compares them whole; the chosen lambda's run is the fixed recipe's, bit for bit."""
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(0, 256, (1, n), generator=g),
                "attention_mask": torch.ones(1, n, dtype=torch.long)}
               for n in (12, 30, 17, 25, 9, 21, 14, 28)]
    config = QuantizationConfig(
        transform=TransformConfig(lam="auto"),
        autobrake=AutoBrakeConfig(grid=(0.25, 0.75), scope=scope,
                                  finalists=2 if scope == "model" else 1))
    model = tiny_model("llama")
    report = quantize_model(model, batches, config, progress=False)
    assert quantize_model(tiny_model("llama"), batches, config, progress=False).to_dict()[
        "autobrake"] == report.to_dict()["autobrake"]
    if scope == "model":
        kept = report.model["autobrake_model"]["lam"]
        assert set(report.model["autobrake_model"]["finalists"]) == {0.25, 0.75}
        fixed = tiny_model("llama")
        quantize_model(fixed, batches, replace(config, transform=replace(config.transform,
                                                                       lam=kept)),
                       progress=False)
        ours, theirs = quantized_linears(model), quantized_linears(fixed)
        assert all(torch.equal(ours[n].weight.qdata, theirs[n].weight.qdata) for n in ours)


def test_cross_fitting_pools_each_fold_scored_with_the_other_folds_fit():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 32, generator=g)
    x = torch.randn(4, 96, 32, generator=g) * torch.exp(torch.randn(32, generator=g))
    sums = [law.diagonal_blocks(xk.double().T @ xk.double(), 16) for xk in x]
    grid = (0.0, 0.5, 1.0)
    choice = cross_fitted_lambda(weight, sums, [96.0] * 4, list(x), "nvfp4", grid)
    for lam in grid:  # the same sums, one fold at a time, with the library's own pieces
        error = energy = 0.0
        for k in range(4):
            rest = torch.cat([x[j] for j in range(4) if j != k])
            basis = kbbq_basis(weight, law.diagonal_blocks(law.second_moment(rest), 16))
            share = realized_output_error(weight, x[k], basis.transform(lam), "nvfp4")
            y_energy = float((x[k] @ weight.T).double().square().sum())
            error, energy = error + share * y_energy, energy + y_energy
        assert choice.errors[lam] == pytest.approx(error / energy, rel=1e-5)
    assert choice.errors[choice.lam] == min(choice.errors.values())
    with pytest.raises(ValueError, match="no scored tokens"):
        cross_fitted_lambda(weight, sums, [96.0] * 4, [xk[:0] for xk in x], "nvfp4", grid,
                            name="layer.q")


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
    from kbbq_pl.eval.report_files import report_markdown

    batches = _eight_sequences()
    reports = []
    for _ in range(2):
        model = tiny_model("llama")
        auto = QuantizationConfig(transform=TransformConfig(lam="auto"))
        reports.append(quantize_model(model, batches, auto, progress=False))
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


def test_model_lambda_takes_the_smallest_mean_error_in_db():
    # layer a prefers 0.5 by 3 dB, layers b and c prefer 1 by 2 dB: the mean picks 1
    choices = {"a": LambdaChoice(0.5, {0.5: 1e-3, 1.0: 2e-3}),
               "b": LambdaChoice(1.0, {0.5: 1.585e-3, 1.0: 1e-3}),
               "c": LambdaChoice(1.0, {0.5: 1.585e-3, 1.0: 1e-3})}
    lam, means = model_lambda(choices)
    assert lam == 1.0 and means[1.0] < means[0.5]
    assert means[0.5] == pytest.approx((-30 + 2 * 10 * math.log10(1.585e-3)) / 3)
    tie = {"a": LambdaChoice(1.0, {0.75: 1e-3, 1.0: 1e-3})}
    assert model_lambda(tie)[0] == 0.75  # the first in grid order
    with pytest.raises(ValueError, match="different candidates"):
        model_lambda({"a": choices["a"], "d": LambdaChoice(1.0, {0.25: 1.0, 1.0: 0.5})})
    with pytest.raises(ValueError, match="no layer"):
        model_lambda({})


@pytest.mark.parametrize("quantizer", ["rtn", "gptq"])
def test_model_scope_is_the_fixed_recipe_at_the_lambda_it_chose(quantizer):
    """``autobrake.scope: model`` scores like the per-layer brake, then quantizes the model
    with one lambda: the codes of the fixed-lambda recipe at that lambda, bit for bit."""
    from kbbq_pl.eval.report_files import report_markdown

    batches = _eight_sequences()
    grid = (0.25, 0.75, 1.0)
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                weights=WeightsConfig(quantizer),
                                autobrake=AutoBrakeConfig(grid=grid, scope="model"))
    model, per_layer = tiny_model("llama"), tiny_model("llama")
    source = {k: v.clone() for k, v in model.state_dict().items()}
    report = quantize_model(model, batches, config, progress=False)
    layer_scope = replace(config, autobrake=replace(config.autobrake, scope="layer"))
    layers = quantize_model(per_layer, batches, layer_scope, progress=False)
    lam, means = model_lambda(layers.autobrake)
    assert report.model["autobrake_model"]["lam"] == lam and lam in grid
    assert report.model["autobrake_model"]["mean_error_db"] == means
    assert report.model["autobrake_model"]["layer_choices"] == {
        n: c.lam for n, c in layers.autobrake.items()}
    assert {r.lam for r in report.layers} == {lam}
    assert report.config["autobrake"]["scope"] == "model"
    assert report.seconds["total"] > report.seconds["autobrake_scoring"] > 0

    fixed_model = tiny_model("llama")
    assert all(torch.equal(fixed_model.state_dict()[k], v) for k, v in source.items())
    fixed = replace(config, transform=replace(config.transform, lam=lam))
    quantize_model(fixed_model, batches, fixed, progress=False)
    ours, theirs = quantized_linears(model), quantized_linears(fixed_model)
    assert ours.keys() == theirs.keys() and len(ours) == 14
    for name in ours:
        a, b = ours[name].weight, theirs[name].weight
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale.view(torch.uint8),
                                                                b.scale.view(torch.uint8))
    assert "one for the model" in report_markdown(report)
    with pytest.raises(ValueError, match="quantizes a copy of the model first"):
        quantize_model(tiny_model("llama"), batches, config, residency=object(), progress=False)


def test_model_finalists_are_the_smallest_means_best_first():
    choices = {"a": LambdaChoice(0.5, {0.25: 4e-3, 0.5: 1e-3, 0.75: 2e-3, 1.0: 2e-3}),
               "b": LambdaChoice(1.0, {0.25: 4e-3, 0.5: 3e-3, 0.75: 2e-3, 1.0: 2e-3})}
    finalists, means = model_finalists(choices, 3)
    assert finalists == [0.5, 0.75, 1.0]  # 0.75 and 1 tie: grid order
    assert finalists[0] == model_lambda(choices)[0] and means == model_lambda(choices)[1]
    assert model_finalists(choices, 4)[0] == [0.5, 0.75, 1.0, 0.25]


def test_finalists_need_a_model_scope_and_one_held_out_split():
    for bad in (0, 4, True, 1.5):
        with pytest.raises(ValueError, match="finalists is an integer from 1 to the grid's 3"):
            AutoBrakeConfig(grid=(0.5, 0.75, 1.0), scope="model", finalists=bad)
    with pytest.raises(ValueError, match="needs autobrake.scope 'model' or 'best'"):
        AutoBrakeConfig(finalists=2)
    with pytest.raises(ValueError, match="folds must be 1"):
        AutoBrakeConfig(scope="model", finalists=2, folds=2)
    assert AutoBrakeConfig(scope="best", finalists=7).finalists == 7


@pytest.mark.parametrize("quantizer", ["rtn", "gptq"])
def test_finalists_are_compared_out_of_sample_and_the_closest_is_refitted(quantizer):
    """``autobrake.finalists: 3``: the three candidates of the smallest mean error are each
    quantized on the fitting sequences alone and compared on the held-out ones; the model is
    the fixed-lambda recipe at the closest one on every sequence, bit for bit, and the report
    holds every finalist's divergence."""
    from kbbq_pl.eval.report_files import report_markdown

    batches = _eight_sequences()
    grid = (0.25, 0.5, 0.75, 1.0)
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                weights=WeightsConfig(quantizer),
                                autobrake=AutoBrakeConfig(grid=grid, scope="model", finalists=3))
    model = tiny_model("llama")
    report = quantize_model(model, batches, config, progress=False)
    layer_scope = replace(config, autobrake=replace(config.autobrake, scope="layer",
                                                    finalists=1))
    scoring = quantize_model(tiny_model("llama"), batches, layer_scope, progress=False)
    finalists, means = model_finalists(scoring.autobrake, 3)
    one = report.model["autobrake_model"]
    assert list(one["finalists"]) == finalists and one["mean_error_db"] == means

    def fixed(lam: float) -> QuantizationConfig:
        return replace(config, transform=replace(config.transform, lam=lam))

    fitting, held_out = split_sequences(batches, 0.5, seed=0)
    trials = {lam: tiny_model("llama") for lam in finalists}
    for lam, trial in trials.items():
        quantize_model(trial, fitting, fixed(lam), progress=False)
    divergence = held_out_divergence(tiny_model("llama"), trials, held_out)
    assert one["finalists"] == {lam: value for lam, (value, _) in divergence.items()}
    kept = min(finalists, key=lambda lam: divergence[lam][0])
    assert one["lam"] == kept and {r.lam for r in report.layers} == {kept}
    assert "autobrake_best" not in report.model
    assert report.seconds["total"] == pytest.approx(sum(
        report.seconds[k] for k in ("autobrake_scoring", "autobrake_trials", "autobrake_fixed",
                                    "autobrake_compare")))
    refitted = tiny_model("llama")
    quantize_model(refitted, batches, fixed(kept), progress=False)
    ours, theirs = quantized_linears(model), quantized_linears(refitted)
    assert ours.keys() == theirs.keys() and len(ours) == 14
    for name in ours:
        a, b = ours[name].weight, theirs[name].weight
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.transform, b.transform)
    assert f"finalists {finalists[0]:g} (" in report_markdown(report)

    best = replace(config, autobrake=replace(config.autobrake, scope="best"))
    again = quantize_model(tiny_model("llama"), batches, best, progress=False)
    assert again.model["autobrake_model"] == one  # the same trials and lambda
    assert again.model["autobrake_best"]["divergence"]["model"] == one["finalists"][kept]


def _scope_best_trials(config: QuantizationConfig, lam: float, make: Callable[[], nn.Module],
                       batches: list[dict[str, Tensor]]) -> dict[str, tuple[float, str]]:
    """The divergences ``scope: best`` compares, from whole models: the per-layer auto-brake
    and the lambda, each quantized on the fitting sequences, run on the held-out ones."""
    fitting, held_out = split_sequences(batches, 0.5, seed=0)
    recipes = {"layer": replace(config, autobrake=replace(config.autobrake, scope="layer")),
               "model": replace(config, transform=replace(config.transform, lam=lam))}
    models = {name: make() for name in recipes}
    for name, recipe in recipes.items():
        quantize_model(models[name], fitting, recipe, progress=False)
    return held_out_divergence(make(), models, held_out)


@pytest.mark.parametrize("quantizer", ["rtn", "gptq"])
def test_scope_best_compares_the_per_layer_brake_and_the_lambda_out_of_sample(quantizer):
    """``autobrake.scope: best``: the per-layer auto-brake and the finalist lambda are each
    quantized on the fitting sequences alone; the report holds their divergences from the
    full-precision model on the held-out sequences and keeps the smaller."""
    from kbbq_pl.eval.report_files import report_markdown

    batches = _eight_sequences()
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                weights=WeightsConfig(quantizer),
                                autobrake=AutoBrakeConfig(grid=(0.25, 0.75, 1.0), scope="best"))
    report = quantize_model(tiny_model("llama"), batches, config, progress=False)
    lam = report.model["autobrake_model"]["lam"]
    divergence = _scope_best_trials(config, lam, lambda: tiny_model("llama"), batches)
    best = report.model["autobrake_best"]
    assert best["metric"] == "kl" and best["divergence"] == {k: v[0] for k, v in
                                                             divergence.items()}
    assert report.model["autobrake_model"]["finalists"] == {lam: divergence["model"][0]}
    assert best["kept"] == min(divergence, key=lambda k: divergence[k][0])
    assert "the closest on the held-out sequences (KL, each fitted on the others) of per layer (" \
        in report_markdown(report)


@pytest.mark.parametrize("kept", ["layer", "model"])
def test_scope_best_keeps_the_scoring_run_or_refits_the_lambda(force_scope_best, kept):
    """Whichever trial ``scope: best`` finds closest (forced here), the model is bit for bit
    that recipe's on every sequence: the per-layer auto-brake's (the scoring run, no run
    more) or the fixed lambda's."""
    force_scope_best(kept)
    batches = _eight_sequences()
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                autobrake=AutoBrakeConfig(grid=(0.25, 0.75, 1.0), scope="best"))
    model = tiny_model("llama")
    report = quantize_model(model, batches, config, progress=False)
    assert report.model["autobrake_best"]["kept"] == kept
    lam = report.model["autobrake_model"]["lam"]
    recipe = (replace(config, autobrake=replace(config.autobrake, scope="layer")) if kept == "layer"
              else replace(config, transform=replace(config.transform, lam=lam)))
    expected = tiny_model("llama")
    quantize_model(expected, batches, recipe, progress=False)
    assert (report.seconds["autobrake_fixed"] > 0) == (kept == "model")
    assert report.seconds["total"] == pytest.approx(sum(
        report.seconds[k] for k in ("autobrake_scoring", "autobrake_trials", "autobrake_fixed",
                                    "autobrake_compare")))
    ours, theirs = quantized_linears(model), quantized_linears(expected)
    assert ours.keys() == theirs.keys() and len(ours) == 14
    for name in ours:
        a, b = ours[name].weight, theirs[name].weight
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.transform, b.transform)
    with torch.no_grad():
        ids = batches[0]["input_ids"]
        assert torch.equal(model(input_ids=ids).logits, expected(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3", "llama-without-head"])
def test_scope_best_measures_block_by_block_what_the_whole_models_output(arch):
    """The held-out streams (each block run beside the pipeline, the head replayed on the last
    hidden state) give the divergences of the whole models' forwards, to the bit; a model
    without logits is compared by its last hidden state."""

    def make():
        return tiny_model("llama").model if arch == "llama-without-head" else tiny_model(arch)

    batches = _eight_sequences()
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                autobrake=AutoBrakeConfig(grid=(0.25, 1.0), scope="best"))
    report = quantize_model(make(), batches, config, progress=False)
    lam = report.model["autobrake_model"]["lam"]
    divergence = _scope_best_trials(config, lam, make, batches)
    best = report.model["autobrake_best"]
    assert best["divergence"] == {k: v[0] for k, v in divergence.items()}
    assert best["metric"] == ("cosine_distance" if arch == "llama-without-head" else "kl")


def test_held_out_divergence_is_zero_for_the_same_model_and_uses_hidden_states_without_logits():

    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
    assert held_out_divergence(tiny_model("llama"), {"same": tiny_model("llama")},
                               batches) == {"same": (0.0, "kl")}
    encoder, other = tiny_model("llama").model, tiny_model("llama", seed=1).model
    ((error, metric),) = held_out_divergence(encoder, {"other": other}, batches).values()
    with torch.no_grad():
        want, got = encoder(input_ids=ids)[0].double(), other(input_ids=ids)[0].double()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert metric == "cosine_distance" and error == pytest.approx(float((1 - cosine).mean()))
    # masked positions do not count; every kept token counts alike, whatever its norm
    mask = torch.ones_like(ids)
    mask[:, 12:] = 0
    masked = [{"input_ids": ids[:2], "attention_mask": mask[:2]},
              {"input_ids": ids[2:], "attention_mask": mask[2:]}]
    with torch.no_grad():
        want = encoder(input_ids=ids, attention_mask=mask)[0].double()
        got = other(input_ids=ids, attention_mask=mask)[0].double()
    expected = (1 - torch.nn.functional.cosine_similarity(got, want, dim=-1))[:, :12].mean()
    ((error, _),) = held_out_divergence(encoder, {"other": other}, masked).values()
    assert error == pytest.approx(float(expected))


def test_cross_fitted_auto_lambda_in_the_pipeline():
    """``autobrake.folds: 4``: every layer's lambda is the cross-fitted choice and its
    transform the one fitted on all tokens (the fixed-lambda recipe's at that lambda, up to
    the order in which the batches' moments are summed)."""

    batches = _eight_sequences()
    config = QuantizationConfig(transform=TransformConfig(lam="auto"),
                                autobrake=AutoBrakeConfig(folds=4, tokens=256))
    model = tiny_model("llama")
    report = quantize_model(model, batches, config, progress=False)
    assert len(report.autobrake) == 14
    chosen = {row.name: row.lam for row in report.layers}
    assert all(choice.errors[choice.lam] == min(choice.errors.values())
               for choice in report.autobrake.values())
    for lam in sorted(set(chosen.values())):
        fixed = tiny_model("llama")
        quantize_model(fixed, batches, QuantizationConfig(transform=TransformConfig(lam=lam)),
                       progress=False)
        ours, theirs = quantized_linears(model), quantized_linears(fixed)
        for name in (n for n, v in chosen.items() if v == lam and n.startswith("model.layers.0")):
            torch.testing.assert_close(ours[name].transform, theirs[name].transform,
                                       rtol=1e-5, atol=1e-6, msg=name)


def test_auto_lambda_configuration_errors():
    from kbbq_pl.quant.config import (
        AutoBrakeConfig,
        QuantizationConfig,
        TransformConfig,
        WeightsConfig,
    )

    with pytest.raises(ValueError, match="chooses KBBQ's brake"):
        QuantizationConfig(transform=TransformConfig("wush", lam="auto"))
    with pytest.raises(ValueError, match="autobrake.grid holds lambdas"):
        QuantizationConfig(transform=TransformConfig(lam="auto"),
                           autobrake=AutoBrakeConfig(grid=(0.5, 2.0)))
    with pytest.raises(ValueError, match="lies in \\[0, 1\\] or is 'auto'"):
        QuantizationConfig(transform=TransformConfig(lam="best"))
    with pytest.raises(ValueError, match="autobrake.folds is a positive integer"):
        AutoBrakeConfig(folds=0)
    with pytest.raises(ValueError, match="refit: true"):
        AutoBrakeConfig(folds=4, refit=False)
    with pytest.raises(ValueError, match="cross-fitting is implemented for RTN-KBBQ"):
        QuantizationConfig(transform=TransformConfig(lam="auto"),
                           weights=WeightsConfig("gptq"), autobrake=AutoBrakeConfig(folds=4))


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
