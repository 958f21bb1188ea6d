"""Writing files and folders so that a reader never sees a half-written one, and nothing that
kbbq-pl did not write is ever lost.

Every output of kbbq-pl (checkpoints, reports, converted models, cached data) goes through
:func:`atomic_write` (a temporary file in the same folder, flushed, then renamed over the
target) or :func:`write_folder` (a temporary sibling folder, renamed into place).

The policy for a user-named output (:func:`check_output`, called by the commands before any
work and again by the writers): a missing path or an empty folder is written; an existing one
is an error unless ``overwrite``, and even then only an output kbbq-pl wrote is replaced: a
folder holding the marker :data:`MARKER_NAME` and no file beyond those the marker lists, or a
JSON file whose ``written_by`` is ``"kbbq-pl"``.  An output equal to a source (the model
folder, a converted checkpoint), inside it, or containing it is refused whatever the flags.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

MARKER_NAME = "kbbq-pl.json"
"""The file every folder written by :func:`write_folder` holds: who wrote it, what, and the
files it wrote (the only ones ``overwrite`` may delete)."""
WRITTEN_BY = "kbbq-pl"


class OutputPathError(FileExistsError):
    """An output path kbbq-pl refuses to write (it would replace or mix with what the user
    owns, or write into a source) or cannot write (a file or a read-only folder above it)."""

def _umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _usual_modes(folder: Path) -> None:
    """Give ``folder``, its subfolders and files the modes the user's umask gives a new file
    (0644 / 0755 under umask 022): ``tempfile`` and safetensors' ``save_file`` create them
    private (0600 / 0700), which a server running under another account cannot read."""
    mask = _umask()
    for path in [*folder.rglob("*"), folder]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary_path)``, then move the finished file to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        _fsync(Path(temporary))
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes it private; use the usual mode
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def _is_relative_to(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def _written_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()}


def _foreign_files(folder: Path) -> list[str] | None:
    """Files in ``folder`` that kbbq-pl did not write (None: the folder has no valid marker)."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("written_by") != WRITTEN_BY:
        return None
    listed = set(marker.get("files", [])) | {MARKER_NAME}
    return sorted(_written_files(folder) - listed)


def _file_is_ours(path: Path) -> bool:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and document.get("written_by") == WRITTEN_BY


def _check_writable(target: Path) -> None:
    """An :class:`OutputPathError` where ``target`` cannot be created: the nearest existing
    folder above it is a file or is not writable (a read-only mount), said before the work
    rather than when the finished output is moved into place."""
    above = target.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise OutputPathError(f"cannot write {target}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write {target}: the folder {above} is not writable")


def check_output(path: str | Path, *, overwrite: bool = False,
                 sources: Iterable[str | Path | None] = (),
                 kind: Literal["folder", "file"] = "folder") -> Path:
    """The resolved output ``path`` when writing it loses nothing kbbq-pl did not write (see the
    module docstring); else an :class:`OutputPathError` saying why.  ``sources`` are the inputs
    the output must not coincide with, lie in, or contain.  Call it before the work."""
    target = Path(path).expanduser().resolve()
    for source in sources:
        if source is None:
            continue
        source = Path(source).expanduser().resolve()
        if target == source:
            raise OutputPathError(f"refusing to write the output over its source {source}")
        if _is_relative_to(target, source):
            raise OutputPathError(f"refusing to write the output {target} inside the source "
                                  f"{source}: the source is never modified")
        if _is_relative_to(source, target):
            raise OutputPathError(f"refusing to write the output {target}: it contains the "
                                  f"source {source}, which replacing it would delete")
    _check_writable(target)
    if not target.exists() and not target.is_symlink():
        return target
    if kind == "file":
        if not target.is_file():
            raise OutputPathError(f"{target} exists and is not a regular file; choose another "
                                  "output path")
        if not overwrite:
            raise OutputPathError(f"{target} exists; pass --overwrite (overwrite=True) to "
                                  "replace a file kbbq-pl wrote")
        if not _file_is_ours(target):
            raise OutputPathError(f"{target} exists and kbbq-pl did not write it; refusing to "
                                  "replace it, even with --overwrite")
        return target
    if not target.is_dir():
        raise OutputPathError(f"{target} exists and is not a folder; refusing to replace it, "
                              "even with --overwrite: choose another output folder")
    if not any(target.iterdir()):
        return target
    if not overwrite:
        raise OutputPathError(f"{target} exists and is not empty; pass --overwrite "
                              "(overwrite=True) to replace a folder kbbq-pl wrote")
    foreign = _foreign_files(target)
    if foreign is None:
        raise OutputPathError(f"{target} exists and kbbq-pl did not write it (no {MARKER_NAME}); "
                              "refusing to replace it, even with --overwrite")
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                          else "")
        raise OutputPathError(f"{target} holds files kbbq-pl did not write ({shown}); refusing "
                              "to replace it, even with --overwrite")
    return target


def write_folder(out_dir: str | Path, write: Callable[[Path], None], *, kind: str,
                 overwrite: bool = False, sources: Iterable[str | Path | None] = (),
                 metadata: dict[str, Any] | None = None) -> Path:
    """Call ``write(staging)`` on a fresh folder beside ``out_dir``, add the marker (``kind``:
    what the folder is, the files written, ``metadata``), then move it into place; an existing
    ``out_dir`` is replaced only as :func:`check_output` allows.  Nothing is left behind on
    failure, and the staging folder of an earlier writer of ``out_dir`` that was killed is
    removed (:func:`remove_stale_staging`).  Returns the resolved folder."""
    from .._version import __version__

    out_dir = check_output(out_dir, overwrite=overwrite, sources=sources)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{STAGING}{os.getpid()}.",
                                    dir=out_dir.parent))
    try:
        write(staging)
        marker = {"written_by": WRITTEN_BY, "version": __version__, "kind": kind,
                  **(metadata or {}), "files": sorted(_written_files(staging))}
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        for file in staging.rglob("*"):
            if file.is_file():
                _fsync(file)
        _usual_modes(staging)
        if out_dir.exists():
            check_output(out_dir, overwrite=overwrite)  # again: it may have changed meanwhile
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.rename(out_dir, old / out_dir.name)
            os.rename(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    except OSError as error:  # a full disk, a quota: name the output, not the staging file
        shutil.rmtree(staging, ignore_errors=True)
        file = f" ({Path(error.filename).name})" if error.filename else ""
        raise OSError(error.errno, f"{out_dir} was not written, nothing was left: "
                      f"{error.strerror or error}{file}") from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def save_safetensors(tensors: dict[str, Any], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, whose I/O failures (a full disk) become the
    ``OSError`` they are (safetensors raises its own ``SafetensorError``) naming ``path``."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:
        found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(error))
        if found is None:
            raise
        raise OSError(int(found.group(2)), found.group(1), str(path)) from error


STAGING = "staging-"
"""Part of the hidden name of :func:`write_folder`'s staging folder, before the writer's pid."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove the staging folders of ``out_dir`` (``.NAME.staging-PID.*``) left by a writer
    that was killed (its process no longer runs; a failing writer removes its own); returns
    them.  A run killed on a full disk or by the out-of-memory killer leaves nothing else."""
    removed = []
    for path in out_dir.parent.glob(f".{out_dir.name}.{STAGING}*"):
        pid = path.name[len(f".{out_dir.name}.{STAGING}"):].split(".", 1)[0]
        if path.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_text(document: Any, indent: int | None = 2, **options: Any) -> str:
    """``document`` as strict JSON text ending in a newline: NaN and infinities written as
    ``null`` (JSON has no such numbers: Python's default ``NaN`` / ``Infinity`` are refused by
    strict readers such as ``jq`` and browsers), other objects as their ``str``."""
    return json.dumps(_finite(document), indent=indent, default=str, allow_nan=False,
                      **options) + "\n"


def write_output_json(path: str | Path, document: dict[str, Any], *, overwrite: bool = False,
                      sources: Iterable[str | Path | None] = ()) -> Path:
    """Write ``document`` (with ``written_by: kbbq-pl``) as JSON to the user-named file
    ``path``, atomically, as :func:`check_output` allows."""
    target = check_output(path, overwrite=overwrite, sources=sources, kind="file")
    return atomic_write_text(target, json_text({"written_by": WRITTEN_BY, **document}))


def written_summary(path: str | Path) -> str:
    """What a command wrote, for its last line: ``wrote DIR/ (N files, X MiB): a, b, ...``
    listing every file of a folder (the marker's list when kbbq-pl wrote it), or ``wrote FILE
    (X KiB)``."""
    path = Path(path)
    if path.is_file():
        return f"wrote {path} ({_size(path.stat().st_size)})"
    files = sorted(_written_files(path))
    size = sum((path / name).stat().st_size for name in files)
    entries: dict[str, int] = {}  # a top-level file, or a subfolder with its file count
    for name in files:
        top, _, below = name.partition("/")
        entries[f"{top}/" if below else top] = entries.get(f"{top}/" if below else top, 0) + 1
    shown = [f"{name} ({count} files)" if name.endswith("/") else name
             for name, count in entries.items()]
    return f"wrote {path}/ ({len(files)} files, {_size(size)}): {', '.join(shown)}"


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} bytes"


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_resumable_folder(out_dir: str | Path, *, kind: str, resume: bool = False,
                          overwrite: bool = False, sources: Iterable[str | Path | None] = ()
                          ) -> Path:
    """An output folder filled file by file (:func:`add_resumable_file`), so that an
    interrupted run can go on: a new or empty ``out_dir`` is started; an existing one is
    continued with ``resume`` (it must be a folder of this ``kind`` that kbbq-pl wrote, holding
    nothing else), or emptied of kbbq-pl's files with ``overwrite`` (as :func:`check_output`
    allows); otherwise an :class:`OutputPathError`."""
    from .._version import __version__

    target = Path(out_dir).expanduser().resolve()
    if resume and target.is_dir() and any(target.iterdir()):
        check_output(target, overwrite=True, sources=sources)  # ours, nothing foreign
        marker = json.loads((target / MARKER_NAME).read_text(encoding="utf-8"))
        if marker.get("kind") != kind:
            raise OutputPathError(f"{target} holds a kbbq-pl {marker.get('kind')!r} output, "
                                  f"not a {kind!r} one; --resume cannot continue it")
        return target
    target = check_output(target, overwrite=overwrite, sources=sources)
    if target.is_dir():
        for name in sorted(_written_files(target), reverse=True):
            (target / name).unlink()
    target.mkdir(parents=True, exist_ok=True)
    marker = {"written_by": WRITTEN_BY, "version": __version__, "kind": kind, "files": []}
    atomic_write_text(target / MARKER_NAME, json.dumps(marker, indent=2) + "\n")
    return target


def add_resumable_file(folder: Path, name: str, content: str | Callable[[Path], None]) -> Path:
    """Write ``folder/name`` atomically (``content``: the text, or a function writing the file
    at the path it is given) and list it in the marker of ``folder`` (a folder from
    :func:`open_resumable_folder`)."""
    path = (atomic_write_text(folder / name, content) if isinstance(content, str)
            else atomic_write(folder / name, content))
    marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    marker["files"] = sorted(set(marker.get("files", [])) | {name})
    atomic_write_text(folder / MARKER_NAME, json.dumps(marker, indent=2) + "\n")
    return path
