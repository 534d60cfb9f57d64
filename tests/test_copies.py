"""Host copies: the buffer pool (NOTE [buffers held by events]), reuse without sharing,
and offload deadlines (NOTE [offloads free where simulated])."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stepgraphs import random_step

from slackswap.core.plan import Plan
from slackswap.runtime.checks import offload_deadlines
from slackswap.runtime.copies import HostCopies
from slackswap.runtime.stats import RuntimeStats
from slackswap.runtime.streams import stand_ins
from slackswap.sim.simulate import offload_frees

SIZES = [250, 500, 1000]  # fp32 elements: 1000, 2000 and 4000 bytes


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 99)), max_size=40),
       capacity=st.integers(0, 12000))
def test_the_pool_never_hands_out_a_held_buffer(steps: list, capacity: int) -> None:
    """Offloads and give-backs in any order: a host copy keeps its bytes until it is
    given back, the pool keeps no more than its capacity or the most bytes held at once,
    and an offload allocates only when no free buffer of its size is pooled."""
    copies, stats = HostCopies(capacity), RuntimeStats()
    held: list[tuple[torch.Tensor, float]] = []
    most_held = 0  # the pool may keep as much as was held at once
    for n, (offload, pick) in enumerate(steps):
        if offload or not held:
            size = SIZES[pick % len(SIZES)]
            pooled = copies.pooled_bytes
            before = stats.host_buffers_allocated
            host = copies.offload(torch.full((size,), float(n)), stats)
            assert host.nbytes == 4 * size
            reused = stats.host_buffers_allocated == before
            assert reused == (copies.pooled_bytes == pooled - 4 * size)
            assert all(host.data_ptr() != other.data_ptr() for other, _ in held)
            held.append((host, float(n)))
        else:
            copies.give_back(held.pop(pick % len(held))[0])
        most_held = max(most_held, sum(host.nbytes for host, _ in held))
        assert copies.pooled_bytes <= max(capacity, most_held)
        for host, value in held:
            assert torch.all(host.view(torch.float32) == value)


class _Event:
    """A copy's event whose completion the test sets."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_offloads_go_at_their_deadline_or_when_done() -> None:
    """NOTE [offloads free where simulated]: a device tensor an offload reads is let go of
    when its copy is seen done, and at the latest at its deadline, where the compute
    stream waits for a copy still in flight (and only for that one)."""
    calls: Counter = Counter()
    with stand_ins(calls):  # the compute stream's waits, counted
        copies, stats = HostCopies(), RuntimeStats(_link_of=HostCopies().link)
        events = [_Event() for _ in range(4)]
        tensors = [torch.zeros(256) for _ in range(4)]
        # deadlines: op 5, op 3, none (freed only when done), op 3
        for group, (event, t, due) in enumerate(zip(events, tensors, [5, 3, None, 3],
                                                    strict=True)):
            copies._in_flight(event, [(t, torch.empty(1024, dtype=torch.uint8), due, 0, None)],
                              group)

        def held() -> list[int]:  # the copies whose device tensor is still held, anywhere
            entries = [*copies._offloads, *(due[2] for due in copies.due)]
            return [i for i, e in enumerate(events)
                    if any(x[0] is e and x[1] is not None for x in entries)]

        events[0].done = True  # copies finish in issue order (one stream)
        copies.free_due(1, stats)  # before op 2: nothing is due yet
        assert held() == [0, 1, 2, 3] and not calls["wait_event"]
        copies.free_due(2, stats)  # before op 3: copies 1 and 3, still in flight, go
        # (a stand-in stream's wait marks the event done: the stream runs after it)
        assert held() == [0, 2] and calls["wait_event"] == 2
        assert [e.done for e in events] == [True, True, False, True]
        assert stats.offload_waits == 2
        for event in events:
            event.done = True
        copies.poll()  # all done: poll lets the rest go, deadline or not
        assert held() == [] and not copies._offloads
        copies.free_due(10, stats)  # a deadline already met finds nothing to wait for
        assert calls["wait_event"] == stats.offload_waits == 2


def test_offload_deadlines_are_the_simulators_once_per_plan() -> None:
    """What a CUDA step frees by (NOTE [offloads free where simulated]) is what the
    simulator says, worked out once per plan; a plan that offloads nothing has none."""
    profile = random_step(random.Random(3), 8)
    names = [t.name for t in profile.saved_activations
             if t.producer is not None and t.bytes >= 1024]
    plan = Plan(fingerprint=profile.fingerprint, strategy="hand",
                decisions={n: "offload" for n in names})
    deadlines = offload_deadlines(profile, plan)
    assert deadlines and deadlines == offload_frees(profile, plan)
    assert offload_deadlines(profile, plan) is deadlines  # worked out once
    assert offload_deadlines(profile, Plan.keep_all(profile)) == {}


@pytest.mark.parametrize("policy", ["behind", "done"])
def test_a_waiting_offload_given_back_is_never_copied(policy: str) -> None:
    """NOTE [offloads issued in groups]: an offload whose copy waits for its group and
    whose handle autograd lets go of first (its graph dropped in forward) is not copied
    later into a buffer the pool may have handed to the next offload."""
    calls: Counter = Counter()
    with stand_ins(calls, policy):
        copies, stats = HostCopies(), RuntimeStats()
        a, b = torch.full((256,), 1.0), torch.full((256,), 2.0)
        host_a = copies.offload(a, stats, issue=False)
        copies.give_back(host_a)
        host_b = copies.offload(b, stats, issue=False)
        assert host_b is host_a  # the pool handed the buffer on
        copies.issue()
        assert calls["copy"] == 1 and torch.equal(host_b.view(torch.float32), b)
