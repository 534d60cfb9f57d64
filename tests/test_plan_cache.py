"""NOTE [plan cache]: a cached plan is the plan, its result the fresh plan's, and nothing
but the same profile, hardware, budget, strategy and code finds it."""

from __future__ import annotations

import json
import random
import stat
from pathlib import Path

import pytest
from stepgraphs import block_step

import slackswap
import slackswap.planners.cache as plan_cache
from slackswap.core.hardware import with_overrides
from slackswap.planners import STRATEGIES, plan_in_context
from slackswap.planners.bound import retention_bound
from slackswap.planners.cache import CacheWarning
from slackswap.planners.context import PlanContext


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path))
    return tmp_path / "plans"


def _context(seed: int = 0, fraction: float = 0.5, hw=None) -> PlanContext:
    profile = block_step(random.Random(seed), 3)
    hw = hw or slackswap.load_hardware("a100-80gb")
    return PlanContext(profile, hw, int(fraction * profile.keep_all_peak))


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (a[0].model_dump() == b[0].model_dump() and a[1].model_dump() == b[1].model_dump()
            and a[1].run is not None and b[1].run is not None
            and a[1].run.timeline.spans == b[1].run.timeline.spans)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_hit_is_the_fresh_plan_and_its_result(strategy: str, cache: Path) -> None:
    fresh = plan_in_context(_context(), strategy)
    made, seconds = plan_cache.cached_attempt(_context(), strategy)
    assert _same(made, fresh)
    assert len(list(cache.iterdir())) == 1
    again, recorded = plan_cache.cached_attempt(_context(), strategy)
    assert _same(again, fresh) and recorded == seconds  # the time it took to make


def test_only_the_same_inputs_and_code_find_a_plan(cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base = _context()
    plan_cache.cached_attempt(base, "slackswap")
    hw = with_overrides(base.hw, {"host.watch_s": 2 * base.hw.host.watch_s})
    for other in (_context(seed=1), _context(fraction=0.6), _context(hw=hw)):
        plan_cache.cached_attempt(other, "slackswap")
    plan_cache.cached_attempt(base, "capuchin")
    assert len(list(cache.iterdir())) == 5
    plan_cache.cached_attempt(base, "slackswap")
    assert len(list(cache.iterdir())) == 5
    monkeypatch.setattr(plan_cache, "_code_digest", lambda: "edited")  # a changed planner
    plan_cache.cached_attempt(base, "slackswap")
    assert len(list(cache.iterdir())) == 6


def test_a_damaged_entry_is_planned_again(cache: Path) -> None:
    fresh, _ = plan_cache.cached_attempt(_context(), "slackswap")
    [entry] = cache.iterdir()
    entry.write_text('{"value": {"decisions": 3}')
    with pytest.warns(CacheWarning, match=r"cache entry .* is damaged \(.*not valid JSON"):
        again, _ = plan_cache.cached_attempt(_context(), "slackswap")
    assert _same(again, fresh)
    assert entry.read_text().startswith('{"key": ')  # written whole again
    assert _same(plan_cache.cached_attempt(_context(), "slackswap")[0], fresh)


def _entry(path: Path) -> dict:
    return json.loads(path.read_text())


def _rewrite(path: Path, entry: dict, digest: bool = True) -> None:
    """``entry`` at ``path``, its digest made to match its value when ``digest``."""
    if digest:
        entry["digest"] = plan_cache._digest(entry["value"])
    path.write_text(json.dumps(entry))


@pytest.mark.parametrize(("damage", "why"), [
    ("decision", "its value does not match its digest"),
    ("other strategy", "its key is another entry's"),
    ("nan seconds", "NaN is not a number JSON holds"),
    ("negative seconds", "its time -1 is not a time"),
    ("unknown activation", "the profile does not save, e.g. 'nope'"),
    ("other budget", "its plan is for another budget"),
    ("no key", "not a cache entry"),
])
def test_an_entry_that_is_not_sound_is_never_used(cache: Path, damage: str, why: str) -> None:
    """Issue 50: an edited decision, another strategy's plan under this one's name, a
    NaN time: each is planned again with a one-line warning, never reported."""
    fresh, _ = plan_cache.cached_attempt(_context(), "slackswap")
    [path] = cache.iterdir()
    entry = _entry(path)
    plan = entry["value"]
    if damage == "decision":
        name = next(n for n, d in plan["decisions"].items() if d != "keep")
        plan["decisions"][name] = "keep"
        _rewrite(path, entry, digest=False)
    elif damage == "other strategy":
        plan_cache.cached_attempt(_context(), "recompute-only")
        other = next(p for p in cache.iterdir() if p != path)
        path.write_text(other.read_text())
    elif damage == "nan seconds":
        path.write_text(path.read_text().replace(f'"seconds": {entry["seconds"]}',
                                                 '"seconds": NaN'))
    elif damage == "negative seconds":
        entry["seconds"] = -1
        _rewrite(path, entry)
    elif damage == "unknown activation":
        plan["decisions"]["nope"] = "recompute"
        _rewrite(path, entry)
    elif damage == "other budget":
        plan["budget_bytes"] += 1
        _rewrite(path, entry)
    else:
        del entry["key"]
        _rewrite(path, entry)
    with pytest.warns(CacheWarning) as caught:
        again, _ = plan_cache.cached_attempt(_context(), "slackswap")
    [warning] = [str(w.message) for w in caught]
    assert why in warning and "made again" in warning and "\n" not in warning
    assert _same(again, fresh)
    assert _entry(path)["value"] == json.loads(fresh[0].model_dump_json())  # repaired


@pytest.mark.parametrize("bound", [1.5, -0.1, True, "0.5", None])
def test_a_cached_bound_out_of_range_is_solved_again(cache: Path, bound) -> None:
    solved, _ = plan_cache.cached_bound(_context())
    [path] = cache.iterdir()
    entry = _entry(path)
    entry["value"] = bound
    _rewrite(path, entry)
    with pytest.warns(CacheWarning, match="is not a retention in"):
        assert plan_cache.cached_bound(_context())[0] == solved


def test_entries_are_private_and_never_written_through_a_link(cache: Path,
                                                              tmp_path: Path) -> None:
    """Issue 50: the cache's folders are its user's only; an entry replaced by a link to
    another file leaves that file as it was."""
    fresh, _ = plan_cache.cached_attempt(_context(), "slackswap")
    [path] = cache.iterdir()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path.unlink()
    path.symlink_to(victim)
    with pytest.warns(CacheWarning) as caught:
        again, _ = plan_cache.cached_attempt(_context(), "slackswap")
    assert _same(again, fresh)
    assert victim.read_text() == "precious" and path.is_symlink()
    assert any("symbolic link" in str(w.message) for w in caught)


def test_a_cache_folder_that_is_a_link_is_not_used(cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache.symlink_to(elsewhere)
    with pytest.warns(CacheWarning, match="is a symbolic link: not used"):
        made, _ = plan_cache.cached_attempt(_context(), "slackswap")
    assert made is not None and list(elsewhere.iterdir()) == []


def test_an_unwritable_cache_is_read_only(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50: a cache that cannot be written (here: its root is a file) only costs the
    next run its time: the plan and the bound are made, with one warning."""
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    monkeypatch.setenv("SLACKSWAP_CACHE", str(root))
    fresh = plan_in_context(_context(), "slackswap")
    with pytest.warns(CacheWarning, match=r"cache .* cannot be written .*: results are not "
                                          "stored"):
        made, _ = plan_cache.cached_attempt(_context(), "slackswap")
        bound, _ = plan_cache.cached_bound(_context())
    assert _same(made, fresh) and bound == retention_bound(_context())
    assert root.read_text() == "not a folder"


def test_the_bound_is_cached_as_solved(cache: Path) -> None:
    bound, seconds = plan_cache.cached_bound(_context())
    assert bound == retention_bound(_context()) > 0
    assert plan_cache.cached_bound(_context()) == (bound, seconds)
    assert len(list(cache.iterdir())) == 1


def test_a_traced_step_is_planned_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``slackswap.plan(model, batch)`` off CUDA: a step traced the same way again is
    planned from the cache (the planner is not asked), and the plan is the same."""
    from factories import mlp

    model, x = mlp()
    first = slackswap.plan(model, x, budget=0.5)
    assert len(list(cache.iterdir())) == 1

    def planner_asked(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(plan_cache, "plan_in_context", planner_asked)
    again = slackswap.plan(model, x, budget=0.5)
    assert again.model_dump() == first.model_dump()
    assert again._profile is not None  # so that ``apply`` prefetches without being told
    with pytest.raises(AssertionError, match="planned again"):  # another budget: a miss
        slackswap.plan(model, x, budget=0.6)


def test_a_cached_profile_is_the_model_it_is_filed_under(tmp_path: Path) -> None:
    """Issue 50: bert's profile copied over gpt2's entry is not reported as gpt2's: the
    entry's key and content are checked, and gpt2 is profiled again."""
    from slackswap.reproduce import cached_profile

    hw = slackswap.load_hardware("a100-80gb")
    gpt2 = cached_profile("gpt2-xl-tiny", hw)
    cached_profile("bert-large-tiny", hw)
    folder = tmp_path / "profiles"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    [gpt2_path] = folder.glob("gpt2-xl-tiny-*.json")
    [bert_path] = folder.glob("bert-large-tiny-*.json")
    gpt2_path.write_text(bert_path.read_text())
    with pytest.warns(CacheWarning, match="its key is another entry's"):
        again = cached_profile("gpt2-xl-tiny", hw)
    assert again.model == "gpt2-xl-tiny" and again.model_dump() == gpt2.model_dump()
    bert = _entry(bert_path)  # bert's profile under gpt2's key: still another model's
    bert["key"] = _entry(gpt2_path)["key"]
    _rewrite(gpt2_path, bert)
    with pytest.warns(CacheWarning, match="another model's profile"):
        assert cached_profile("gpt2-xl-tiny", hw).model == "gpt2-xl-tiny"


def test_a_hardware_name_never_leads_an_entry_out_of_the_cache(tmp_path: Path) -> None:
    """NOTE [files]: a hardware file's name is any text; the profile cached for it is
    named after it, and a name with ``../`` and ``/`` once put the entry (0o600) in a
    folder outside the cache and made that folder 0o700. It stays in the cache now."""
    from slackswap.reproduce import cached_profile

    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    victim.chmod(0o755)
    evil = "x/../../victim/pwn"
    hw = slackswap.load_hardware("a100-80gb").model_copy(update={"name": evil})
    made = cached_profile("bert-large-tiny", hw)
    assert list(victim.iterdir()) == [] and stat.S_IMODE(victim.stat().st_mode) == 0o755
    [entry] = (tmp_path / "profiles").iterdir()
    assert entry.name.startswith("bert-large-tiny-x_.._.._victim_pwn-")
    assert cached_profile("bert-large-tiny", hw).model_dump() == made.model_dump()
    assert len(list((tmp_path / "profiles").iterdir())) == 1
