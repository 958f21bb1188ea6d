"""W4A4 on one GPU, side by side with bf16: activation quantization, the GEMM, a whole model.

    python bench/gpu.py [--sections act,gemm,model] [--formats nvfp4,mxfp4] [--rep-ms 200]
    python bench/gpu.py --dry-run     # tiny shapes on the CPU under TRITON_INTERPRET=1

Every ratio compares two measurements of one run (CUDA events, warm-up, median;
``triton.testing.do_bench`` clears the L2 cache between repeats, so the 32 MB of packed weights
are read from memory as the 134 MB of bf16 weights are):

* activation quantize: ``kbbq_pl.kernels.quantize_activations`` on an 8192 x 8192 bf16 input
  (no transform, and one random 16 x 16 / 32 x 32 matrix per block: the KBBQ case, as costly as
  block Hadamard), bytes read + written (input, transform, codes, scales: each once) over time,
  against a device-to-device copy of the input (bytes read + written).  Target >= 0.70.  The
  ``tf32x3`` row multiplies ``T x`` on tensor cores instead of the exact FMA chain (faster, not
  bit-identical: its code mismatch rate against the exact kernel is printed beside it).
* W4A4 GEMM: ``w4a4_matmul`` on packed operands against ``torch.matmul`` in bf16 at
  K = N = 8192.  Targets: speed-up >= 2.5 at M = 1 and 16, >= 0.8 at M = 4096.
* whole model: a random-init Llama (hidden 4096, 8 layers) in bf16 against the same model with
  every decoder linear's weight a ``W4A4Weight`` (Hadamard blocks, dynamic activation
  scales; its ``F.linear`` runs ``kbbq_pl.kernels.linear_w4a4``): weight memory, batch-1
  greedy decoding (CUDA graphs), prefill of 4 x 2048 tokens, and two checks of the kernel path
  against ``W4A4Weight``'s emulation on the same GPU:
  the first block's linears on the model's own activations (each output should be within one
  bf16 rounding of the emulation's: the products agree to ~1e-7 and the bf16 outputs differ
  at near-ties), and the logits of each path against the bf16 model's.  Whole-model logits of
  the two paths are not compared with each other: in a random-init W4A4 model a one-ulp
  difference flips FP4 codes in the next layer, and the flips compound (an H100 run saw a 0.43
  relative difference for NVFP4 whose every linear agreed to 7e-5), so the check is that both
  are equally far from bf16.  Targets: memory <= 0.35, decode >= 2.0, prefill >= 0.7.

The model section quantizes the decoder linears the library's way (their weights become
``kbbq_pl.quant.w4a4.W4A4Weight``, whose ``F.linear`` dispatches to the kernels on CUDA).
Without CUDA the script exits with a message unless ``--dry-run`` is given.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

FULL = dict(act_shape=(8192, 8192), gemm_nk=8192, gemm_m=(1, 16, 4096), hidden=4096,
            intermediate=11008, heads=32, layers=8, vocab=32000, prefill=(4, 2048),
            prompt=32, decode_tokens=128, logits_tokens=16)
DRY = dict(act_shape=(20, 64), gemm_nk=64, gemm_m=(1, 20), hidden=32, intermediate=64,
           heads=2, layers=1, vocab=64, prefill=(2, 8), prompt=3, decode_tokens=2,
           logits_tokens=3)
TARGETS = {"act": 0.70, "gemm_small": 2.5, "gemm_large": 0.8, "memory": 0.35, "decode": 2.0,
           "prefill": 0.7}


@dataclass
class Timer:
    """Median seconds of ``fn()``: CUDA events through ``triton.testing.do_bench`` on GPUs;
    on the CPU (dry runs, where only the logic matters) one call timed by the host clock."""

    device: torch.device
    rep_ms: float

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return do_bench(fn, warmup=max(25, self.rep_ms // 4), rep=self.rep_ms,
                            return_mode="median") / 1e3
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row]
        print("| " + " | ".join(cells) + " |")


def random_blocks(k: int, d: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(k // d, d, d, generator=gen) / math.sqrt(d)).to(device)


# --------------------------------------------------------------------------- activations


def activation_section(shapes: dict, formats: list[str], device, timer: Timer) -> None:
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import triton_kernels as tk

    m, k = shapes["act_shape"]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    copy = torch.empty_like(x)
    t_copy = timer(lambda: copy.copy_(x))
    copy_rate = 2 * x.numel() * x.element_size() / t_copy
    rows = []
    for name in formats:
        fmt = get_format(name)
        d = fmt.block_size
        t = random_blocks(k, d, device)
        scales = [None, 0.01] if fmt.global_scale else [None]
        for transform, label in ((None, "none"), (t, f"{d}x{d} per block")):
            for scale in scales:
                written = m * k // 2 + m * k // d
                read = x.numel() * 2 + (0 if transform is None else transform.numel() * 4)
                seconds = timer(lambda: K.quantize_activations(x, transform, fmt, scale))
                rate = (read + written) / seconds
                kind = "static" if scale is not None else ("dynamic, 2 passes" if fmt.global_scale
                                                           else "-")
                rows.append([name, label, kind, "fma (exact)", seconds * 1e3, rate / 1e9,
                             rate / copy_rate, TARGETS["act"], ""])
        if device.type == "cuda":
            kind, rounding, gain = K._scale_meta(fmt)
            gs = None if not fmt.global_scale else torch.tensor(0.01, device=device)
            exact = tk.quantize_activations(x, t, d, kind, rounding, gain, gs)

            def fast():
                return tk.quantize_activations(x, t, d, kind, rounding, gain, gs,
                                               product=tk.PRODUCT_TF32X3)

            seconds = timer(fast)
            mismatch = float((fast()[0] != exact[0]).float().mean())
            rate = (x.numel() * 2 + t.numel() * 4 + m * k // 2 + m * k // d) / seconds
            rows.append([name, f"{d}x{d} per block", "static" if gs is not None else "-",
                         "tf32x3", seconds * 1e3, rate / 1e9, rate / copy_rate, TARGETS["act"],
                         f"{mismatch:.2g}"])
    print(f"\ndevice-to-device copy of {m} x {k} bf16: {t_copy * 1e3:.4g} ms, "
          f"{copy_rate / 1e9:.4g} GB/s (read + written)")
    table(f"activation quantize, {m} x {k} bf16 (bytes read + written / time, vs the copy)",
          ["format", "transform", "scale", "product", "ms", "GB/s", "x copy", "target",
           "code mismatch"], rows)


# --------------------------------------------------------------------------- GEMM


def gemm_section(shapes: dict, formats: list[str], device, timer: Timer) -> None:
    from kbbq_pl import formats as F
    from kbbq_pl import kernels as K

    n = k = shapes["gemm_nk"]
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    rows = []
    for m in shapes["gemm_m"]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        t_bf16 = timer(lambda: torch.matmul(x, w.T))
        for name in formats:
            q = F.quantize(w, name)
            a = K.quantize_activations(x, None, name)
            args = (*a, q.qdata, q.scale, q.global_scale, name)
            t_fp4 = timer(lambda: K.w4a4_matmul(*args))
            ref = K.reference_w4a4_matmul(*args)
            err = float((K.w4a4_matmul(*args, None, torch.float32).double() - ref).norm()
                        / ref.norm())
            target = TARGETS["gemm_small" if m <= 16 else "gemm_large"]
            rows.append([m, name, t_bf16 * 1e3, t_fp4 * 1e3, t_bf16 / t_fp4, target, err])
    table(f"W4A4 GEMM vs bf16 torch.matmul, K = N = {n}",
          ["M", "format", "bf16 ms", "W4A4 ms", "speed-up", "target", "fp32 rel. error"], rows)


# --------------------------------------------------------------------------- model


def llama(shapes: dict, device) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shapes["hidden"], intermediate_size=shapes["intermediate"],
                         num_attention_heads=shapes["heads"], num_key_value_heads=shapes["heads"],
                         num_hidden_layers=shapes["layers"], vocab_size=shapes["vocab"],
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def quantize_for_kernels(model: nn.Module, fmt: str) -> nn.Module:
    """Every linear of the decoder layers quantized the library's way: its weight replaced by a
    :class:`~kbbq_pl.quant.w4a4.W4A4Weight` (``Q(W T^-1)`` with one Hadamard matrix per block and
    dynamic activation scales) that computes ``F.linear`` on the kernels where they run
    (``lm_head`` and embeddings stay bf16)."""
    from kbbq_pl.formats import get_format
    from kbbq_pl.quant.layers import w4a4_weight
    from kbbq_pl.transforms.fit import hadamard

    d = get_format(fmt).block_size
    for index, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    t = hadamard(d, torch.float32).to(child.weight.device)
                    t = t.expand(child.in_features // d, d, d).contiguous()
                    weight = w4a4_weight(child, fmt, t, act_scale="dynamic",
                                         name=f"model.layers.{index}.{name}")
                    child.weight = nn.Parameter(weight, requires_grad=False)
    return model


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; for a quantized weight, its codes, scales and transforms."""
    from kbbq_pl.formats import QuantizedTensor

    if isinstance(tensor, QuantizedTensor):
        inner, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module, linears_only: bool) -> int:
    """Bytes of the model's parameters and buffers (only the decoder linears' with
    ``linears_only``)."""
    total = 0
    for name, module in model.named_modules():
        if linears_only and (not isinstance(module, nn.Linear) or name == "lm_head"):
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        total += sum(tensor_bytes(t) for t in tensors)
    return total


def decode_tokens_per_second(model, prompt: torch.Tensor, tokens: int, use_graphs: bool):
    """Batch-1 greedy decoding after ``prompt``; returns (tokens/s, how it ran)."""
    from transformers import StaticCache

    device = prompt.device
    # room for the warm-up steps too: transformers may place each step after the cache's last
    # filled slot rather than at ``cache_position`` (an index past the end asserts on the GPU)
    length = prompt.shape[1] + tokens + 16
    try:
        cache = StaticCache(config=model.config, max_cache_len=length)
    except TypeError:  # transformers 4.x
        cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=length,
                            device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(prompt.shape[1], device=device))
    ids = out.logits[:, -1:].argmax(-1)
    position = torch.tensor([prompt.shape[1]], device=device)

    def step():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                       cache_position=position).logits
        ids.copy_(logits[:, -1:].argmax(-1))
        position.add_(1)

    how = "eager"
    run = step
    if use_graphs:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(3):  # warm-up (and autotuning) outside the capture
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                step()
            run = graph.replay
            how = "CUDA graph"
        except Exception as error:  # report and measure eagerly rather than not at all
            print(f"(CUDA graph capture failed: {type(error).__name__}: {error}; decoding eagerly)")
            torch.cuda.synchronize()
    position.fill_(prompt.shape[1])
    with torch.no_grad():
        if device.type == "cuda":
            run()  # warm-up
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(tokens - 1):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return (tokens - 1) / seconds, how


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def kernel_and_emulation(model: nn.Module, ids: torch.Tensor):
    """(largest relative difference of the first decoder block's linear outputs, kernels
    against emulation, on that block's own inputs; logits on the kernels; emulated logits).
    The emulation is ``W4A4Weight``'s product on the same device (on the CPU it took minutes)."""
    from kbbq_pl.quant import w4a4

    inputs: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_pre_hook(
        lambda module, args, name=name: inputs.setdefault(name, args[0].detach()))
        for name, module in model.model.layers[0].named_modules()
        if isinstance(module, nn.Linear) and isinstance(module.weight, w4a4.W4A4Weight)]
    with torch.no_grad():
        with mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ()):
            emulated = model(input_ids=ids, use_cache=False).logits.float()
            for hook in hooks:
                hook.remove()
            expected = {name: model.model.layers[0].get_submodule(name)(x)
                        for name, x in inputs.items()}
        kernel_logits = model(input_ids=ids, use_cache=False).logits.float()
        worst = max(relative_difference(model.model.layers[0].get_submodule(name)(x),
                                        expected[name]) for name, x in inputs.items())
    return worst, kernel_logits, emulated


def logits_to_bf16(logits: torch.Tensor, base: torch.Tensor) -> str:
    agree = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
    return f"{relative_difference(logits, base):.3g} (top-1 {agree:.0%})"


def model_section(shapes: dict, formats: list[str], device, timer: Timer) -> None:
    cuda = device.type == "cuda"

    start = time.perf_counter()

    def progress(step: str) -> None:  # a run cut off at its time limit still shows how far it got
        print(f"  [model section, {time.perf_counter() - start:.0f} s] {step}", flush=True)

    reference = llama(shapes, device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shapes["vocab"], (1, shapes["prompt"]), generator=gen).to(device)
    batch = torch.randint(0, shapes["vocab"], shapes["prefill"], generator=gen).to(device)
    probe = torch.randint(0, shapes["vocab"], (1, shapes["logits_tokens"]), generator=gen)

    def prefill(model):
        with torch.no_grad():
            return model(input_ids=batch, use_cache=False).logits

    with torch.no_grad():
        base_logits = reference(input_ids=probe.to(device), use_cache=False).logits.float()
    base_memory = weight_bytes(reference, linears_only=False)
    base_linears = weight_bytes(reference, linears_only=True)
    progress("bf16 model built")
    base_prefill = timer(functools.partial(prefill, reference))
    progress("bf16 prefill timed")
    base_decode, how = decode_tokens_per_second(reference, prompt, shapes["decode_tokens"], cuda)
    rows = [["bf16", 1.0, 1.0, base_decode, how, 1.0, base_prefill * 1e3, 1.0, "-", "-", "-"]]
    progress(f"row {rows[-1]}")
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference
    for name in formats:
        model = llama(shapes, device)
        model.load_state_dict(state)
        quantize_for_kernels(model, name)
        progress(f"{name} quantized")
        if cuda:
            torch.cuda.empty_cache()
        memory = weight_bytes(model, linears_only=False) / base_memory
        linears = weight_bytes(model, linears_only=True) / base_linears
        seconds = timer(functools.partial(prefill, model))
        progress(f"{name} prefill timed")
        tokens, how = decode_tokens_per_second(model, prompt, shapes["decode_tokens"], cuda)
        progress(f"{name} decode timed")
        linear_diff, kernel_logits, emulated = kernel_and_emulation(model, probe.to(device))
        progress(f"{name} logits emulated")
        rows.append([name, memory, linears, tokens, how, tokens / base_decode, seconds * 1e3,
                     base_prefill / seconds, f"{linear_diff:.2g}",
                     logits_to_bf16(kernel_logits, base_logits),
                     logits_to_bf16(emulated, base_logits)])
        progress(f"row {rows[-1]}")
        del model
    batch_shape = "x".join(str(v) for v in shapes["prefill"])
    table(f"whole model: random Llama, hidden {shapes['hidden']}, {shapes['layers']} layers "
          f"(targets: memory <= {TARGETS['memory']}, decode >= {TARGETS['decode']}x, prefill "
          f">= {TARGETS['prefill']}x)",
          ["model", "weights x bf16", "linears x bf16", "decode tok/s", "decode run",
           "decode x bf16", f"prefill {batch_shape} ms", "prefill x bf16",
           "block 0 linears: kernels vs emulation", "logits to bf16: kernels",
           "logits to bf16: emulation"], rows)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="act,gemm,model")
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--rep-ms", type=float, default=200.0,
                        help="measuring time per do_bench call (milliseconds)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter (no timings "
                             "worth reading): checks the script's logic")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit("bench/gpu.py measures a CUDA GPU and none is visible; "
                 "`python bench/gpu.py --dry-run` runs its logic on tiny CPU shapes")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kbbq_pl.kernels loads triton
    from kbbq_pl import kernels as K

    device = torch.device("cuda" if cuda else "cpu")
    if not K.available(device):
        sys.exit(f"kbbq_pl.kernels cannot run on {device} (is triton installed?)")
    shapes = DRY if args.dry_run else FULL
    timer = Timer(device, args.rep_ms)
    formats = args.formats.split(",")
    sections = args.sections.split(",")
    start = time.perf_counter()
    if cuda:
        name = torch.cuda.get_device_name(device)
        print(f"{name}, torch {torch.__version__}" + (" (dry run)" if args.dry_run else ""))
    else:
        print("dry run on the CPU under the Triton interpreter: timings are not GPU figures")
    if "act" in sections:
        activation_section(shapes, formats, device, timer)
    if "gemm" in sections:
        gemm_section(shapes, formats, device, timer)
    if "model" in sections:
        model_section(shapes, formats, device, timer)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
