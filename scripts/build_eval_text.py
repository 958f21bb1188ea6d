"""Build kbbq-pl's packaged held-out text, ``kbbq_pl/resources/wikitext2_test_head.txt``.

    python scripts/build_eval_text.py [--data ../shared/data] [--out PATH] [--min-bytes N]

The file is the beginning of WikiText-2 ``wikitext2/test.txt`` (the tokenized variant, as
distributed in pytorch/examples; CC BY-SA 3.0), byte for byte: the fewest whole lines of
the file that hold at least ``--min-bytes`` bytes (24,000: about 6,000 SmolLM2 tokens), so
it is a prefix of the full file that ends at a line boundary.  ``kbbq-pl eval`` and
``kbbq-pl compare`` score it (``--tasks ppl,kl``) when ``DATA_DIR/wikitext2/test.txt`` is
absent; their default window, the first 2048 tokens, is then the same token stream as on the
full file.  Deterministic: the same input gives the same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kbbq_pl.io.fileio import atomic_write


def head(path: Path, min_bytes: int) -> bytes:
    """The fewest whole lines at the start of ``path`` holding at least ``min_bytes`` bytes."""
    data = path.read_bytes()
    end = data.find(b"\n", max(min_bytes - 1, 0))
    if end < 0:
        raise ValueError(f"{path} holds fewer than {min_bytes} bytes in whole lines")
    return data[: end + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--out", default="kbbq_pl/resources/wikitext2_test_head.txt")
    parser.add_argument("--min-bytes", type=int, default=24_000)
    args = parser.parse_args()
    text = head(Path(args.data) / "wikitext2" / "test.txt", args.min_bytes)
    atomic_write(args.out, lambda path: path.write_bytes(text))
    print(f"wrote {args.out}: {len(text)} bytes, {len(text.splitlines())} lines")


if __name__ == "__main__":
    main()
