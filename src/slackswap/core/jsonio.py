"""Atomic JSON files and schema-versioned loading for the data model."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import pydantic

from slackswap.errors import InputError

__all__ = ["JsonFile", "atomic_write", "atomic_write_text", "content_digest", "dump_model",
           "load_model", "validate_model"]

M = TypeVar("M", bound=pydantic.BaseModel)


def _umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` with ``write(f)`` so that readers see the old file or the new one,
    never half, and otherwise as a shell's ``>`` would: a symlink is followed, a device or
    FIFO (``/dev/null``) is written in place, a file keeps its mode (a new one takes the
    umask's). Missing folders are made; failures raise :class:`InputError`."""
    target = Path(os.path.realpath(path))
    try:
        if target.exists() and not target.is_file():
            with open(target, "wb") as f:
                write(f)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write`."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def dump_model(model: pydantic.BaseModel, path: str | os.PathLike[str]) -> None:
    """Serialize a data-model object to JSON at ``path``, atomically."""
    atomic_write_text(path, model.model_dump_json())


def content_digest(model: pydantic.BaseModel) -> str:
    """A hash of everything ``model`` holds (its JSON): equal digests, equal contents."""
    return hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:24]


def validate_model(cls: type[M], data: Any, source: str) -> M:
    """Build ``cls`` from parsed JSON or TOML, turning schema problems into one-line errors."""
    expected = cls.model_fields["schema_version"].default
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(version, int) and version > expected:
        raise InputError(
            f"{source}: schema_version {version} is newer than this SlackSwap reads "
            f"({expected}); upgrade slackswap"
        )
    if isinstance(version, int) and version < 1:
        raise InputError(f"{source}: schema_version {version} is not a version (1 to "
                         f"{expected}); fix the file or write it again")
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        what = f"field '{field}': " if field else ""
        message = err["msg"].removeprefix("Value error, ")
        more = f" ({e.error_count()} problems in all)" if e.error_count() > 1 else ""
        raise InputError(f"{source}: {what}{message}{more}") from None


def load_model(cls: type[M], path: str | os.PathLike[str]) -> M:
    """Read a data-model object from a JSON file, with errors that name the file and field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    return validate_model(cls, data, str(path))


class JsonFile:
    """``save`` and ``load`` for a schema-versioned data-model class (a pydantic model)."""

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this object to ``path`` as JSON, atomically."""
        dump_model(self, path)  # type: ignore[arg-type]

    @classmethod
    def load(cls: type[M], path: str | os.PathLike[str]) -> M:  # type: ignore[misc]
        """Read an object from a JSON file; errors name the file and the field."""
        return load_model(cls, path)
