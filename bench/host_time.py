"""Host time of an eager W4A4 linear on the decode path: Triton's Python in, CUDA's launch out.

    python bench/host_time.py [--k 4096] [--reps 2000]
    python bench/host_time.py --tiny      # K = 256, a few calls

What an eager decode step pays on the host for each linear before the GPU runs anything:
``kbbq_pl.kernels.linear_w4a4``'s checks, its prepared weight, allocations, grids, and Triton's
binding of the two launches, at M = 1 and 16, for NVFP4 (static activation scale) and MXFP4,
each with KBBQ-shaped per-block transforms, on K x K weights.  The kernels are compiled for
sm_90 on this CPU and their launches recorded instead of run (``bench/_no_gpu.py``), so the
figure is everything but CUDA's own launch call (a few microseconds each on a GPU host); a CUDA
graph (or ``torch.compile`` with CUDA graphs) removes all of it.  Each row is timed as shipped
(``launch``: ``direct``, Triton's compiled kernel launched again without binding its arguments:
:mod:`kbbq_pl.kernels.direct_launch`) and with every launch through Triton (``through Triton``), in
alternating rounds.  The table: the median and the fastest of the rounds of ``--reps`` calls,
microseconds per call.

Then the siblings of one Llama attention (q, k, v: K -> K, K/4, K/4, each its own transform)
at one row: each layer's ``linear_w4a4``, one ``linear_w4a4_siblings``, and the three
``nn.Linear`` calls of a module as it ran before the grouping and hooked by
``group_sibling_linears`` (what a loaded model runs: the hooks, the first call computing all,
the others served), microseconds for the three, launched directly.

Last, a whole eager decode step (batch 1, a static cache, no CUDA graph) of a Llama small
enough that a bf16 step's time on this CPU is its host time: bf16 against W4A4, grouped and
not, launched directly and through Triton (:func:`model_rows`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # the kernels compiled, as a GPU runs them

import torch  # noqa: E402
from _no_gpu import no_gpu_launches  # noqa: E402

ROUNDS = 5


def host_us(calls: dict[str, Callable[[], object]], reps: int) -> dict[str, tuple[float, float]]:
    """Per name, (median, fastest) microseconds per call over :data:`ROUNDS` rounds of ``reps``
    calls, the calls' rounds alternating (the machine's drift shared)."""
    for call in calls.values():
        for _ in range(min(reps, 20)):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(reps):
                call()
            times[name].append((time.perf_counter() - start) / reps * 1e6)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4096, help="weights K x K")
    parser.add_argument("--reps", type=int, default=2000, help="calls per round")
    parser.add_argument("--tiny", action="store_true", help="K = 256, 20 calls a round")
    args = parser.parse_args(argv)
    k, reps = (256, 20) if args.tiny else (args.k, args.reps)
    from kbbq_pl import formats as F
    from kbbq_pl import kernels as K
    from kbbq_pl.kernels import direct_launch

    torch.manual_seed(0)
    torch.set_num_threads(1)  # host time is one thread's; no wait on another's spin
    print(f"host time of kbbq_pl.kernels.linear_w4a4 (decode path, kernels compiled for sm_90, "
          f"CUDA's launch not run), {k} x {k}, torch {torch.__version__}\n")
    print(f"{'format':8s} {'rows':>5s} {'launch':15s} {'median us':>10s} {'fastest us':>11s}")
    with ExitStack() as stack:
        stack.enter_context(no_gpu_launches())
        for fmt in ("nvfp4", "mxfp4"):
            q = F.quantize(torch.randn(k, k) * 0.02, fmt)
            d = F.get_format(fmt).block_size
            transform = torch.randn(k // d, d, d)
            scale = torch.tensor(0.01) if fmt == "nvfp4" else None
            prepared = K.prepare_weight(q.qdata, q.scale, q.global_scale, fmt, scale)
            for rows in (1, 16):
                x = torch.randn(rows, k, dtype=torch.bfloat16)

                def call(x=x):
                    K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, fmt, transform, scale,
                                  prepared=prepared, path="decode")

                def through_triton(call=call):
                    direct_launch.DIRECT = False
                    try:
                        call()
                    finally:
                        direct_launch.DIRECT = True

                figures = host_us({"direct": call, "through Triton": through_triton}, reps)
                for how, (median, fastest) in figures.items():
                    print(f"{fmt:8s} {rows:5d} {how:15s} {median:10.1f} {fastest:11.1f}",
                          flush=True)
        print(f"\nq, k, v ({k} -> {k}, {k // 4}, {k // 4}) at one row, microseconds for the "
              "three\n")
        print(f"{'format':8s} {'how':34s} {'median us':>10s} {'fastest us':>11s}")
        for fmt in ("nvfp4", "mxfp4"):
            figures = host_us(dict(sibling_calls(fmt, k, stack)), reps)
            for how, (median, fastest) in figures.items():
                print(f"{fmt:8s} {how:34s} {median:10.1f} {fastest:11.1f}", flush=True)
        model_rows(stack, steps=5 if args.tiny else 50)


MODEL = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, vocab=256)
"""The Llama of :func:`model_rows`: ``bench/gpu.py``'s, with arithmetic too small to count on a
CPU, so that a bf16 step's time is its host time too."""


def model_rows(stack: ExitStack, steps: int) -> None:
    """Host milliseconds of an eager batch-1 decode step (a static KV cache, no CUDA graph:
    ``bench/gpu.py``'s decoding, every launch from the host) of a small Llama
    (:data:`MODEL`; the same positions each round), bf16 against W4A4 with KBBQ-shaped
    blocks (``bench/gpu.py``'s quantization), grouped as loaded and each linear on its own,
    launched directly and through Triton: on a GPU whose kernels take less than this, the
    step's ratio to bf16."""
    import gpu

    from kbbq_pl import kernels as K
    from kbbq_pl._compat import cache_argument
    from kbbq_pl.kernels import direct_launch
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.siblings import group_sibling_linears

    stack.enter_context(mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)))
    stack.enter_context(mock.patch.object(K, "available", lambda device: True))
    torch.manual_seed(0)
    prompt = torch.randint(0, MODEL["vocab"], (1, 8))

    def step_ms(model) -> float:
        from transformers import StaticCache

        # room for every step: transformers may write each after the last filled slot
        cache = StaticCache(config=model.config,
                            max_cache_len=prompt.shape[1] + (ROUNDS + 1) * steps + 16)
        with_cache = {cache_argument(model): cache}
        with torch.no_grad():
            out = model(input_ids=prompt, **with_cache, use_cache=True,
                        cache_position=torch.arange(prompt.shape[1]))
            ids = out.logits[:, -1:].argmax(-1)

            def step(position: int) -> None:
                model(input_ids=ids, **with_cache, use_cache=True,
                      cache_position=torch.tensor([position]))

            step(prompt.shape[1])  # warm-up: the one-row kernels compiled
            times = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                for position in range(prompt.shape[1], prompt.shape[1] + steps):
                    step(position)
                times.append((time.perf_counter() - start) / steps * 1e3)
        return statistics.median(times)

    base = step_ms(gpu.llama(MODEL, "cpu"))
    print(f"\nan eager batch-1 decode step of a Llama ({MODEL['layers']} layers, hidden "
          f"{MODEL['hidden']}), host ms (median of {ROUNDS} rounds of {steps} steps)\n")
    print(f"{'model':8s} {'linears':14s} {'launch':15s} {'step ms':>8s} {'x bf16 time':>12s}")
    print(f"{'bf16':8s} {'-':14s} {'-':15s} {base:8.2f} {1.0:12.2f}")
    for fmt in ("nvfp4", "mxfp4"):
        model = gpu.llama(MODEL, "cpu")
        hooks = gpu.quantize_for_kernels(model, fmt, prompt)
        for linears in ("grouped", "each alone"):
            if linears == "each alone":
                hooks.remove()
            for how, direct in (("direct", True), ("through Triton", False)):
                with mock.patch.object(direct_launch, "DIRECT", direct):
                    ms = step_ms(model)
                print(f"{fmt:8s} {linears:14s} {how:15s} {ms:8.2f} {ms / base:12.2f}",
                      flush=True)
        group_sibling_linears(model)


class _Attention(torch.nn.Module):
    """q, k, v reading one input."""

    def __init__(self, layers):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = layers

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def sibling_calls(fmt: str, k: int, stack: ExitStack):
    """(how, call) for q, k, v of ``fmt`` at one row: each alone, grouped, a hooked module."""
    from kbbq_pl import formats as F
    from kbbq_pl import kernels as K
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.layers import w4a4_weight
    from kbbq_pl.quant.siblings import group_sibling_linears

    stack.enter_context(mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)))
    stack.enter_context(mock.patch.object(K, "available", lambda device: True))
    d = F.get_format(fmt).block_size
    static = F.get_format(fmt).global_scale
    linears = []
    for i, n in enumerate((k, k // 4, k // 4)):
        linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.mul_(0.05)
        weight = w4a4_weight(linear, fmt, torch.randn(k // d, d, d),
                             act_scale="static" if static else "dynamic",
                             act_global_scale=torch.tensor(0.01 * (1 + i)) if static else None)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        linears.append(linear)
    weights = [linear.weight for linear in linears]
    scales = [w.act_global_scale for w in weights]
    prepared = [w4a4._prepared_weight(K, w, s) for w, s in zip(weights, scales)]
    layers = [K.SiblingLinear(w.qdata, w.scale, w.global_scale, w.transform, s, None, p)
              for w, s, p in zip(weights, scales, prepared)]
    x = torch.randn(1, k, dtype=torch.bfloat16)
    attention, unhooked = _Attention(linears), _Attention(linears)
    group_sibling_linears(attention)

    def alone():
        for layer in layers:
            K.linear_w4a4(x, layer.weight_codes, layer.weight_scales, layer.weight_global, fmt,
                          layer.transform, layer.act_global_scale, prepared=layer.prepared,
                          path="decode")

    def grouped():
        K.linear_w4a4_siblings(x, layers, fmt)

    def hooked():
        with torch.no_grad():
            attention(x)

    def not_hooked():
        with torch.no_grad():
            unhooked(x)

    return [("each layer's linear_w4a4", alone), ("linear_w4a4_siblings", grouped),
            ("module, 3 nn.Linear calls", not_hooked),
            ("module hooked, 3 nn.Linear calls", hooked)]


if __name__ == "__main__":
    main()
