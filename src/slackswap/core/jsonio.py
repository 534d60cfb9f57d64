"""Atomic JSON files and schema-versioned loading for the data model."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import pydantic

from slackswap.errors import InputError

__all__ = ["JsonFile", "atomic_write_text", "dump_model", "load_model", "validate_model"]

M = TypeVar("M", bound=pydantic.BaseModel)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_model(model: pydantic.BaseModel, path: str | os.PathLike[str]) -> None:
    """Serialize a data-model object to JSON at ``path``, atomically."""
    atomic_write_text(path, model.model_dump_json())


def validate_model(cls: type[M], data: Any, source: str) -> M:
    """Build ``cls`` from parsed JSON, turning schema problems into one-line errors."""
    expected = cls.model_fields["schema_version"].default
    if isinstance(data, dict):
        version = data.get("schema_version")
        if isinstance(version, int) and version > expected:
            raise InputError(
                f"{source}: schema_version {version} is newer than this SlackSwap reads "
                f"({expected}); upgrade slackswap"
            )
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<top level>"
        raise InputError(
            f"{source}: field '{field}': {err['msg']} ({e.error_count()} problem(s) in all)"
        ) from None


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
