"""Shards of the compiled core's tables, and managers freed while other threads hold their keys.

A table is split into shards by key hash, each with its own mutex, so that threads using
different keys never touch the same memory (free-threaded builds: 64 shards by default;
with a GIL: 1). ``LOCKMGR_SHARDS`` sets the count. Holds of a freed manager that another
thread still has stay linked in that thread's lists (only it may change them while it runs
fast paths): the manager's keys are dropped at once, the rest is that thread's to free.
"""

from __future__ import annotations

import gc
import os
import queue
import subprocess
import sys
import threading
import tracemalloc
import weakref

import pytest

from lockmgr._tuning import FREE_THREADED_SHARDS, MAX_SHARDS, shards_per_table

from conftest import PATIENCE, end_holding_keys_of_a_freed_manager


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=PATIENCE * 3, env={**os.environ, **env})


@pytest.mark.parametrize("setting", [None, "", "1", "2", "64", str(MAX_SHARDS)])
@pytest.mark.parametrize("free_threaded", [True, False])
def test_shard_count_comes_from_the_setting_or_the_build(setting, free_threaded) -> None:
    default = FREE_THREADED_SHARDS if free_threaded else 1
    assert shards_per_table(setting, free_threaded) == (int(setting) if setting else default)


@pytest.mark.parametrize("setting", ["0", "3", "48", "-4", str(MAX_SHARDS * 2), "many", "1.0"])
def test_a_shard_count_that_is_not_a_power_of_two_up_to_the_limit_is_refused(setting) -> None:
    with pytest.raises(ValueError, match=f"LOCKMGR_SHARDS must be a power of two.*{setting!r}"):
        shards_per_table(setting, True)


@pytest.mark.compiled
def test_the_compiled_core_takes_its_shard_count_from_the_environment() -> None:
    sizes = {}
    for setting in ("1", "64"):
        done = _python("import lockmgr; print(lockmgr.LockManager().__sizeof__())",
                       LOCKMGR_SHARDS=setting)
        assert done.returncode == 0, done.stderr
        sizes[setting] = int(done.stdout)
    # Each shard has its own cache lines and buckets.
    assert sizes["64"] - sizes["1"] >= 63 * 128
    done = _python("import lockmgr._core", LOCKMGR_SHARDS="12")
    assert done.returncode == 1
    assert "ValueError: LOCKMGR_SHARDS must be a power of two from 1 to 1024, not '12'" in done.stderr


class Key:
    """A key whose lifetime a test can watch (hash and equality by name)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.name == self.name


def test_a_manager_freed_while_another_thread_holds_its_keys_drops_them_at_once(
        impl, workers) -> None:
    doomed = impl.RWLockManager()
    other = impl.LockManager()
    written, read, kept = Key("written"), Key("read"), Key("kept")
    refs = [weakref.ref(written), weakref.ref(read)]
    holder = workers("holder")
    holder.run(lambda: doomed.acquire_write(written))
    holder.run(lambda: doomed.acquire_read(read))
    holder.run(lambda: other.acquire(kept))
    del doomed, written, read
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    # The holder's lists still reach what it held there; its other keys are unaffected.
    assert holder.run(lambda: other.release_all()) == 1
    assert holder.run(lambda: other.acquire(kept, timeout=PATIENCE))
    holder.run(lambda: other.release(kept))
    assert len(other) == 0


def test_a_thread_that_ends_holding_keys_of_a_freed_manager_warns_only_of_live_ones(impl) -> None:
    live = impl.LockManager()
    caught = end_holding_keys_of_a_freed_manager(impl.LockManager, lambda: live.acquire("left"))
    assert len(caught) == 1 and "'left'" in str(caught[0].message)
    assert "'gone'" not in str(caught[0].message)
    assert len(live) == 0 and live.acquire("left", blocking=False)


@pytest.mark.parametrize("stripes", [None, 16], ids=["exact", "striped"])
def test_managers_freed_while_other_threads_run_fast_paths_on_theirs(impl, stripes) -> None:
    """Tearing a table down touches other threads' lists only through orphans: threads that
    keep taking and giving back keys (and keep keys of the managers being freed) while
    managers are freed lose nothing and crash nothing. Run apart: a bug here crashes.
    Striped: the compiled core's entries hold the stripes borrowed from their manager."""
    code = f"""
import gc, sys, threading, time
from {impl.__name__} import LockManager, RWLockManager
THREADS, ROUNDS, STRIPES = 4, 300, {stripes!r}
shared = LockManager(stripes=STRIPES)
doomed = [RWLockManager(stripes=STRIPES) for _ in range(ROUNDS)]
# Each thread's written key on a stripe of its own (striped: else one would wait forever).
written, used, i = [], {{doomed[0].stripe_of("r")}}, 0
while len(written) < THREADS:
    key, i = ("w", i), i + 1
    if STRIPES is None or doomed[0].stripe_of(key) not in used:
        written.append(key)
        used.add(doomed[0].stripe_of(key))
counts = [0] * THREADS
errors = []
start = threading.Barrier(THREADS + 1)

def churn(index):
    try:
        start.wait()
        for round in range(ROUNDS):
            manager = doomed[round]
            manager.acquire_write(written[index])  # left behind: an orphan once it is freed
            manager.acquire_read("r")
            for i in range(20):
                with shared[("k", index, i % 3)]:
                    counts[index] += 1
        shared.release_all()
    except BaseException as exc:
        errors.append(exc)

threads = [threading.Thread(target=churn, args=(i,)) for i in range(THREADS)]
for thread in threads:
    thread.start()
start.wait()
deadline = time.monotonic() + {PATIENCE}
for round in range(ROUNDS):                      # free each manager as soon as all used it
    while doomed[round].stats().acquisitions < 2 * THREADS and not errors:
        assert time.monotonic() < deadline, "the threads stopped making progress"
    doomed[round] = None
    gc.collect(0)
for thread in threads:
    thread.join()
assert not errors, errors
assert counts == [ROUNDS * 20] * THREADS, counts
assert len(shared) == 0 and shared.stats().waiting == 0
print("ok")
"""
    done = _python(code, PYTHONWARNINGS="ignore")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_pool_thread_holding_keys_of_freed_managers_does_not_accumulate_them(impl) -> None:
    """A worker that takes keys of managers another thread then frees (and never releases
    them) keeps nothing of those managers for long: its next acquisition frees what they
    left in its lists, so memory stays flat however many managers come and go."""
    jobs: queue.Queue[object] = queue.Queue()
    done: queue.Queue[None] = queue.Queue()

    def worker() -> None:
        while (manager := jobs.get()) is not None:
            manager.acquire_write("job")  # never released: an error path
            manager.acquire_read("read")
            done.put(None)
            del manager

    def managers_come_and_go(count: int) -> None:
        for _ in range(count):
            manager = impl.RWLockManager()
            jobs.put(manager)
            done.get(timeout=PATIENCE)
            del manager

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        managers_come_and_go(50)  # the worker's token, spare memory and caches
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            managers_come_and_go(2000)
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    finally:
        jobs.put(None)
        thread.join(PATIENCE)
    assert growth < 32 * 1024  # ~200 bytes per manager would be 400 KB
