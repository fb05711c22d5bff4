"""Every path at once, from several threads: singles, views, holds, sets, reads, writes,
upgrades, stripes, try-locks, timeouts, deadlocks and threads that end holding keys. Every
critical section checks mutual exclusion and makes a non-atomic update; afterwards no update
is lost, most operations succeeded, and nothing is held or queued. (The same mix ran clean
under valgrind memcheck on the compiled core.)

On a free-threaded CPython with the GIL off the threads really run at once, on as many cores
as there are: that is the run that matters most (``.ci/run``'s free-threaded job, and
``scripts/tsan.sh`` under ThreadSanitizer). There ``LOCKMGR_REQUIRE_NO_GIL=1`` makes the
test fail if the GIL is on — enabled by some import, or by ``PYTHON_GIL`` — since then the
run would prove nothing about parallel threads."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager

import pytest

from conftest import PATIENCE, abandoned_warnings
from lockmgr import DeadlockError, LockTimeout

KEYS = ["a", "b", "c", "d", 1, 2]
THREADS = 6
ROUNDS = 200
KINDS = ["many", "hold-many", "single", "view", "hold", "read", "rw-write", "rw-many",
         "striped", "striped-single"]

#: Set by the free-threaded CI job: the GIL must be off while the mix runs.
REQUIRE_NO_GIL = os.environ.get("LOCKMGR_REQUIRE_NO_GIL") == "1"


def gil_enabled() -> bool:
    """Whether the GIL is on (always, before 3.13 or on a build with one)."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


class Ledger:
    """Who is inside which critical section; overlaps and updates are counted, not assumed.

    Its own bookkeeping is under a plain lock, so it never races; the updates it checks are
    deliberately non-atomic (read, let other threads run, write) and only the manager under
    test protects them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.writers: Counter[tuple[str, object]] = Counter()
        self.readers: Counter[tuple[str, object]] = Counter()
        self.values: Counter[tuple[str, object]] = Counter()  # updated under the tested lock
        self.expected: Counter[tuple[str, object]] = Counter()
        self.overlaps: list[str] = []

    def enter(self, lock: tuple[str, object], write: bool) -> None:
        with self._guard:
            if write:
                self.writers[lock] += 1
                if self.writers[lock] > 1 or self.readers[lock]:
                    self.overlaps.append(f"writer on {lock} with {self.writers[lock] - 1} "
                                         f"writers and {self.readers[lock]} readers")
            else:
                self.readers[lock] += 1
                if self.writers[lock]:
                    self.overlaps.append(f"reader on {lock} with a writer")

    def leave(self, lock: tuple[str, object], write: bool) -> None:
        with self._guard:
            (self.writers if write else self.readers)[lock] -= 1

    def update(self, lock: tuple[str, object]) -> None:
        """The critical section's work: a lost update shows as a count short at the end."""
        value = self.values[lock]
        time.sleep(0)  # invite a switch inside the critical section
        self.values[lock] = value + 1
        with self._guard:
            self.expected[lock] += 1

    def inside(self, locks: list[tuple[str, object]], write: bool = True) -> None:
        for lock in locks:
            self.enter(lock, write)
        if write:
            for lock in locks:
                self.update(lock)
        else:
            time.sleep(0)
        for lock in locks:
            self.leave(lock, write)


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "unfair"])
def test_everything_at_once_keeps_exclusion_and_leaves_nothing_behind(impl, fair) -> None:
    if REQUIRE_NO_GIL:
        assert not gil_enabled(), "LOCKMGR_REQUIRE_NO_GIL=1 but the GIL is on: threads would not run at once"
    locks = impl.LockManager(fair=fair)
    rw = impl.RWLockManager()
    striped = impl.LockManager(stripes=4)
    ledger = Ledger()
    failures: list[BaseException] = []
    # Per thread, merged at the end: ``counter[key] += 1`` is a read and a write, which
    # threads running at once (no GIL) would interleave and lose.
    tried_by: list[Counter[tuple[str, bool]]] = [Counter() for _ in range(THREADS)]
    succeeded_by: list[Counter[tuple[str, bool]]] = [Counter() for _ in range(THREADS)]
    upgrade_deadlocks_by = [0] * THREADS

    def stripe(key: object) -> tuple[str, object]:
        return ("striped", striped.stripe_of(key))

    def body(index: int) -> None:
        rng = random.Random(index)
        tried, succeeded = tried_by[index], succeeded_by[index]
        try:
            for _ in range(ROUNDS):
                keys = rng.sample(KEYS, rng.randint(1, 3))
                # Mostly patient calls (they must succeed), some try-locks and short timeouts.
                timeout = rng.choice([0, 0.001, 0.01] + [PATIENCE] * 5)
                patient = timeout == PATIENCE
                kind = rng.choice(KINDS)
                tried[kind, patient] += 1

                def inside(holding: AbstractContextManager[object],
                           resources: list[tuple[str, object]]) -> None:
                    """Enter ``holding`` (a timed hold) and check exclusion; a short timeout
                    may give up, a patient one must not."""
                    try:
                        with holding:
                            ledger.inside(resources)
                        succeeded[kind, patient] += 1
                    except LockTimeout:
                        if patient:
                            raise

                if kind == "hold-many":
                    inside(locks.hold_many(keys, timeout=timeout), [("locks", key) for key in keys])
                elif kind == "view":  # a KeyLock: ``with`` waits forever, so only patiently
                    view = locks[keys[0]]
                    if patient:
                        with view:
                            ledger.inside([("locks", keys[0])])
                        succeeded[kind, patient] += 1
                    elif view.acquire(timeout=timeout) if timeout else view.acquire(False):
                        ledger.inside([("locks", keys[0])])
                        view.release()
                        succeeded[kind, patient] += 1
                elif kind == "hold":
                    inside(locks.hold(keys[0], timeout=timeout), [("locks", keys[0])])
                elif kind == "rw-write":
                    inside(rw.write(keys[0], timeout=timeout), [("rw", keys[0])])
                elif kind == "striped-single":
                    if striped.acquire(keys[0], timeout=timeout):
                        ledger.inside([stripe(keys[0])])
                        striped.release(keys[0])
                        succeeded[kind, patient] += 1
                elif kind == "many":
                    if locks.acquire_many(keys, timeout=timeout):
                        ledger.inside([("locks", key) for key in keys])
                        locks.release_many(keys)
                        succeeded[kind, patient] += 1
                elif kind == "single":
                    if locks.acquire(keys[0], timeout=timeout):
                        ledger.inside([("locks", keys[0])])
                        locks.release(keys[0])
                        succeeded[kind, patient] += 1
                elif kind == "read":
                    if rw.acquire_read(keys[0], timeout=timeout):
                        ledger.inside([("rw", keys[0])], write=False)
                        succeeded[kind, patient] += 1
                        if rng.random() < 0.5:
                            try:  # an upgrade: two readers upgrading at once is a deadlock
                                upgraded = rw.acquire_write(keys[0], timeout=timeout)
                            except DeadlockError:
                                upgrade_deadlocks_by[index] += 1
                                upgraded = False
                            if upgraded:
                                ledger.inside([("rw", keys[0])])
                                rw.release_write(keys[0])
                        rw.release_read(keys[0])
                elif kind == "rw-many":
                    reads, writes = keys[:1], keys[1:]
                    if rw.acquire_many(reads=reads, writes=writes, timeout=timeout):
                        ledger.inside([("rw", key) for key in reads], write=False)
                        ledger.inside([("rw", key) for key in writes])
                        rw.release_many(reads=reads, writes=writes)
                        succeeded[kind, patient] += 1
                else:
                    try:
                        with striped.hold_many(keys, timeout=timeout):
                            ledger.inside(list(dict.fromkeys(map(stripe, keys))))
                        succeeded[kind, patient] += 1
                    except LockTimeout:
                        if patient:
                            raise
            if index % 3 == 0:
                locks.acquire(("abandoned", index))  # this thread ends holding it
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(THREADS)]
    with abandoned_warnings() as warned:  # started inside: see conftest.abandoned_warnings
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + PATIENCE * 3
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    # One warning per thread that ended holding its ("abandoned", index) key.
    assert len(warned) == len(range(0, THREADS, 3)), [str(w.message) for w in warned]
    assert not failures, failures
    assert ledger.overlaps == [], ledger.overlaps[:5]
    assert ledger.values == ledger.expected, "lost updates"
    tried, succeeded = sum(tried_by, Counter()), sum(succeeded_by, Counter())
    upgrade_deadlocks = sum(upgrade_deadlocks_by)
    # Progress: patient calls (5 in 8) never fail, so most calls succeed.
    assert sum(tried.values()) == THREADS * ROUNDS
    assert all(succeeded[kind, True] == tried[kind, True] for kind, _ in tried), (tried, succeeded)
    assert sum(succeeded.values()) > 0.55 * THREADS * ROUNDS, (tried, succeeded)
    assert upgrade_deadlocks == rw.stats().deadlocks
    assert locks.stats().deadlocks == striped.stats().deadlocks == 0
    for manager in (locks, rw, striped):
        assert len(manager) == 0 and manager.stats().waiting == 0 and manager.stats().held == 0
    for manager in (locks, striped):
        assert manager.acquire("a", timeout=0) and manager.acquire_many(KEYS, timeout=0)
        manager.release_many(KEYS)
        manager.release("a")
    if REQUIRE_NO_GIL:  # still off: nothing the mix ran turned it back on
        assert not gil_enabled(), "the GIL was turned on while the mix ran"
