"""Image-text-to-text models (Llava, Gemma 3, Qwen2.5-VL): their language model is quantized,
their vision tower and projector are kept as they are (text calibration never runs them), and
the checkpoint reloads, with images, in kbbq-pl and transformers, and streams from disk."""

from __future__ import annotations

import json
import runpy

import pytest
import torch
from tiny_models import IMAGE_TOKEN, small_multimodal, tiny_multimodal

from kbbq_pl.cli.commands import main
from kbbq_pl.io.checkpoint import read_tensors, save_quantized
from kbbq_pl.io.models import from_pretrained, load_model
from kbbq_pl.io.streaming import quantize_checkpoint
from kbbq_pl.quant import QuantizationConfig, quantize_model
from kbbq_pl.quant.layers import quantized_linears
from kbbq_pl.quant.modules import is_linear, modality_encoders
from kbbq_pl.quant.sequential import find_blocks

ARCHS = ["llava", "gemma3", "qwen2_5_vl"]
ENCODERS = {"llava": ["model.vision_tower", "model.multi_modal_projector"],
            "gemma3": ["model.vision_tower", "model.multi_modal_projector"],
            "qwen2_5_vl": ["model.visual"]}

pytestmark = pytest.mark.usefixtures("one_thread")


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 400, (2, 32), generator=generator)}
            for _ in range(2)]


def image_inputs(arch: str) -> dict[str, torch.Tensor]:
    """Text around one 32 x 32 image, as each architecture takes it."""
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(0, 400, (1, 6), generator=generator)
    if arch == "qwen2_5_vl":  # 4 x 4 patches of 14 x 14, two frames, merged 2 x 2
        image = torch.tensor([[502] + [IMAGE_TOKEN] * 4])
        extra = {"pixel_values": torch.randn(16, 3 * 2 * 14 * 14, generator=generator),
                 "image_grid_thw": torch.tensor([[1, 4, 4]])}
    else:
        image = torch.full((1, 16 if arch == "llava" else 4), IMAGE_TOKEN)
        extra = {"pixel_values": torch.randn(1, 3, 32, 32, generator=generator)}
    ids = torch.cat([text[:, :3], image, text[:, 3:]], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **extra}


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_the_language_model_is_quantized_and_the_vision_tower_kept(arch):
    model = tiny_multimodal(arch)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert modality_encoders(model) == ENCODERS[arch]
    assert find_blocks(model)[0] == "model.language_model.layers"  # not the vision blocks
    report = quantize_model(model, _batches(), QuantizationConfig(), progress=False)
    language = {name for name, m in tiny_multimodal(arch).named_modules()
                if is_linear(m) and name.startswith("model.language_model.")}
    assert set(quantized_linears(model)) == language
    encoders = tuple(f"{name}." for name in ENCODERS[arch])
    kept = {name: p for name, p in model.named_parameters() if name.startswith(encoders)}
    assert kept and all(torch.equal(p, before[name]) for name, p in kept.items())
    for name in ENCODERS[arch]:
        assert "text calibration does not run it" in report.skipped[name]
    assert not [name for name in report.skipped if name.startswith(encoders)]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_checkpoint_reloads_and_runs_images_bit_for_bit(arch, tmp_path):
    from transformers import AutoModelForImageTextToText

    model = tiny_multimodal(arch)
    quantize_model(model, _batches(), QuantizationConfig(), progress=False)
    save_quantized(model, tmp_path / "q")
    inputs = image_inputs(arch)
    expected = logits(model, inputs)
    assert not torch.equal(expected, logits(tiny_multimodal(arch), inputs))
    ours = from_pretrained(tmp_path / "q")
    assert type(ours) is type(model)
    assert torch.equal(logits(ours, inputs), expected)
    theirs = AutoModelForImageTextToText.from_pretrained(tmp_path / "q")
    assert torch.equal(logits(theirs, inputs), expected)
    # trust_remote_code=True: the folder's loader names the same classes
    name, config_name = type(model).__name__, type(model.config).__name__
    assert json.loads((tmp_path / "q" / "config.json").read_text())["auto_map"] == {
        "AutoConfig": f"kbbq_pl_loader.{config_name}",
        "AutoModelForImageTextToText": f"kbbq_pl_loader.{name}"}
    loader = runpy.run_path(str(tmp_path / "q" / "kbbq_pl_loader.py"))
    assert issubclass(loader[config_name], type(model.config))
    assert issubclass(loader[name], type(model)) and loader[name].__name__ == name
    assert torch.equal(logits(loader[name].from_pretrained(tmp_path / "q"), inputs), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_multimodal_model_streams_bit_for_bit_as_in_memory(arch, tmp_path):
    # save_pretrained writes the architecture's original names (llava and gemma3:
    # language_model.model.layers.*; qwen2.5-vl: model.layers.*, visual.*)
    tiny_multimodal(arch).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    assert_streams_as_in_memory(tmp_path)


def assert_streams_as_in_memory(tmp_path) -> None:
    """The checkpoint in ``tmp_path / "src"`` streamed gives the in-memory run's tensors."""
    config = QuantizationConfig()
    model, _ = load_model(tmp_path / "src")
    quantize_model(model, _batches(), config, progress=False)
    save_quantized(model, tmp_path / "memory")
    quantize_checkpoint(tmp_path / "src", tmp_path / "streamed", config, _batches(),
                        progress=False)
    memory, streamed = read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "streamed")
    assert memory.keys() == streamed.keys()
    assert all(torch.equal(memory[k], streamed[k]) for k in memory)


def test_quantize_a_multimodal_folder_from_the_command_line(tmp_path, capsys):
    """The quantized folder and its export keep the source's image processor (a server
    builds the model's processor from them)."""
    from transformers import AutoImageProcessor, CLIPImageProcessor

    tiny_multimodal("llava").save_pretrained(tmp_path / "llava")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
                       ).save_pretrained(tmp_path / "llava")
    assert main(["quantize", "--model", str(tmp_path / "llava"), "--output_dir",
                 str(tmp_path / "out"), "--data.n_tokens", "256", "--data.seq_len", "32"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["skipped"]) >= {"model.vision_tower", "model.multi_modal_projector"}
    assert "fidelity" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "out"), str(tmp_path / "ct"), "--format",
                 "compressed-tensors"]) == 0
    for folder in ("out", "ct"):
        processor = AutoImageProcessor.from_pretrained(tmp_path / folder)
        assert processor.crop_size == {"height": 32, "width": 32}, folder


@pytest.mark.parametrize("model_type", [
    "qwen3_vl", "qwen3_vl_moe",  # experts stored fused and transposed
    "kimi_k25",  # its vision attention stored as one wqkv, split in three when loaded
    "gemma4", "glm4v_moe",
    "step3p7",  # its projector is one linear layer
])
def test_more_multimodal_models_quantize_reload_and_stream(model_type, tmp_path):
    """Text only: the language model quantized, the encoders kept, the checkpoint reloaded
    through transformers bit for bit, and streamed from disk as in memory."""
    from transformers import AutoModelForImageTextToText

    model = small_multimodal(model_type)
    encoders = modality_encoders(model)
    assert encoders and find_blocks(model)[0].endswith("language_model.layers")
    report = quantize_model(model, _batches(), QuantizationConfig(), progress=False)
    layers = quantized_linears(model)
    assert layers and not [n for n in layers if n.startswith(tuple(encoders))]
    assert all(encoder in report.skipped for encoder in encoders)
    ids = _batches()[0]["input_ids"][:1]
    save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "q")
    assert torch.equal(logits(reloaded, {"input_ids": ids}), logits(model, {"input_ids": ids}))
    small_multimodal(model_type).to(torch.bfloat16).save_pretrained(tmp_path / "src",
                                                                    max_shard_size="300KB")
    assert_streams_as_in_memory(tmp_path)
