"""The llama2.c converter against a plain-torch run.c (tests/_llama2c_reference.py)."""

from __future__ import annotations

import hashlib
import re
import struct

import pytest
import torch
from _llama2c_reference import Llama2c, Tokenizer
from conftest import SHARED_DATA

from kbbq_pl.cli.commands import main
from kbbq_pl.eval.evaluation import perplexity
from kbbq_pl.io.llama2c import (
    build_tokenizer,
    convert_llama2c,
    hf_llama_config,
    hf_state_dict,
    interleaved_to_halves,
    read_llama2c_checkpoint,
    read_llama2c_tokenizer,
)

FOLDER = "tiny_llama_aidreams260K"


@pytest.fixture(scope="module")
def sources():
    data = SHARED_DATA / FOLDER
    checkpoint, tokenizer = data / "aidreams260K.bin", data / "tok512.bin"
    if not checkpoint.is_file() or not tokenizer.is_file():
        pytest.skip(f"the tiny llama2.c model is absent ({data}/aidreams260K.bin, tok512.bin)")
    return checkpoint, tokenizer


@pytest.fixture(scope="module")
def reference(sources):
    return Llama2c(*sources)


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = convert_llama2c(*sources, tmp_path_factory.mktemp("hf") / "aidreams260K")
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


def _rope_interleaved(x: torch.Tensor, pos: int, head_size: int) -> torch.Tensor:
    pairs = x.reshape(-1, head_size // 2, 2)
    freq = 1.0 / 10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    cos, sin = torch.cos(pos * freq), torch.sin(pos * freq)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)


def _rope_halves(x: torch.Tensor, pos: int, head_size: int) -> torch.Tensor:
    heads = x.reshape(-1, head_size)
    freq = 1.0 / 10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    cos = torch.cos(pos * freq).repeat(2)
    sin = torch.sin(pos * freq).repeat(2)
    rotated = torch.cat([-heads[:, head_size // 2:], heads[:, : head_size // 2]], -1)
    return (heads * cos + rotated * sin).reshape(x.shape)


def test_interleaved_to_halves_moves_rope_pairs():
    rows = torch.arange(8.0).reshape(8, 1)  # 2 heads of size 4
    assert interleaved_to_halves(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    weight = torch.randn(3 * 16, 10, dtype=torch.float64)
    x = torch.randn(10, dtype=torch.float64)
    for pos in (0, 1, 7, 100):
        interleaved = _rope_interleaved(weight @ x, pos, 16)
        halves = _rope_halves(interleaved_to_halves(weight, 3) @ x, pos, 16)
        torch.testing.assert_close(halves, interleaved_to_halves(interleaved[:, None], 3)[:, 0])


def test_checkpoint_header_and_weights(sources):
    config, weights = read_llama2c_checkpoint(sources[0])
    assert (config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
            config.vocab_size, config.seq_len) == (64, 172, 4, 4, 4, 512, 128)
    assert config.shared_classifier and "wcls" not in weights
    assert config.file_size() == sources[0].stat().st_size
    assert weights["w1"].shape == (4, 172, 64) and weights["w2"].shape == (4, 64, 172)
    assert sum(w.numel() for w in weights.values()) == 230_976


def test_logits_match_run_c(converted, reference):
    _, model, _ = converted
    generator = torch.Generator().manual_seed(0)
    sequences = [
        reference.encode("The whisper of patterns unfolds through the weights."),
        [1, *torch.randint(3, 512, (40,), generator=generator).tolist()],
        [1, *torch.randint(3, 512, (127,), generator=generator).tolist()],  # full seq_len
    ]
    for tokens in sequences:
        expected = reference.forward(tokens)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_without_the_rope_permutation_logits_differ(sources, reference):
    from transformers import LlamaForCausalLM

    config, weights = read_llama2c_checkpoint(sources[0])
    state = hf_state_dict(config, weights)
    for layer in range(config.n_layers):
        state[f"model.layers.{layer}.self_attn.q_proj.weight"] = weights["wq"][layer]
        state[f"model.layers.{layer}.self_attn.k_proj.weight"] = weights["wk"][layer]
    model = LlamaForCausalLM(hf_llama_config(config)).eval()
    model.load_state_dict(state, strict=False)
    tokens = reference.encode("The whisper of patterns unfolds through the weights.")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    assert (logits - reference.forward(tokens)).abs().max() > 1e-2


def test_greedy_decoding_gives_english(converted, reference):
    _, model, tokenizer = converted
    expected = reference.generate(100)
    with torch.no_grad():
        out = model.generate(torch.tensor([[1]]), max_new_tokens=len(expected) - 1,
                             do_sample=False, min_new_tokens=len(expected) - 1)
    assert out[0].tolist() == expected
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text == reference.decode(expected)
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 30
    assert 2.5 < sum(map(len, words)) / len(words) < 9  # word-like lengths
    # nearly all of the text is words separated by single spaces and punctuation
    assert len(re.sub(r"[A-Za-z'\s.,;:!?\"-]", "", text)) <= len(text) // 50
    common = {"the", "of", "a", "and", "as", "i", "my", "in", "to", "with", "through"}
    assert sum(w.lower() in common for w in words) >= len(words) // 8


@pytest.mark.parametrize("text", [
    "The whisper of patterns unfolds through the weights, like an echo!",
    "Numbers 1234 and symbols #@% mix with  double  spaces.",
    "Ünïcödé → beyond the vocabulary: 日本語 and émoji 🙂",
])
def test_tokenizer_matches_llama2c_and_round_trips(converted, reference, text):
    _, _, tokenizer = converted
    ids = tokenizer(text)["input_ids"]
    assert ids == reference.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_llama2_tokenizer_bin_encodes_like_llama2c():
    path = SHARED_DATA / "llama2_tokenizer" / "tokenizer.bin"
    if not path.is_file():
        pytest.skip(f"the Llama 2 tokenizer export is absent ({path})")
    tokenizer = build_tokenizer(read_llama2c_tokenizer(path, 32000), 4096, path)
    reference = Tokenizer(path, 32000)
    for text in ["It was the best of times, it was the worst of times.",
                 "Numbers 1234 and symbols #@% mix with  double  spaces,\ttabs\nand lines.",
                 " leading space, Ünïcödé → 日本語 and émoji 🙂"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == reference.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_perplexity_on_wikitext(converted, shared_data):
    _, model, tokenizer = converted
    result = perplexity(model, tokenizer, shared_data / "wikitext2" / "test.txt",
                        seq_len=128, stride=64, max_tokens=4096)
    assert result["n_tokens"] == 4096
    assert 1.0 < result["perplexity"] < 512  # a trained model beats the uniform guess


def test_conversion_errors(sources, tmp_path):
    checkpoint, tokenizer = sources
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources]
    data = checkpoint.read_bytes()

    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"truncated\.bin: truncated: 932024 bytes.*932124"):
        read_llama2c_checkpoint(truncated)
    longer = tmp_path / "longer.bin"
    longer.write_bytes(data + b"\0" * 8)
    with pytest.raises(ValueError, match="longer than its header says"):
        read_llama2c_checkpoint(longer)
    versioned = tmp_path / "v1.bin"
    versioned.write_bytes(struct.pack("<Ii", 0x616B3432, 1) + data[8:])
    with pytest.raises(ValueError, match="v1.bin: a llama2.c export of format version 1"):
        read_llama2c_checkpoint(versioned)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(struct.pack("<7i", 64, 172, 4, 3, 4, 512, 128) + data[28:])
    with pytest.raises(ValueError, match="garbage.bin: not a llama2.c v0 checkpoint"):
        read_llama2c_checkpoint(garbage)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        read_llama2c_checkpoint(tmp_path / "missing.bin")

    short_tokenizer = tmp_path / "tok.bin"
    short_tokenizer.write_bytes(tokenizer.read_bytes()[:-3])
    with pytest.raises(ValueError, match="tok.bin: truncated at token 511 of 512"):
        read_llama2c_tokenizer(short_tokenizer, 512)
    with pytest.raises(ValueError, match="bytes after the 500 tokens"):
        read_llama2c_tokenizer(tokenizer, 500)
    with pytest.raises(ValueError, match="truncated"):
        convert_llama2c(truncated, tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    out = convert_llama2c(checkpoint, tokenizer, tmp_path / "out")
    with pytest.raises(FileExistsError, match="out exists"):
        convert_llama2c(checkpoint, tokenizer, out)
    assert convert_llama2c(checkpoint, tokenizer, out, overwrite=True) == out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources] == before


def test_cli_convert(sources, tmp_path, capsys):
    out = tmp_path / "cli-model"
    assert main(["convert-llama2c", "--checkpoint", str(sources[0]), "--tokenizer",
                 str(sources[1]), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                       out.iterdir()}
    assert str(out) in capsys.readouterr().out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<unk>", 0)  # llama2.c has none
