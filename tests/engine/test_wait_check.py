"""A thread waiting in a synchronous acquire runs its own wait check
(``lockmgr._owners.WAIT_CHECK``) after each slice of the wait, a task waiting in process
awaits its own (``TASK_WAIT_CHECK``) at its interval, and what a check raises ends the wait
with nothing queued or held. The PostgreSQL managers look for a deadlock through the server
there."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from types import ModuleType

import pytest

from conftest import PATIENCE, Worker
from lockmgr._owners import TASK_WAIT_CHECK, WAIT_CHECK


class Refused(Exception):
    pass


def with_check(check: Callable[[], object], call: Callable[[], bool]) -> bool:
    """``call()`` with ``check`` as the calling thread's wait check."""
    WAIT_CHECK.call = check
    try:
        return call()
    finally:
        WAIT_CHECK.call = None


WAITS = {
    # name: (make the manager, take what the waiter then waits for, the waiter's call, release)
    "one key": (lambda impl: impl.LockManager(), lambda m: m.acquire("k"),
                lambda m, t: m.acquire("k", timeout=t), lambda m: m.release("k")),
    "many keys": (lambda impl: impl.LockManager(), lambda m: m.acquire("k"),
                  lambda m, t: m.acquire_many(["j", "k"], timeout=t),
                  lambda m: m.release_many(["j", "k"])),
    "read": (lambda impl: impl.RWLockManager(), lambda m: m.acquire_write("k"),
             lambda m, t: m.acquire_read("k", timeout=t), lambda m: m.release_read("k")),
}


@pytest.fixture(params=sorted(WAITS))
def wait(request: pytest.FixtureRequest) -> tuple[Callable, ...]:  # type: ignore[type-arg]
    return WAITS[request.param]


def test_a_waiting_thread_runs_its_check_on_its_own_thread_until_granted(
        impl: ModuleType, wait: tuple[Callable, ...], workers: Callable[[str], Worker]) -> None:  # type: ignore[type-arg]
    make, take, call, release = wait
    manager = make(impl)
    take(manager)
    ran_on: set[int] = set()
    running = threading.Event()

    def check() -> None:
        ran_on.add(threading.get_ident())
        running.set()

    worker = workers("waiter")
    waiting = worker.submit(lambda: with_check(check, lambda: call(manager, PATIENCE)))
    assert running.wait(PATIENCE), "the waiting thread never ran its check"
    assert not waiting.done()
    manager.release_all()
    assert waiting.result() is True
    assert ran_on == {worker.thread.ident}
    worker.run(lambda: release(manager))
    assert len(manager) == 0


def test_what_the_check_raises_ends_the_wait_with_nothing_queued_or_held(
        impl: ModuleType, wait: tuple[Callable, ...], workers: Callable[[str], Worker]) -> None:  # type: ignore[type-arg]
    make, take, call, release = wait
    manager = make(impl)
    take(manager)

    def check() -> None:
        raise Refused

    worker = workers("waiter")
    with pytest.raises(Refused):  # an untimed wait ends only through its check
        worker.run(lambda: with_check(check, lambda: call(manager, -1)))
    assert all(not state.waiters for state in manager.snapshot())
    manager.release_all()
    assert len(manager) == 0
    assert worker.run(lambda: call(manager, 0)) is True  # nothing of the refused wait is in the way
    worker.run(lambda: release(manager))


#: Waits whose slices outlast the test: the waiter wakes only for a post (a grant) or at
#: its deadline, so whether the check runs after that wake-up is decided, not raced.
CHECK_AFTER_THE_WAIT_ENDS = """
import sys, threading
from lockmgr import _tuning
_tuning.MAIN_THREAD_SLICE = 600.0
import importlib
from lockmgr._owners import WAIT_CHECK
engine = importlib.import_module(sys.argv[1])
from lockmgr._pure import _operations
_operations._WAIT_SLICE = _tuning.MAIN_THREAD_SLICE  # imported with lockmgr, before the line above

class Refused(Exception):
    pass

def check():
    raise Refused("the check ran after the wait ended")

def wait_with_check(call):
    WAIT_CHECK.call = check
    try:
        outcome.append(call())
    except BaseException as error:
        outcome.append(error)
    finally:
        WAIT_CHECK.call = None
    if locks.owner("k") == threading.get_ident():
        outcome.append("kept")
        locks.release("k")

locks = engine.LockManager()
locks.acquire("k")
outcome = []
timed = threading.Thread(target=wait_with_check, args=(lambda: locks.acquire("k", timeout=0.2),))
timed.start()
timed.join(60)
print("timed out:", *outcome)
outcome.clear()
granted = threading.Thread(target=wait_with_check, args=(lambda: locks.acquire("k"),))
granted.start()
while locks.stats().waiting != 1:
    threading.Event().wait(0.001)
locks.release("k")
granted.join(60)
print("granted:", *outcome)
"""


def test_a_wait_that_ended_returns_without_running_the_check(impl: ModuleType) -> None:
    # The check runs only while the request still waits after its section: a wait that
    # timed out, or that the grant woke, returns without it (the twin ran it first, and a
    # check raising then gave the grant back).
    # LOCKMGR_NO_EXTENSIONS=1: importing lockmgr leaves the compiled core alone, so it reads
    # the slice the child sets when the child imports it.
    done = subprocess.run([sys.executable, "-c", CHECK_AFTER_THE_WAIT_ENDS, impl.__name__],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LOCKMGR_NO_EXTENSIONS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["timed out: False", "granted: True kept"]


def test_an_acquisition_that_does_not_wait_never_runs_the_check(
        impl: ModuleType, workers: Callable[[str], Worker]) -> None:
    locks = impl.LockManager()

    def check() -> None:
        raise Refused

    assert with_check(check, lambda: locks.acquire("k"))
    assert with_check(check, lambda: locks.acquire("k", timeout=PATIENCE))  # a re-entry
    other = workers("other")
    assert other.run(lambda: with_check(check, lambda: locks.acquire("k", blocking=False))) is False
    assert other.run(lambda: with_check(check, lambda: locks.acquire("k", timeout=0))) is False
    locks.release("k")
    locks.release("k")
    assert len(locks) == 0


# -- a task's wait: TASK_WAIT_CHECK, in the task's context --------------------------------------


def task_waiting_with_check(impl: ModuleType, workers: Callable[[str], Worker],
                            check: Callable[[], Awaitable[object]]) -> tuple[object, ModuleType]:
    """A task waits for "k", which a worker thread holds, with ``check`` as its wait check
    (every 10 ms): the worker releases "k" once the check ran twice. Returns what the
    acquisition returned or raised, and the manager."""
    locks = impl.LockManager()
    holder = workers("holder")
    holder.run(lambda: locks.acquire("k"))

    async def main() -> object:
        TASK_WAIT_CHECK.set((0.01, check))
        try:
            return await locks.aio.acquire("k")
        except Refused as refused:
            return refused
        finally:
            assert all(not state.waiters for state in locks.snapshot())

    try:
        return asyncio.run(asyncio.wait_for(main(), PATIENCE)), locks
    finally:
        holder.run(lambda: locks.release_all())


def test_a_waiting_task_awaits_its_check_until_granted(impl, workers) -> None:  # type: ignore[no-untyped-def]
    ran = threading.Semaphore(0)
    released: list[bool] = []

    async def check() -> None:
        ran.release()
        await asyncio.sleep(0)  # a coroutine: it may await

    def release_after_two_checks(locks: object) -> None:
        assert ran.acquire(timeout=PATIENCE) and ran.acquire(timeout=PATIENCE)
        locks.release("k")  # type: ignore[attr-defined]
        released.append(True)

    locks = impl.LockManager()
    holder = workers("holder")
    holder.run(lambda: locks.acquire("k"))
    releasing = holder.submit(lambda: release_after_two_checks(locks))

    async def main() -> bool:
        TASK_WAIT_CHECK.set((0.01, check))
        granted: bool = await locks.aio.acquire("k")
        locks.aio.release("k")
        return granted

    assert asyncio.run(asyncio.wait_for(main(), PATIENCE)) is True
    releasing.result()
    assert released == [True] and len(locks) == 0


def test_what_a_tasks_check_raises_ends_its_wait_with_nothing_queued_or_held(
        impl, workers) -> None:  # type: ignore[no-untyped-def]
    async def check() -> None:
        raise Refused

    outcome, locks = task_waiting_with_check(impl, workers, check)
    assert isinstance(outcome, Refused)
    assert len(locks) == 0  # type: ignore[arg-type]
