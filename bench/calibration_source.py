"""A text source far larger than what is read of it: read in part against read whole.

    python bench/calibration_source.py [--copies 27] [--n-tokens 16384] [--seq-len 256]
    python bench/calibration_source.py --tiny     # the WikiText-2 excerpt kbbq-pl ships

Writes a JSON-lines file of GSM8K *train* (``../shared/data/gsm8k/train.jsonl``) ``--copies``
times over (27: 201,771 records, 230 MB), each record a ``text`` (question and answer) and a
``messages`` conversation of the two, and times what a recipe's calibration does with it
(``token_blocks``, packed, on the ``text`` field; ``token_records``, whole records, on the
rendered conversations) with SmolLM2-135M's tokenizer and chat template: as it does now, a
seeded draw of the records until 256 characters a token (``CHARS_PER_TOKEN``), and with that
limit lifted (the whole file rendered and tokenized, as before 2026-12-03); and what ``kbbq-pl
eval --tasks ppl,kl --text`` scores of it (the first ``--n-tokens`` tokens of the ``text``
column): tokenized from a prefix, as it does now, and the whole text tokenized and cut, as
before 2026-12-03.  Each run is a
process of its own, so that its peak RSS is its own.  ``--tiny`` only checks that the script
runs (tests/bench/test_tiny_modes.py): the excerpt's lines 20 times over, kbbq-pl's byte-level
test tokenizer, 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "train.jsonl"
WHOLE = 10**15
"""Characters a token that no file holds: the limit lifted, the source read whole."""


def write_source(path: Path, copies: int, tiny: bool) -> int:
    """The JSON-lines source: each record ``{"text", "messages"}``; returns its record count."""
    if tiny:
        import _tiny

        pairs = [(line, line) for line in _tiny.wikitext_file().read_text().splitlines()
                 if line.strip()]
    else:
        if not DATA.is_file():
            raise SystemExit(f"{DATA} is missing: the source is GSM8K train "
                             "(../shared/data/gsm8k/train.jsonl)")
        pairs = [(r["question"], r["answer"]) for r in map(json.loads, DATA.open())]
    with path.open("w", encoding="utf-8") as out:
        for _ in range(copies):
            for question, answer in pairs:
                out.write(json.dumps({"text": f"{question}\n{answer}", "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]}) + "\n")
    return copies * len(pairs)


def run_one(source: str, tokenizer_dir: str, mode: str, whole: bool, n_tokens: int,
            seq_len: int) -> None:
    """One calibration read (in this process): prints seconds, peak RSS and the tokens read."""
    from transformers import AutoTokenizer

    from kbbq_pl.io import data

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if whole:
        data.CHARS_PER_TOKEN = WHOLE
    start = time.perf_counter()
    if mode == "packed":
        tokens = data.token_blocks(source, tokenizer, n_tokens=n_tokens, seq_len=seq_len).numel()
    elif mode == "eval":
        from kbbq_pl.eval.evaluation import _token_stream

        tokens = len(_token_stream(tokenizer, source, None)[:n_tokens] if whole
                     else _token_stream(tokenizer, source, n_tokens))
    else:
        tokens = sum(len(ids) for ids in data.token_records(
            source, tokenizer, n_tokens=n_tokens, max_len=seq_len, text_key="messages"))
    seconds = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"s": seconds, "peak_gb": peak_gb, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=27)
    parser.add_argument("--n-tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args()
    if args.one:
        source, tokenizer_dir, mode, whole, n_tokens, seq_len = args.one
        return run_one(source, tokenizer_dir, mode, whole == "1", int(n_tokens), int(seq_len))
    if args.tiny:
        args.copies, args.n_tokens, args.seq_len = 20, 64, 32

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source.jsonl"
        records = write_source(source, args.copies, args.tiny)
        if args.tiny:
            import _tiny

            tokenizer_dir = Path(tmp) / "tokenizer"
            _tiny.byte_tokenizer().save_pretrained(tokenizer_dir)
        else:
            from kbbq_pl.io.gguf_models import smollm2_path

            tokenizer_dir = smollm2_path()
        print(f"source: {records} records, {source.stat().st_size / 1e6:.1f} MB; "
              f"n_tokens {args.n_tokens}, seq_len {args.seq_len}")
        rows = []
        for mode in ("packed", "whole records", "eval text"):
            for whole in (False, True):
                child = subprocess.run(
                    [sys.executable, __file__, "--one", str(source), str(tokenizer_dir),
                     mode.split()[0], str(int(whole)), str(args.n_tokens), str(args.seq_len)],
                    capture_output=True, text=True, check=True)
                rows.append((mode, "whole" if whole else "in part",
                             json.loads(child.stdout.strip().splitlines()[-1])))
    print(f"{'reader':<15}{'source read':<13}{'s':>8}{'peak RSS GB':>13}{'tokens':>9}")
    for mode, read, row in rows:
        print(f"{mode:<15}{read:<13}{row['s']:>8.2f}{row['peak_gb']:>13.2f}{row['tokens']:>9}")


if __name__ == "__main__":
    main()
