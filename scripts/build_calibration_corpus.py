"""Build kbbq-pl's mixed-domain calibration corpus, ``kbbq_pl/resources/calibration_mixed.jsonl``.

    python scripts/build_calibration_corpus.py [--data ../shared/data] [--out PATH]

Reads three public data sets from ``--data`` (laid out as ``../shared/data``, see its
MANIFEST.md) and writes one JSON object per line, ``{"text", "domain", "source"}``:

* prose: paragraphs of WikiText-2 ``wikitext2/valid.txt`` (the tokenized variant), headings
  dropped, sentences holding ``<unk>`` dropped, turned back into plain text
  (:func:`kbbq_pl.eval.evaluation.detokenize_wikitext`); CC-BY-SA 3.0;
* math: GSM8K ``gsm8k/train.jsonl`` questions with their worked solutions (calculator
  annotations ``<<...>>`` removed); MIT;
* code: MBPP ``mbpp/mbpp.jsonl`` training tasks 601-974 (none of the test tasks 11-510 that
  ``kbbq-pl eval --tasks mbpp`` scores, nor its prompt tasks 1-10), the task as a comment
  above the solution; CC-BY-4.0.

The records are interleaved in a seeded order, so every calibration block of a few hundred
tokens mixes domains.  Deterministic: the same inputs give the same bytes.  The budget per
domain is in characters (``--prose/--math/--code``).  WikiText-2's valid split and GSM8K's train
split are not scored by kbbq-pl's evaluations (WikiText-2 test, GSM8K test), so calibrating on
the corpus does not touch held-out text.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from kbbq_pl.eval.evaluation import _is_heading, detokenize_wikitext, split_wikitext_sentences
from kbbq_pl.io.fileio import atomic_write_text

MBPP_TRAIN_IDS = range(601, 975)


def prose(path: Path, budget: int) -> list[dict[str, str]]:
    records, used = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or _is_heading(line):
            continue
        sentences = [s for s in split_wikitext_sentences(line) if "<unk>" not in s]
        text = " ".join(detokenize_wikitext(s) for s in sentences)
        if len(text) < 200:
            continue
        records.append({"text": text, "domain": "prose", "source": "wikitext2/valid.txt"})
        used += len(text)
        if used >= budget:
            break
    return records


def math(path: Path, budget: int) -> list[dict[str, str]]:
    records, used = [], 0
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            doc = json.loads(line)
            solution = re.sub(r"<<[^>]*>>", "", doc["answer"])
            text = f"Question: {doc['question']}\nAnswer: {solution}"
            records.append({"text": text, "domain": "math", "source": "gsm8k/train.jsonl"})
            used += len(text)
            if used >= budget:
                break
    return records


def code(path: Path, budget: int) -> list[dict[str, str]]:
    records, used = [], 0
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            doc = json.loads(line)
            if doc["task_id"] not in MBPP_TRAIN_IDS:
                continue
            body = doc["code"].replace("\r\n", "\n").replace("\t", "    ")
            text = f"# {doc['text']}\n{body}\n"
            records.append({"text": text, "domain": "code", "source": "mbpp/mbpp.jsonl"})
            used += len(text)
            if used >= budget:
                break
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--out", default="kbbq_pl/resources/calibration_mixed.jsonl")
    parser.add_argument("--prose", type=int, default=240_000, help="characters of prose")
    parser.add_argument("--math", type=int, default=110_000, help="characters of math")
    parser.add_argument("--code", type=int, default=80_000, help="characters of code")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = Path(args.data)
    records = (prose(data / "wikitext2" / "valid.txt", args.prose)
               + math(data / "gsm8k" / "train.jsonl", args.math)
               + code(data / "mbpp" / "mbpp.jsonl", args.code))
    random.Random(args.seed).shuffle(records)
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    atomic_write_text(args.out, text)
    counts = {d: sum(r["domain"] == d for r in records) for d in ("prose", "math", "code")}
    chars = {d: sum(len(r["text"]) for r in records if r["domain"] == d) for d in counts}
    print(f"wrote {args.out}: {len(records)} records {counts}, characters {chars}, "
          f"{len(text.encode('utf-8'))} bytes")


if __name__ == "__main__":
    main()
