"""NOTE [offloads issued in groups]: which pack issues each offload's copy, the same for the
runtime and the simulator, and what the simulator makes of it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stepgraphs import random_step
from test_simulate import NO_HOST, _chain, link_hardware

from slackswap.core.offloads import OFFLOAD_DELAY_S, OFFLOAD_WINDOW, forward_packs, offload_issues
from slackswap.core.plan import Plan
from slackswap.sim.simulate import simulate


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 14), share=st.floats(0.1, 1.0),
       window=st.integers(0, 6), delay=st.sampled_from([0.0, 1e-4, 1e-3, 1.0]))
def test_groups_are_runs_of_offloads_within_the_window(seed: int, n: int, share: float,
                                                       window: int, delay: float) -> None:
    """Every offload is issued by one pack: the first pack of its group's last offload,
    at or after its own; groups are runs in pack order, each within ``window`` ops and
    ``delay`` seconds of compute of its first offload's pack, and a group closes only
    where the next offload would break one of the two."""
    rng = random.Random(seed)
    profile = random_step(rng, n)
    packs = forward_packs(profile)
    saved = sorted({t for t, _ in packs if t >= 0})
    offloaded = {t for t in saved if rng.random() < share}
    issues = offload_issues(profile, offloaded, window, delay)
    first = {}
    for j, (t, _) in enumerate(packs):
        first.setdefault(t, j)
    assert set(issues) == offloaded & set(first)
    ends = [0.0]
    for op in profile.ops:
        ends.append(ends[-1] + op.time_s)
    order = sorted(issues, key=first.get)
    groups: list[list[int]] = []
    for t in order:
        if groups and issues[groups[-1][0]] == issues[t]:
            groups[-1].append(t)
        else:
            groups.append([t])
    assert len({issues[g[0]] for g in groups}) == len(groups)  # runs, never interleaved
    for k, group in enumerate(groups):
        j = issues[group[0]]
        assert j == first[group[-1]] and all(first[t] <= j for t in group)
        start = packs[first[group[0]]][1]
        for t in group:
            before = packs[first[t]][1]
            assert before <= start + window and ends[before] - ends[start] <= delay
        if k + 1 < len(groups):  # the next one would have broken this one's bounds
            before = packs[first[groups[k + 1][0]]][1]
            assert before > start + window or ends[before] - ends[start] > delay


def _two_offloads(f1_time: float) -> tuple[float, float]:
    """A packed before op 1, B before op 2 (after f1): when A's copy starts, and B's."""
    profile = _chain(f1_time, b_bytes=1_200_000)
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={"t0": "offload", "t1": "offload"})
    hw = link_hardware(0.5e9, 0.5e9, 0.4e9, 0.2e9, 0.0, host=NO_HOST)
    spans = {(s.stream, s.index): (s.start, s.end)
             for s in simulate(profile, plan, hw).run.timeline.spans}
    return spans["d2h", 0][0], spans["d2h", 1][0]


def test_a_group_copies_once_the_compute_before_its_last_pack_has_run() -> None:
    """A's copy waits for B's pack, one op later, when that op is short (within the
    window and the delay): both start once f1 has run (1 ms + f1); after a longer f1, A
    goes alone, as f0 ends."""
    short = OFFLOAD_DELAY_S / 2
    assert OFFLOAD_WINDOW >= 1
    assert _two_offloads(short) == pytest.approx((1e-3 + short, 1e-3 + short + 2e-3),
                                                 rel=1e-9)
    long = 4 * OFFLOAD_DELAY_S
    a, _ = _two_offloads(long)
    assert a == pytest.approx(1e-3, rel=1e-12)
