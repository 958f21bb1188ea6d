"""Packaged YAML recipes (``kbbq_pl.recipes``): ``kbbq-pl quantize --config NAME`` runs one,
``kbbq-pl recipes`` lists them."""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path


def packaged_recipes() -> dict[str, str]:
    """Every packaged recipe's name and what it does (its header comment, up to the usage
    line), in name order."""
    recipes = {}
    for entry in sorted(files(__name__).iterdir(), key=lambda e: e.name.removesuffix(".yaml")):
        if not entry.name.endswith(".yaml"):
            continue
        header = []
        for line in entry.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#") or line.startswith("# kbbq-pl "):
                break
            header.append(line.lstrip("# ").strip())
        recipes[entry.name[:-len(".yaml")]] = " ".join(header)
    return recipes


def recipe_path(name: str) -> Path:
    """The file of a packaged recipe (``rtn_kbbq_nvfp4_lam0.75``, with or without ``.yaml``);
    a name that is not one raises :class:`FileNotFoundError` suggesting the closest names."""
    stem = Path(name).name.removesuffix(".yaml")
    known = packaged_recipes()
    if stem in known:
        return Path(str(files(__name__).joinpath(f"{stem}.yaml")))
    close = difflib.get_close_matches(stem, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise FileNotFoundError(f"recipe {name!r}: no such file and no packaged recipe of that name; "
                            f"{hint}`kbbq-pl recipes` lists the {len(known)} packaged recipes")
