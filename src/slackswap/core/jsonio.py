"""Files read and written safely, and schema-versioned loading for the data model.

NOTE [files]
    Nothing a file says, and no file an output path names, may harm the machine or the
    result. Every write goes through :func:`atomic_write`: the new content goes to a
    temporary file made beside the target with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a
    link planted under its name is an error, never followed) and is renamed over the
    target, which replaces a name and never writes through one; a target that is a
    symbolic link, or exists and is not a regular file (a FIFO, a device, a folder), is
    refused with a one-line error. Every read goes through :func:`read_file`: it opens
    without blocking, refuses what is not a regular file (``/dev/zero``, a FIFO) and
    what is larger than a limit, and reports bytes that are not UTF-8 in one line.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import json
import math
import os
import secrets
import stat
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import pydantic

from slackswap.errors import InputError

__all__ = ["JsonFile", "MAX_FILE_BYTES", "atomic_write", "atomic_write_text",
           "content_digest", "dump_model", "json_text", "load_model", "make_private_dir",
           "parse_json", "read_file", "refuse_unwritable", "validate_model"]

M = TypeVar("M", bound=pydantic.BaseModel)

# The largest file read (a profile of a large model is a few tens of MB).
MAX_FILE_BYTES = 256 * 2**20


def _umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *,
                 private: bool = False) -> None:
    """Write ``path`` with ``write(f)`` so that readers see the old file or the new one,
    never half, and nothing but ``path`` changes (NOTE [files]): a target that is a
    symbolic link or not a regular file is refused, never written through. A file keeps
    its mode, a new one takes the umask's (``private``: 0o600, in folders made 0o700,
    for cache entries). Missing folders are made; failures raise :class:`InputError`."""
    name = os.fspath(path)
    if not name:
        raise InputError("cannot write '': the file name is empty; name a file")
    if name.endswith(os.sep):
        raise InputError(f"cannot write {name}: it names a folder; name a file in it")
    target = Path(os.path.abspath(name))
    try:
        info = refuse_unwritable(name)
        if private:
            make_private_dir(target.parent)
            mode = 0o600
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666 & ~_umask()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(
            os, "O_CLOEXEC", 0)
        while True:
            tmp = target.parent / f".{target.name[:64]}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o600)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                os.fchmod(f.fileno(), mode)
            os.replace(tmp, target)  # renames over the name: never writes through a link
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise InputError(f"cannot write {name}: {e.strerror or e}") from None


def refuse_unwritable(path: str | os.PathLike[str]) -> os.stat_result | None:
    """What ``path`` is now (None: nothing), or an :class:`InputError` where
    :func:`atomic_write` would refuse to write it (a symbolic link, a folder, a FIFO, a
    device): checked before long work too, so that work is not thrown away and no set
    of outputs is left half-written (NOTE [files])."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"refusing to write {os.fspath(path)}: it is {_kind(info.st_mode)}, "
                         "not a regular file; remove it or name another file")
    return info


def make_private_dir(folder: Path) -> None:
    """Make ``folder`` (and missing parents) readable and writable by its owner only;
    an existing folder of ours is made so too, a link or another user's is refused."""
    missing, here = [], folder
    while not os.path.lexists(here) and here != here.parent:
        missing.append(here)
        here = here.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (made meanwhile by another run)
            os.mkdir(made, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(errno.ENOTDIR, f"{folder} is {_kind(info.st_mode)}, not a folder")
    if info.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{folder} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(folder, 0o700)


def atomic_write_text(path: str | os.PathLike[str], text: str, *,
                      private: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write`."""
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data), private=private)


def read_file(path: str | os.PathLike[str], what: str = "file",
              limit: int | None = None, *, compressed: bool = False) -> str:
    """The text of ``path`` (UTF-8), read with a size limit (NOTE [files]): what is not
    a regular file, or is larger than ``limit`` bytes (``MAX_FILE_BYTES``), is refused
    with an :class:`InputError`, as are bytes that are not UTF-8. ``compressed``: the
    file is gzip, and ``limit`` bounds what it holds once uncompressed too (a small file
    that inflates to gigabytes is refused, never held)."""
    limit = MAX_FILE_BYTES if limit is None else limit
    data = _read_bytes(path, what, limit)
    if compressed:
        data = _gunzip(data, path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}); is it the right "
                         "file?") from None


def _read_bytes(path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (:func:`read_file`)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # (a FIFO opens at once, and is refused below)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"cannot read {what} {path}: it is {_kind(info.st_mode)}, not "
                             "a regular file; name a file")
        if info.st_size > limit:
            raise InputError(f"cannot read {what} {path}: it is {_size(info.st_size)}, over "
                             f"the {_size(limit)} a {what} may be; is it the right file?")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 2**20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputError(f"cannot read {what} {path}: it grew past the {_size(limit)} a "
                         f"{what} may be while it was read")
    return data


def _gunzip(data: bytes, path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """``data`` (gzip) uncompressed, refused past ``limit`` bytes: read at most one byte
    more than that, so a decompression bomb costs ``limit`` and no more."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            out = f.read(limit + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise InputError(f"cannot read {what} {path}: not gzip ({e}); is it the right "
                         "file?") from None
    if len(out) > limit:
        raise InputError(f"cannot read {what} {path}: it holds over {_size(limit)} "
                         f"uncompressed, more than a {what} may be; is it the right file?")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON holds")


def parse_json(text: str, source: str, strict: bool = False) -> Any:
    """Parsed JSON, errors in one line; ``strict``: ``NaN`` and ``Infinity`` refused (a
    data-model file's are refused by its schema, which names the field)."""
    try:
        return json.loads(text, parse_constant=_no_constant if strict else None)
    except json.JSONDecodeError as e:
        raise InputError(f"{source}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except ValueError as e:
        raise InputError(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise InputError(f"{source}: nested too deeply to be a SlackSwap file; is it the "
                         "right file?") from None


def _non_finite(value: Any, where: str = "") -> str | None:
    """Where in ``value`` (JSON-like) the first NaN or infinity is, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "the value"
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in items:
        if (found := _non_finite(item, f"{where}.{key}" if where else str(key))) is not None:
            return found
    return None


def json_text(value: Any, what: str, **options: Any) -> str:
    """``value`` as strict JSON (``json.dumps`` options), for ``what`` (a file's name).

    NOTE [finite JSON]: every JSON SlackSwap writes is strict: ``NaN`` and ``Infinity``
    are not JSON, and a reader (``jq``, a browser, this package) refuses or misreads them.
    A figure that does not exist is written as ``null`` by its writer, which says what it
    means (results.json: a strategy's ``retention`` is null where it has no feasible plan,
    as ``slackswap.reproduce`` says); a NaN or infinity left in a value is a bug upstream,
    refused here in one line naming its place, and nothing is written."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:
        place = _non_finite(value)
        if place is None:
            raise
        raise InputError(f"cannot write {what}: {place} is not a finite number, which JSON "
                         "cannot hold; nothing was written (please report it)") from None


def dump_model(model: pydantic.BaseModel, path: str | os.PathLike[str]) -> None:
    """Serialize a data-model object to JSON at ``path``, atomically (NOTE [finite JSON]:
    never a NaN, which pydantic would write as null, or an infinity)."""
    text = json_text(model.model_dump(mode="json"), os.fspath(path), ensure_ascii=False,
                     separators=(",", ":"))
    atomic_write_text(path, text)


def content_digest(model: pydantic.BaseModel) -> str:
    """A hash of everything ``model`` holds (its JSON): equal digests, equal contents."""
    return hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:24]


def validate_model(cls: type[M], data: Any, source: str) -> M:
    """Build ``cls`` from parsed JSON or TOML, turning schema problems into one-line errors.

    NOTE [strict types]: a file's values are read as JSON types, strictly: a number field
    takes a number, never ``true`` (read as 1) or ``"3"``; a whole-number field (bytes,
    ids, ``schema_version``) takes a whole number, never ``3.0``; a flag takes ``true`` or
    ``false``, never 1. (Objects built in Python are converted as pydantic does.)"""
    expected = cls.model_fields["schema_version"].default
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        shown = json.dumps(version, default=str)
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise InputError(f"{source}: schema_version {shown} is not a version: a whole number "
                         f"from 1 to {expected}, unquoted; fix the file or write it again")
    if isinstance(version, int) and version > expected:
        raise InputError(
            f"{source}: schema_version {version} is newer than this SlackSwap reads "
            f"({expected}); upgrade slackswap"
        )
    if isinstance(version, int) and version < 1:
        raise InputError(f"{source}: schema_version {version} is not a version (1 to "
                         f"{expected}); fix the file or write it again")
    try:
        # NOTE [strict types]: validated as JSON, in strict mode (NaN stays a token, which
        # the schema refuses by field; TOML's dates become strings, refused as numbers)
        return cls.model_validate_json(json.dumps(data, default=str), strict=True)
    except pydantic.ValidationError as e:
        raise InputError(f"{source}: {_first_problem(e)}") from None
    except (RecursionError, ValueError) as e:
        raise InputError(f"{source}: nested too deeply to be a SlackSwap file ({e}); is "
                         "it the right file?") from None


def _first_problem(e: pydantic.ValidationError) -> str:
    """The first of ``e``'s problems, in one line, with the field it is in."""
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"])
    what = f"field '{field}': " if field else ""
    message = " ".join(err["msg"].removeprefix("Value error, ").split())
    more = f" ({e.error_count()} problems in all)" if e.error_count() > 1 else ""
    return f"{what}{message}{more}"


def load_model(cls: type[M], path: str | os.PathLike[str]) -> M:
    """Read a data-model object from a JSON file, with errors that name the file and field."""
    what = {"StepProfile": "profile", "Plan": "plan"}.get(cls.__name__, "file")
    data = parse_json(read_file(path, what), str(path))
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
