"""Model folders named by a HuggingFace Hub id.

Every reader of a folder (a full-precision model to quantize, a kbbq-pl checkpoint to load or
export) takes a local path or a Hub id, as transformers' ``from_pretrained`` does:
:func:`local_folder` gives the id's snapshot in the HuggingFace cache, fetched where the Hub is
reachable, read from the cache under ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A HuggingFace Hub model id, ``org/name``."""
HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.py", SAFE_WEIGHTS_NAME]
"""What a Hub snapshot fetches first: config, tokenizer, the model code of a folder that holds
its own (run only with ``trust_remote_code``), and the weights in one file or the index of
their shards (``model.safetensors.index.json``), whose shards come next (:func:`hub_snapshot`):
not every ``*.safetensors`` of the repository (Mistral's also hold ``consolidated.safetensors``,
the same weights again for another reader)."""


def local_folder(path: str | Path) -> Path:
    """``path`` itself, or, for a Hub id that names no local path, its snapshot
    (:func:`hub_snapshot`)."""
    if not Path(path).exists() and HUB_ID.match(str(path)):
        return hub_snapshot(str(path))
    return Path(path)


def hub_snapshot(repo_id: str) -> Path:
    """The HuggingFace cache's snapshot of ``repo_id`` (downloaded unless ``HF_HUB_OFFLINE``):
    :data:`HUB_FILES`, then the files they name (:func:`_listed_files`)."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
        rest = _listed_files(folder)
        if rest:
            folder = Path(snapshot_download(repo_id, allow_patterns=rest))
    except Exception as error:  # noqa: BLE001 - offline, unknown id, no network: one message
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise FileNotFoundError(f"{repo_id!r} is neither a local folder nor a HuggingFace Hub "
                                f"model that could be fetched ({reason}); pass a local "
                                "folder, or fetch it where the Hub is reachable") from None
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{repo_id!r}: the Hub snapshot {folder} has no config.json")
    return folder


def _listed_files(folder: Path) -> list[str]:
    """What a snapshot's first files name, to fetch next: the weight shards of
    ``model.safetensors.index.json`` (as transformers' ``from_pretrained`` fetches them) and the
    folders of the sentence-transformers modules ``modules.json`` lists (a dense head's
    weights)."""
    patterns = []
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        patterns += sorted(set(json.loads(index.read_text())["weight_map"].values()))
    modules = folder / "modules.json"
    if modules.is_file():
        patterns += [f"{module['path']}/*" for module in json.loads(modules.read_text())
                     if isinstance(module, dict) and module.get("path")]
    return patterns
