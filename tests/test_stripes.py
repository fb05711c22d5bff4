"""Striped managers: keys map onto a fixed number of locks, so memory never grows."""

from __future__ import annotations

import gc
import sys
import sysconfig
import threading
import tracemalloc
import weakref

import pytest

from conftest import PATIENCE, end_holding_keys_of_a_freed_manager, wait_until
from lockmgr import NotOwnedError
from lockmgr._args import stripe_index


def _two_keys_on_one_stripe(locks) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    seen: dict[int, str] = {}
    for i in range(10_000):
        key = f"key-{i}"
        stripe = locks.stripe_of(key)
        if stripe in seen:
            return seen[stripe], key
        seen[stripe] = key
    raise AssertionError("no two keys share a stripe")


@pytest.mark.parametrize(("asked", "count"), [(1, 1), (5, 8), (16, 16), (1000, 1024)])
def test_stripe_count_rounds_up_to_a_power_of_two(impl, asked, count) -> None:
    assert impl.LockManager(stripes=asked).stripes == count
    assert impl.RWLockManager(stripes=asked).stripes == count
    assert impl.LockManager().stripes is None and impl.LockManager().stripe_of("k") is None


@pytest.mark.parametrize(("stripes", "error"), [(0, ValueError), (-4, ValueError),
                                                (1 << 30, ValueError), (2.5, TypeError),
                                                ("8", TypeError)])
def test_bad_stripe_counts_are_rejected(impl, stripes, error) -> None:
    with pytest.raises(error):
        impl.LockManager(stripes=stripes)
    with pytest.raises(error):
        impl.RWLockManager(stripes=stripes)


#: stripe_index(hash, count) as documented (multiply by 2**64/phi mod 2**64, fold the high half
#: onto the low half, keep the low bits), worked out once and pinned: both engines must agree
#: with these, not merely with each other.
PINNED_STRIPES = {  # hash: (stripe of 2, 8, 64, 1024)
    0: (0, 0, 0, 0),
    1: (0, 4, 44, 428),
    2: (0, 0, 24, 856),
    7: (1, 1, 1, 129),
    -2: (1, 3, 27, 859),
    -7: (0, 0, 0, 128),
    42: (0, 4, 28, 796),
    1000003: (1, 5, 5, 197),
    2**31 - 1: (0, 2, 58, 954),
    2**32: (1, 5, 21, 21),
    12345678901234: (0, 2, 50, 498),
}


@pytest.mark.parametrize("key_hash", list(PINNED_STRIPES))
def test_stripe_index_is_the_documented_function(key_hash) -> None:
    for count, stripe in zip((2, 8, 64, 1024), PINNED_STRIPES[key_hash], strict=True):
        assert stripe_index(key_hash, count) == stripe
    assert stripe_index(key_hash, 1) == 0


def test_both_engines_map_keys_to_the_pinned_stripes(impl) -> None:
    managers = {count: impl.LockManager(stripes=count) for count in (2, 8, 64, 1024)}
    for key_hash, stripes in PINNED_STRIPES.items():
        key = -1 if key_hash == -2 else key_hash  # an int is its own hash, except -1 (-2)
        assert hash(key) == key_hash
        assert tuple(managers[count].stripe_of(key) for count in (2, 8, 64, 1024)) == stripes
    locks = managers[64]
    for key in ["a", "user:42", (1, "x"), 2**70, b"bytes", 1.5]:  # whatever the hash
        assert locks.stripe_of(key) == stripe_index(hash(key), 64)


def test_a_key_takes_the_lock_of_its_pinned_stripe(impl, workers) -> None:
    locks = impl.LockManager(stripes=64)
    other = workers("other")
    other.run(lambda: locks.acquire(-7))  # stripe 0 of 64, as 0 (both pinned above)
    assert locks.acquire(0, timeout=0) is False
    assert locks.acquire(1, timeout=0) is True  # stripe 44: free
    locks.release(1)
    other.run(lambda: locks.release(0))  # the same lock: releasing it releases -7
    assert len(locks) == 0


def test_keys_on_one_stripe_share_its_lock(impl, workers) -> None:
    locks = impl.LockManager(stripes=8)
    first, second = _two_keys_on_one_stripe(locks)
    locks.acquire(first)
    assert locks.owned(second) and locks.locked(second) and second in locks
    assert locks.recursion_count(second) == 1
    locks.acquire(second)  # the same lock: re-entered
    assert locks.recursion_count(first) == 2 and len(locks) == 1
    locks.release(second)
    locks.release(second)  # releasing a key of the stripe releases the stripe
    assert not locks.locked(first)
    other = workers("other")
    other.run(lambda: locks.acquire(first))
    assert locks.acquire(second, timeout=0) is False
    with pytest.raises(NotOwnedError, match="<stripe"):
        locks.release(second)
    other.run(lambda: locks.release(first))


def test_views_and_conditions_work_per_stripe(impl) -> None:
    locks = impl.LockManager(stripes=4)
    first, second = _two_keys_on_one_stripe(locks)
    view = locks[first]
    assert view.key == first
    with view:
        assert locks[second]._is_owned() and "key='" in repr(view)
    with locks.hold(second, timeout=0):
        assert locks.locked(first)
    assert len(locks) == 0


def test_multi_key_calls_collapse_onto_stripes(impl, workers) -> None:
    locks = impl.LockManager(stripes=4)
    first, second = _two_keys_on_one_stripe(locks)
    keys = [first, second, "other-1", "other-2", "other-3"]
    assert locks.acquire_many(keys, timeout=0) is True  # never waits on its own stripe
    assert locks.recursion_count(first) == 1 and len(locks) <= 4
    locks.release_many(keys)
    assert len(locks) == 0
    rw = impl.RWLockManager(stripes=2)
    assert rw.acquire_many(reads=[first, second, "x"], writes=["y"], timeout=0)
    rw.release_many(reads=[first, second, "x"], writes=["y"])
    assert len(rw) == 0


def test_striped_rw_reads_share_and_writes_exclude(impl, workers) -> None:
    rw = impl.RWLockManager(stripes=4)
    first, second = _two_keys_on_one_stripe(rw)
    reader, writer = workers("reader"), workers("writer")
    reader.run(lambda: rw.acquire_read(first))
    assert rw.readers(second) == 1
    queued = writer.submit(lambda: rw.acquire_write(second))
    wait_until(lambda: rw.stats().waiting == 1, "the writer queued on the shared stripe")
    reader.run(lambda: rw.release_read(first))
    assert queued.result() is True and rw.write_locked(first)
    writer.run(lambda: rw.release_write(second))
    assert len(rw) == 0


#: Memory a free-threaded build may still hold for blocks already freed (QSBR's deferred
#: frees: a queue of at most 254 blocks, here a small dict's storage of about 200 B each).
DEFERRED_FREES = 254 * 200 if sysconfig.get_config_var("Py_GIL_DISABLED") else 0


def test_memory_stays_fixed_however_many_keys(impl) -> None:
    locks = impl.LockManager(stripes=64)
    gc.collect()
    tracemalloc.start()
    try:
        for key in range(64 * 4):  # warm-up: every stripe's entry has existed once
            locks.acquire(key)
        locks.release_all()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        keys = [f"natural-id-{i}" for i in range(20_000)]
        for key in keys[:1000]:  # by now every stripe is held
            locks.acquire(key)
        with_a_thousand = tracemalloc.get_traced_memory()[0]
        for key in keys[1000:]:
            locks.acquire(key)
        assert len(locks) == locks.stats().held == 64
        # 19,000 more keys: nothing per key (at most a larger count object per stripe, and on
        # a free-threaded build the blocks of dicts shared between threads that it frees
        # only once every thread has passed a quiescent state: one queue of up to 254
        # blocks). Even 3 B per key would be 57,000 B.
        assert tracemalloc.get_traced_memory()[0] - with_a_thousand < 64 * 64 + DEFERRED_FREES
        assert locks.release_all() <= 64
        del keys
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - before < 16 * 1024
    finally:
        tracemalloc.stop()
    assert len(locks) == 0


# -- the stripe objects' lifetime -----------------------------------------------------------
# The compiled core's entries hold a striped manager's stripes without a reference (so that
# threads on different stripes write no shared reference count): the manager keeps them
# until it is freed, after its last entry. These pin that down on both engines.


def _references(obj: object) -> int:
    return sys.getrefcount(obj) - 1  # less getrefcount's own argument


def test_using_a_stripe_leaves_its_references_as_they_were(impl, workers) -> None:
    locks = impl.LockManager(stripes=4)
    rw = impl.RWLockManager(stripes=4)
    first, second = _two_keys_on_one_stripe(locks)
    stripe, rw_stripe = locks._table_key(first), rw._table_key(first)
    assert locks._table_key(second) is stripe and repr(stripe).startswith("<stripe ")
    before = _references(stripe), _references(rw_stripe)
    for _ in range(3):
        locks.acquire(first)
        locks.acquire(second)  # re-entered
        with locks[second], locks.hold(first, timeout=0):
            assert locks.recursion_count(first) == 4
        state = locks[first]._release_save()
        locks[second]._acquire_restore(state)
        locks.release(first)
        locks.release(second)
        with pytest.raises(NotOwnedError, match="<stripe"):
            locks.release(first)
        assert locks.acquire_many([first, second, "x"], timeout=0)
        locks.release_many([first, second, "x"])
        with rw.read(first), rw.read(second):
            assert rw.readers(first) == 1
        with rw.write(second):
            rw.acquire_read(first)
            rw.release_read(first)
        assert rw.acquire_write(first, timeout=0)
        rw.release_write(second)
    other = workers("other")
    other.run(lambda: locks.acquire(first))
    assert locks.acquire(second, timeout=0) is False
    other.run(lambda: locks.release(second))
    assert len(locks) == 0 and len(rw) == 0
    gc.collect()  # the errors' tracebacks (the pure twin's frames name the stripe)
    assert (_references(stripe), _references(rw_stripe)) == before


def test_a_striped_manager_freed_while_another_thread_holds_stripes(impl, workers) -> None:
    doomed = impl.RWLockManager(stripes=8)
    other = impl.LockManager(stripes=8)
    written, read = _two_keys_on_different_stripes(doomed)
    stripes = [doomed._table_key(written), doomed._table_key(read)]
    alone = [_references(stripe) for stripe in stripes]  # ours and the manager's
    holder = workers("holder")
    holder.run(lambda: doomed.acquire_write(written))
    holder.run(lambda: doomed.acquire_read(read))
    holder.run(lambda: other.acquire("kept"))
    ref = weakref.ref(doomed)
    del doomed
    gc.collect()
    assert ref() is None
    # The stripes outlive their manager as plain objects; its references to them are gone.
    assert [repr(stripe) for stripe in stripes] == [f"<stripe {int(s)}>" for s in stripes]
    assert [_references(stripe) for stripe in stripes] == [count - 1 for count in alone]
    # The holder's next section frees what it kept of the freed table; its keys elsewhere
    # are unaffected.
    assert holder.run(lambda: other.release_all()) == 1
    assert holder.run(lambda: other.acquire("kept", timeout=PATIENCE))
    holder.run(lambda: other.release("kept"))
    assert len(other) == 0
    assert [_references(stripe) for stripe in stripes] == [count - 1 for count in alone]


def test_a_thread_ending_with_stripes_of_a_freed_and_a_live_manager_warns_of_the_live(
        impl) -> None:
    live = impl.RWLockManager(stripes=4)
    stripe = live._table_key("left")
    before = _references(stripe)
    caught = end_holding_keys_of_a_freed_manager(lambda: impl.LockManager(stripes=4),
                                                 lambda: live.acquire_read("left"))
    assert len(caught) == 1 and repr(stripe) in str(caught[0].message)
    del caught
    gc.collect()
    assert _references(stripe) == before  # the warning's reference went with it
    assert len(live) == 0 and live.acquire_write("left", blocking=False)
    live.release_write("left")


def _two_keys_on_different_stripes(locks) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    first = "key-0"
    for i in range(1, 10_000):
        if locks.stripe_of(f"key-{i}") != locks.stripe_of(first):
            return first, f"key-{i}"
    raise AssertionError("every key shares a stripe")
