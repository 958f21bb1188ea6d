"""Files shipped with kbbq-pl (the embedded evaluation sentences)."""

from importlib.resources import files


def eval_sentences() -> list[str]:
    """The embedded English sentences the ``kbbq-pl quantize`` default measures fidelity on."""
    text = files(__name__).joinpath("eval_sentences.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
