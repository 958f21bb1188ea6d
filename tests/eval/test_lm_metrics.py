"""Causal-LM metrics (kbbq_pl.eval.lm_metrics) and ``kbbq-pl eval --tasks ppl,kl``."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.cli import main
from kbbq_pl.eval.evaluation import perplexity
from kbbq_pl.eval.lm_metrics import lm_metrics, reference_log_probs
from kbbq_pl.eval.metrics import token_kl

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_kl_matches_the_definition():
    torch.manual_seed(0)
    logits_ref, logits = torch.randn(5, 11), torch.randn(5, 11)
    ref = torch.log_softmax(logits_ref, -1)
    expected = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), ref, log_target=True,
                                          reduction="none").sum(-1)
    assert torch.allclose(token_kl(ref, logits).float(), expected, atol=1e-6)
    assert token_kl(ref, logits_ref).abs().max() < 1e-6  # same distribution: zero
    assert (token_kl(ref, logits) > 0).all()
    with pytest.raises(ValueError, match=r"\(5, 11\).*\(5, 10\)"):
        token_kl(ref, logits[:, :10])


def _models():
    model = tiny_model("llama", seed=0)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1))
    return model, other, ids


def test_lm_metrics_agree_with_perplexity_and_a_cached_reference():
    model, other, ids = _models()
    kwargs = dict(context=64, stride=24, add_bos=False)
    itself = lm_metrics(model, None, ids, reference=model, **kwargs)
    # two interleaved window generators leave the caller's autograd state as it was
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert itself["kl"] < 1e-9 and itself["kl_max"] < 1e-6
    plain = perplexity(model, None, ids, seq_len=64, stride=24, add_bos=False)
    assert itself["perplexity"] == pytest.approx(plain["perplexity"], rel=1e-9)
    assert itself["n_tokens"] == plain["n_tokens"] == 299
    assert (itself["context"], itself["stride"]) == (64, 24)

    live = lm_metrics(other, None, ids, reference=model, **kwargs)
    cached = reference_log_probs(model, None, ids, **kwargs)
    assert cached.log_probs.shape == (299, 256)
    stored = lm_metrics(other, None, ids, reference=cached, **kwargs)
    assert live["kl"] > 1e-4 and live["kl_max"] >= live["kl"]
    assert stored["kl"] == pytest.approx(live["kl"], rel=1e-6)
    assert stored["perplexity"] == pytest.approx(live["perplexity"], rel=1e-9)
    assert lm_metrics(other, None, ids, **kwargs)["kl"] is None

    with pytest.raises(ValueError, match="another stream or window shape"):
        lm_metrics(other, None, ids[:200], reference=cached, **kwargs)
    with pytest.raises(ValueError, match="another stream or window shape"):
        lm_metrics(other, None, ids, reference=cached, context=64, stride=32, add_bos=False)


def test_cli_eval_ppl_and_kl(tiny_llama2c_folder, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play "
                    "outside in the sun. One day, she saw a big red ball in the park. " * 6,
                    encoding="utf-8")
    out = tmp_path / "results.json"
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "ppl,kl",
                 "--text", str(text),
                 "--context", "64", "--stride", "32", "--max-tokens", "200",
                 "--reference", str(tiny_llama2c_folder), "--out", str(out)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))["lm_metrics"]
    assert results["n_tokens"] == 200 and results["context"] == 64 and results["stride"] == 32
    assert 1.0 < results["perplexity"] < 512.0  # better than uniform over its 512 tokens
    assert results["kl"] < 1e-9  # the model against itself
    assert "perplexity" in capsys.readouterr().out

    # a full-precision model names no reference of its own
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "kl", "--text",
                 str(text)]) == 2
    assert "pass --reference" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "ppl", "--text",
                 str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_cli_eval_kl_of_a_quantized_folder_defaults_to_its_source(tiny_llama2c_folder, tmp_path,
                                                                     capsys):
    text = tmp_path / "story.txt"
    text.write_text("Tom and Sam went to the park to play with a ball. " * 20, encoding="utf-8")
    quantized = tmp_path / "q"
    assert main(["quantize", "--config", "rtn_kbbq_nvfp4_lam0.75",
                 "--model", str(tiny_llama2c_folder),
                 "--data.init_args.source", str(text), "--data.init_args.n_tokens", "256",
                 "--data.init_args.seq_len", "64", "--output_dir", str(quantized)]) == 0
    capsys.readouterr()
    out = tmp_path / "q.json"
    assert main(["eval", "--model", str(quantized), "--tasks", "ppl,kl", "--text", str(text),
                 "--context", "64", "--stride", "32", "--out", str(out)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))["lm_metrics"]
    assert results["reference"] == str(tiny_llama2c_folder)
    assert results["kl"] > 1e-4  # FP4 weights and activations change the predictions


def test_cli_eval_reads_no_more_than_the_model_and_checks_its_options(
        tiny_llama2c_folder, tiny_chat_folder, tmp_path, capsys):
    """The default window is 512 tokens or the model's max_position_embeddings where shorter
    (stride half of it); a longer --context, an unknown --num-fewshot benchmark and a KL
    reference with another tokenizer are one-line errors naming them."""
    from transformers import AutoConfig

    longest = AutoConfig.from_pretrained(tiny_llama2c_folder).max_position_embeddings
    assert longest < 512
    text = tmp_path / "story.txt"
    text.write_text("Tom and Sam went to the park to play with a ball. " * 40, encoding="utf-8")
    out = tmp_path / "results.json"
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "ppl", "--text",
                 str(text), "--out", str(out)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))["lm_metrics"]
    assert (results["context"], results["stride"]) == (longest, longest // 2)
    capsys.readouterr()
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "ppl", "--text",
                 str(text), "--context", str(longest + 1)]) == 2
    assert f"pass a context (--context) of at most {longest}" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "hellaswag",
                 "--num-fewshot", "hellaswg=5"]) == 2
    assert "--num-fewshot: unknown benchmark 'hellaswg'" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_llama2c_folder), "--tasks", "kl", "--text",
                 str(text), "--reference", str(tiny_chat_folder)]) == 2
    assert f"the tokenizer of {tiny_chat_folder} differs" in capsys.readouterr().err
