"""Memory follows the keys currently locked: nothing is left behind, nothing leaks."""

from __future__ import annotations

import gc
import tracemalloc

import pytest


def _traced_growth(locks, run) -> int:  # type: ignore[no-untyped-def]
    """What ``run()`` leaves allocated, after a small warm-up (token, spare entries)."""
    gc.collect()
    tracemalloc.start()
    try:
        for key in range(64):
            locks.acquire(("warm-up", key))
        locks.release_all()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_million_distinct_keys_leave_nothing_behind(impl) -> None:
    locks = impl.LockManager()
    # The twin runs 30,000 under tracemalloc (each allocation traced makes it slow): a leak
    # of one object per key, 16 bytes at least, would still be 480 KB past the bound.
    count = 1_000_000 if impl.__name__.endswith("_core") else 30_000

    def churn() -> None:
        for i in range(count):
            key = ("natural-id", i)
            locks.acquire(key)
            locks.release(key)

    assert _traced_growth(locks, churn) < 16 * 1024
    assert len(locks) == 0 and locks.stats().acquisitions == count + 64


def test_many_keys_held_at_once_shrink_back(impl) -> None:
    locks = impl.LockManager()
    keys = [f"user:{i}" for i in range(50_000)]

    def fill_and_drain() -> None:
        for key in keys:
            locks.acquire(key)
        assert len(locks) == len(keys)
        assert locks.release_all() == len(keys)

    assert _traced_growth(locks, fill_and_drain) < 16 * 1024
    assert len(locks) == 0


def test_waiting_and_timeouts_leave_nothing_behind(impl, workers) -> None:
    locks = impl.LockManager()
    holder = workers("holder")

    def contend() -> None:
        holder.run(lambda: [locks.acquire(i) for i in range(200)])
        for i in range(200):
            assert not locks.acquire(i, timeout=0.0001)
        holder.run(locks.release_all)

    contend()  # once first: what a first timeout allocates for good (the holder's token…)
    assert _traced_growth(locks, contend) < 16 * 1024
    assert len(locks) == 0


def test_sets_that_fail_leave_nothing_behind(impl, workers) -> None:
    """A set that fails (try, timeout) on fresh keys drops every entry it created."""
    locks, rw = impl.LockManager(), impl.RWLockManager()
    holder = workers("holder")

    def contend() -> None:
        holder.run(lambda: (locks.acquire("held"), rw.acquire_write("held")))
        for i in range(300):
            assert not locks.acquire_many([("fresh", i), "held", ("other", i)], timeout=0)
            assert not rw.acquire_many(reads=[("fresh", i)], writes=["held"], timeout=0)
        for i in range(10):
            assert not locks.acquire_many([("fresh", i), "held"], timeout=0.0001)
            assert not rw.acquire_many(reads=[("fresh", i), "held"], timeout=0.0001)
        holder.run(locks.release_all)
        holder.run(rw.release_all)

    assert _traced_growth(locks, contend) < 16 * 1024
    assert len(locks) == len(rw) == 0


@pytest.mark.compiled
@pytest.mark.parametrize("held", [0, 10_000])
def test_compiled_size_per_held_key(held: int) -> None:
    from lockmgr._core import LockManager

    locks = LockManager()
    empty = locks.__sizeof__()
    for i in range(held):
        locks.acquire(i)
    if held:
        assert (locks.__sizeof__() - empty) / held <= 200
    locks.release_all()
    assert locks.__sizeof__() - empty <= 16 * 96  # at most the spare entries remain
