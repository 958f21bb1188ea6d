"""Files shipped with kbbq-pl: the embedded evaluation sentences, the mixed-domain
calibration corpus (``calibration_mixed.jsonl``, see ``CALIBRATION_CORPUS.md`` beside it for
its sources and licences) and the held-out text ``kbbq-pl eval``/``compare`` score without
the data folder (``wikitext2_test_head.txt``, see ``EVAL_TEXT.md``)."""

from importlib.resources import as_file, files
from pathlib import Path

CALIBRATION_CORPUS = "calibration_mixed.jsonl"
EVAL_TEXT = "wikitext2_test_head.txt"


def eval_sentences() -> list[str]:
    """The embedded English sentences the ``kbbq-pl quantize`` default measures fidelity on."""
    text = files(__name__).joinpath("eval_sentences.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def calibration_corpus() -> Path:
    """The path of the shipped mixed-domain calibration corpus (prose, math, code; JSON lines
    with a ``text`` field)."""
    with as_file(files(__name__).joinpath(CALIBRATION_CORPUS)) as path:
        return Path(path)


def eval_text() -> Path:
    """The path of the shipped held-out text: the beginning of WikiText-2 ``test.txt`` (the
    tokenized variant, CC BY-SA 3.0), byte for byte, cut at a line boundary after 24,000 bytes
    (about 5,800 SmolLM2 tokens); ``kbbq-pl eval``/``compare`` score it (``ppl``, ``kl``) when
    the data folder has no ``wikitext2/test.txt``."""
    with as_file(files(__name__).joinpath(EVAL_TEXT)) as path:
        return Path(path)
