"""Plans and bounds cached on disk by content, beside the profiles ``reproduce`` caches:
run again (another output, target or report), ``slackswap reproduce`` and ``slackswap
fit`` plan nothing, and solve no bound, they have before; ``slackswap.plan(model,
batch)`` off CUDA plans a step it has planned before at once.

NOTE [plan cache]
    A plan depends on the profile, the hardware, the budget and the strategy, and on
    the code that makes it: nothing else (node limits, not time limits, stop the solver;
    the perturbed search's generator is seeded). The key is the content of the first
    two, the budget and strategy, and a digest of SlackSwap's own source with the
    versions of SciPy (its HiGHS) and NumPy, so an edited checkout or another solver
    never reuses a plan. A hit is simulated once more, so its result carries the
    schedule and timeline a fresh plan's does, and reports the time the plan took to
    make when it was made. Only profiles that are the same on every run use it: the
    preset-driven commands' analytic ones, and the steps ``slackswap.plan(model, batch)``
    traces off CUDA (and ``auto`` and ``attach`` with it). A profile measured on a GPU
    differs from run to run and would only fill the cache. The bound
    (``retention_bound``) is cached the same way: on the reference workloads its LP is
    most of a warm ``reproduce``.

NOTE [cache entries]
    An entry is what the cache holds for one key: ``{"key", "digest", "seconds",
    "value"}``, the digest a SHA-256 of the value's canonical JSON. An entry is used only
    when its key is the key asked for (a file copied over another's name is not), its
    digest is its value's (an edited or truncated value is not), its JSON is strict (no
    ``NaN``), its seconds a finite time and its value what the reader validates (a plan
    of this profile, a bound in [0, 1]); anything else is rebuilt, with a one-line
    warning, and written again. The cache's folders are made private to their user
    (0o700, entries 0o600) and written as every file is (NOTE [files] in
    :mod:`slackswap.core.jsonio`); a folder that is a link or another user's is not
    used, and a cache that cannot be written is read-only: what is made is used and not
    stored, with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import stat
import time
import warnings
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pydantic

from slackswap.core.jsonio import (
    atomic_write_text,
    content_digest,
    make_private_dir,
    parse_json,
    read_file,
)
from slackswap.core.plan import Plan
from slackswap.errors import SlackSwapError
from slackswap.planners.bound import retention_bound
from slackswap.planners.context import PlanContext
from slackswap.planners.search import Attempt
from slackswap.planners.strategies import plan_in_context
from slackswap.sim.simulate import simulate

__all__ = ["CacheWarning", "cache_root", "cached_attempt", "cached_bound", "entry_path",
           "read_entry", "write_entry"]


class CacheWarning(UserWarning):
    """A cache entry that was not used, or a cache that could not be written."""


def cache_root() -> Path:
    """``$SLACKSWAP_CACHE``, or ``~/.cache/slackswap``."""
    return Path(os.environ.get("SLACKSWAP_CACHE") or Path.home() / ".cache" / "slackswap")


# what an entry's file name keeps of a label: no separator, so no name leaves its folder
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def entry_path(folder: str, key: str, *labels: str) -> Path:
    """The file of the entry stored under ``key`` in the cache's ``folder``, named after
    ``labels`` (a model, a hardware, a strategy) for whoever lists the folder. A label can
    come from a file (a hardware file's ``name``) and hold anything, ``../`` or ``/``
    included: each is cut to letters, digits and ``._+-`` and 40 characters, so the
    entry stays in ``folder`` (NOTE [files]); the key keeps entries apart."""
    shown = "-".join(_UNSAFE.sub("_", label)[:40] for label in labels)
    return cache_root() / folder / f"{shown}-{key}.json"


@functools.cache
def _code_digest() -> str:
    """SlackSwap's source, and the versions of the libraries a plan's numbers come from."""
    root = Path(__file__).parents[1]  # the package's
    digest = hashlib.sha256(f"{version('scipy')}|{version('numpy')}".encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _digest(value: Any) -> str:
    """A SHA-256 of ``value``'s canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


_said: set[str] = set()


def _warn(message: str, once: bool = False) -> None:
    """A :class:`CacheWarning`; ``once``: the first time in this process only."""
    if once and message in _said:
        return
    _said.add(message)
    warnings.warn(message, CacheWarning, stacklevel=3)


def _foreign(folder: Path) -> str | None:
    """Why the cache must not use ``folder`` (a link, not a folder, another user's);
    None when it may, or does not exist yet."""
    try:
        info = os.lstat(folder)
    except OSError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.geteuid():
        return "belongs to another user"
    return None


def read_entry(path: Path, key: str, read: Callable[[Any], Any]) -> tuple[Any, float] | None:
    """The value stored at ``path`` under ``key`` (``read`` turns its JSON into the value,
    raising on anything it does not accept) and the seconds it took to make; None when
    there is none, or it is not sound (NOTE [cache entries]): it is then made again."""
    if (why := _foreign(path.parent)) is not None:
        _warn(f"cache folder {path.parent} {why}: not used; remove it or set SLACKSWAP_CACHE",
              once=True)
        return None
    if not os.path.lexists(path):
        return None
    try:
        entry = parse_json(read_file(path, "cache entry"), str(path), strict=True)
        if not isinstance(entry, dict) or set(entry) != {"key", "digest", "seconds", "value"}:
            raise ValueError("not a cache entry")
        if entry["key"] != key:
            raise ValueError("its key is another entry's")
        if entry["digest"] != _digest(entry["value"]):
            raise ValueError("its value does not match its digest")
        seconds = entry["seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"its time {seconds!r} is not a time")
        return read(entry["value"]), float(seconds)
    except (SlackSwapError, ValueError, TypeError, KeyError, pydantic.ValidationError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0].replace(f"{path}: ", "")
        _warn(f"cache entry {path} is damaged ({why[:200]}): made again")
        return None


def write_entry(path: Path, key: str, value: Any, seconds: float) -> None:
    """Store ``value`` (JSON) under ``key`` at ``path``, privately; a cache that cannot be
    written is read-only (NOTE [cache entries]): one warning, no error."""
    if _foreign(path.parent) is not None:
        return  # (said when it was read)
    try:
        entry = {"key": key, "digest": _digest(value), "seconds": seconds, "value": value}
        text = json.dumps(entry, allow_nan=False)
    except ValueError:
        return  # a value that is not strict JSON is not stored
    try:
        make_private_dir(path.parent)
        atomic_write_text(path, text, private=True)
    except (OSError, SlackSwapError) as e:
        why = getattr(e, "strerror", None) or str(e)
        _warn(f"cache {path.parent} cannot be written ({why}): results are not stored",
              once=True)


def _cached(ctx: PlanContext, what: str, make: Callable[[], Any],
            read: Callable[[Any], Any], write: Callable[[Any], Any]) -> tuple[Any, float]:
    """``make()`` and the seconds it took, or the entry for ``ctx`` and ``what`` stored
    by an earlier run (``write`` turns the value into JSON, ``read`` back)."""
    key = hashlib.sha256(
        f"{content_digest(ctx.profile)}|{content_digest(ctx.hw)}|{ctx.budget}|{what}|"
        f"{version('slackswap')}|{_code_digest()}".encode()).hexdigest()[:24]
    path = entry_path("plans", key, what)
    if (found := read_entry(path, key, read)) is not None:
        return found
    start = time.perf_counter()
    value = make()
    seconds = time.perf_counter() - start
    write_entry(path, key, write(value), seconds)
    return value, seconds


def cached_attempt(ctx: PlanContext, strategy: str) -> tuple[Attempt | None, float]:
    """``plan_in_context(ctx, strategy)`` and the seconds it took to make, from the cache
    when it is there (NOTE [plan cache])."""

    def read(plan: Any) -> Attempt | None:
        if plan is None:
            return None
        plan = Plan.model_validate(plan)
        if plan.budget_bytes not in (None, ctx.budget):
            raise ValueError(f"its plan is for another budget ({plan.budget_bytes} bytes)")
        plan.check(ctx.profile)
        return plan, simulate(ctx.profile, plan, ctx.hw, ctx.budget)

    return _cached(ctx, strategy, lambda: plan_in_context(ctx, strategy), read,
                   lambda attempt: None if attempt is None else attempt[0].model_dump(
                       mode="json"))


def cached_bound(ctx: PlanContext) -> tuple[float, float]:
    """``retention_bound(ctx)`` and the seconds it took to solve, from the cache when it
    is there (NOTE [plan cache])."""
    return _cached(ctx, "bound", lambda: retention_bound(ctx), _bound_value, float)


def _bound_value(value: Any) -> float:
    """A cached bound: a retention, in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= 1):
        raise ValueError(f"its bound {value!r} is not a retention in [0, 1]")
    return float(value)
