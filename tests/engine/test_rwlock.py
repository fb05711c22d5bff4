"""RWLockManager: shared/exclusive per key, reentrant, upgrades, FIFO without starvation."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import PATIENCE, abandoned_warnings, wait_until
from lockmgr import DeadlockError, LockStats, LockTimeout, NotOwnedError
from test_api import BAD_ACQUIRE_ARGS


@pytest.fixture
def rw(impl):  # type: ignore[no-untyped-def]
    return impl.RWLockManager()


def test_read_and_write_roundtrip(rw) -> None:
    assert rw.acquire_read("k") is True
    assert rw.readers("k") == 1 and not rw.write_locked("k") and "k" in rw and len(rw) == 1
    rw.release_read("k")
    assert rw.acquire_write("k") is True
    assert rw.readers("k") == 0 and rw.write_locked("k") and len(rw) == 1
    rw.release_write("k")
    assert len(rw) == 0 and "k" not in rw and rw.stats().held == 0
    assert repr(rw).startswith("<lockmgr.RWLockManager held=0 waiting=0 at 0x")


def test_many_readers_at_once_and_writers_excluded(rw, workers) -> None:
    readers = [workers(f"r{i}") for i in range(4)]
    for reader in readers:
        assert reader.run(lambda: rw.acquire_read("k", timeout=0)) is True
    assert rw.readers("k") == 4
    writer = workers("writer")
    assert writer.run(lambda: rw.acquire_write("k", timeout=0)) is False
    for reader in readers:
        reader.run(lambda: rw.release_read("k"))
    assert writer.run(lambda: rw.acquire_write("k", timeout=0)) is True
    assert readers[0].run(lambda: rw.acquire_read("k", timeout=0)) is False
    assert readers[0].run(lambda: rw.acquire_write("k", timeout=0)) is False
    writer.run(lambda: rw.release_write("k"))
    assert len(rw) == 0


def test_reentrant_counts_and_the_writer_may_read(rw) -> None:
    rw.acquire_read("k")
    rw.acquire_read("k")
    assert rw._read_count("k") == 2
    rw.acquire_write("k")  # the only reader upgrades at once
    rw.acquire_write("k")
    rw.acquire_read("k")  # a writer reads without blocking
    assert rw._read_count("k") == 3 and rw.write_locked("k")
    rw.release_write("k")
    rw.release_write("k")  # a downgrade: still reading
    assert not rw.write_locked("k") and rw.readers("k") == 1
    for _ in range(3):
        rw.release_read("k")
    assert len(rw) == 0
    with pytest.raises(NotOwnedError):
        rw.release_read("k")
    with pytest.raises(NotOwnedError):
        rw.release_write("k")


def test_downgrade_lets_waiting_readers_in(rw, workers) -> None:
    rw.acquire_write("k")
    rw.acquire_read("k")
    reader = workers("reader")
    queued = reader.submit(lambda: rw.acquire_read("k"))
    wait_until(lambda: rw.stats().waiting == 1, "the reader queued")
    rw.release_write("k")
    assert queued.result() is True and rw.readers("k") == 2
    reader.run(lambda: rw.release_read("k"))
    rw.release_read("k")
    assert len(rw) == 0


def test_upgrade_waits_for_other_readers_and_goes_first(rw, workers) -> None:
    upgrader, other_reader, writer = workers("upgrader"), workers("other"), workers("writer")
    upgrader.run(lambda: rw.acquire_read("k"))
    other_reader.run(lambda: rw.acquire_read("k"))
    writing = writer.submit(lambda: rw.acquire_write("k"))
    wait_until(lambda: rw.stats().waiting == 1, "the writer queued")
    upgrading = upgrader.submit(lambda: rw.acquire_write("k"))
    wait_until(lambda: rw.stats().waiting == 2, "the upgrade queued")
    other_reader.run(lambda: rw.release_read("k"))
    # The upgrade was queued last but goes first: it needs only the other reader gone.
    assert rw.write_locked("k") and rw.readers("k") == 1 and rw.stats().waiting == 1
    assert upgrading.result() is True
    upgrader.run(rw.release_all)
    assert writing.result() is True
    writer.run(lambda: rw.release_write("k"))
    assert len(rw) == 0


def test_an_upgrade_waits_until_every_other_reader_has_left(rw, workers) -> None:
    upgrader, first, second = workers("upgrader"), workers("first"), workers("second")
    for reader in (upgrader, first, second):
        reader.run(lambda: rw.acquire_read("k"))
    upgrading = upgrader.submit(lambda: rw.acquire_write("k"))
    wait_until(lambda: rw.stats().waiting == 1, "the upgrade queued")
    first.run(lambda: rw.release_read("k"))  # one other reader is still in
    assert not rw.write_locked("k") and rw.readers("k") == 2 and rw.stats().waiting == 1
    assert second.run(lambda: rw.acquire_read("k", timeout=0)) is True  # re-reading: at once
    second.run(lambda: rw.release_read("k"))
    assert not rw.write_locked("k") and rw.stats().waiting == 1
    second.run(lambda: rw.release_read("k"))
    assert rw.write_locked("k") and rw.readers("k") == 1 and rw.stats().waiting == 0
    assert upgrading.result() is True
    upgrader.run(lambda: rw.release_write("k"))
    assert not rw.write_locked("k") and rw.readers("k") == 1  # a downgrade: still reading
    upgrader.run(lambda: rw.release_read("k"))
    assert len(rw) == 0


def test_two_upgrading_readers_deadlock_the_second(rw, workers) -> None:
    first, second = workers("first"), workers("second")
    first.run(lambda: rw.acquire_read("k"))
    second.run(lambda: rw.acquire_read("k"))
    upgrading = first.submit(lambda: rw.acquire_write("k"))
    wait_until(lambda: rw.stats().waiting == 1, "the first upgrade queued")
    with pytest.raises(DeadlockError) as caught:
        second.run(lambda: rw.acquire_write("k", timeout=5))
    assert caught.value.cycle == [(second.thread.ident, "k"), (first.thread.ident, "k")]
    assert rw.stats().deadlocks == 1 and rw.readers("k") == 2
    second.run(lambda: rw.release_read("k"))
    assert upgrading.result() is True
    first.run(rw.release_all)
    assert len(rw) == 0


def test_new_reader_waits_behind_a_queued_writer(rw, workers) -> None:
    holder, writer, late = workers("holder"), workers("writer"), workers("late reader")
    holder.run(lambda: rw.acquire_read("k"))
    writing = writer.submit(lambda: rw.acquire_write("k"))
    wait_until(lambda: rw.stats().waiting == 1, "the writer queued")
    assert late.run(lambda: rw.acquire_read("k", timeout=0)) is False
    reading = late.submit(lambda: rw.acquire_read("k"))
    wait_until(lambda: rw.stats().waiting == 2, "the late reader queued")
    assert holder.run(lambda: rw.acquire_read("k", timeout=0)) is True  # re-reading never waits
    holder.run(lambda: rw.release_read("k"))
    holder.run(lambda: rw.release_read("k"))
    assert rw.write_locked("k") and rw.readers("k") == 0 and rw.stats().waiting == 1
    assert writing.result() is True
    writer.run(lambda: rw.release_write("k"))
    assert reading.result() is True
    late.run(lambda: rw.release_read("k"))
    assert len(rw) == 0


def test_readers_at_the_head_are_granted_together(rw, workers) -> None:
    rw.acquire_write("k")
    names = ["r1", "r2", "r3", "w", "r4"]
    calls = {}
    threads = {name: workers(name) for name in names}
    for count, name in enumerate(names, 1):
        take = rw.acquire_write if name == "w" else rw.acquire_read
        calls[name] = threads[name].submit(lambda take=take: take("k"))
        wait_until(lambda count=count: rw.stats().waiting == count, f"{name} queued")
    rw.release_write("k")
    for name in ("r1", "r2", "r3"):
        assert calls[name].result() is True
    assert rw.readers("k") == 3 and not rw.write_locked("k") and rw.stats().waiting == 2
    for name in ("r1", "r2", "r3"):
        threads[name].run(lambda: rw.release_read("k"))
    assert rw.write_locked("k") and rw.readers("k") == 0 and rw.stats().waiting == 1
    assert calls["w"].result() is True
    threads["w"].run(lambda: rw.release_write("k"))
    assert calls["r4"].result() is True
    threads["r4"].run(lambda: rw.release_read("k"))
    assert len(rw) == 0 and rw.stats().waiting == 0


def test_writer_is_not_starved_by_a_stream_of_readers(rw) -> None:
    """6 reader threads loop; a writer gets in once the readers present leave.

    Readers hold for ~1 ms, so a writer that is not starved gets in within milliseconds; the
    bound below only has to survive a loaded machine (the typical wait is the benchmark's
    business). A starved writer never gets in: readers keep overlapping."""
    stop = threading.Event()
    reads = [0] * 6

    def reader(index: int) -> None:
        while not stop.is_set():
            with rw.read("k"):
                reads[index] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    waits = []
    try:
        wait_until(lambda: all(reads), "every reader is reading")
        for _ in range(10):
            asked = time.monotonic()
            with rw.write("k", timeout=PATIENCE / 2):
                waits.append(time.monotonic() - asked)
                assert rw.readers("k") == 0
            before = sum(reads)
            wait_until(lambda before=before: sum(reads) > before + 6, "the readers went on")
    finally:
        stop.set()
        for thread in threads:
            thread.join(PATIENCE)
    assert max(waits) < PATIENCE / 4, waits
    assert len(rw) == 0


def test_read_write_context_managers_and_timeouts(rw, workers) -> None:
    with rw.read("k") as entered:
        assert entered is True and rw.readers("k") == 1
        with rw.read("k", timeout=0):
            assert rw._read_count("k") == 2
    with rw.write("k", timeout=1):
        assert rw.write_locked("k")
    other = workers("other")
    other.run(lambda: rw.acquire_write("k"))
    with pytest.raises(LockTimeout):
        with rw.read("k", timeout=0.01):
            pytest.fail("entered without the key")
    with pytest.raises(LockTimeout):
        with rw.write("k", timeout=0):
            pytest.fail("entered without the key")
    other.run(lambda: rw.release_write("k"))
    assert len(rw) == 0 and rw.stats().waiting == 0


@pytest.mark.parametrize("kwargs", BAD_ACQUIRE_ARGS, ids=repr)
def test_rw_argument_checking_mirrors_threading(rw, kwargs) -> None:
    with pytest.raises(Exception) as expected:
        threading.Lock().acquire(**kwargs)
    for acquire in (rw.acquire_read, rw.acquire_write):
        with pytest.raises(expected.type):
            acquire("k", **kwargs)
    with pytest.raises(ValueError):
        rw.read("k", timeout=-2)
    with pytest.raises(TypeError):
        rw.write([], timeout=None)
    assert rw.stats() == LockStats(0, 0, 0, 0, 0, 0)


def test_release_all_counts_keys_once(rw, workers) -> None:
    rw.acquire_read("a")
    rw.acquire_read("a")
    rw.acquire_write("b")
    rw.acquire_read("b")
    rw.acquire_write("c")
    assert rw.release_all() == 3
    assert len(rw) == 0


def test_read_write_deadlock_is_detected(rw, workers) -> None:
    first, second = workers("first"), workers("second")
    first.run(lambda: rw.acquire_write("A"))
    second.run(lambda: rw.acquire_write("B"))
    blocked = first.submit(lambda: rw.acquire_read("B"))
    wait_until(lambda: rw.stats().waiting == 1, "first waits to read B")
    with pytest.raises(DeadlockError):
        second.run(lambda: rw.acquire_read("A"))
    second.run(rw.release_all)
    assert blocked.result() is True
    assert first.run(rw.release_all) == 2


def test_a_reader_that_ends_is_released(rw) -> None:
    took, end = threading.Event(), threading.Event()

    def reader() -> None:
        rw.acquire_read("k")
        took.set()
        end.wait(PATIENCE)

    thread = threading.Thread(target=reader)
    writing = threading.Thread(target=lambda: (rw.acquire_write("k"), rw.release_write("k")),
                               daemon=True)
    # The reader starts inside the block: on a free-threaded 3.14 it runs in a copy of the
    # block's warnings context (conftest.abandoned_warnings says where the warning goes).
    with abandoned_warnings() as warned:
        thread.start()
        assert took.wait(PATIENCE)
        writing.start()
        wait_until(lambda: rw.stats().waiting == 1, "the writer queued")
        end.set()
        thread.join(PATIENCE)
    assert [str(w.message) for w in warned] == [
        f"thread {thread.name!r} (ident {thread.ident}) ended holding key 'k'; released it"]
    writing.join(PATIENCE)
    assert not writing.is_alive() and len(rw) == 0


@pytest.mark.parametrize("upgrading", [False, True], ids=["plain", "with-an-upgrade"])
def test_a_read_queued_behind_a_waiting_sets_read_is_a_deadlock_edge(rw, workers,
                                                                    upgrading) -> None:
    # The set waits for "c"; its read of the free key "b" heads b's queue, and a read queued
    # behind it waits for the whole set, though both are reads: closing that cycle is
    # refused at once (it waited for ever before), and the set then gets every key.
    first, second = workers("first"), workers("second")
    first.run(lambda: rw.acquire_write("c"))
    writes = ["c"]
    if upgrading:  # the set also upgrades a key its thread reads: that node heads its queue
        second.run(lambda: rw.acquire_read("a"))
        writes.append("a")
    waiting = second.submit(lambda: rw.acquire_many(reads=["b"], writes=writes))
    wait_until(lambda: rw.stats().waiting == 1, "the set waits for c")
    with pytest.raises(DeadlockError):
        first.run(lambda: rw.acquire_read("b", timeout=PATIENCE))
    assert rw.stats().waiting == 1 and rw.readers("b") == 0
    first.run(rw.release_all)
    assert waiting.result() is True
    assert second.run(rw.release_all) == (3 if upgrading else 2)
    assert len(rw) == 0


def test_an_upgrade_in_a_set_queued_before_a_waiting_request_is_a_deadlock_edge(
        rw, workers) -> None:
    # An upgrade goes before every request queued on its key, so a request already waiting
    # there waits for the upgrader from then on. T0 reads a and waits for {read b, read c}
    # behind T1's write of c; T2 reads b and asks to write a and b: it would wait for T0's
    # read of a, while T0's read of b waits behind T2's upgrade. Refused at once (both
    # waited for ever).
    t0, t1, t2 = workers("T0"), workers("T1"), workers("T2")
    t0.run(lambda: rw.acquire_read("a"))
    t2.run(lambda: rw.acquire_read("b"))
    t1.run(lambda: rw.acquire_write("c"))
    waiting = t0.submit(lambda: rw.acquire_many(reads=["b", "c"]))
    wait_until(lambda: rw.stats().waiting == 1, "T0 waits for c")
    with pytest.raises(DeadlockError):
        t2.run(lambda: rw.acquire_many(writes=["a", "b"], timeout=PATIENCE))
    t1.run(rw.release_all)
    assert waiting.result() is True
    assert t0.run(rw.release_all) == 3 and t2.run(rw.release_all) == 1
    assert len(rw) == 0


def test_an_upgrade_alone_queued_before_a_waiting_request_is_a_deadlock_edge(
        rw, workers) -> None:
    # The same with a single upgrade: T2 and T4 read b; T4 waits to write a, which T0
    # reads; T0 waits for {read b, read c} behind T1's write of c. T2 upgrading b waits
    # for T4, which waits for T0, whose read of b would wait behind T2's upgrade.
    t0, t1, t2, t4 = workers("T0"), workers("T1"), workers("T2"), workers("T4")
    t0.run(lambda: rw.acquire_read("a"))
    t2.run(lambda: rw.acquire_read("b"))
    t4.run(lambda: rw.acquire_read("b"))
    t1.run(lambda: rw.acquire_write("c"))
    sets = t0.submit(lambda: rw.acquire_many(reads=["b", "c"]))
    wait_until(lambda: rw.stats().waiting == 1, "T0 waits for c")
    writes = t4.submit(lambda: rw.acquire_write("a"))
    wait_until(lambda: rw.stats().waiting == 2, "T4 waits for a")
    with pytest.raises(DeadlockError):
        t2.run(lambda: rw.acquire_write("b", timeout=PATIENCE))
    t1.run(rw.release_all)
    assert sets.result() is True
    assert t0.run(rw.release_all) == 3
    assert writes.result() is True
    assert t4.run(rw.release_all) == 2 and t2.run(rw.release_all) == 1
    assert len(rw) == 0
