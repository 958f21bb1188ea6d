"""Does vLLM read a compressed-tensors export and compute kbbq-pl's product?  On a CPU, no GPU.

Two halves, in two environments (vLLM pins its own torch and transformers):

    # kbbq-pl's environment: every FP4 layer of the export, as kbbq-pl imports it, on seeded
    # float32 inputs
    python scripts/vllm_check.py reference EXPORT --out ref.pt
    # an environment with vLLM (its CUDA wheel imports on a CPU; pip install --no-deps vllm and
    # what it then asks for, amd-quark for MXFP4's emulation)
    python scripts/vllm_check.py vllm EXPORT --reference ref.pt

The vLLM half builds vLLM's model for the export (its config parsing, its compressed-tensors
scheme for a GPU of ``--capability``, its ``create_weights`` and ``load_weights``, its
``process_weights_after_loading``) on the CPU, with vLLM's emulation kernels (the FP4 GEMM
emulated in float32) in place of the CUDA ones, which are all a CPU lacks.  It reports every
parameter the file did not fill, and runs every FP4 linear of vLLM's model (fused ones, such as
``qkv_proj``, against the concatenated outputs of kbbq-pl's ``q_proj``, ``k_proj``, ``v_proj``)
on the reference's inputs (bfloat16 values).  MXFP4 layers need amd-quark, whose CUDA-only
activation rounding and weight decoding are replaced on a CPU by quark's own PyTorch reference
of them.  Mixture-of-experts layers are loaded (every parameter filled) but not run: vLLM has no
MoE kernel for a CPU.  It does not run attention or a whole forward pass:
that needs vLLM's CPU build or a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch

ROWS = 8
SEED = 0


def _inputs(in_features: int, amax: float) -> torch.Tensor:
    """Seeded float32 inputs ``[ROWS, in_features]`` whose amax is ``amax`` (the calibrated
    range of a static NVFP4 activation scale, else 1)."""
    generator = torch.Generator().manual_seed(SEED + in_features)
    x = torch.randn(ROWS, in_features, generator=generator)
    # bfloat16 values (kept in float32): quark's MXFP4 rounding takes bfloat16 inputs
    return (x * (amax / x.abs().max())).bfloat16().float()


def reference(export: Path, out: Path) -> None:
    """kbbq-pl's output of every FP4 layer of ``export`` on :func:`_inputs`."""
    import kbbq_pl
    from kbbq_pl.quant.layers import quantized_linears

    model = kbbq_pl.from_pretrained(export, dtype=torch.float32)
    layers = {}
    with torch.no_grad():
        for name, layer in quantized_linears(model).items():
            scale = layer.act_global_scale
            amax = 1.0 if scale is None else float(scale) * 448 * 6
            x = _inputs(layer.in_features, amax)
            layers[name] = {"x": x, "y": layer(x)}
    torch.save({"export": str(export), "layers": layers}, out)
    print(f"{len(layers)} FP4 layers of {export} -> {out}")


def _vllm_model(export: Path, capability: int) -> torch.nn.Module:
    """vLLM's model of ``export`` on the CPU, loaded and processed, with its emulation
    kernels; vLLM believes it runs on a GPU of compute capability ``capability``."""
    import vllm.model_executor.kernels.linear as kernels
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability, PlatformEnum
    from vllm.utils.torch_utils import set_default_torch_dtype

    type(current_platform).get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(capability // 10, capability % 10))
    kernels._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] = [kernels.EmulationNvFp4LinearKernel]
    kernels._POSSIBLE_MXFP4_KERNELS[PlatformEnum.CPU] = [kernels.EmulationMxfp4LinearKernel]
    _load_only_moe()
    config = EngineArgs(model=str(export), dtype="float32", enforce_eager=True,
                        max_model_len=256, skip_tokenizer_init=True).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29533", 0, "gloo")
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(torch.float32), torch.device("cpu"):
            model = initialize_model(vllm_config=config)
        loader = get_model_loader(config.load_config)
        loaded = model.load_weights(loader.get_all_weights(config.model_config, model))
        model.unfilled_parameters = sorted(  # KV-cache scales are optional
            name for name, _ in model.named_parameters()
            if name not in loaded and not name.endswith(("_scale", "_zero_point")))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model


def _load_only_moe() -> None:
    """vLLM has no mixture-of-experts kernel for a CPU (its emulation is a Triton kernel): its
    FP4 MoE layers are built with the emulation backend named and no kernel, loaded, and
    neither processed nor run."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_mxfp4 as mxfp4,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4,
    )

    nvfp4.select_nvfp4_moe_backend = lambda *args, **kwargs: (NvFp4MoeBackend.EMULATION, None)
    mxfp4.select_mxfp4_moe_backend = lambda *args, **kwargs: (Mxfp4MoeBackend.EMULATION, None)
    for method in (nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod,
                   mxfp4.CompressedTensorsW4A4Mxfp4MoEMethod):
        method.process_weights_after_loading = lambda self, layer: None


def _mx_emulation_on_cpu() -> None:
    """vLLM's MXFP4 emulation rounds the activations with amd-quark's ``qdq_mxfp4`` (scale
    rounding ``even``) and decodes the weights with its ``dq_mxfp4``, whose kernels (compiled,
    Triton) are CUDA-only; on a CPU they are quark's own PyTorch reference of the same kernels
    (``downcast_to_mxfp_torch``, ``upcast_from_mxfp_torch``), on bfloat16 inputs as the
    kernel takes them."""
    if torch.cuda.is_available():
        return
    try:
        from quark.torch.kernel import mx
        from quark.torch.kernel.mx import triton as kernel
    except ImportError:
        return  # vLLM's MXFP4 emulation says it needs amd-quark
    modes = {"even": kernel.DequantScaleRoundingMode.EVEN}

    def qdq_reference(x: torch.Tensor, mode: str = "even") -> torch.Tensor:
        # the inputs (_inputs) are bfloat16 values, and so are MXFP4's (E2M1 times 2^e)
        low = x.to(torch.bfloat16)
        if not torch.equal(low.to(x.dtype), x):
            raise ValueError("vllm_check.py: MXFP4 inputs must be bfloat16 values")
        codes, scales = kernel.downcast_to_mxfp_torch(
            low, torch.uint8, axis=-1, DEQUANT_SCALE_ROUNDING_MODE=modes[mode])
        return kernel.upcast_from_mxfp_torch(codes, scales, torch.bfloat16, axis=-1).to(x.dtype)

    mx.qdq_mxfp4 = qdq_reference
    mx.dq_mxfp4 = lambda codes, scales, dtype: kernel.upcast_from_mxfp_torch(
        codes, scales, dtype, axis=-1)


def _parts(model: torch.nn.Module, name: str) -> list[str]:
    """kbbq-pl's layers that vLLM's linear ``name`` holds (its ``packed_modules_mapping``)."""
    parent, _, leaf = name.rpartition(".")
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    prefix = f"{parent}." if parent else ""
    return [prefix + part for part in mapping.get(leaf, [leaf])]


def check_vllm(export: Path, reference_file: Path, capability: int, tolerance: float) -> int:
    """Load ``export`` into vLLM's model and compare its FP4 linears with ``reference_file``;
    prints a table; returns 1 if a parameter or layer is missing or a layer differs by more
    than ``tolerance`` of its largest output."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform
    _mx_emulation_on_cpu()
    try:
        from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
        from vllm.model_executor.layers.linear import LinearBase
    except ImportError as error:
        print(f"vllm_check.py vllm: needs vLLM in this environment ({error})", file=sys.stderr)
        return 2

    ref = torch.load(reference_file)["layers"]
    model = _vllm_model(export, capability)
    unfilled = model.unfilled_parameters
    rows, covered = [], set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase):
                # its parameters are filled (checked above) from the experts' tensors, which
                # vLLM names by the checkpoint (Mixtral's block_sparse_moe), not by kbbq-pl
                covered.update(n for n in ref if re.search(r"\.experts\.\d+\.", n))
                rows.append((name, "", None, "loaded; not run (no CPU MoE kernel)"))
                continue
            if not isinstance(module, LinearBase) or not hasattr(module, "weight_scale"):
                continue
            parts = _parts(model, name)
            missing = [p for p in parts if p not in ref]
            if missing:
                rows.append((name, "", None, f"no kbbq-pl layer {', '.join(missing)}"))
                continue
            covered.update(parts)
            x = ref[parts[0]]["x"]
            expected = torch.cat([ref[p]["y"] for p in parts], dim=-1)
            out = module(x)
            got = out[0] if isinstance(out, tuple) else out
            diff = float((got - expected).abs().max() / expected.abs().max())
            kernel = getattr(getattr(module, "scheme", None), "kernel", module.quant_method)
            rows.append((name, type(kernel).__name__, diff, ""))
    print(f"{'vLLM layer':56s} {'kernel':32s} max|vLLM - kbbq-pl| / max|kbbq-pl|")
    for name, kernel, diff, note in rows:
        print(f"{name:56s} {kernel:32s} {note or f'{diff:.2e}'}")
    uncovered = sorted(set(ref) - covered)
    diffs = [diff for _, _, diff, _ in rows if diff is not None]
    worst = max(diffs, default=float("nan"))
    print(f"\n{type(model).__name__}: {len(diffs)} FP4 linears compared, worst {worst:.2e}; "
          f"parameters not filled by the file: {unfilled or 'none'}; kbbq-pl layers vLLM "
          f"did not run: {uncovered or 'none'}")
    failed = [name for name, _, diff, note in rows
              if note.startswith("no kbbq-pl") or (diff is not None and diff > tolerance)]
    return 1 if unfilled or uncovered or failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="half", required=True)
    ref = sub.add_parser("reference", help="kbbq-pl's outputs (kbbq-pl's environment)")
    ref.add_argument("export", type=Path)
    ref.add_argument("--out", type=Path, required=True)
    run = sub.add_parser("vllm", help="vLLM's load and outputs (an environment with vLLM)")
    run.add_argument("export", type=Path)
    run.add_argument("--reference", type=Path, required=True)
    run.add_argument("--capability", type=int, default=100,
                     help="the GPU vLLM picks its scheme for (100: Blackwell, W4A4; 90: Hopper)")
    run.add_argument("--tolerance", type=float, default=1e-5,
                     help="largest difference accepted, relative to a layer's largest output "
                          "(float32 products in another order differ by about 1e-7)")
    args = parser.parse_args(argv)
    if args.half == "reference":
        reference(args.export, args.out)
        return 0
    return check_vllm(args.export, args.reference, args.capability, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
