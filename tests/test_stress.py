"""Every path at once, from several threads: singles, sets, reads, upgrades, stripes, timeouts,
deadlocks and threads that end holding keys. Afterwards nothing may be held or queued.
(The same mix ran clean under valgrind memcheck on the compiled core.)"""

from __future__ import annotations

import random
import threading

import pytest

from conftest import PATIENCE
from lockmgr import AbandonedLockWarning, DeadlockError, LockTimeout


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "unfair"])
def test_everything_at_once_leaves_nothing_behind(impl, fair) -> None:
    locks = impl.LockManager(fair=fair)
    rw = impl.RWLockManager()
    striped = impl.LockManager(stripes=4)
    failures: list[BaseException] = []

    def body(index: int) -> None:
        rng = random.Random(index)
        try:
            for _ in range(200):
                keys = rng.sample(["a", "b", "c", "d", 1, 2], rng.randint(1, 3))
                choice = rng.random()
                try:
                    if choice < 0.2:
                        if locks.acquire_many(keys, timeout=rng.choice([0, 0.001, 0.01])):
                            locks.release_many(keys)
                    elif choice < 0.4:
                        if locks.acquire(keys[0], timeout=0.002):
                            locks.release(keys[0])
                    elif choice < 0.6:
                        if rw.acquire_read(keys[0], timeout=0.002):
                            if rng.random() < 0.5 and rw.acquire_write(keys[0], timeout=0.002):
                                rw.release_write(keys[0])
                            rw.release_read(keys[0])
                    elif choice < 0.8:
                        if rw.acquire_many(reads=keys[:1], writes=keys[1:], timeout=0.002):
                            rw.release_many(reads=keys[:1], writes=keys[1:])
                    else:
                        with striped.hold_many(keys, timeout=0.01):
                            pass
                except (DeadlockError, LockTimeout):
                    pass
            if index % 3 == 0:
                locks.acquire(("abandoned", index))  # this thread ends holding it
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(6)]
    with pytest.warns(AbandonedLockWarning):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(PATIENCE * 3)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    assert not failures, failures
    for manager in (locks, rw, striped):
        assert len(manager) == 0 and manager.stats().waiting == 0
