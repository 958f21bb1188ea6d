"""Writes the format-1 checkpoint fixtures of ``tests/io/test_checkpoint_compat.py``.

Run once, with the code that wrote format 1 and computed W4A4 products on a dense dequantized
copy of the weights, from the repository root:

    python tests/data/make_v1_checkpoints.py

Each fixture is a tiny random Llama (one block, hidden 32, FFN 44: the down projection is
zero-padded to whole blocks) quantized by ``quantize_model`` and written by ``save_quantized``,
beside ``<name>.expected.safetensors`` holding probe ``input_ids`` and the logits that code
computed on them.  The files are kept as written; rerunning with later code would test nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from kbbq_pl.io.checkpoint import save_quantized
from kbbq_pl.io.models import tiny_model
from kbbq_pl.quant import QuantizationConfig, quantize_model

HERE = Path(__file__).resolve().parent / "v1"
TINY = dict(hidden_size=32, intermediate_size=44, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64)
RECIPES = {
    "nvfp4_kbbq_static": QuantizationConfig(format="nvfp4", transform="kbbq", lam=0.75,
                                            act_scale="static"),
    "mxfp4_haar_dynamic": QuantizationConfig(format="mxfp4", transform="haar",
                                             act_scale="dynamic"),
}


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, 64, (4, 16), generator=generator)
    probe = torch.randint(0, 64, (2, 12), generator=generator)
    for name, config in RECIPES.items():
        model = tiny_model("llama", **TINY)
        batches = [{"input_ids": calibration[i:i + 2]} for i in range(0, 4, 2)]
        quantize_model(model, batches, config, progress=False)
        save_quantized(model, HERE / name, recipe=config.to_dict())
        with torch.no_grad():
            logits = model(input_ids=probe).logits
        save_file({"input_ids": probe, "logits": logits.contiguous()},
                  str(HERE / f"{name}.expected.safetensors"))


if __name__ == "__main__":
    main()
