"""Quantize a model folder under a memory cap (run as a script by test_streaming_memory.py).

    python capped_quantize.py streamed|memory SOURCE OUT CAP_MB

After the imports and a warm-up quantization of a one-block model (the rounding kernels'
compilation and the libraries' first-call allocations are not the model's), the resident memory
may grow by at most ``CAP_MB``: a watchdog thread samples it every millisecond and ends the process
with exit code 75 the moment it is exceeded, and the peak (``VmHWM``) is checked again at
the end.  Prints the growth in MiB as JSON.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

import torch

CAPPED = 75


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    mode, source, out, cap_mb = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kbbq_pl.io.checkpoint import save_quantized
    from kbbq_pl.io.models import load_model
    from kbbq_pl.io.streaming import quantize_checkpoint
    from kbbq_pl.quant import QuantizationConfig, quantize_model
    from kbbq_pl.quant.report import peak_rss_mb
    from kbbq_pl.quant.sequential import trim_heap

    config = QuantizationConfig.from_dict({"transform": {"name": "kbbq", "lam": 0.75}})
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 512, (2, 64), generator=generator)}
               for _ in range(2)]
    warm = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512))
    quantize_model(warm, batches, config, progress=False)
    del warm
    gc.collect()
    trim_heap()
    base = resident_mb()
    peak_before = peak_rss_mb()
    largest = [0.0]

    def watch() -> None:
        while True:
            grown = resident_mb() - base
            largest[0] = max(largest[0], grown)
            if grown > cap_mb:
                print(json.dumps({"capped": True, "grown_mb": grown}), flush=True)
                os._exit(CAPPED)
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
    if mode == "streamed":
        quantize_checkpoint(source, out, config, batches, progress=False)
    else:
        model, _ = load_model(source)
        quantize_model(model, batches, config, progress=False)
        save_quantized(model, out)
    peak = peak_rss_mb()
    if peak > max(peak_before, base + cap_mb):
        print(json.dumps({"capped": True, "grown_mb": peak - base}), flush=True)
        os._exit(CAPPED)
    print(json.dumps({"capped": False, "grown_mb": largest[0]}), flush=True)


if __name__ == "__main__":
    main()
