"""Sentence selection, embedding fidelity and perplexity (kbbq_pl.eval.evaluation)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from kbbq_pl.eval.evaluation import (
    cosine_summary,
    cosine_to_reference,
    detokenize_wikitext,
    embedding_fidelity,
    mean_pooled_embeddings,
    perplexity,
    rolling_windows,
    split_wikitext_sentences,
    wikitext_sentences,
)
from kbbq_pl.io.models import load_model

SAMPLE = """
 = Some Title =

 The cat sat on the mat . It was a 3 @.@ 5 @-@ metre mat , said the <unk> . Short one .

 = = Section = =
 He wrote " Hello there " in 1999 ( not 2000 ) and it 's fine ! Is this the last one of them ?
 A paragraph fragment that never ends
"""


def test_split_and_detokenize():
    sentences = split_wikitext_sentences("A b c . D e ? F g")
    assert sentences == [["A", "b", "c", "."], ["D", "e", "?"], ["F", "g"]]
    assert detokenize_wikitext("It was a 3 @.@ 5 @-@ metre mat , he said .".split()) == \
        "It was a 3.5-metre mat, he said."
    assert detokenize_wikitext('He wrote " Hello there " ( not 2000 ) and it \'s fine !'
                               .split()) == 'He wrote "Hello there" (not 2000) and it\'s fine!'


def test_wikitext_sentences_rules(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(SAMPLE, encoding="utf-8")
    everything = wikitext_sentences(path, None, min_words=1, drop_unk=False, detokenize=False)
    # headings, blank lines and the unfinished fragment gone; 3 + 2 sentences
    assert everything == [
        "The cat sat on the mat .",
        "It was a 3 @.@ 5 @-@ metre mat , said the <unk> .",
        "Short one .",
        'He wrote " Hello there " in 1999 ( not 2000 ) and it \'s fine !',
        "Is this the last one of them ?",
    ]
    # "Short one ." has 2 words, the second sentence an <unk>
    kept = wikitext_sentences(path, None, min_words=5)
    assert kept == ["The cat sat on the mat.",
                    'He wrote "Hello there" in 1999 (not 2000) and it\'s fine!',
                    "Is this the last one of them?"]
    assert wikitext_sentences(path, 2, min_words=5, seed=None) == kept[:2]
    picked = wikitext_sentences(path, 2, min_words=5, seed=3)
    assert len(picked) == 2 and all(s in kept for s in picked)
    assert picked == sorted(picked, key=kept.index)  # file order
    with pytest.raises(ValueError, match="only 3 sentences"):
        wikitext_sentences(path, 4, min_words=5)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        wikitext_sentences(tmp_path / "missing.txt", 2)


def test_wikitext_sentences_real_file(shared_data):
    path = shared_data / "wikitext2" / "test.txt"
    first = wikitext_sentences(path, 64, seed=0)
    assert first == wikitext_sentences(path, 64, seed=0)
    assert len(first) == 64 and len(set(first)) == 64
    assert first != wikitext_sentences(path, 64, seed=1)
    for sentence in first:
        assert "<unk>" not in sentence and "@-@" not in sentence
        assert not sentence.startswith("=")
        assert len(sentence.split()) >= 5


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")


@pytest.fixture(scope="module")
def sentences():
    return ["The cat sat on the mat.", "Quantization rounds every weight onto a small grid.",
            "A much longer sentence that needs padding when it is batched with short ones, "
            "because it has many more tokens than the others.", "Hello."]


def test_mean_pooling_ignores_padding(minilm, sentences):
    model, tokenizer = minilm
    batched = mean_pooled_embeddings(model, tokenizer, sentences, batch_size=4)
    alone = torch.cat([mean_pooled_embeddings(model, tokenizer, [s]) for s in sentences])
    assert batched.shape == (4, model.config.hidden_size)
    assert batched.dtype == torch.float32
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    # a sentence's embedding is not the pooled padding of another
    assert cosine_summary(batched[:1], batched[2:3])["mean_cosine"] < 0.9


def test_embedding_fidelity(minilm, sentences):
    model, tokenizer = minilm
    same = embedding_fidelity(model, model, tokenizer, sentences)
    assert same["n_sentences"] == 4
    assert same["mean_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert same["min_cosine"] == pytest.approx(1.0, abs=1e-6)

    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in noisy.encoder.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator)
                           * 0.2 * parameter.std())
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    result = cosine_to_reference(noisy, tokenizer, sentences, reference)
    assert result == embedding_fidelity(model, noisy, tokenizer, sentences)
    assert 0.0 < result["min_cosine"] <= result["mean_cosine"] < 0.999
    with pytest.raises(ValueError, match="3 sentences but 4"):
        cosine_to_reference(noisy, tokenizer, sentences[:3], reference)


@pytest.mark.parametrize("n_tokens,seq_len,stride", [
    (2, 2, 1), (10, 4, 1), (10, 4, 3), (100, 16, 8), (17, 32, 16), (33, 8, 7),
])
def test_rolling_windows_score_every_position_once(n_tokens, seq_len, stride):
    windows = rolling_windows(n_tokens, seq_len, stride)
    scored = [t for _, first, end in windows for t in range(first, end)]
    assert scored == list(range(1, n_tokens))
    for begin, first, end in windows:
        assert 0 <= begin < first <= end and end - begin <= seq_len
        assert begin == 0 or first - begin >= seq_len - stride


def test_rolling_windows_errors():
    with pytest.raises(ValueError, match="stride"):
        rolling_windows(10, 4, 4)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        rolling_windows(1, 4, 2)


class Bigram(nn.Module):
    """A causal LM whose next-token distribution depends on the current token only."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator()
                                              .manual_seed(1)))
        self.config = SimpleNamespace(bos_token_id=0, max_position_embeddings=64)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


def test_perplexity_exact_accounting_with_windows():
    model = Bigram(11)
    ids = torch.randint(1, 11, (50,), generator=torch.Generator().manual_seed(2))
    stream = torch.cat([torch.tensor([0]), ids])
    logp = torch.log_softmax(model.table.detach().double(), dim=-1)
    by_hand = -logp[stream[:-1], stream[1:]].mean().item()
    for seq_len, stride in [(8, 4), (8, 7), (3, 1), (64, 32)]:
        result = perplexity(model, None, ids, seq_len=seq_len, stride=stride, batch_size=3)
        assert result["n_tokens"] == 50
        assert result["nll"] == pytest.approx(by_hand, rel=1e-6)
        assert result["perplexity"] == pytest.approx(math.exp(by_hand), rel=1e-6)
    no_bos = perplexity(model, None, ids, seq_len=8, stride=4, add_bos=False, max_tokens=20)
    assert no_bos["n_tokens"] == 19
    assert no_bos["nll"] == pytest.approx(-logp[ids[:19], ids[1:20]].mean().item(), rel=1e-6)


def test_perplexity_of_a_tiny_llama_by_hand():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(3))
    result = perplexity(model, None, ids, seq_len=64, stride=32)
    assert result["n_windows"] == 1 and result["n_tokens"] == 40
    stream = torch.cat([torch.tensor([model.config.bos_token_id]), ids])
    with torch.no_grad():
        logits = model(input_ids=stream[None]).logits[0, :-1].double()
    by_hand = -torch.log_softmax(logits, -1).gather(1, stream[1:, None]).mean().item()
    assert result["perplexity"] == pytest.approx(math.exp(by_hand), rel=1e-5)
    # windows change the context, so the value moves a little, and the count does not
    windowed = perplexity(model, None, ids, seq_len=16, stride=8)
    assert windowed["n_tokens"] == 40 and windowed["n_windows"] > 1
    # a random-initialized model is close to uniform over its 256 tokens
    assert 128 < result["perplexity"] < 512 and 128 < windowed["perplexity"] < 512



def test_a_data_file_is_scored_on_its_text_column(tmp_path):
    """``--text`` a ``.jsonl`` or ``.parquet`` file scores its ``text`` column, records joined
    by newlines, as calibration reads it (a ``.jsonl`` was scored as JSON syntax); a text file
    is scored as written."""
    import datasets

    from kbbq_pl.eval.evaluation import prepare_stream
    from kbbq_pl.io.models import load_model

    _, tokenizer = load_model("minilm")
    texts = [f"held-out record {i}: the quick brown fox jumps over the lazy dog ."
             for i in range(20)]
    (tmp_path / "held_out.txt").write_text("\n".join(texts))
    (tmp_path / "held_out.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    datasets.Dataset.from_dict({"text": texts}).to_parquet(tmp_path / "held_out.parquet")
    model = tiny_model("llama")
    expected = prepare_stream(model, tokenizer, tmp_path / "held_out.txt", None)
    assert expected[1:] == tokenizer("\n".join(texts), add_special_tokens=False)["input_ids"]
    for name in ("held_out.jsonl", "held_out.parquet"):
        assert prepare_stream(model, tokenizer, tmp_path / name, None) == expected, name


def test_the_first_tokens_of_a_long_text_are_read_from_a_prefix(tmp_path):
    """``ppl`` and ``kl`` score the first ``max_tokens`` of ``--text``: they are tokenized from a
    prefix of it (a 230 MB file was tokenized whole to score its first 16,384 tokens: 121 s and
    16.7 GB, bench/calibration_source.py), and are the whole text's first tokens, for a
    WordPiece and a byte-level BPE tokenizer with merges, at any count; without
    ``max_tokens`` the whole text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kbbq_pl.eval.evaluation import prepare_stream
    from kbbq_pl.resources import eval_text

    text = eval_text().read_text(encoding="utf-8") * 40
    file = tmp_path / "long.txt"
    file.write_text(text, encoding="utf-8")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(text.splitlines()[:400], trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    class Reading:  # the tokenizer, noting the longest text it is given
        def __init__(self, tokenizer):
            self.tokenizer, self.longest = tokenizer, 0

        def __call__(self, part, **kwargs):
            self.longest = max(self.longest, len(part))
            return self.tokenizer(part, **kwargs)

    model = tiny_model("llama")
    for tokenizer in (load_model("minilm")[1], PreTrainedTokenizerFast(tokenizer_object=backend)):
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        for count in (1, 333, 2048, 7777):
            reading = Reading(tokenizer)
            ids = prepare_stream(model, reading, file, count, add_bos=False)
            assert ids == whole[:count], (tokenizer, count)
            assert reading.longest < len(text) / 4, (tokenizer, count)
        assert prepare_stream(model, tokenizer, file, None, add_bos=False) == whole


# --- the held-out text kbbq-pl ships, and `kbbq-pl eval`/`compare` without the data folder -----

ROOT = Path(__file__).resolve().parents[2]


def test_the_packaged_eval_text_is_shipped_with_its_licence():
    from kbbq_pl.resources import eval_text

    path = eval_text()
    data = path.read_bytes()
    assert 20_000 < len(data) < 30_000 and data.endswith(b"\n") and b"\r" not in data
    assert data.startswith(b" \n = Robert <unk> = \n")  # WikiText-2 test, tokenized variant
    notes = (path.parent / "EVAL_TEXT.md").read_text(encoding="utf-8")
    assert path.name in notes and "CC BY-SA 3.0" in notes and "scripts/build_eval_text.py" in notes


def test_the_build_script_reproduces_the_packaged_eval_text(shared_data, tmp_path):
    from kbbq_pl.resources import eval_text

    out = tmp_path / "head.txt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_eval_text.py"),
                    "--data", str(shared_data), "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    assert out.read_bytes() == eval_text().read_bytes()
    full = (shared_data / "wikitext2" / "test.txt").read_bytes()
    assert full.startswith(out.read_bytes())  # a prefix, cut at a line boundary


def test_the_packaged_text_starts_with_the_full_files_tokens(shared_data, tiny_llama2c_folder):
    """The first tokens of the excerpt are the full file's (so `--max-tokens 2048` scores the
    same stream on either), under the tiny model's 512-token tokenizer and MiniLM's WordPiece
    (SmolLM2's BPE: 5,848 of 5,848, checked when the excerpt was built; EVAL_TEXT.md)."""
    from transformers import AutoTokenizer

    from kbbq_pl.eval.lm_metrics import default_text
    from kbbq_pl.io.models import minilm_path
    from kbbq_pl.resources import eval_text

    assert default_text(shared_data) == shared_data / "wikitext2" / "test.txt"
    full = (shared_data / "wikitext2" / "test.txt").read_text(encoding="utf-8")
    head = eval_text().read_text(encoding="utf-8")
    tokenizers = [AutoTokenizer.from_pretrained(tiny_llama2c_folder)]
    try:
        tokenizers.append(AutoTokenizer.from_pretrained(minilm_path()))
    except ImportError:
        pass
    for tokenizer in tokenizers:
        ids = tokenizer(head, add_special_tokens=False, verbose=False)["input_ids"]
        reference = tokenizer(full, add_special_tokens=False, verbose=False)["input_ids"]
        assert len(ids) > 4096 and ids[:4096] == reference[:4096]


class _LoadedTheModel(RuntimeError):
    pass


@pytest.fixture
def no_loading(monkeypatch):
    """Loading or resolving a model, or importing lm-eval, fails the test."""
    from kbbq_pl.io import models

    def refuse(*args, **kwargs):
        raise _LoadedTheModel("a model was loaded before the paths were checked")

    for name in ("load_model", "resolve_model_path"):
        monkeypatch.setattr(models, name, refuse)
    for module in ("lm_eval", "lm_eval.tasks", "lm_eval.api.model"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError


@pytest.mark.parametrize("command", ["eval", "compare"])
def test_missing_data_is_reported_before_the_model_is_loaded(command, no_loading, tmp_path,
                                                             capsys):
    from kbbq_pl.cli import main

    out = ["--output_dir", str(tmp_path / "out")] if command == "compare" else []
    base = [command, "--model", "smollm2", *out]
    empty = tmp_path / "data"
    empty.mkdir()
    cases = [
        (["--tasks", "ppl,arc_easy", "--data-dir", str(tmp_path / "missing")],
         ["--data-dir", "is not a folder", "llm_foundry_eval/arc_easy.jsonl"]),
        (["--tasks", "piqa", "--data-dir", str(empty)],
         ["--data-dir", str(empty / "llm_foundry_eval" / "piqa.jsonl")]),
        (["--tasks", "hellaswag", "--data-dir", str(empty)],
         ["--data-dir", "hellaswag/hellaswag_val_full.txt.bz2"]),
        (["--tasks", "mmlu", "--data-dir", str(empty)], ["--data-dir", "mmlu/test"]),
        (["--tasks", "ppl", "--text", str(tmp_path / "missing.txt")],
         ["--text", "missing.txt"]),
    ]
    for argv, expected in cases:
        assert main([*base, *argv]) == 2, argv
        captured = capsys.readouterr()
        assert len(captured.err.strip().splitlines()) == 1, captured.err
        for piece in expected:
            assert piece in captured.err, (argv, captured.err)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def tiny_llama_with_bytes(tmp_path):
    """A tiny random Llama with a byte-level tokenizer (256 tokens, one per byte), as a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))},
                                   merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    folder = tmp_path / "tiny"
    tiny_model("llama", max_position_embeddings=512).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(folder)
    return folder


def test_eval_ppl_scores_the_packaged_text_without_a_data_folder(tiny_llama_with_bytes,
                                                                 tmp_path, capsys):
    import json

    from kbbq_pl.cli import main
    from kbbq_pl.resources import eval_text

    empty = tmp_path / "data"
    empty.mkdir()
    out = tmp_path / "ppl.json"
    assert main(["eval", "--model", str(tiny_llama_with_bytes), "--tasks", "ppl",
                 "--data-dir", str(empty), "--batch-size", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"ppl/kl text: {eval_text()} (kbbq-pl's packaged")
    metrics = json.loads(out.read_text(encoding="utf-8"))["lm_metrics"]
    assert metrics["text"] == str(eval_text())
    # the default window: the first 2048 tokens (bytes here), read 512 at a time
    assert metrics["n_tokens"] == 2048 and metrics["context"] == 512
    assert 128 < metrics["perplexity"] < 512  # a random model: about uniform over 256 bytes
