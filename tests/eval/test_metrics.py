"""The torchmetrics metrics of kbbq_pl.eval.metrics: the figures kbbq-pl printed before them
bit for bit, torchmetrics' own metrics to rounding, two processes as one, logged by Lightning."""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.eval.evaluation import (
    cosine_summary,
    mean_pooled_embeddings,
    perplexity,
    prepare_stream,
    rolling_windows,
    scored_positions,
    window_batches,
    window_logits,
)
from kbbq_pl.eval.lm_metrics import lm_metrics, reference_log_probs
from kbbq_pl.eval.metrics import CosineFidelity, TokenKL, TokenPerplexity, token_kl
from kbbq_pl.io.models import load_model
from kbbq_pl.resources import eval_sentences, eval_text

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the accumulation kbbq-pl did by hand before the metrics (release 0.1.0, verbatim) -------

def _hand_perplexity(model, tokenizer, source, seq_len, stride, max_tokens, batch_size):
    ids = prepare_stream(model, tokenizer, source, max_tokens)
    windows = rolling_windows(len(ids), seq_len, stride)
    total = 0.0
    count = 0
    for _, targets, predicted in window_logits(model, ids, windows, batch_size):
        nll = torch.nn.functional.cross_entropy(predicted, targets, reduction="sum")
        total += nll.double().item()
        count += len(targets)
    mean = total / count
    return {"perplexity": math.exp(mean), "nll": mean, "n_tokens": count,
            "n_windows": len(windows)}


def _hand_lm_metrics(model, reference, tokenizer, source, context, stride, max_tokens,
                     batch_size):
    ids = prepare_stream(model, tokenizer, source, max_tokens)
    windows = rolling_windows(len(ids), context, stride)
    reference_windows = window_logits(reference, ids, windows, batch_size)
    nll = kl = kl_max = 0.0
    count = 0
    for _, targets, logits in window_logits(model, ids, windows, batch_size):
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").double().item()
        ref = torch.log_softmax(next(reference_windows)[2], dim=-1)
        per_token = token_kl(ref, logits)
        kl += per_token.sum().item()
        kl_max = max(kl_max, per_token.max().item())
        count += len(targets)
    mean = nll / count
    return {"perplexity": math.exp(mean), "nll": mean, "kl": kl / count, "kl_max": kl_max,
            "n_tokens": count, "n_windows": len(windows), "context": context, "stride": stride}


def _hand_cosine_summary(embeddings, reference):
    cosine = torch.nn.functional.cosine_similarity(
        embeddings.to(torch.float64), reference.to(torch.float64), dim=1)
    return {"mean_cosine": cosine.mean().item(), "min_cosine": cosine.min().item(),
            "n_sentences": int(cosine.numel())}


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")


def _perturbed(model, scale, seed=0):
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape,
                                                                 generator=generator))
    return other


def test_lm_figures_are_the_hand_written_ones_bit_for_bit(minilm):
    """A tiny random Llama over the MiniLM vocabulary on the shipped held-out text."""
    tokenizer = minilm[1]
    model = tiny_model("llama", vocab_size=len(tokenizer))
    other = _perturbed(model, 0.5)
    window = {"max_tokens": 600, "batch_size": 3}
    assert perplexity(model, tokenizer, eval_text(), seq_len=128, stride=48, **window) == \
        _hand_perplexity(model, tokenizer, eval_text(), 128, 48, **window)
    expected = _hand_lm_metrics(other, model, tokenizer, eval_text(), 128, 48, **window)
    assert expected["n_windows"] > 3 and expected["kl"] > 1e-4
    assert lm_metrics(other, tokenizer, eval_text(), reference=model, context=128, stride=48,
                      **window) == expected
    cached = reference_log_probs(model, tokenizer, eval_text(), context=128, stride=48, **window)
    assert lm_metrics(other, tokenizer, eval_text(), reference=cached, context=128, stride=48,
                      **window) == expected


def test_embedding_fidelity_is_the_hand_written_one_bit_for_bit(minilm):
    model, tokenizer = minilm
    sentences = eval_sentences()
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    embeddings = mean_pooled_embeddings(_perturbed(model, 0.05), tokenizer, sentences)
    summary = cosine_summary(embeddings, reference)
    assert summary == _hand_cosine_summary(embeddings, reference)
    assert summary["n_sentences"] == len(sentences) and summary["min_cosine"] < 0.9999
    # in batches: the same min and count, the mean to float64 rounding
    fidelity = CosineFidelity()
    for start in range(0, len(sentences), 10):
        fidelity.update(embeddings[start : start + 10], reference[start : start + 10])
    batched = fidelity.summary()
    assert batched["min_cosine"] == summary["min_cosine"]
    assert batched["mean_cosine"] == pytest.approx(summary["mean_cosine"], rel=1e-14, abs=0)
    assert fidelity.compute().item() == batched["mean_cosine"]
    with pytest.raises(ValueError, match=r"\(3, 384\).*\(4, 384\)"):
        fidelity.update(embeddings[:3], reference[:4])


def _batches(seed=0, n=8, vocab=50):
    generator = torch.Generator().manual_seed(seed)
    rows = [int(r) for r in torch.randint(3, 12, (n,), generator=generator)]
    logits = [3 * torch.randn(r, vocab, generator=generator) for r in rows]
    reference = [torch.log_softmax(x + torch.randn(x.shape, generator=generator), -1)
                 for x in logits]
    targets = [torch.randint(0, vocab, (r,), generator=generator) for r in rows]
    embeddings = [torch.randn(r, 16, generator=generator) for r in rows]
    fp = [e + 0.3 * torch.randn(e.shape, generator=generator) for e in embeddings]
    return list(zip(logits, targets, reference, embeddings, fp))


def _updated(batches):
    metrics = TokenPerplexity(), TokenKL(), CosineFidelity()
    for logits, targets, reference, embeddings, fp in batches:
        metrics[0].update(logits, targets)
        metrics[1].update(reference, logits)
        metrics[2].update(embeddings, fp)
    return metrics


def _figures(metrics):
    return {type(m).__name__: {"compute": m.compute().item(), **m.summary()} for m in metrics}


def test_metrics_accumulate_reset_and_skip_ignored_targets():
    batches = _batches()
    ppl, kl, cosine = _updated(batches)
    logits = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    reference = torch.cat([b[2] for b in batches])
    nll = torch.nn.functional.cross_entropy(logits.double(), targets)
    per_token = token_kl(reference, logits)
    assert ppl.summary()["n_tokens"] == kl.summary()["n_tokens"] == len(targets)
    assert ppl.summary()["nll"] == pytest.approx(nll.item(), rel=1e-6)
    assert ppl.compute().item() == pytest.approx(math.exp(nll.item()), rel=1e-6)
    assert kl.compute().item() == pytest.approx(per_token.mean().item(), rel=1e-12)
    assert kl.summary()["kl_max"] == per_token.max().item()
    assert cosine.summary()["n_sentences"] == len(targets)
    # [batch, positions, vocab] as a LightningModule has them, padding skipped
    padded = targets.clone()
    padded[::3] = -100
    batched = TokenPerplexity()
    batched.update(logits[None], padded[None])
    kept = padded != -100
    assert batched.summary()["n_tokens"] == int(kept.sum())
    assert batched.summary()["nll"] == pytest.approx(
        torch.nn.functional.cross_entropy(logits[kept].double(), targets[kept]).item(), rel=1e-6)
    for metric in (ppl, kl, cosine):
        metric.reset()
    assert ppl.count.item() == kl.count.item() == cosine.count.item() == 0
    assert math.isinf(cosine.cosine_min.item()) and kl.kl_max.item() == 0.0
    masked, selected = TokenKL(), TokenKL()  # a padded batch's positions left out
    masked.update(reference[None], logits[None], kept[None])
    selected.update(reference[kept], logits[kept])
    assert masked.summary() == selected.summary() and masked.summary()["n_tokens"] < len(kept)
    with pytest.raises(ValueError, match="does not cover the positions"):
        masked.update(reference, logits, kept[:-1])
    for metric, what in ((ppl, "token"), (kl, "token"), (cosine, "sentence")):
        with pytest.raises(ValueError, match=f"no {what} was scored"):
            metric.summary()
    with pytest.raises(ValueError, match="do not predict targets"):
        ppl.update(logits, targets[:-1])
    with pytest.raises(ValueError, match="differ in shape"):
        kl.update(reference[None], logits)


def test_torchmetrics_own_metrics_give_the_same_quantities_to_rounding():
    from torchmetrics.regression import CosineSimilarity, KLDivergence
    from torchmetrics.text import Perplexity

    batches = _batches()
    ppl, kl, cosine = _updated(batches)
    theirs = Perplexity(), KLDivergence(log_prob=True), CosineSimilarity(reduction="mean")
    for logits, targets, reference, embeddings, fp in batches:
        theirs[0].update(logits[None], targets[None])
        theirs[1].update(reference, torch.log_softmax(logits, -1))
        theirs[2].update(embeddings, fp)
    for ours, other in zip((ppl, kl, cosine), theirs):
        assert ours.compute().item() == pytest.approx(other.compute().item(), rel=1e-5)
    # where they part: a probability below float32's range is 0 to log(softmax), not to ours
    logits = torch.tensor([[0.0, -200.0]])
    target = torch.tensor([1])
    assert math.isinf(Perplexity()(logits[None], target[None]).item())
    mine = TokenPerplexity()
    mine.update(logits, target)
    assert mine.summary()["nll"] == pytest.approx(200.0, rel=1e-6)


def _two_process_worker(rank: int, world: int, init_file: str, out_dir: str,
                        batches: list) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        half = len(batches) // world
        metrics = _updated(batches[rank * half : (rank + 1) * half])
        figures = _figures(metrics)
        figures["local"] = {type(m).__name__: m.count.item() for m in metrics}  # unsynced after
        torch.save(figures, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_give_the_same_values_as_one():
    """Rank 0 updates on the first half of the batches, rank 1 on the second; both compute.
    Counts, the KL max and the cosine min are bit for bit the one-process values; the float64
    sums are added in another order (each half, then the two halves), so they and the means
    agree to 1e-14 relative, and bit for bit with one process that groups its sums the same."""
    import torch.multiprocessing as mp

    batches = _batches()
    one = _figures(_updated(batches))
    first, second = _updated(batches[:4]), _updated(batches[4:])
    with tempfile.TemporaryDirectory() as folder:
        # fork: the workers start with this process's modules loaded (spawn re-imports them)
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_two_process_worker, nprocs=2, join=True, start_method=method,
                           args=(2, os.path.join(folder, "init"), folder, batches))
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]
    for rank, mine in zip(ranks, (first, second)):  # after compute, each keeps its own states
        assert rank.pop("local") == {type(m).__name__: m.count.item() for m in mine}
    exact = ("n_tokens", "n_sentences", "kl_max", "min_cosine")
    for figures in ranks:
        assert figures.keys() == one.keys()
        for name, values in one.items():
            for key, value in values.items():
                if key in exact:
                    assert figures[name][key] == value, (name, key)
                else:
                    assert figures[name][key] == pytest.approx(value, rel=1e-14, abs=0), \
                        (name, key)
        # the same grouping on one process: bit for bit
        n = one["TokenKL"]["n_tokens"]
        assert figures["TokenPerplexity"]["nll"] == (first[0].nll_sum + second[0].nll_sum) / n
        assert figures["TokenKL"]["kl"] == (first[1].kl_sum + second[1].kl_sum) / n
        assert figures["CosineFidelity"]["mean_cosine"] == \
            (first[2].cosine_sum + second[2].cosine_sum) / n


def _held_out_module(model, teacher):
    from lightning.pytorch import LightningModule

    class HeldOut(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            object.__setattr__(self, "teacher", teacher)  # not a submodule
            self.val_perplexity = TokenPerplexity()
            self.val_kl = TokenKL()

        def validation_step(self, batch, batch_idx):
            logits = self.model(input_ids=batch["input_ids"]).logits
            reference = self.teacher(input_ids=batch["input_ids"]).logits
            for (targets, predicted), (_, fp) in zip(scored_positions(batch, logits),
                                                     scored_positions(batch, reference)):
                self.val_perplexity.update(predicted, targets)
                self.val_kl.update(torch.log_softmax(fp, -1), predicted)
            self.log("val_perplexity", self.val_perplexity)
            self.log("val_kl", self.val_kl)

    return HeldOut()


def test_lightning_logs_the_held_out_figures_of_lm_metrics():
    from lightning.pytorch import Trainer

    model = tiny_model("llama")
    other = _perturbed(model, 0.5)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1))
    stream = prepare_stream(other, None, ids, None, add_bos=False)
    batches = window_batches(stream, rolling_windows(len(stream), 64, 24), batch_size=4)
    assert [len(b["first"]) for b in batches] == [4, 4, 3]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    module = _held_out_module(other, model)
    for _ in range(2):  # the metrics are reset between runs
        logged = trainer.validate(module, loader, verbose=False)[0]
        expected = lm_metrics(other, None, ids, reference=model, context=64, stride=24,
                              add_bos=False)
        assert logged["val_perplexity"] == pytest.approx(expected["perplexity"], rel=1e-12)
        assert logged["val_kl"] == expected["kl"]
    assert module.val_perplexity.count.item() == 0  # reset at the end of the epoch


def test_perplexity_of_bf16_logits_is_summed_in_float32_at_least():
    """A bf16 model's logits: the NLL is that of the same values in float32 (cross-entropy in
    bf16 would round the log-softmax and the sum to 8 bits)."""
    logits = (torch.randn(4096, 512, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    targets = torch.randint(0, 512, (4096,), generator=torch.Generator().manual_seed(1))
    low, exact = TokenPerplexity(), TokenPerplexity()
    low.update(logits, targets)
    exact.update(logits.float(), targets)
    assert low.summary() == exact.summary()
