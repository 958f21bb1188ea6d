"""Files shipped with kbbq-pl: the embedded evaluation sentences, and the mixed-domain
calibration corpus (``calibration_mixed.jsonl``, see ``CALIBRATION_CORPUS.md`` beside it for
its sources and licences)."""

from importlib.resources import as_file, files
from pathlib import Path

CALIBRATION_CORPUS = "calibration_mixed.jsonl"


def eval_sentences() -> list[str]:
    """The embedded English sentences the ``kbbq-pl quantize`` default measures fidelity on."""
    text = files(__name__).joinpath("eval_sentences.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def calibration_corpus() -> Path:
    """The path of the shipped mixed-domain calibration corpus (prose, math, code; JSON lines
    with a ``text`` field)."""
    with as_file(files(__name__).joinpath(CALIBRATION_CORPUS)) as path:
        return Path(path)
