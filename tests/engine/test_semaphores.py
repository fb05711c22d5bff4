"""SemaphoreManager: at most ``limit`` slots per key, one more for each acquire (a holder's
too), strict FIFO, ownership, abandonment, bad input, and no false deadlock, on both
engines."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from conftest import PATIENCE, abandoned_warnings, wait_until
from lockmgr import DeadlockError, LockTimeout, NotOwnedError
from lockmgr._args import READ, WRITE
from test_api import BAD_ACQUIRE_ARGS

LIMITS = pytest.mark.parametrize("limit", [1, 3], ids=["limit-1", "limit-3"])


@LIMITS
def test_a_roundtrip_leaves_nothing_behind(impl, limit) -> None:
    slots = impl.SemaphoreManager(limit)
    assert slots.limit == limit and slots.fair is True
    assert slots.holders("k") == 0 and slots.available("k") == limit and "k" not in slots
    assert slots.acquire("k") is True
    assert slots.holders("k") == 1 and slots.available("k") == limit - 1
    assert slots.owned("k") and "k" in slots and len(slots) == 1
    slots.release("k")
    assert len(slots) == 0 and slots.snapshot() == [] and not slots.owned("k")
    assert repr(slots).startswith(f"<lockmgr.SemaphoreManager limit={limit} fair=True held=0 ")


def test_a_limit_of_one_takes_the_exclusive_path_and_more_the_shared_one(impl) -> None:
    assert impl.SemaphoreManager(1)._slot_mode == WRITE
    assert impl.SemaphoreManager(2)._slot_mode == READ


@LIMITS
def test_at_most_limit_holders_at_once(impl, limit, workers) -> None:
    slots = impl.SemaphoreManager(limit)
    holders = [workers(f"holder{i}") for i in range(limit)]
    for holder in holders:
        assert holder.run(lambda: slots.acquire("k", timeout=0)) is True
    late = workers("late")
    assert late.run(lambda: slots.acquire("k", timeout=0)) is False
    assert late.run(lambda: slots.acquire("k", timeout=0.01)) is False
    assert slots.holders("k") == limit and slots.available("k") == 0
    assert slots.stats().timeouts == 2
    holders[0].run(lambda: slots.release("k"))
    assert late.run(lambda: slots.acquire("k", timeout=0)) is True
    for holder in [*holders[1:], late]:
        holder.run(lambda: slots.release("k"))
    assert len(slots) == 0


@pytest.mark.parametrize("limit", [3, lambda key: 3], ids=["limit-3", "limit-callable-3"])
def test_each_acquire_takes_one_more_slot_also_by_a_holder(impl, limit, workers) -> None:
    slots = impl.SemaphoreManager(limit)
    assert slots.acquire("k") and slots.acquire("k", timeout=0)  # two slots of one owner
    assert slots.holders("k") == 2 and slots.available("k") == 1
    (state,) = slots.snapshot()  # an owner once, with the slots it holds
    assert [(h.owner, h.count) for h in state.holders] == [(threading.get_ident(), 2)]
    other = workers("other")
    assert other.run(lambda: slots.acquire("k", timeout=0)) is True
    assert other.run(lambda: slots.acquire("k", timeout=0)) is False  # the 3 are taken
    slots.release("k")  # gives back one of its two
    assert slots.owned("k") and slots.holders("k") == 2 and slots.available("k") == 1
    slots.release("k")
    assert not slots.owned("k")
    with pytest.raises(NotOwnedError):
        slots.release("k")
    assert slots.holders("k") == 1
    other.run(lambda: slots.release("k"))
    assert len(slots) == 0 and slots.stats().acquisitions == 3


@pytest.mark.parametrize("limit", [1, 3, lambda key: 1, lambda key: 3],
                         ids=["limit-1", "limit-3", "limit-callable-1", "limit-callable-3"])
def test_a_holder_asking_for_a_slot_only_it_could_free_is_a_deadlock_error(impl, limit) -> None:
    """Every slot of "k" is the caller's own: a try gives up, a wait (with or without a
    timeout, one key or a set) is refused at once, nothing changed; a limit of 1 included:
    a holder's second acquire is no re-entry."""
    slots = impl.SemaphoreManager(limit)
    count = limit if isinstance(limit, int) else limit("k")
    for _ in range(count):
        assert slots.acquire("k", timeout=0) is True
    assert slots.acquire("k", timeout=0) is False
    for wait in (lambda: slots.acquire("k"), lambda: slots.acquire("k", timeout=PATIENCE),
                 lambda: slots.hold("k").__enter__(),
                 lambda: slots.acquire_many(["other", "k"])):
        with pytest.raises(DeadlockError) as refused:
            wait()
        assert refused.value.cycle == [(threading.get_ident(), "k")]
    assert slots.acquire_many(["other", "k"], timeout=0) is False
    assert slots.holders("k") == count and "other" not in slots and len(slots) == 1
    assert slots.stats().deadlocks == 4 and slots.stats().timeouts == 2
    for _ in range(count):
        slots.release("k")
    assert len(slots) == 0


def test_a_holder_asking_for_another_slot_waits_in_line(impl, workers) -> None:
    """A and B hold the two slots of "k"; C asks first, then A asks for a second slot: a
    slot B gives back goes to C, the next one (C's) to A."""
    slots = impl.SemaphoreManager(2)
    a, b, c = workers("a"), workers("b"), workers("c")
    a.run(lambda: slots.acquire("k"))
    b.run(lambda: slots.acquire("k"))
    c_waits = c.submit(lambda: slots.acquire("k"))
    wait_until(lambda: slots.stats().waiting == 1, "c queued")
    a_waits = a.submit(lambda: slots.acquire("k"))
    wait_until(lambda: slots.stats().waiting == 2, "a queued behind c")
    b.run(lambda: slots.release("k"))
    assert c_waits.result() is True and not a_waits.done()
    c.run(lambda: slots.release("k"))
    assert a_waits.result() is True
    assert slots.holders("k") == 2 and slots.stats().deadlocks == 0
    a.run(lambda: (slots.release("k"), slots.release("k")))
    assert len(slots) == 0


@LIMITS
def test_waiters_are_granted_in_arrival_order(impl, limit, workers) -> None:
    slots = impl.SemaphoreManager(limit)
    holders = [workers(f"holder{i}") for i in range(limit)]
    for holder in holders:
        holder.run(lambda: slots.acquire("k"))
    waiters = [workers(f"waiter{i}") for i in range(4)]
    calls = []
    for number, waiter in enumerate(waiters):
        calls.append(waiter.submit(lambda: slots.acquire("k")))
        wait_until(lambda: slots.stats().waiting == number + 1, f"waiter {number} queued")
    order = [*holders, *waiters]
    for released in range(len(waiters)):
        order[released].run(lambda: slots.release("k"))
        assert calls[released].result() is True
        assert not any(call.done() for call in calls[released + 1:]), "a waiter overtook"
    for holder in order[len(waiters):]:
        holder.run(lambda: slots.release("k"))
    assert len(slots) == 0 and slots.stats().contended == len(waiters)


def test_a_free_slot_goes_to_no_one_behind_a_queued_set(impl, fair, workers) -> None:
    """A set queued on "k" (waiting for "x" too) is ahead of a newcomer: with fair=True the
    newcomer does not take the free slot of "k"; with fair=False it does."""
    slots = impl.SemaphoreManager(2, fair=fair)
    holders = [workers("x-holder0"), workers("x-holder1")]
    for holder in holders:
        holder.run(lambda: slots.acquire("x"))
    slots.acquire("k")  # one slot of "k" held, one free
    waiter = workers("set")
    queued = waiter.submit(lambda: slots.acquire_many(["k", "x"]))
    wait_until(lambda: slots.stats().waiting == 1, "the set queued")
    assert slots.available("k") == 1
    newcomer = workers("newcomer")
    assert newcomer.run(lambda: slots.acquire("k", timeout=0)) is (not fair)
    if not fair:
        newcomer.run(lambda: slots.release("k"))
    holders[0].run(lambda: slots.release("x"))
    assert queued.result() is True
    assert slots.holders("k") == 2 and slots.holders("x") == 2
    waiter.run(lambda: slots.release_many(["k", "x"]))
    holders[1].run(lambda: slots.release("x"))
    slots.release("k")
    assert len(slots) == 0


def test_a_waiter_holding_a_slot_is_no_false_deadlock(impl, workers) -> None:
    """A and B hold the two slots of "s"; A waits for "lock" held by C; C waits for a slot
    of "s". A search that took every holder of "s" for an edge would call that a cycle
    (C -> A -> C), but B can still release: C's wait is granted, no DeadlockError."""
    slots = impl.SemaphoreManager(2)
    locks = impl.LockManager()
    a, b, c = workers("a"), workers("b"), workers("c")
    a.run(lambda: slots.acquire("s"))
    b.run(lambda: slots.acquire("s"))
    c.run(lambda: locks.acquire("lock"))
    a_waits = a.submit(lambda: locks.acquire("lock"))
    wait_until(lambda: locks.stats().waiting == 1, "a waits for the lock")
    c_waits = c.submit(lambda: slots.acquire("s"))
    wait_until(lambda: slots.stats().waiting == 1, "c waits for a slot")
    b.run(lambda: slots.release("s"))
    assert c_waits.result() is True
    c.run(lambda: locks.release("lock"))
    assert a_waits.result() is True
    assert slots.stats().deadlocks == 0 and locks.stats().deadlocks == 0
    a.run(lambda: (locks.release("lock"), slots.release("s")))
    c.run(lambda: slots.release("s"))
    assert len(slots) == 0 and len(locks) == 0


@LIMITS
def test_hold_views_and_synchronized(impl, limit, workers) -> None:
    slots = impl.SemaphoreManager(limit)
    with slots.hold("k") as held:
        assert held is True and slots.owned("k")
    with slots["k"] as held:
        assert held is True and slots["k"].holders() == 1 and slots["k"].available() == limit - 1
    assert slots["k"] == slots["k"] and slots["k"].key == "k" and slots["k"].manager is slots
    view = slots["k"]
    assert view.acquire(timeout=0) is True
    view.release()

    @slots.synchronized(lambda user: user)
    def work(user: str) -> int:
        return slots.holders(user)

    assert work("u") == 1 and len(slots) == 0
    others = [workers(f"other{i}") for i in range(limit)]
    for other in others:
        other.run(lambda: slots.acquire("k"))
    with pytest.raises(LockTimeout), slots.hold("k", timeout=0.01):
        pass
    for other in others:
        other.run(lambda: slots.release("k"))
    assert len(slots) == 0


@LIMITS
def test_many_keys_all_or_nothing(impl, limit, workers) -> None:
    slots = impl.SemaphoreManager(limit)
    full = [workers(f"full{i}") for i in range(limit)]
    for worker in full:
        worker.run(lambda: slots.acquire("b"))
    assert slots.acquire_many(["a", "b"], timeout=0) is False
    assert slots.holders("a") == 0 and len(slots) == 1
    full[0].run(lambda: slots.release("b"))
    assert slots.acquire_many(["a", "b", "a"], timeout=0) is True
    assert slots.holders("a") == 1 and slots.holders("b") == limit
    slots.release_many(["a", "b"])
    with slots.hold_many(["a", "b"], timeout=0):
        assert slots.owned("a") and slots.owned("b")
    with pytest.raises(NotOwnedError):
        slots.release_many(["a", "b"])
    for worker in full[1:]:
        worker.run(lambda: slots.release("b"))
    assert len(slots) == 0


@pytest.mark.parametrize("taken", [[1], [2, 1]], ids=["limit-1", "limit-3"])
def test_a_thread_that_ends_holding_slots_gives_them_all_up_with_a_warning_per_key(
        impl, taken) -> None:
    """Threads that end holding every slot of "k" (one of them two) release them all: the
    waiter gets one; each thread warns once for "k", however many slots it held."""
    slots = impl.SemaphoreManager(sum(taken))
    took, end = threading.Event(), threading.Event()

    def holder(count: int) -> None:
        for _ in range(count):
            slots.acquire("k")
        took.set()
        end.wait(PATIENCE)

    fill = [threading.Thread(target=holder, args=(count,)) for count in taken]
    waiting = threading.Thread(target=lambda: (slots.acquire("k"), slots.release("k")),
                               daemon=True)
    with abandoned_warnings() as warned:
        for thread in fill:
            thread.start()
            assert took.wait(PATIENCE)
            took.clear()
        waiting.start()
        wait_until(lambda: slots.stats().waiting == 1, "the waiter queued")
        end.set()
        for thread in fill:
            thread.join(PATIENCE)
    assert sorted(str(w.message) for w in warned) == sorted(
        f"thread {thread.name!r} (ident {thread.ident}) ended holding key 'k'; released it"
        for thread in fill)
    waiting.join(PATIENCE)
    assert not waiting.is_alive() and len(slots) == 0


@pytest.mark.parametrize("limit", [0, -1, -(2**70)])
def test_a_limit_below_one_is_refused(impl, limit) -> None:
    with pytest.raises(ValueError, match="limit must be an int from 1"):
        impl.SemaphoreManager(limit)


@pytest.mark.parametrize("limit", [True, False, 1.0, "3", None, 2**70])
def test_a_limit_that_is_no_int_is_refused(impl, limit) -> None:
    error = ValueError if limit == 2**70 else TypeError
    with pytest.raises(error, match="limit must be"):
        impl.SemaphoreManager(limit)


@LIMITS
def test_an_unhashable_key_is_refused_with_nothing_changed(impl, limit) -> None:
    slots = impl.SemaphoreManager(limit)
    for call in (slots.acquire, slots.release, slots.hold, slots.holders, slots.available,
                 slots.owned, slots.__getitem__, lambda key: slots.acquire_many(["a", key])):
        with pytest.raises(TypeError):
            call([])
    assert len(slots) == 0 and slots.stats().acquisitions == 0


@pytest.mark.parametrize("kwargs", BAD_ACQUIRE_ARGS, ids=repr)
def test_acquire_rejects_what_threading_rejects(impl, kwargs) -> None:
    slots = impl.SemaphoreManager(2)
    with pytest.raises((TypeError, ValueError, OverflowError)):
        slots.acquire("k", **kwargs)
    assert len(slots) == 0


def test_a_limit_callable_sets_each_keys_limit_when_it_enters_the_table(impl, workers) -> None:
    limits = {"one": 1, "two": 2}
    slots = impl.SemaphoreManager(lambda key: limits.get(key, 3))
    assert slots._slot_mode == READ and callable(slots.limit)
    assert [slots.available(key) for key in ("one", "two", "other")] == [1, 2, 3]
    takers = [workers(f"taker{i}") for i in range(4)]
    for key, admitted in (("one", 1), ("two", 2), ("other", 3)):
        got = [taker.run(lambda key=key: slots.acquire(key, timeout=0)) for taker in takers]
        assert got == [True] * admitted + [False] * (4 - admitted), key
    limits["two"] = 4  # "two" is in use: it keeps the limit it entered with
    assert takers[3].run(lambda: slots.acquire("two", timeout=0)) is False
    assert slots.available("two") == 0
    for taker in takers:
        taker.run(slots.release_all)
    assert len(slots) == 0 and slots.available("two") == 4
    assert slots.acquire_many(["one", "two"]) is True
    assert slots.holders("one") == 1 and slots.available("one") == 0
    slots.release_many(["one", "two"])
    assert len(slots) == 0


@pytest.mark.parametrize("answer, error", [(0, ValueError), (-1, ValueError), (True, TypeError),
                                           (2.0, TypeError), ("2", TypeError), (None, TypeError)])
def test_a_bad_limit_from_the_callable_fails_the_acquire_with_nothing_changed(
        impl, answer, error) -> None:
    slots = impl.SemaphoreManager(lambda key: answer if key == "bad" else 2)
    match = r"limit\('bad'\) must return"
    for call in (lambda: slots.acquire("bad"), lambda: slots.acquire_many(["good", "bad"]),
                 lambda: slots.hold("bad").__enter__(), lambda: slots.available("bad")):
        with pytest.raises(error, match=match):
            call()
    assert len(slots) == 0 and slots.stats().acquisitions == 0 and slots.snapshot() == []


def test_what_the_limit_callable_raises_fails_the_acquire_with_nothing_changed(impl) -> None:
    def limit(key: str) -> int:
        raise LookupError(key)

    slots = impl.SemaphoreManager(limit)
    with pytest.raises(LookupError):
        slots.acquire("k")
    assert len(slots) == 0 and slots.stats().acquisitions == 0


def test_snapshot_metrics_and_the_slow_wait_log_show_slot_holders(impl, workers) -> None:
    slots = impl.SemaphoreManager(2, log_waits_after=0.01)
    holders = [workers(f"holder{i}") for i in range(2)]
    for holder in holders:
        holder.run(lambda: slots.acquire("k"))
    logger, records = logging.getLogger("lockmgr"), []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        waiter = workers("waiter")
        waiting = waiter.submit(lambda: slots.acquire("k"))
        wait_until(lambda: any(r.levelno == logging.WARNING for r in records), "the slow-wait log")
        (state,) = slots.snapshot()
        assert state.key == "k" and [h.mode for h in state.holders] == ["read", "read"]
        assert sorted(h.owner for h in state.holders) == sorted(
            holder.thread.ident for holder in holders)
        assert [w.owner for w in state.waiters] == [waiter.thread.ident]
        holders[0].run(lambda: slots.release("k"))
        assert waiting.result() is True
        wait_until(lambda: any(r.levelno == logging.INFO for r in records), "the end of the wait")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    warning = next(r for r in records if r.levelno == logging.WARNING)
    assert "for key 'k' (read)" in warning.getMessage() and warning.lockmgr_keys == ("k",)
    metrics = slots.metrics()
    assert metrics.wait_time.count == 1 and metrics.stats.contended == 1
    waiter.run(lambda: slots.release("k"))
    holders[1].run(lambda: slots.release("k"))
    assert len(slots) == 0


@pytest.mark.parametrize("limit", [1, lambda key: 1], ids=["limit-1", "limit-callable-1"])
def test_a_cycle_through_keys_of_one_slot_is_a_deadlock_error(impl, limit, workers) -> None:
    """A key with one slot has one holder, what a wait for it waits for: a cycle through
    such keys is refused, whether the key takes the exclusive path (a limit of 1) or the
    shared one with a limit of 1 (a limit callable's answer)."""
    slots = impl.SemaphoreManager(limit)
    first, second = workers("first"), workers("second")
    first.run(lambda: slots.acquire("x"))
    second.run(lambda: slots.acquire("y"))
    blocked = first.submit(lambda: slots.acquire("y"))
    wait_until(lambda: slots.stats().waiting == 1, "first waits for y")
    with pytest.raises(DeadlockError) as refused:
        second.run(lambda: slots.acquire("x"))
    assert [key for _, key in refused.value.cycle] == ["x", "y"]
    second.run(lambda: slots.release("y"))
    assert blocked.result() is True
    first.run(slots.release_all)
    assert len(slots) == 0 and slots.stats().deadlocks == 1


@pytest.mark.parametrize("limit", [1, 2, lambda key: len(key)], ids=["limit-1", "limit-2",
                                                                       "limit-callable"])
def test_threads_hammering_keys_never_exceed_the_limit(impl, limit) -> None:
    """Eight threads take and give back slots of three keys (one at a time, with hold, and
    two at once), and count who is inside: never more than each key's limit."""
    slots = impl.SemaphoreManager(limit)
    keys = ["a", "bb", "ccc"]
    allowed = {key: limit(key) if callable(limit) else limit for key in keys}
    inside = dict.fromkeys(keys, 0)
    most = dict.fromkeys(keys, 0)
    guard = threading.Lock()
    failures: list[BaseException] = []

    def enter(*entered: str) -> None:
        with guard:
            for key in entered:
                inside[key] += 1
                most[key] = max(most[key], inside[key])
        # Stay a moment, so that the others pile up at the keys: a limit that let one more
        # in would show in ``most`` (what is asserted holds however long this takes).
        time.sleep(0.0002)

    def leave(*left: str) -> None:
        with guard:
            for key in left:
                inside[key] -= 1

    def hammer(index: int) -> None:
        try:
            for round_ in range(150):
                key, other = keys[(index + round_) % 3], keys[(index + round_ + 1) % 3]
                if round_ % 3 == 0:
                    with slots.hold(key, timeout=PATIENCE):
                        enter(key)
                        leave(key)
                elif round_ % 3 == 1:
                    assert slots.acquire(key, timeout=PATIENCE)
                    enter(key)
                    leave(key)
                    slots.release(key)
                else:
                    with slots.hold_many([key, other], timeout=PATIENCE):
                        enter(key, other)
                        leave(key, other)
        except BaseException as error:  # handed to the test
            failures.append(error)

    threads = [threading.Thread(target=hammer, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * PATIENCE)
    assert not any(thread.is_alive() for thread in threads) and failures == []
    assert all(most[key] <= allowed[key] for key in keys), (most, allowed)
    assert len(slots) == 0 and slots.stats().waiting == 0
