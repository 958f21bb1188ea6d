"""The GPTQ family (kbbq_pl.quant.gptq.quantizer) in the block-sequential pipeline, one and two
processes."""

from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.quant import (
    AutoBrakeConfig,
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.collectives import Collectives
from kbbq_pl.quant.gptq.quantizer import HessianCollector, assign_owners
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears

pytestmark = pytest.mark.usefixtures("one_thread")


def batches_of(ids: torch.Tensor, size: int = 2) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids[i:i + size]} for i in range(0, len(ids), size)]


def calibration_ids(rows: int = 8, length: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,transform,refit", [("llama", "kbbq", "in_loop"),
                                                  ("qwen3", "identity", "in_loop"),
                                                  ("gpt2", "hadamard", "in_loop"),
                                                  ("gpt2", "wush", "fixed")])
def test_sequential_loop_swaps_every_target_and_stays_finite(arch, transform, refit):
    model = tiny_model(arch)
    ids = calibration_ids()
    reference = model(input_ids=ids).logits
    scales = "mse" if transform == "hadamard" else "minmax"
    config = QuantizationConfig(transform=TransformConfig(transform, lam=0.5),
                                weights=WeightsConfig("gptq", transform_refit=refit,
                                                      scale_search=scales))
    report = quantize_model(model, batches_of(ids), config, progress=False)
    layers = quantized_linears(model)
    expected = 8 if arch == "gpt2" else 14
    assert len(layers) == len(report.layers) == expected
    assert not isinstance(model.lm_head, QuantizedLinear)
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.5
    for row in report.layers:
        assert row.tokens == ids.numel() and row.act_global_scale is not None
        assert row.output_snr_db > 5 and row.kappa_before > 0 and row.kappa_after > 0
    assert report.model["peak_rss_mb"] > 0 and report.model["blocks"] == 2
    assert not any(info["fallback"] for info in report.model["gptq"].values())
    assert {"calibration", "gptq", "propagation", "total"} <= set(report.seconds)


def test_blocks_are_calibrated_on_the_quantized_blocks_outputs():
    """Block 1's Hessians come from block 0 quantized W4A4 (static activation scales)."""
    model = tiny_model("llama")
    ids = calibration_ids(4)
    seen = []
    handle = model.model.layers[1].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            (args[0] if args else kwargs["hidden_states"]).detach().clone())
        if len(seen) < 2 else None, with_kwargs=True)
    gptq = QuantizationConfig(transform=TransformConfig("identity"), weights=WeightsConfig("gptq"))
    quantize_model(model, batches_of(ids), gptq, progress=False)
    handle.remove()
    hidden = model(input_ids=ids[:2], output_hidden_states=True).hidden_states[1]
    assert torch.allclose(seen[0], hidden, atol=1e-6)
    fp = tiny_model("llama")(input_ids=ids[:2], output_hidden_states=True).hidden_states[1]
    assert not torch.allclose(seen[0], fp, atol=1e-3)


def test_gptq_beats_rtn_in_the_loop_and_is_deterministic():
    model = tiny_model("llama", hidden_size=128, intermediate_size=256)
    ids = calibration_ids(8, 64)
    snrs = {}
    for quantizer in ("rtn", "gptq", "gptq"):
        m = copy.deepcopy(model)
        config = QuantizationConfig(transform=TransformConfig("identity"),
                                    weights=WeightsConfig(quantizer))
        report = quantize_model(m, batches_of(ids), config, progress=False)
        snrs.setdefault(quantizer, []).append(
            (report.summary()["median_output_snr_db"], m(input_ids=ids).logits))
    assert snrs["gptq"][0][0] > snrs["rtn"][0][0]
    assert torch.equal(snrs["gptq"][0][1], snrs["gptq"][1][1])


def test_in_loop_refit_and_unaligned_layers():
    model = tiny_model("llama", intermediate_size=172)
    ids = calibration_ids(4)
    config = QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("wush"),
                                weights=WeightsConfig("gptq"))
    report = quantize_model(model, batches_of(ids), config, progress=False)
    down = {r.name: r for r in report.layers}["model.layers.0.mlp.down_proj"]
    assert (down.in_features, down.padded_in) == (172, 192)
    assert torch.isfinite(model(input_ids=ids).logits).all()
    layer = model.model.layers[0].mlp.down_proj
    assert layer.transform.shape == (6, 32, 32) and layer.act_global_scale is None


def test_gptq_checkpoints_reload_bit_exactly(tmp_path):
    from kbbq_pl.io.checkpoint import save_quantized
    from kbbq_pl.io.models import from_pretrained

    model = tiny_model("llama")
    ids = calibration_ids(4)
    config = QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("kbbq"),
                                weights=WeightsConfig("gptq"))
    quantize_model(model, batches_of(ids), config, progress=False)
    save_quantized(model, tmp_path / "out", recipe=config.to_dict())
    reloaded = from_pretrained(tmp_path / "out")
    assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_config_fields_and_validation():
    gptq = WeightsConfig("gptq")
    assert QuantizationConfig(transform=TransformConfig("hadamard"),
                              weights=WeightsConfig("gptq", scale_search="mse")).method == "MR-GPTQ"
    assert QuantizationConfig(transform=TransformConfig("kbbq"), weights=gptq).method == "GPTQ-KBBQ"
    assert QuantizationConfig(transform=TransformConfig("identity"), weights=gptq).method == "GPTQ"
    assert QuantizationConfig(transform=TransformConfig("wush")).method == "RTN-WUSH"
    for bad, match in [
        (dict(quantizer="awq"), "weights.quantizer must be one of"),
        (dict(damping=0.0), r"weights.damping \(GPTQ's\) must be a finite positive number"),
        (dict(damping=float("inf")), r"weights.damping .* got inf"),
        (dict(scale_search="l2"), "scale_search must be one of"),
        (dict(group_scales="per_token"), "group_scales must be one of"),
        (dict(act_order="yes"), "act_order must be True, False or None"),
    ]:
        with pytest.raises(ValueError, match=match):
            WeightsConfig(**bad)
    for bad, match in [(dict(damping=-1.0), r"transform.damping .* >= 0, got -1.0"),
                       (dict(damping=float("nan")), "transform.damping .* got nan"),
                       (dict(damping="0.01"), "transform.damping .* got '0.01'"),
                       (dict(seed="abc"), "transform.seed must be an integer, got 'abc'")]:
        with pytest.raises(ValueError, match=match):
            TransformConfig(**bad)
    with pytest.raises(ValueError, match="keep_samples .* must be a positive integer, got 0"):
        QuantizationConfig(keep_samples=0)
    with pytest.raises(ValueError, match="multiple of the nvfp4 block 16"):
        QuantizationConfig(weights=WeightsConfig(block_size=24))
    for name in ("hadamard", "wush", "kbbq"):  # their blocks hold a Sylvester Hadamard factor
        with pytest.raises(ValueError, match=rf"transform '{name}' .* needs a power-of-two "
                                             r"block; format e2m1_b24_e4m3 has blocks of 24"):
            QuantizationConfig(format=FormatConfig("e2m1_b24_e4m3"),
                               transform=TransformConfig(name), weights=WeightsConfig(
                                   block_size=96))
    assert QuantizationConfig(format=FormatConfig("e2m1_b24_e4m3"),
                              transform=TransformConfig("haar"),
                              weights=WeightsConfig(block_size=96)).block == 24
    with pytest.raises(ValueError, match="act-order needs transform_refit='fixed'"):
        QuantizationConfig(transform=TransformConfig("kbbq"),
                           weights=WeightsConfig("gptq", transform_refit="in_loop", act_order=True))
    kbbq = QuantizationConfig(transform=TransformConfig("kbbq"), weights=WeightsConfig("gptq"))
    assert kbbq.refits_in_loop and not kbbq.gptq_act_order
    fixed = QuantizationConfig(transform=TransformConfig("kbbq"),
                               weights=WeightsConfig("gptq", transform_refit="fixed"))
    assert not fixed.refits_in_loop and fixed.gptq_act_order
    plain = QuantizationConfig(transform=TransformConfig("hadamard"), weights=gptq)
    assert not plain.refits_in_loop and plain.gptq_act_order  # in_loop concerns WUSH / KBBQ
    assert not QuantizationConfig(transform=TransformConfig("kbbq")).refits_in_loop


def test_rtn_with_mse_scales_and_errors_of_the_loop():
    model = tiny_model("llama")
    ids = calibration_ids(2)
    minmax = copy.deepcopy(model)
    identity = QuantizationConfig(transform=TransformConfig("identity"))
    quantize_model(minmax, batches_of(ids), identity, progress=False)
    quantize_model(model, batches_of(ids),
                   replace(identity, weights=WeightsConfig(scale_search="mse")), progress=False)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight.qdata,
                           minmax.model.layers[0].mlp.up_proj.weight.qdata)
    gptq = QuantizationConfig(weights=WeightsConfig("gptq"))
    with pytest.raises(ValueError, match="calibration set is empty"):
        quantize_model(tiny_model("llama"), [], gptq, progress=False)
    with pytest.raises(ValueError, match="needs Collectives.broadcast"):
        quantize_model(tiny_model("llama"), batches_of(ids), gptq,
                       collectives=Collectives(world_size=2), progress=False)


def test_hessians_are_shared_by_layers_reading_one_input():
    model = tiny_model("llama")
    block = model.model.layers[0]
    linears = {"q": block.self_attn.q_proj, "k": block.self_attn.k_proj}
    collector = HessianCollector(linears, 16)
    x = torch.randn(3, 5, 64)
    with collector.hooks():
        block.self_attn.q_proj(x)
        block.self_attn.k_proj(x)
    collector.reduce(lambda t: t)
    assert torch.equal(collector.stats["q"].full_sum, collector.stats["k"].full_sum)
    flat = x.reshape(-1, 64).double()
    assert torch.allclose(collector.hessian("q").double(), 2 * flat.T @ flat / 15, atol=1e-5)
    assert collector.stats["q"].count == 15


def test_layers_reading_one_input_hold_one_sum_until_their_inputs_part_ways():
    """q/k/v-like readers of one tensor hold one float64 sum, added to once per call; a layer
    whose input parts ways, or that reads the input twice, keeps its own exact sum."""
    from kbbq_pl.quant.stats import accumulate, gram

    torch.manual_seed(0)
    linears = {name: torch.nn.Linear(32, 8) for name in "abcd"}
    collector = HessianCollector(linears, 16)
    calls = [torch.randn(7, 32) for _ in range(3)]
    other = torch.randn(5, 32)
    expected = {name: torch.zeros(32, 32, dtype=torch.float64) for name in linears}
    reads = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1, "other"], "d": [0, 0, 1, 1, 2, 2]}
    with collector.hooks():
        for k, x in enumerate(calls):
            linears["a"](x), linears["b"](x)
            linears["c"](x if k < 2 else other)
            linears["d"](x), linears["d"](x)
    for name, read in reads.items():
        for r in read:
            accumulate(expected[name], gram(other if r == "other" else calls[r]))
    assert collector.stats["a"].full_sum is collector.stats["b"].full_sum
    assert collector.stats["c"].full_sum is not collector.stats["a"].full_sum
    for name in linears:
        assert torch.equal(collector.stats[name].full_sum, expected[name]), name
    collector.reduce(lambda t: t)
    assert [sorted(g) for g in collector.groups()] == [["a", "b"], ["c"], ["d"]]


def test_owner_assignment_balances_and_is_deterministic():
    costs = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0, "e": 1.0}
    owners = assign_owners(costs, 2)
    assert owners == assign_owners(dict(reversed(costs.items())), 2)
    loads = [sum(c for n, c in costs.items() if owners[n] == r) for r in range(2)]
    assert sorted(loads) == [8.0, 8.0]
    assert set(assign_owners(costs, 1).values()) == {0}


def test_auto_lambda_picks_the_best_gptq_candidate_per_layer():
    from kbbq_pl.quant.autobrake import DEFAULT_GRID
    from kbbq_pl.quant.sequential import split_sequences

    ids = calibration_ids()
    config = QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("kbbq"),
                                weights=WeightsConfig("gptq"))
    auto = replace(config, transform=TransformConfig("kbbq", "auto"))
    reports, states = [], []
    for _ in range(2):
        model = tiny_model("llama")
        reports.append(quantize_model(model, batches_of(ids), auto, progress=False))
        states.append(_quantized_state(model))
    report = reports[0]
    assert [r.lam for r in report.layers] == [r.lam for r in reports[1].layers]
    assert all(torch.equal(v, states[1][k]) for k, v in states[0].items())
    assert len(report.autobrake) == 14
    for row in report.layers:
        choice = report.autobrake[row.name]
        assert set(choice.errors) == set(DEFAULT_GRID) and row.lam == choice.lam
        assert choice.errors[choice.lam] == min(choice.errors.values())
    assert len({r.lam for r in report.layers}) > 1, "one lambda everywhere: nothing was chosen"

    # a one-point grid refitted on all tokens is GPTQ-KBBQ at that lambda, code for code, on
    # the same batches (the split re-batches the sequences: fitting part, then held-out part)
    model = tiny_model("llama")
    quantize_model(model, batches_of(ids), replace(auto, autobrake=AutoBrakeConfig(grid=(0.5,))),
                   progress=False)
    fixed = tiny_model("llama")
    fit, held_out = split_sequences(batches_of(ids), 0.5, seed=0)
    quantize_model(fixed, fit + held_out, replace(config, transform=TransformConfig("kbbq", 0.5)),
                   progress=False)
    auto_state, fixed_state = _quantized_state(model), _quantized_state(fixed)
    for key, value in fixed_state.items():
        assert torch.equal(value, auto_state[key]), key


# ----------------------------------------------------------------------- two processes

DDP_CONFIG = QuantizationConfig(format=FormatConfig("nvfp4"),
                                transform=TransformConfig("kbbq", 0.5),
                                weights=WeightsConfig("gptq"))
AUTO_CONFIGS = {"rtn auto": QuantizationConfig(transform=TransformConfig(lam="auto")),
                "gptq auto": replace(DDP_CONFIG, transform=TransformConfig(lam="auto"))}
"""Two processes given every batch (``shard=True``, as ``kbbq-pl quantize`` under torchrun)."""


def _quantized_state(model) -> dict[str, torch.Tensor]:
    state = {}
    for name, layer in quantized_linears(model).items():
        state[f"{name}.qdata"] = layer.weight.qdata
        state[f"{name}.scale"] = layer.weight.scale.view(torch.uint8)
        state[f"{name}.global_scale"] = layer.weight.global_scale
        state[f"{name}.transform"] = layer.transform
        state[f"{name}.act_global_scale"] = layer.act_global_scale
    return state


def _ddp_worker(rank: int, world_size: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        model = tiny_model("llama")
        batches = batches_of(calibration_ids())
        mine = batches[rank * len(batches) // world_size:(rank + 1) * len(batches) // world_size]
        collectives = Collectives.torch_distributed()
        quantize_model(model, mine, DDP_CONFIG, progress=False, collectives=collectives)
        states = {"fixed": _quantized_state(model)}
        for name, config in AUTO_CONFIGS.items():
            model = tiny_model("llama")
            report = quantize_model(model, batches, config, shard=True, progress=False,
                                    collectives=collectives)
            states[name] = {**_quantized_state(model), "choices": _choices(report)}
        states["rows"] = collectives.gather_rows(torch.full((rank + 1, 3), float(rank + 1)),
                                                 limit=2)
        if rank == 0:
            torch.save(states, out_file)
    finally:
        dist.destroy_process_group()


def test_two_processes_give_the_same_quantized_weights_as_one():
    """Fixed lambda on each rank's own batches; ``lam: auto`` sharded from every batch: the
    same split, held-out sample, choices and scores as one process."""
    import torch.multiprocessing as mp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same GEMM kernels as the workers
    try:
        model = tiny_model("llama")
        quantize_model(model, batches_of(calibration_ids()), DDP_CONFIG, progress=False)
        singles = {"fixed": _quantized_state(model)}
        for name, config in AUTO_CONFIGS.items():  # lam auto: one process's split and sample
            model = tiny_model("llama")
            report = quantize_model(model, batches_of(calibration_ids()), config, progress=False)
            singles[name] = {**_quantized_state(model), "choices": _choices(report)}
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        out_file = os.path.join(folder, "rank0.pt")
        mp.spawn(_ddp_worker, args=(2, init_file, out_file), nprocs=2, join=True)
        doubles = torch.load(out_file)
    assert torch.equal(doubles.pop("rows"), torch.tensor([[1.0] * 3, [2.0] * 3]))
    assert singles.keys() == doubles.keys()
    for run, single in singles.items():
        double = doubles[run]
        assert single.keys() == double.keys()
        assert single.pop("choices", None) == double.pop("choices", None), run
        for key, value in single.items():
            assert torch.equal(value, double[key]), (run, key)


def _choices(report) -> dict[str, tuple[float, dict[float, float]]]:
    return {name: (choice.lam, choice.errors) for name, choice in report.autobrake.items()}


def test_lightning_collectives_map_onto_the_strategy():
    calls = []

    class Strategy:  # the three methods of a Lightning strategy the loop uses
        global_rank, world_size = 1, 2

        def reduce(self, t, reduce_op):
            calls.append(("reduce", reduce_op))
            return t * 2

        def broadcast(self, obj, src=0):
            calls.append(("broadcast", src))
            return obj

    ops = Collectives.lightning(Strategy())
    assert (ops.rank, ops.world_size) == (1, 2) and ops.can_broadcast
    assert ops.reduce_sum(torch.ones(())) == 2 and ops.reduce_max(torch.ones(())) == 2
    assert ops.broadcast("payload", 1) == "payload"
    assert calls == [("reduce", "sum"), ("reduce", "max"), ("broadcast", 1)]
    Strategy.world_size = 1
    assert Collectives.lightning(Strategy()) == Collectives()


def test_gptq_cannot_keep_trainable_master_weights():
    with pytest.raises(ValueError, match="GPTQ stores rounded codes"):
        quantize_model(tiny_model("llama"), batches_of(calibration_ids(2)),
                       QuantizationConfig(weights=WeightsConfig("gptq")), trainable=True,
                       progress=False)


@pytest.mark.gpu
def test_sequential_loop_moves_each_block_to_the_device_and_back():
    model = tiny_model("llama")
    ids = calibration_ids(4)
    config = QuantizationConfig(transform=TransformConfig("kbbq"), weights=WeightsConfig("gptq"))
    report = quantize_model(model, batches_of(ids), config, device="cuda", progress=False)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert report.model["peak_cuda_mb"] > 0 and len(report.layers) == 14
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_part_with_fewer_batches_than_processes_is_an_error_before_any_work():
    model = tiny_model("llama")
    auto = QuantizationConfig(transform=TransformConfig(lam="auto"))
    batches = batches_of(calibration_ids(rows=4))  # two batches: one to fit, one held out
    with pytest.raises(ValueError, match="2 processes need at least one calibration batch each; "
                                         "the fitting part has 1"):
        quantize_model(model, batches, auto, shard=True,
                       collectives=Collectives(rank=1, world_size=2), progress=False)
    assert not quantized_linears(model)
