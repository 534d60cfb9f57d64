"""NOTE [offloads issued in groups]: which pack issues each offload's copy, the same for the
runtime and the simulator, and what the simulator makes of it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stepgraphs import random_step

from slackswap.core.hardware import Host
from slackswap.core.offloads import forward_packs, offload_issues
from slackswap.core.plan import Plan
from slackswap.sim.host import host_times
from slackswap.sim.schedule import build_schedule


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 14), share=st.floats(0.1, 1.0))
def test_a_group_is_the_offloads_packed_before_one_op(seed: int, n: int,
                                                      share: float) -> None:
    """Every offload is issued by the last first pack of an offloaded tensor before the
    same op as its own (no compute issued between): at or after its own pack, and
    offloads packed before different ops never share a group."""
    rng = random.Random(seed)
    profile = random_step(rng, n)
    packs = forward_packs(profile)
    offloaded = {t for t in {t for t, _ in packs if t >= 0} if rng.random() < share}
    issues = offload_issues(profile, offloaded)
    first: dict[int, int] = {}
    for j, (t, _) in enumerate(packs):
        first.setdefault(t, j)
    assert set(issues) == offloaded
    for t, j in issues.items():
        before = packs[first[t]][1]
        assert j >= first[t] and packs[j][1] == before
        assert j == max(first[u] for u in offloaded if packs[first[u]][1] == before)


def test_the_host_pays_for_a_group_at_its_last_pack() -> None:
    """With only ``offload_s`` to pay, the host's cost per item is the offloads whose
    group's last pack runs before it, and a copy is ready once the host has issued its
    group: the schedule's copies start where they did."""
    profile = random_step(random.Random(7), 10)
    planned = [t for t in profile.saved_activations
               if t.producer is not None and t.bytes >= 1024 and t.name]
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={t.name: "offload" for t in planned})
    sched = build_schedule(profile, plan)
    offloaded = {c.tensor for c in sched.d2h}
    assert offloaded
    host = Host(dispatch_s=0.0, pack_s=0.0, unpack_s=0.0, watch_s=0.0, replay_s=0.0,
                offload_s=1e-3)
    times = host_times(profile, plan, sched, host)
    assert times is not None
    packs = forward_packs(profile)
    issues = offload_issues(profile, offloaded)
    assert sum(times.cost) == pytest.approx(1e-3 * len(offloaded))
    for copy, ready in zip(sched.d2h, times.d2h_ready, strict=True):
        if copy.tensor in issues:  # ready when the host has paid for every offload of
            before = packs[issues[copy.tensor]][1]  # groups up to its own
            paid = sum(1 for j in set(issues.values()) if packs[j][1] <= before
                       for t in issues if issues[t] == j)
            assert ready == pytest.approx(max(1e-3 * paid, times.issued[copy.after_item]))
