"""Atomic multi-key locking: all or nothing, FIFO on every key, no deadlock, no starvation."""

from __future__ import annotations

import random
import threading
import time

import pytest

from conftest import PATIENCE, wait_until
from lockmgr import DeadlockError, LockTimeout, NotOwnedError
from test_concurrency import run_threads


def test_acquire_many_takes_each_distinct_key_once(locks) -> None:
    assert locks.acquire_many(["a", "b", "a", 1, 1.0]) is True
    assert len(locks) == 3 and all(locks.recursion_count(k) == 1 for k in ("a", "b", 1))
    locks.release_many(["b", "a", 1])
    assert len(locks) == 0
    assert locks.acquire_many([]) is True and len(locks) == 0


def test_keys_already_held_are_re_entered(locks) -> None:
    locks.acquire("a")
    assert locks.acquire_many(["a", "b"], timeout=0)
    assert locks.recursion_count("a") == 2 and locks.recursion_count("b") == 1
    locks.release_many(["a", "b"])
    assert locks.recursion_count("a") == 1 and not locks.locked("b")
    locks.release("a")


def test_timeout_leaves_nothing_held_and_nothing_behind(locks, workers) -> None:
    holder = workers("holder")
    holder.run(lambda: locks.acquire("b"))
    assert locks.acquire_many(["a", "b", "c"], timeout=0) is False
    assert locks.acquire_many(["a", "b", "c"], timeout=0.05) is False
    with pytest.raises(LockTimeout):
        with locks.hold_many(["a", "b"], timeout=0.01):
            pytest.fail("entered without the keys")
    stats = locks.stats()
    assert (stats.held, stats.waiting, stats.timeouts) == (1, 0, 3)
    assert len(locks) == 1 and not locks.locked("a") and not locks.locked("c")
    holder.run(lambda: locks.release("b"))
    assert len(locks) == 0


def test_a_waiting_set_keeps_its_place_on_free_keys(locks, workers) -> None:
    holder, grouped, single = workers("holder"), workers("grouped"), workers("single")
    holder.run(lambda: locks.acquire("b"))
    taking = grouped.submit(lambda: locks.acquire_many(["a", "b"]))
    wait_until(lambda: locks.stats().waiting == 1, "the set queued (counted once)")
    # "a" is free, but the set is queued on it: later requests wait or fail behind it.
    assert not locks.locked("a")
    assert single.run(lambda: locks.acquire("a", timeout=0)) is False
    later = single.submit(lambda: locks.acquire("a"))
    wait_until(lambda: locks.stats().waiting == 2, "the later request queued")
    holder.run(lambda: locks.release("b"))
    assert taking.result() is True
    assert locks.owner("a") == locks.owner("b") == grouped.thread.ident
    assert locks.stats().waiting == 1  # the later request still waits, behind the set
    grouped.run(lambda: locks.release_many(["a", "b"]))
    assert later.result() is True
    single.run(lambda: locks.release("a"))
    assert len(locks) == 0


def test_a_waiting_set_keeps_its_place_against_later_sets(locks, workers) -> None:
    holder, grouped, later = workers("holder"), workers("grouped"), workers("later")
    holder.run(lambda: locks.acquire("b"))
    taking = grouped.submit(lambda: locks.acquire_many(["a", "b"]))
    wait_until(lambda: locks.stats().waiting == 1, "the set queued")
    # "a" and "c" are free, but the first set is queued on "a": a later set fails or waits.
    assert later.run(lambda: locks.acquire_many(["a", "c"], timeout=0)) is False
    assert later.run(lambda: locks.acquire_many(["c", "a"], timeout=0.01)) is False
    stats = locks.stats()
    assert (stats.waiting, stats.held, stats.timeouts) == (1, 1, 2)
    assert not locks.locked("a") and not locks.locked("c")
    waiting = later.submit(lambda: locks.acquire_many(["c", "a"]))
    wait_until(lambda: locks.stats().waiting == 2, "the later set queued")
    assert not locks.locked("c")  # it waits for "a" without holding "c"
    holder.run(lambda: locks.release("b"))
    assert taking.result() is True
    assert locks.owner("a") == grouped.thread.ident and not locks.locked("c")
    assert locks.stats().waiting == 1
    grouped.run(lambda: locks.release_many(["a", "b"]))
    assert waiting.result() is True
    assert locks.owner("a") == locks.owner("c") == later.thread.ident
    later.run(lambda: locks.release_many(["a", "c"]))
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_a_set_that_times_out_lets_the_requests_behind_it_in(locks, workers) -> None:
    holder, grouped, single = workers("holder"), workers("grouped"), workers("single")
    holder.run(lambda: locks.acquire("b"))
    taking = grouped.submit(lambda: locks.acquire_many(["a", "b"], timeout=1.0))
    wait_until(lambda: locks.stats().waiting == 1, "the set queued")
    later = single.submit(lambda: locks.acquire("a"))
    # Queued behind the set on free "a" (on a stalled machine the set may be gone first:
    # then "a" is simply free, and the outcome below is the same).
    wait_until(lambda: locks.stats().waiting == 2 or later.done(), "the single queued")
    assert taking.result() is False  # timed out: "b" stayed held
    assert later.result() is True and locks.owner("a") == single.thread.ident
    assert locks.stats().waiting == 0 and locks.owner("b") == holder.thread.ident
    single.run(lambda: locks.release("a"))
    holder.run(lambda: locks.release("b"))
    assert len(locks) == 0


def test_release_many_is_all_or_nothing(locks, workers) -> None:
    locks.acquire_many(["a", "b"])
    with pytest.raises(NotOwnedError, match="'c'"):
        locks.release_many(["a", "b", "c"])
    assert locks.owned("a") and locks.owned("b")
    locks.release_many(["a", "b"])
    with pytest.raises(TypeError, match="single str"):
        locks.acquire_many("ab")
    with pytest.raises(TypeError):
        locks.acquire_many([[1]])
    assert len(locks) == 0


def test_dining_philosophers_in_opposite_orders(impl, fair) -> None:
    locks = impl.LockManager(fair=fair)
    seats = 5
    meals = [0] * seats
    eating = [0] * seats  # per fork: how many philosophers hold it

    def philosopher(index: int, barrier: threading.Barrier) -> None:
        left, right = f"fork-{index}", f"fork-{(index + 1) % seats}"
        forks = [left, right] if index % 2 else [right, left]
        barrier.wait()
        for _ in range(100):
            with locks.hold_many(forks, timeout=PATIENCE):
                for fork in (index, (index + 1) % seats):
                    eating[fork] += 1
                    assert eating[fork] == 1, "a fork in two hands"
                time.sleep(0)
                for fork in (index, (index + 1) % seats):
                    eating[fork] -= 1
                meals[index] += 1

    run_threads(seats, philosopher)
    assert meals == [100] * seats and len(locks) == 0 and locks.stats().deadlocks == 0


def test_overlapping_random_sets_under_stress(impl, fair) -> None:
    locks = impl.LockManager(fair=fair)
    keys = [f"k{i}" for i in range(6)]
    inside = dict.fromkeys(keys, 0)
    done = [0]

    def body(index: int, barrier: threading.Barrier) -> None:
        rng = random.Random(index)
        barrier.wait()
        for _ in range(150):
            chosen = rng.sample(keys, rng.randint(1, 4))
            if rng.random() < 0.2:  # some try and give up
                if not locks.acquire_many(chosen, timeout=rng.choice([0, 0.001])):
                    continue
            else:
                locks.acquire_many(reversed(chosen))
            for key in chosen:
                inside[key] += 1
                assert inside[key] == 1, "two holders"
            time.sleep(0)
            for key in chosen:
                inside[key] -= 1
            done[0] += 1
            locks.release_many(chosen)

    run_threads(6, body)
    stats = locks.stats()
    assert done[0] > 0 and len(locks) == 0 and stats.waiting == 0 and stats.deadlocks == 0


def test_a_set_is_not_starved_by_single_key_traffic(impl, fair) -> None:
    locks = impl.LockManager(fair=fair)
    stop = threading.Event()
    rounds = [0, 0]

    def hog(index: int) -> None:  # keeps "a" or "b" busy, re-taking it at once
        key = "ab"[index]
        while not stop.is_set():
            with locks[key]:
                rounds[index] += 1

    hogs = [threading.Thread(target=hog, args=(i,), daemon=True) for i in range(2)]
    for thread in hogs:
        thread.start()
    try:
        wait_until(lambda: min(rounds) > 50, "both hogs are running")
        for _ in range(5):
            asked = time.monotonic()
            assert locks.acquire_many(["a", "b"], timeout=PATIENCE) is True
            assert time.monotonic() - asked < PATIENCE / 4  # its place in both queues holds
            locks.release_many(["a", "b"])
    finally:
        stop.set()
        for thread in hogs:
            thread.join(PATIENCE)
    assert len(locks) == 0


def test_a_set_joins_the_deadlock_detector(locks, workers) -> None:
    first, second, third = workers("first"), workers("second"), workers("third")
    first.run(lambda: locks.acquire("A"))
    second.run(lambda: locks.acquire("B"))
    third.run(lambda: locks.acquire("C"))
    waiting = first.submit(lambda: locks.acquire_many(["B", "C"]))  # edges to second and third
    wait_until(lambda: locks.stats().waiting == 1, "first waits for its set")
    with pytest.raises(DeadlockError) as caught:
        third.run(lambda: locks.acquire("A"))
    assert caught.value.cycle == [(third.thread.ident, "A"), (first.thread.ident, "C")]
    with pytest.raises(DeadlockError):
        second.run(lambda: locks.acquire_many(["A", "x"], timeout=5))
    assert not locks.locked("x") and locks.stats().deadlocks == 2
    second.run(lambda: locks.release("B"))
    third.run(lambda: locks.release("C"))
    assert waiting.result() is True
    assert first.run(locks.release_all) == 3


def test_rw_sets_read_shared_and_write_exclusive(impl, workers) -> None:
    rw = impl.RWLockManager()
    reader, writer = workers("reader"), workers("writer")
    assert rw.acquire_many(reads=["a", "b"], writes=["b", "c"]) is True  # b is written
    assert rw.readers("a") == 1 and rw.write_locked("b") and rw.readers("b") == 0
    assert rw.write_locked("c")
    assert reader.run(lambda: rw.acquire_many(reads=["a"], timeout=0)) is True
    assert reader.run(lambda: rw.acquire_many(reads=["a", "b"], timeout=0)) is False
    writing = writer.submit(lambda: rw.acquire_many(writes=["a"]))
    wait_until(lambda: rw.stats().waiting == 1, "the writer queued")
    rw.release_many(reads=["a", "b"], writes=["b", "c"])
    reader.run(lambda: rw.release_many(reads=["a"]))
    assert writing.result() is True
    writer.run(lambda: rw.release_many(writes=["a"]))
    with rw.hold_many(reads=["x"], writes=["y"], timeout=1):
        assert rw.readers("x") == 1 and rw.write_locked("y")
    assert len(rw) == 0 and rw.stats().waiting == 0


def test_a_granted_read_set_lets_in_the_readers_queued_behind_it(impl, workers) -> None:
    rw = impl.RWLockManager()
    writer, grouped, reader = workers("writer"), workers("grouped"), workers("reader")
    writer.run(lambda: rw.acquire_write("b"))
    taking = grouped.submit(lambda: rw.acquire_many(reads=["a", "b"]))
    wait_until(lambda: rw.stats().waiting == 1, "the read set queued")
    # "a" is free but the set is queued on it: a new reader queues behind it.
    assert reader.run(lambda: rw.acquire_read("a", timeout=0)) is False
    reading = reader.submit(lambda: rw.acquire_read("a"))
    wait_until(lambda: rw.stats().waiting == 2, "the reader queued behind the set")
    # The release grants the set, which shares "a": that same release lets the reader in
    # behind it. Seen from the releasing thread at once, before the set's own thread runs
    # (its call returning would let the reader in too, only later).
    seen = writer.run(lambda: (rw.release_write("b"), rw.stats().waiting, rw.readers("a"),
                               rw.readers("b")))
    assert seen[1:] == (0, 2, 1)
    assert taking.result() is True and reading.result() is True
    reader.run(lambda: rw.release_read("a"))
    grouped.run(lambda: rw.release_many(reads=["a", "b"]))
    assert len(rw) == 0


def test_a_read_set_shares_keys_with_readers_and_waits_for_writers(impl, workers) -> None:
    rw = impl.RWLockManager()
    reader, grouped, writer = workers("reader"), workers("grouped"), workers("writer")
    reader.run(lambda: rw.acquire_read("a"))
    assert grouped.run(lambda: rw.acquire_many(reads=["a", "b"], timeout=0)) is True
    assert rw.readers("a") == 2 and rw.readers("b") == 1
    writing = writer.submit(lambda: rw.acquire_many(writes=["b", "c"]))
    wait_until(lambda: rw.stats().waiting == 1, "the write set queued")
    assert not rw.write_locked("c")  # all or nothing: it holds no key while it waits
    # A new read set waits behind the queued writer on "b" (no starving it).
    assert reader.run(lambda: rw.acquire_many(reads=["b"], timeout=0)) is False
    grouped.run(lambda: rw.release_many(reads=["a", "b"]))
    assert writing.result() is True and rw.write_locked("b") and rw.write_locked("c")
    writer.run(lambda: rw.release_many(writes=["b", "c"]))
    reader.run(lambda: rw.release_read("a"))
    assert len(rw) == 0 and rw.stats().waiting == 0


def test_a_read_set_waits_behind_a_writer_queued_on_one_of_its_keys(impl, workers) -> None:
    """A set is granted only at the head of every queue it is in: its read of "a" waits
    behind a writer queued there, even when its other key frees up and "a" is only read."""
    rw = impl.RWLockManager()
    reader, writer, owner, grouped = (workers(name) for name in ("reader", "writer", "owner",
                                                                  "grouped"))
    reader.run(lambda: rw.acquire_read("a"))
    writing = writer.submit(lambda: rw.acquire_write("a"))
    wait_until(lambda: rw.stats().waiting == 1, "the writer queued on a")
    owner.run(lambda: rw.acquire_write("b"))
    taking = grouped.submit(lambda: rw.acquire_many(reads=["a", "b"]))
    wait_until(lambda: rw.stats().waiting == 2, "the set queued")
    owner.run(lambda: rw.release_write("b"))  # "b" is free now; "a" is read, writer ahead
    assert rw.stats().waiting == 2 and rw.readers("a") == 1 and "b" not in rw
    reader.run(lambda: rw.release_read("a"))
    assert rw.write_locked("a") and rw.stats().waiting == 1 and "b" not in rw
    assert writing.result() is True
    writer.run(lambda: rw.release_write("a"))
    assert taking.result() is True and rw.readers("a") == rw.readers("b") == 1
    grouped.run(lambda: rw.release_many(reads=["a", "b"]))
    assert len(rw) == 0 and rw.stats().waiting == 0


def test_rw_set_upgrading_a_read_key(impl, workers) -> None:
    rw = impl.RWLockManager()
    other = workers("other")
    rw.acquire_read("k")
    other.run(lambda: rw.acquire_read("k"))
    assert rw.acquire_many(writes=["k", "j"], timeout=0) is False  # the other reader is in
    other.run(lambda: rw.release_read("k"))
    assert rw.acquire_many(writes=["k", "j"], timeout=0) is True  # the only reader upgrades
    assert rw.write_locked("k") and rw.readers("k") == 1
    rw.release_many(writes=["k", "j"])
    rw.release_read("k")
    assert len(rw) == 0


def test_a_set_that_times_out_lets_the_request_behind_it_in_at_once(impl, workers) -> None:
    """A waiting set queued on a free key ("a", blocked on "b") times out: leaving hands "a"
    to the request queued behind it then and there, seen from the set's own thread as its
    call returns (not only when that request's own wait looks again)."""
    locks = impl.LockManager()
    holder, grouped, waiter = workers("holder"), workers("grouped"), workers("waiter")
    holder.run(lambda: locks.acquire("b"))
    trying = grouped.submit(lambda: (locks.acquire_many(["a", "b"], timeout=1.0),
                                     locks.owner("a"), locks.stats().waiting))
    wait_until(lambda: locks.stats().waiting == 1, "the set queued")
    taking = waiter.submit(lambda: locks.acquire("a"))
    wait_until(lambda: locks.stats().waiting == 2, "the request queued behind the set")
    assert trying.result() == (False, waiter.thread.ident, 0)
    assert taking.result() is True
    waiter.run(lambda: locks.release("a"))
    holder.run(lambda: locks.release("b"))
    assert len(locks) == 0 and locks.stats().timeouts == 1


def test_release_many_of_a_spent_generator_refuses_and_releases_nothing(impl) -> None:
    locks = impl.LockManager()
    keys = (key for key in ["a", "b"])
    assert locks.acquire_many(keys)
    with pytest.raises(TypeError, match=r"keys is an iterator with nothing left in it .*"
                                        r"nothing was released; pass the keys again"):
        locks.release_many(keys)
    assert locks.owned("a") and locks.owned("b")
    locks.release_many(key for key in ["a", "b"])  # a fresh generator releases as a list does
    locks.release_many([])  # an empty collection releases nothing, rightly
    assert len(locks) == 0
    rw = impl.RWLockManager()
    reads = iter(["r"])
    assert rw.acquire_many(reads=reads)
    with pytest.raises(TypeError, match="reads is an iterator with nothing left in it"):
        rw.release_many(reads=reads)
    assert rw.readers("r") == 1
    rw.release_many(reads=["r"])
