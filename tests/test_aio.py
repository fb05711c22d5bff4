"""asyncio tasks and threads on one lock table (``locks.aio``), on both engines."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import nullcontext
from typing import Any

import pytest

from conftest import (
    PATIENCE,
    Worker,
    abandoned_warnings,
    block_records,
    held_by_another_task,
    wait_until,
)
from lockmgr import (
    AsyncLockManager,
    AsyncRWLockManager,
    DeadlockError,
    LockTimeout,
    NotOwnedError,
)
from lockmgr._common import LOOP_THREAD


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` as the task of a fresh event loop, bounded in time."""
    async def bounded() -> Any:
        return await asyncio.wait_for(main(), PATIENCE)
    return asyncio.run(bounded())


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition`` (a real state: a queue length) holds."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.001)


def in_thread(func: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(func())
        except BaseException as error:  # handed to the test
            box.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


async def joined(thread: threading.Thread) -> None:
    await asyncio.to_thread(thread.join, PATIENCE)
    assert not thread.is_alive()


async def held_by_a_thread(locks: Any, key: object) -> tuple[threading.Thread, threading.Event]:
    """A thread holding ``key`` until the returned event is set."""
    holds, release = threading.Event(), threading.Event()

    def holder() -> None:
        with locks[key]:
            holds.set()
            release.wait(PATIENCE)

    thread, _ = in_thread(holder)
    await asyncio.to_thread(holds.wait, PATIENCE)
    return thread, release


# -- the API -----------------------------------------------------------------------------


def test_views_are_typed_per_manager_kind(impl) -> None:
    locks, rw = impl.LockManager(), impl.RWLockManager()
    assert isinstance(locks.aio, AsyncLockManager) and locks.aio.manager is locks
    assert isinstance(rw.aio, AsyncRWLockManager) and rw.aio.manager is rw
    assert isinstance(locks.aio["k"], impl.AsyncKeyLock) and locks.aio["k"].key == "k"


def test_a_task_owns_reentrantly_and_a_thread_is_another_owner(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        async with locks.aio["k"]:
            async with locks.aio.hold("k"):
                assert locks.aio.recursion_count("k") == 2
            assert locks.aio.owned("k") and locks.aio.recursion_count("k") == 1
            assert locks.owner("k") is asyncio.current_task()
            # The thread running this task's loop is a different owner.
            assert not locks.owned("k") and locks.recursion_count("k") == 0
            with pytest.raises(NotOwnedError):
                locks.release("k")
            assert locks.acquire("k", blocking=False) is False
            assert await asyncio.create_task(locks.aio.acquire("k", blocking=False)) is False
            assert "k" in locks and locks.locked("k") and locks.aio.locked("k")
            assert len(locks) == 1 == len(locks.aio) and "k" in locks.aio
        assert not locks.locked("k") and len(locks) == 0
        with pytest.raises(NotOwnedError):
            locks.aio.release("k")

    run(main)
    stats = locks.stats()
    assert (stats.held, stats.waiting, stats.acquisitions, stats.timeouts) == (0, 0, 2, 2)


def test_every_aio_method_outside_a_task_raises_runtime_error(impl) -> None:
    locks, rw = impl.LockManager(), impl.RWLockManager()
    for call in (lambda: locks.aio.owned("k"), lambda: locks.aio.recursion_count("k"),
                 lambda: locks.aio.release("k"), lambda: locks.aio.release_all(),
                 lambda: locks.aio.release_many(["k"]), lambda: rw.aio.release_read("k"),
                 lambda: rw.aio.owned("k")):
        with pytest.raises(RuntimeError, match="asyncio task"):
            call()
    for coroutine in (locks.aio.acquire("k"), locks.aio.acquire_many(["k"]),
                      locks.aio["k"].acquire(), rw.aio.acquire_read("k")):
        with pytest.raises(RuntimeError, match="asyncio task"):
            coroutine.send(None)
        coroutine.close()
    assert len(locks) == 0 and len(rw) == 0


def test_bad_arguments_raise_as_the_sync_api_does_and_change_nothing(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        for kwargs, error in (({"blocking": False, "timeout": 1}, ValueError),
                              ({"timeout": -2}, ValueError), ({"timeout": float("nan")}, ValueError),
                              ({"timeout": "1"}, TypeError)):
            with pytest.raises(error):
                await locks.aio.acquire("k", **kwargs)
            with pytest.raises(error):
                locks.acquire("k", **kwargs)
        with pytest.raises(TypeError):
            await locks.aio.acquire(["unhashable"])
        with pytest.raises(TypeError):
            await locks.aio.acquire_many("ab")
        with pytest.raises(TypeError):
            locks.aio.hold("k", timeout="x")
        with pytest.raises(TypeError):
            locks.aio.synchronized(42)

    run(main)
    assert locks.stats().acquisitions == 0 and len(locks) == 0


# -- one queue for tasks and threads ---------------------------------------------------------


def test_tasks_and_threads_queue_fifo_on_one_key(impl) -> None:
    locks = impl.LockManager()  # fair: a release hands the key to the oldest waiter
    order: list[str] = []

    async def main() -> None:
        async def task(name: str) -> None:
            async with locks.aio[("k",)]:
                order.append(name)

        def thread_body() -> None:
            with locks[("k",)]:
                order.append("thread")

        await locks.aio.acquire(("k",))
        first = asyncio.create_task(task("task 1"))
        await until(lambda: locks.stats().waiting == 1, "task 1 waits")
        thread, box = in_thread(thread_body)
        await until(lambda: locks.stats().waiting == 2, "the thread waits")
        second = asyncio.create_task(task("task 2"))
        await until(lambda: locks.stats().waiting == 3, "task 2 waits")
        locks.aio.release(("k",))
        await asyncio.gather(first, second)
        await joined(thread)
        assert box == [None]

    run(main)
    assert order == ["task 1", "thread", "task 2"]
    assert locks.stats().contended == 3 and len(locks) == 0


def test_a_release_hands_the_key_to_a_waiting_task_before_it_returns(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        await locks.aio.acquire("k")
        waiter = asyncio.create_task(locks.aio.acquire("k"))
        await until(lambda: locks.stats().waiting == 1, "the task waits")
        locks.aio.release("k")
        # Handed over: neither this task nor a thread can take it now.
        assert locks.locked("k") and locks.owner("k") is waiter
        assert locks.acquire("k", blocking=False) is False
        assert await waiter is True  # ended holding it: its done-callback released it
        await until(lambda: not locks.locked("k"), "the ended task's key is released")

    with abandoned_warnings() as caught:
        run(main)
    assert len(locks) == 0 and len(caught) == 1
    assert str(caught[0].message).endswith("ended holding key 'k'; released it")


def test_a_waiting_task_never_blocks_its_loop(impl) -> None:
    locks = impl.LockManager()
    ticks = 0

    async def main() -> None:
        nonlocal ticks
        thread, release = await held_by_a_thread(locks, "k")
        waiter = asyncio.create_task(locks.aio.acquire("k"))
        await until(lambda: locks.stats().waiting == 1, "the task waits")
        for _ in range(20):
            await asyncio.sleep(0)
            ticks += 1
        release.set()  # a grant from another thread wakes the loop
        assert await waiter is True
        await joined(thread)
        await asyncio.sleep(0)  # the waiter's done-callback releases the key

    with abandoned_warnings():
        run(main)
    assert ticks == 20 and len(locks) == 0


def test_unfair_managers_grant_waiting_tasks_and_threads_eventually(impl) -> None:
    locks = impl.LockManager(fair=False)
    counter = {"n": 0}

    async def main() -> None:
        async def task() -> None:
            for _ in range(50):
                async with locks.aio["k"]:
                    n = counter["n"]
                    await asyncio.sleep(0)
                    counter["n"] = n + 1

        def thread_body() -> None:
            for _ in range(50):
                with locks["k"]:
                    n = counter["n"]
                    time.sleep(0)
                    counter["n"] = n + 1

        threads = [in_thread(thread_body)[0] for _ in range(2)]
        await asyncio.gather(*(task() for _ in range(4)))
        for thread in threads:
            await joined(thread)

    run(main)
    assert counter["n"] == 300 and len(locks) == 0 and locks.stats().waiting == 0


# -- cancellation and timeouts -----------------------------------------------------------------


def test_a_cancelled_waiting_task_leaves_the_queue_with_nothing(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        await locks.aio.acquire("k")
        waiter = asyncio.create_task(locks.aio.acquire("k"))
        await until(lambda: locks.stats().waiting == 1, "the task waits")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert locks.stats().waiting == 0 and locks.owner("k") is asyncio.current_task()
        locks.aio.release("k")
        assert not locks.locked("k")

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("next_waiter", ["task", "thread"])
def test_a_grant_that_raced_a_cancellation_goes_to_the_next_waiter(impl, next_waiter) -> None:
    """As asyncio.Lock: the key was handed to a task that was cancelled before it ran; the
    task raises CancelledError and the key goes on, never lost, never left locked."""
    locks = impl.LockManager()
    got: list[str] = []

    async def main() -> None:
        await locks.aio.acquire("k")
        cancelled = asyncio.create_task(locks.aio.acquire("k"))
        await until(lambda: locks.stats().waiting == 1, "the first waiter waits")
        if next_waiter == "task":
            async def follow() -> None:
                async with locks.aio["k"]:
                    got.append("task")
            following = asyncio.create_task(follow())
        else:
            thread, box = in_thread(lambda: (locks.acquire("k"), got.append("thread"),
                                             locks.release("k")))
        await until(lambda: locks.stats().waiting == 2, "the next waiter waits")
        locks.aio.release("k")  # handed to ``cancelled``, which has not run yet
        assert locks.owner("k") is cancelled
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        if next_waiter == "task":
            await following
        else:
            await joined(thread)
            assert box == [(True, None, None)]

    run(main)
    assert got == [next_waiter]
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_timeouts_give_up_and_leave_nothing_queued(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        async def other(call: Callable[[], Awaitable[Any]]) -> Any:
            return await call()

        await locks.aio.acquire("k")
        assert await asyncio.create_task(other(lambda: locks.aio.acquire("k", timeout=0.05))) is False
        with pytest.raises(LockTimeout) as raised:
            await asyncio.create_task(other(lambda: locks.aio.hold("k", timeout=0.05).__aenter__()))
        assert isinstance(raised.value, TimeoutError)
        with pytest.raises(LockTimeout):
            await asyncio.create_task(other(lambda: locks.aio.hold_many(["j", "k"], timeout=0.05).__aenter__()))
        assert not locks.locked("j")
        if sys.version_info >= (3, 11):
            async def bounded() -> None:
                async with asyncio.timeout(0.05):
                    await locks.aio.acquire("k")
            with pytest.raises(TimeoutError):
                await asyncio.create_task(bounded())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.create_task(other(lambda: locks.aio.acquire("k"))), 0.05)
        assert locks.stats().waiting == 0
        locks.aio.release("k")

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_a_task_that_ends_holding_keys_releases_them_with_a_warning(impl) -> None:
    locks, rw = impl.LockManager(), impl.RWLockManager()

    async def main() -> None:
        async def forgetful() -> None:
            await locks.aio.acquire("a")
            await locks.aio.acquire("a")
            await rw.aio.acquire_read("b")

        task = asyncio.create_task(forgetful(), name="forgetful")
        waiter, box = in_thread(lambda: (locks.acquire("a", timeout=PATIENCE), locks.release("a")))
        await task
        await joined(waiter)
        assert box == [(True, None)]

    with abandoned_warnings() as caught:
        run(main)
    assert sorted(str(w.message) for w in caught) == [
        "task 'forgetful' ended holding key 'a'; released it",
        "task 'forgetful' ended holding key 'b'; released it",
    ]
    assert not rw.readers("b") and len(rw) == 0


# -- deadlocks ---------------------------------------------------------------------------------


def test_a_cycle_of_tasks_is_a_deadlock_error(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        first_waits = asyncio.Event()

        async def first() -> None:
            async with locks.aio["a"]:
                await until(lambda: locks.locked("b"), "the second holds b")
                first_waits.set()
                async with locks.aio["b"]:
                    pass

        async def second() -> None:
            async with locks.aio["b"]:
                await first_waits.wait()
                await until(lambda: locks.stats().waiting == 1, "the first waits for b")
                with pytest.raises(DeadlockError) as raised:
                    await locks.aio.acquire("a")
                assert raised.value.cycle == [(asyncio.current_task(), "a"), (one, "b")]

        one = asyncio.create_task(first(), name="one")
        await asyncio.gather(one, second())

    run(main)
    assert locks.stats().deadlocks == 1 and len(locks) == 0


def test_a_cycle_of_a_task_and_a_thread_is_a_deadlock_error(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        await locks.aio.acquire("a")
        thread_holds = threading.Event()

        def thread_body() -> None:
            with locks["b"]:
                thread_holds.set()
                locks.acquire("a")  # waits for this task
                locks.release("a")

        thread, box = in_thread(thread_body)
        await asyncio.to_thread(thread_holds.wait, PATIENCE)
        await until(lambda: locks.stats().waiting == 1, "the thread waits for a")
        with pytest.raises(DeadlockError) as raised:
            await locks.aio.acquire("b")
        assert raised.value.cycle == [(asyncio.current_task(), "b"), (thread.ident, "a")]
        locks.aio.release("a")
        await joined(thread)
        assert box == [None]

    run(main)
    assert len(locks) == 0


def test_a_loop_thread_blocking_on_a_key_of_its_own_task_is_a_deadlock_error(impl) -> None:
    """The task can never run again to release it: the sync acquire fails at once."""
    locks = impl.LockManager()

    async def main() -> None:
        async def holder() -> None:
            async with locks.aio["k"]:
                await asyncio.sleep(PATIENCE)

        task = asyncio.create_task(holder(), name="holder")
        await until(lambda: locks.locked("k"), "the task holds k")
        with pytest.raises(DeadlockError) as raised:
            locks.acquire("k")  # a blocking call on the loop's own thread
        assert raised.value.cycle == [(threading.get_ident(), "k"), (task, LOOP_THREAD)]
        assert "waits for its event loop's thread" in str(raised.value)
        assert locks.acquire("k", timeout=0) is False  # a try-lock never waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main)
    assert len(locks) == 0


# -- many loops, many keys, RW -------------------------------------------------------------------


def test_several_event_loops_in_several_threads_at_once(impl) -> None:
    locks = impl.LockManager()
    counters = {key: 0 for key in range(5)}

    def loop_thread() -> None:
        async def bump(key: int) -> None:
            for _ in range(20):
                async with locks.aio.hold(key):
                    value = counters[key]
                    await asyncio.sleep(0)
                    counters[key] = value + 1

        async def main() -> None:
            await asyncio.gather(*(bump(i % 5) for i in range(10)))

        run(main)

    def plain_thread() -> None:
        for i in range(100):
            with locks.hold(i % 5):
                value = counters[i % 5]
                time.sleep(0)
                counters[i % 5] = value + 1

    threads = [threading.Thread(target=loop_thread) for _ in range(3)]
    threads.append(threading.Thread(target=plain_thread))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
        assert not thread.is_alive()
    assert sum(counters.values()) == 3 * 10 * 20 + 100
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_acquire_many_is_atomic_across_tasks_and_threads_and_cancellable(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        thread, release = await held_by_a_thread(locks, "b")
        waiting = asyncio.create_task(locks.aio.acquire_many(["a", "b", "c"]))
        await until(lambda: locks.stats().waiting == 1, "the set waits")
        assert not locks.locked("a") and not locks.locked("c")  # all or nothing
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert locks.stats().waiting == 0
        async with locks.aio.hold_many(["a", "c"]):
            assert locks.aio.owned("a") and locks.aio.owned("c")
        async def grab() -> bool:
            got = await locks.aio.acquire_many(["c", "b", "a"], timeout=PATIENCE)
            assert all(locks.owner(key) is asyncio.current_task() for key in "abc")
            locks.aio.release_many(["a", "b", "c"])
            return got

        getting = asyncio.create_task(grab())
        await until(lambda: locks.stats().waiting == 1, "the set waits again")
        release.set()
        assert await getting is True
        await joined(thread)

    run(main)
    assert len(locks) == 0


def test_rw_views_share_reads_among_tasks_and_threads(impl) -> None:
    rw = impl.RWLockManager()

    async def main() -> None:
        async with rw.aio.read("k"):
            assert rw.acquire_read("k", blocking=False)  # a thread reads beside the task
            assert rw.readers("k") == 2 == rw.aio.readers("k")
            rw.release_read("k")
            writes, written = asyncio.Event(), asyncio.Event()

            async def write() -> None:
                async with rw.aio.write("k"):
                    writes.set()
                    await written.wait()

            writer = asyncio.create_task(write())
            await until(lambda: rw.stats().waiting == 1, "the writer waits")
            assert not rw.acquire_read("k", blocking=False)  # FIFO: behind the writer
            assert rw.aio.owned("k") and rw.aio.recursion_count("k") == 0
        await writes.wait()
        assert rw.write_locked("k") and rw.aio.write_locked("k")
        with pytest.raises(NotOwnedError):
            rw.aio.release_write("k")  # the writer task holds it, not this one
        written.set()
        await writer
        async with rw.aio.hold_many(reads=["r"], writes=["w"]):
            assert rw.readers("r") == 1 and rw.write_locked("w")
        assert await rw.aio.acquire_write("k")
        assert await asyncio.create_task(
            rw.aio.acquire_many(reads=["k"], blocking=False)) is False
        assert rw.aio.release_all() == 1

    run(main)
    assert len(rw) == 0


def test_release_all_releases_only_the_current_tasks_keys(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        await locks.aio.acquire("a")
        await locks.aio.acquire("a")
        await locks.aio.acquire_many(["b", "c"])
        assert locks.acquire("t")
        assert locks.aio.release_all() == 3
        assert locks.owned("t") and not locks.locked("a")
        locks.release("t")

    run(main)
    assert len(locks) == 0


def test_striped_managers_lock_stripes_for_tasks(impl) -> None:
    locks = impl.LockManager(stripes=1)

    async def main() -> None:
        async with locks.aio["a"]:
            assert locks.locked("b")  # the same stripe
            assert await asyncio.create_task(locks.aio.acquire("b", blocking=False)) is False

    run(main)
    assert len(locks) == 0


def test_synchronized_coroutines_hold_their_key_per_call(impl) -> None:
    locks = impl.LockManager()
    inside: list[int] = []

    @locks.aio.synchronized(lambda account, amount: f"account:{account}")
    async def deposit(account: int, amount: int) -> int:
        inside.append(account)
        assert locks.locked(f"account:{account}")
        await asyncio.sleep(0)
        inside.remove(account)
        return amount

    async def main() -> None:
        results = await asyncio.gather(*(deposit(i % 2, i) for i in range(6)))
        assert results == list(range(6)) and inside == []

    run(main)
    assert deposit.__name__ == "deposit" and len(locks) == 0
    with pytest.raises(TypeError, match="coroutine function"):
        locks.aio.synchronized(lambda: "k")(lambda: None)
    with pytest.raises(TypeError):
        locks.synchronized(lambda: "k")(deposit)  # the sync decorator refuses coroutines


class SlowKey:
    """A key whose equality is Python code: compared outside the table's sections."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlowKey) and other.name == self.name


def test_keys_compared_in_python_work_for_tasks(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        async with locks.aio[SlowKey("a")]:
            assert locks.aio.owned(SlowKey("a")) and not locks.aio.owned(SlowKey("b"))
            async with locks.aio[SlowKey("b")]:  # the same hash, another key
                waiter = asyncio.create_task(locks.aio.acquire(SlowKey("a")))
                await until(lambda: locks.stats().waiting == 1, "an equal key waits")
        assert await waiter is True
        await until(lambda: len(locks) == 0, "the ended waiter's key is released")

    with abandoned_warnings():
        run(main)


def test_a_coroutine_closed_while_it_waits_leaves_the_queue(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        task, done = await held_by_another_task(locks, "k")
        waiting = locks.aio.acquire("k")  # driven by hand inside this task, then dropped
        waiting.send(None)
        assert locks.stats().waiting == 1
        waiting.close()  # GeneratorExit at its await: the request leaves
        assert locks.stats().waiting == 0
        done.set()
        await task
        assert await locks.aio.acquire("k", blocking=False)
        locks.aio.release("k")

    run(main)
    assert len(locks) == 0


CHILD = """
import asyncio, os, signal, sys, threading
sys.path.insert(0, {tests!r})
import importlib
impl = importlib.import_module({module!r})
locks = impl.LockManager()
holds = threading.Event()
stop = threading.Event()

def holder():
    with locks["k"]:
        holds.set()
        stop.wait(20)

thread = threading.Thread(target=holder)
thread.start()
holds.wait(20)

async def waits():
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, os.kill, os.getpid(), signal.SIGINT)  # Ctrl-C while it waits
    await locks.aio.acquire("k")

try:
    asyncio.run(waits())
except KeyboardInterrupt:
    print("interrupted", locks.stats().waiting)

# A loop closed while one of its tasks waits: that task can never run again, so the grant
# that finds its loop closed ends it as its done-callback would.
async def holds_then_waits():
    await locks.aio.acquire("j")
    await locks.aio.acquire("k")

loop = asyncio.new_event_loop()
task = loop.create_task(holds_then_waits(), name="stranded")
loop.run_until_complete(asyncio.sleep(0.01))
loop.close()
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    stop.set()
    thread.join()
print("after the closed loop", locks.locked("k"), locks.locked("j"), locks.stats().waiting)
for message in sorted(str(w.message) for w in caught):
    print(message)
"""


@pytest.mark.parametrize("module", ["lockmgr._core", "lockmgr._pure"])
def test_ctrl_c_and_a_closed_loop_in_a_subprocess(module) -> None:
    import os
    import subprocess
    code = CHILD.format(tests=os.path.dirname(__file__), module=module)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=PATIENCE * 3)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "interrupted 0", "after the closed loop False False 0",
        "task 'stranded' ended holding key 'j'; released it"]


ACQUIRING_STYLES = {
    "acquire": lambda locks: locks.aio.acquire("k"),
    "async-with": lambda locks: _entered(locks.aio["k"]),
    "hold": lambda locks: _entered(locks.aio.hold("k", timeout=PATIENCE)),
    "hold_many": lambda locks: _entered(locks.aio.hold_many(["k", "j"])),
}


async def _entered(manager: Any) -> None:
    async with manager:
        raise AssertionError("entered although the wait was interrupted")


@pytest.mark.parametrize("style", list(ACQUIRING_STYLES))
def test_an_exception_between_queueing_and_waiting_leaves_nothing_queued(impl, style) -> None:
    """A signal handler may raise at the first check point after the queueing call returns
    (simulated with a trace function at ``_wait_for_grant``'s start): the request leaves."""
    locks = impl.LockManager()

    def tracer(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "_wait_for_grant":
            sys.settrace(None)
            raise KeyboardInterrupt("a handler's exception at the first check point")

    async def main() -> None:
        task, done = await held_by_another_task(locks, "k")
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                await ACQUIRING_STYLES[style](locks)
        finally:
            sys.settrace(None)
        assert locks.stats().waiting == 0 and not locks.locked("j")
        done.set()
        await task

    run(main)
    assert len(locks) == 0


def test_a_task_done_without_awaiting_its_entered_wait_leaves_the_queue(impl) -> None:
    """``__aenter__`` queues at once; a task that never awaits what it answered (an
    exception came in between) leaves the queue when it is done, with nothing held."""
    locks = impl.LockManager()

    async def main() -> None:
        task, done = await held_by_another_task(locks, "k")

        async def enters_and_drops() -> None:
            locks.aio["k"].__aenter__()  # queued; never awaited

        await asyncio.create_task(enters_and_drops())
        await until(lambda: locks.stats().waiting == 0, "the done task's request left")
        done.set()
        await task
        assert not locks.locked("k")

    run(main)
    assert len(locks) == 0


def test_a_stranded_wait_leaves_the_queue_at_the_tasks_next_acquisition(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        task, done = await held_by_another_task(locks, "k")
        entered = locks.aio["k"].__aenter__()  # queued; dropped unawaited, as after an error
        assert locks.stats().waiting == 1
        del entered
        assert await locks.aio.acquire("j")  # the task moves on: its stranded request leaves
        assert locks.stats().waiting == 0
        locks.aio.release("j")
        done.set()
        await task
        assert not locks.locked("k") and not locks.aio.owned("k")

    run(main)
    assert len(locks) == 0


def test_a_wait_is_awaited_once(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        task, done = await held_by_another_task(locks, "k")
        entered = locks.aio["k"].__aenter__()
        asyncio.get_running_loop().call_soon(done.set)
        assert await entered is True
        with pytest.raises(RuntimeError, match="awaited already"):
            await entered
        assert locks.aio.recursion_count("k") == 1
        locks.aio.release("k")
        await task

    run(main)
    assert len(locks) == 0


def test_key_views_can_be_made_directly_and_keep_no_loop_alive(impl) -> None:
    import gc
    import weakref
    locks = impl.LockManager()

    async def main() -> None:
        async with impl.AsyncKeyLock(locks, "k") as got:
            assert got is True and locks.aio.owned("k")
        return None

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None, "the closed loop is still referenced"
    assert len(locks) == 0


def test_each_loop_a_thread_runs_has_its_own_tasks(impl) -> None:
    """The current task is looked up per running loop: a loop stopped and started again, or
    another loop run in between on the same thread, never lends its tasks to the other."""
    locks = impl.LockManager()
    loop = asyncio.new_event_loop()
    holds, done = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with locks.aio["k"]:
            holds.set()
            await done.wait()

    async def other_loop() -> tuple[bool, bool]:
        return locks.aio.owned("k"), await locks.aio.acquire("k", blocking=False)

    async def release() -> None:
        done.set()
        await holding

    try:
        holding = loop.create_task(holder())
        loop.run_until_complete(holds.wait())
        with pytest.raises(RuntimeError):  # no loop runs here now
            locks.aio.owned("k")
        assert asyncio.run(other_loop()) == (False, False)
        loop.run_until_complete(release())
    finally:
        loop.close()
    assert len(locks) == 0


FORK_CHILD = """
import asyncio, os, sys
sys.path.insert(0, {tests!r})
import importlib
impl = importlib.import_module({module!r})
locks = impl.LockManager()

def answer(call):
    try:
        return repr(call())
    except RuntimeError:
        return "RuntimeError"

async def main():
    await locks.aio.acquire("k")
    pid = os.fork()
    if pid == 0:  # the child: whatever asyncio says about its task, aio says too
        asyncio_says = answer(lambda: asyncio.current_task() is not None)
        aio_says = answer(lambda: locks.aio.recursion_count("k") >= 0)
        os._exit(0 if asyncio_says.replace("True", "ok") == aio_says.replace("True", "ok") else 3)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
    locks.aio.release("k")

asyncio.run(main())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.parametrize("module", ["lockmgr._core", "lockmgr._pure"])
def test_a_forked_child_finds_its_task_as_asyncio_does(module) -> None:
    import subprocess
    code = FORK_CHILD.format(tests=os.path.dirname(__file__), module=module)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=PATIENCE * 3)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["child 0"]


def test_a_queued_wait_dropped_in_a_reference_cycle_is_left_safely(impl) -> None:
    """A task's coroutine dropped mid-wait and collected by the garbage collector: its
    request leaves the queue (the owner keeps the wait until it is left)."""
    import gc
    locks = impl.LockManager()

    async def main() -> None:
        task, done = await held_by_another_task(locks, "k")
        waiting = locks.aio.acquire("k")
        waiting.send(None)
        cycle = [waiting]
        cycle.append(cycle)  # only the collector frees it
        del waiting, cycle
        gc.collect()
        assert locks.stats().waiting == 0
        done.set()
        await task
        assert await locks.aio.acquire("k", blocking=False)
        locks.aio.release("k")

    run(main)
    assert len(locks) == 0


# -- a block's exit acts for the task that entered it ------------------------------------------
# A task stranded on a closed loop (asyncio.run's shutdown cut short by a second Ctrl-C) is
# ended by lockmgr: its keys go to others. Its coroutine is closed later (by the garbage
# collector, or anyone), and the GeneratorExit runs the ``__aexit__`` of each block it was
# inside, in whatever task is current then (or none): those exits release nothing.

BLOCKS: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    # style: the manager's class, and the block holding "k" given the manager and the one
    # block object shared by every task of the test (see _shared)
    "aio[key]": ("LockManager", lambda locks, shared: locks.aio["k"]),
    "one shared aio[key]": ("LockManager", lambda locks, shared: shared),
    "hold": ("LockManager", lambda locks, shared: locks.aio.hold("k")),
    "hold_many": ("LockManager", lambda locks, shared: locks.aio.hold_many(["k", "j"])),
    # (the stranded task's block is a call of an aio.synchronized function; the others hold)
    "synchronized": ("LockManager", lambda locks, shared: locks.aio.hold("k")),
    "read": ("RWLockManager", lambda locks, shared: locks.aio.read("k")),
    "write": ("RWLockManager", lambda locks, shared: locks.aio.write("k")),
    # one hold()/read() object used by every task, as an asyncio.Lock is
    "one shared hold": ("LockManager", lambda locks, shared: shared),
    "one shared read": ("RWLockManager", lambda locks, shared: shared),
}


def _shared(locks: Any, style: str) -> Any:
    """The one block object of "k" that every task of a test of ``style`` shares."""
    if style == "one shared hold":
        return locks.aio.hold("k")
    if style == "one shared read":
        return locks.aio.read("k")
    return None if _is_rw(locks) else locks.aio["k"]


def _reads(style: str) -> bool:
    return style in ("read", "one shared read")


def _is_rw(locks: Any) -> bool:
    return isinstance(locks.aio, AsyncRWLockManager)


def _holding_k_then_waiting_for_x(locks: Any, style: str,
                                  shared: Any) -> Coroutine[Any, Any, None]:
    """A coroutine that holds "k" in a block of ``style``, then waits for "x"."""
    take_x = locks.aio.acquire_write if _is_rw(locks) else locks.aio.acquire
    if style == "synchronized":  # the block is the decorated call itself
        @locks.aio.synchronized(lambda: "k")
        async def locked_call() -> None:
            await take_x("x")
        return locked_call()

    async def in_block() -> None:
        async with BLOCKS[style][1](locks, shared):
            await take_x("x")
    return in_block()


def _stranded_and_ended(impl: Any, style: str, ending: str,
                        enters_after_a_wait: bool = False) -> tuple[Any, Any, Any]:
    """A manager, its shared aio["k"] view (None for RW), and a task that held "k" in a
    block of ``style`` (``enters_after_a_wait``: granted once a thread released "k") and
    waited for "x" (held by a thread) when its loop was closed, then was ended by lockmgr:
    by the grant of "x" that found its loop closed, or by ``end_stranded_task``. "k" was
    released with an AbandonedLockWarning."""
    locks = getattr(impl, BLOCKS[style][0])()
    shared = _shared(locks, style)
    take, give = ((locks.acquire_write, locks.release_write) if _is_rw(locks)
                  else (locks.acquire, locks.release))
    worker = Worker("holds x")
    worker.run(lambda: take("x"))
    if enters_after_a_wait:
        worker.run(lambda: take("k"))
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(_holding_k_then_waiting_for_x(locks, style, shared))
        loop.run_until_complete(until(lambda: locks.stats().waiting == 1, "the task waits"))
        if enters_after_a_wait:  # for "k": the release grants it at once, then x is next
            worker.run(lambda: give("k"))
            assert locks.stats().waiting == 0 and locks.owner("k") is task
            loop.run_until_complete(until(lambda: locks.stats().waiting == 1,
                                          "the task waits for x"))
    finally:
        loop.close()  # with the task pending, as after a second Ctrl-C
    task._log_destroy_pending = False  # pending for good, as meant: no log when collected
    with abandoned_warnings() as caught:
        if ending == "end_stranded_task":
            impl.end_stranded_task(task)
        worker.run(lambda: give("x"))  # else its grant finds the task's loop closed
    worker.stop()
    assert not task.done(), "a task of a closed loop stays pending"
    assert "k" not in locks and "x" not in locks and locks.stats().waiting == 0
    assert any("'k'" in str(warning.message) for warning in caught), caught
    return locks, shared, task


@pytest.mark.parametrize("ending", ["a grant", "end_stranded_task"])
@pytest.mark.parametrize("style", list(BLOCKS))
def test_closing_an_ended_tasks_coroutine_keeps_another_tasks_hold(impl, style, ending) -> None:
    """The stranded task's coroutine closed by a task that now holds "k" (in a block of the
    same kind): that task still holds "k" once, and its own exit releases it."""
    locks, shared, stranded = _stranded_and_ended(impl, style, ending)

    async def main() -> None:
        async with BLOCKS[style][1](locks, shared):
            stranded.get_coro().close()  # GeneratorExit at its await: its blocks' exits run
            assert locks.aio.owned("k")
            if _reads(style):
                assert locks.readers("k") == 1 and locks.aio.recursion_count("k") == 0
            else:
                assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


@pytest.mark.parametrize("ending", ["a grant", "end_stranded_task"])
def test_a_shared_views_task_counts_inside_once_its_wait_to_enter_is_granted(impl,
                                                                          ending) -> None:
    """As above, the stranded task having entered the shared aio["k"] after a wait."""
    locks, shared, stranded = _stranded_and_ended(impl, "one shared aio[key]", ending,
                                                  enters_after_a_wait=True)

    async def main() -> None:
        async with shared:
            stranded.get_coro().close()
            assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


@pytest.mark.parametrize("style", list(BLOCKS))
def test_closing_an_ended_tasks_coroutine_with_no_loop_running_raises_nothing(impl,
                                                                              style) -> None:
    locks, shared, stranded = _stranded_and_ended(impl, style, "a grant")
    stranded.get_coro().close()  # no task is current: its exits act for none
    assert len(locks) == 0 and locks.stats().waiting == 0


class _Key:
    """A key that can be referred to weakly: whether anything still keeps it."""


def test_a_task_stranded_on_its_own_future_inside_a_shared_view_is_collectable(impl) -> None:
    """A task inside a block of a long-lived view, waiting on a future of its own (not on
    lockmgr), is stranded on a closed loop and ended with ``end_stranded_task``: neither
    the view nor anything of lockmgr keeps the task. (On 3.10 a frame owns what it
    awaits: the view, by keeping the block's frame, kept the future and so the task.)"""
    locks = impl.LockManager()
    shared = locks.aio["k"]

    async def in_block() -> None:
        async with shared:
            await asyncio.get_running_loop().create_future()  # never done

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(in_block())
        loop.run_until_complete(until(lambda: "k" in locks, "the task holds k"))
    finally:
        loop.close()
    task._log_destroy_pending = False
    with abandoned_warnings():
        impl.end_stranded_task(task)
    assert "k" not in locks
    alive = weakref.ref(task)
    del task
    gc.collect()
    assert alive() is None, "the stranded task is kept alive"
    run(lambda: _enter_and_leave(shared))  # the view still serves
    assert len(locks) == 0


async def _enter_and_leave(view: Any) -> None:
    async with view:
        pass


@pytest.mark.parametrize("how", ["aio[key]", "hold()", "AsyncExitStack"])
def test_a_running_task_keeps_nothing_of_the_blocks_it_left(impl, how) -> None:
    """A long-lived task's blocks, each on a fresh view of a fresh key: once a block has
    exited, its key is collectable while the task runs on (what the task remembers of the
    blocks it is inside, for its ending, goes with each block)."""
    import contextlib

    locks = impl.LockManager()
    refs: list[weakref.ref[_Key]] = []

    async def main() -> None:
        for _ in range(20):
            key = _Key()
            refs.append(weakref.ref(key))
            if how == "aio[key]":
                async with locks.aio[key]:
                    pass
            elif how == "hold()":
                async with locks.aio.hold(key):
                    pass
            else:  # entered and exited in other frames than the block's
                async with contextlib.AsyncExitStack() as stack:
                    await stack.enter_async_context(locks.aio[key])
                del stack
            del key
        gc.collect()
        kept = sum(ref() is not None for ref in refs)
        assert kept == 0, f"{kept} of 20 keys of exited blocks are still kept"

    run(main)
    assert len(locks) == 0


async def _step(view: Any, enter: bool, frames: list[Any]) -> int:
    """Enter or exit ``view`` in a frame of this helper's (as an ``AsyncExitStack`` or a
    wrapper does); an entering frame stays in ``frames`` until the caller lets it go.
    Answers the frame's id."""
    if enter:
        await view.__aenter__()
        frames.append(sys._getframe())
    else:
        await view.__aexit__(None, None, None)
    return id(sys._getframe())


def _step_of_its_own(name: str) -> Callable[[Any, bool, list[Any]], Coroutine[Any, Any, int]]:
    """``_step`` under a code object of its own, of the same shape: the frame of one is
    often handed the memory, so the id, of another's freed frame."""
    return type(_step)(_step.__code__.replace(co_name=name), globals())


@pytest.mark.parametrize("helpers", ["one for both", "one each"])
def test_an_exit_in_a_frame_reusing_an_ended_blocks_frame_id_gives_back_the_tasks_own(
        impl, helpers) -> None:
    """Tasks end inside a block of a shared view entered through a helper (as a wrapper's
    ``__aenter__`` does); the helper's frame returned. Then another task enters in a frame
    of its own and exits through a helper (the same one, as a wrapper's ``__aexit__`` may
    call it, or another), after the first helper's frame died: that exit's frame often
    has its id (every round on 3.11), and must still give back the task's own block
    (nothing raised, "k" released at once).

    On 4bc53c4 the exit was taken for the ended task's (``NotOwnedError``, "k" held until
    the task ended), by both engines: with a helper each, 44 rounds of 100 on 3.10 and 72
    on 3.11 for the pure twin in a scripted run; c7ec321 fixed that case only (a review
    found one helper for both failing every round on 3.10 and 3.11)."""
    locks = impl.LockManager()
    view = locks.aio["k"]
    frames: list[Any] = []

    def helper(name: str) -> Callable[[Any, bool, list[Any]], Coroutine[Any, Any, int]]:
        return _step if helpers == "one for both" else _step_of_its_own(name)

    async def own_block_exited_in_a_helper(name: str) -> int:
        await view.__aenter__()
        frames.clear()  # the ended block's frame dies
        await helper(name)(view, False, frames)
        return locks.aio.recursion_count("k")

    async def main() -> None:
        for round_ in range(100):
            with abandoned_warnings() as caught:
                await asyncio.create_task(helper(f"enter_{round_}")(view, True, frames))
                await until(lambda: "k" not in locks, "the ended task's key is released")
            assert len(caught) == 1, caught
            held = await asyncio.create_task(own_block_exited_in_a_helper(f"exit_{round_}"))
            assert (held, "k" in locks) == (0, False), f"round {round_}"

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("collected_by", ["refcount", "gc"])
def test_an_ended_tasks_block_closed_by_its_collection_takes_nothing_of_the_running_tasks(
        impl, collected_by) -> None:
    """A task drove a coroutine into a block of a shared view and ended, leaving it
    suspended there. While another task holds "k" in a block of the same view (in an async
    generator), that coroutine is collected: closing it runs its block's exit, which is the
    ended task's and takes nothing of the running task's. The running task's own block
    then exits, and releases "k".

    On 4fa2243 (compiled core) the exit was no longer known for the ended task's: a
    generator's weak references are cleared before it is closed, and the record matched
    its owner by a weak reference. It took the running task's entry instead, whose own exit
    then found none under GeneratorExit: "k" stayed held until the task ended."""
    locks = impl.LockManager()
    view = locks.aio["k"]
    left: list[Any] = []

    async def suspended_inside() -> None:
        async with view:
            await asyncio.sleep(0)

    async def ends_leaving_it_inside() -> None:
        coroutine = suspended_inside()
        coroutine.send(None)
        left.append(coroutine)

    async def holding() -> AsyncIterator[None]:
        async with view:
            yield

    async def main() -> tuple[int, bool]:
        with abandoned_warnings():
            await asyncio.create_task(ends_leaving_it_inside())
            await until(lambda: "k" not in locks, "the ended task's key is released")
        generator = holding()
        await generator.__anext__()
        if collected_by == "refcount":
            left.clear()
        else:
            cycle = [left.pop()]
            cycle.append(cycle)
            del cycle
            gc.collect()
        count = locks.aio.recursion_count("k")
        await generator.aclose()
        return count, "k" in locks

    assert run(main) == (1, False)
    assert len(locks) == 0


async def _enters_then_waits(view: Any, enter: bool) -> None:
    """A helper entering ``view`` for its caller, then waiting (where it is cancelled: its
    frame raises), or exiting it."""
    if enter:
        await view.__aenter__()
        await asyncio.sleep(3600)
    else:
        await view.__aexit__(None, None, None)


def test_an_exit_through_a_helper_whose_earlier_frame_raised_after_entering_is_the_tasks(
        impl) -> None:
    """A helper enters a shared view for its caller and is cancelled right after, so its
    frame raised; the task ends holding "k" (released with AbandonedLockWarning). Another
    task then enters in a frame of its own and exits through the same helper, whose new
    frame often has the dead frame's id: the exit gives back the task's own block.

    On 4fa2243 the pure twin kept the raised frame as one that may still exit (it only
    knew frames that returned) and took the exit for the ended task's: NotOwnedError, "k"
    held, in 100 rounds of 100 on 3.10 to 3.12 (a review's script)."""
    locks = impl.LockManager()
    view = locks.aio["k"]

    async def own_block_exited_in_the_helper() -> object:
        await view.__aenter__()
        await _enters_then_waits(view, False)
        return locks.aio.recursion_count("k")

    async def main() -> None:
        for round_ in range(100):
            with abandoned_warnings():
                helper = asyncio.create_task(_enters_then_waits(view, True))
                await until(lambda: "k" in locks, "the helper entered")
                helper.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await helper
                del helper
                await until(lambda: "k" not in locks, "the ended task's key is released")
            held = await asyncio.create_task(own_block_exited_in_the_helper())
            assert (held, "k" in locks) == (0, False), f"round {round_}"

    run(main)
    assert len(locks) == 0


def test_a_running_task_keeps_nothing_of_its_blocks_another_task_closed(impl) -> None:
    """A long-lived task drives async generators into blocks on fresh views, and another
    task closes each (GeneratorExit: the exit is the first task's block, and releases
    nothing); the first task then releases the key itself. While it runs on, nothing of
    those blocks stays with it: each view's record is collected with the view.

    On c7ec321 a task's list of the objects holding its frames lost a slot to the task's
    own exits only: each generator another task closed left one, which kept the view's
    record for as long as the task ran."""
    locks = impl.LockManager()

    async def inside(view: Any) -> AsyncIterator[None]:
        async with view:
            yield

    async def closes(generator: Any) -> None:
        await generator.aclose()

    async def main() -> None:
        before = block_records()
        for index in range(20):
            generator = inside(locks.aio[index])
            await generator.__anext__()
            await asyncio.create_task(closes(generator))
            assert locks.aio.recursion_count(index) == 1  # the closing released nothing
            locks.aio.release(index)
            del generator
        kept = block_records() - before
        assert kept == 0, f"{kept} records of 20 views are kept by the running task"

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("style", list(BLOCKS))
def test_a_block_a_finished_task_left_suspended_exits_as_that_tasks(impl, style) -> None:
    """A task drove a coroutine into a block (it holds "k" there) and finished, leaving it
    suspended: the task's end released "k". Another task that holds "k" now closes that
    coroutine: the block's exit is the finished task's, and releases nothing."""
    locks = getattr(impl, BLOCKS[style][0])()
    shared = _shared(locks, style)
    worker = Worker("holds x")
    worker.run(lambda: (locks.acquire_write if _is_rw(locks) else locks.acquire)("x"))

    async def leaves_it_suspended() -> Coroutine[Any, Any, None]:
        coroutine = _holding_k_then_waiting_for_x(locks, style, shared)
        coroutine.send(None)  # inside the block, waiting for "x"
        return coroutine

    async def main() -> None:
        with abandoned_warnings() as caught:
            coroutine = await asyncio.create_task(leaves_it_suspended())
            await until(lambda: "k" not in locks, "the finished task's keys are released")
        assert locks.stats().waiting == 0
        assert any("'k'" in str(warning.message) for warning in caught), caught
        async with BLOCKS[style][1](locks, shared):
            coroutine.close()
            assert locks.aio.owned("k")
            if _reads(style):
                assert locks.readers("k") == 1
            else:
                assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks

    run(main)
    worker.run(lambda: (locks.release_write if _is_rw(locks) else locks.release)("x"))
    worker.stop()
    assert len(locks) == 0


async def _inside_twice(view: Any) -> AsyncIterator[None]:
    """An async generator inside two nested blocks of ``view``."""
    async with view:
        async with view:
            yield


def test_an_async_generator_closed_by_its_own_task_releases_a_shared_views_key(impl) -> None:
    locks = impl.LockManager()
    shared = locks.aio["k"]

    async def main() -> None:
        generator = _inside_twice(shared)
        await generator.__anext__()
        assert locks.aio.recursion_count("k") == 2
        await generator.aclose()  # GeneratorExit, run by the task inside: its exits
        assert "k" not in locks
        async with shared:  # inside it too: the generator's exits undo its own levels only
            generator = _inside_twice(shared)
            await generator.__anext__()
            assert locks.aio.recursion_count("k") == 3
            await generator.aclose()
            assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks

    run(main)


@pytest.mark.parametrize("how", ["cancelled", "never awaited"])
def test_a_task_whose_entry_into_a_shared_view_failed_is_not_inside(impl, how) -> None:
    """A task queued by the view's ``__aenter__`` whose wait ended without the key (it was
    cancelled, or it never awaited the wait) never was inside the block: once it is done,
    a GeneratorExit in that view's block is still the current task's exit."""
    locks = impl.LockManager()
    shared = locks.aio["k"]

    async def enters() -> None:
        if how == "cancelled":
            async with shared:
                raise AssertionError("entered although cancelled")
        shared.__aenter__()  # queued, and dropped unawaited

    async def main() -> None:
        holder, done = await held_by_another_task(locks, "k")
        entering = asyncio.create_task(enters())
        if how == "cancelled":
            await until(lambda: locks.stats().waiting == 1, "the task waits to enter")
            entering.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancelled" else nullcontext():
            await entering
        await until(lambda: locks.stats().waiting == 0, "the ended wait left the queue")
        done.set()
        await holder
        generator = _inside_twice(shared)
        await generator.__anext__()
        await generator.aclose()
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


# -- one block object shared by several tasks ---------------------------------------------------
# A hold()/read() object (or an aio[key] view) may be used by many tasks, as an asyncio.Lock
# is: it counts which of them are inside its block, and an exit acts for the task whose block
# exits: without GeneratorExit the current task's; with it, a gone task's inside, else the
# current task's if it is inside, else nobody's (nothing released).

SHARED_STYLES = ["one shared aio[key]", "one shared hold", "one shared read"]


@pytest.mark.parametrize("style", SHARED_STYLES)
def test_a_block_object_shared_by_two_tasks_releases_each_tasks_own_hold(impl, style) -> None:
    """Two tasks enter one object (for reading both are inside at once; else the second
    waits in ``__aenter__`` until the first exits): each exit releases its task's hold."""
    locks = getattr(impl, BLOCKS[style][0])()
    shared = _shared(locks, style)

    async def main() -> None:
        inside = {name: asyncio.Event() for name in "ab"}
        leave = {name: asyncio.Event() for name in "ab"}

        async def user(name: str) -> None:
            async with shared:
                inside[name].set()
                await leave[name].wait()
                assert locks.aio.owned("k")
            assert not locks.aio.owned("k")

        a = asyncio.create_task(user("a"))
        await inside["a"].wait()
        b = asyncio.create_task(user("b"))
        if _reads(style):
            await inside["b"].wait()
            assert locks.readers("k") == 2
        else:
            await until(lambda: locks.stats().waiting == 1, "b waits to enter")
        leave["a"].set()
        await a  # a's exit releases a's hold: b enters (if it waited), or still reads
        await inside["b"].wait()
        if _reads(style):
            assert locks.readers("k") == 1
        else:
            assert locks.owner("k") is b and locks.stats().waiting == 0
        leave["b"].set()
        await b
        assert "k" not in locks

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


def _recording_tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    """Every task ``loop`` creates from now on (asyncio's async-generator finalizer's too)."""
    created: list[asyncio.Task[Any]] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        created.append(task)
        return task

    loop.set_task_factory(factory)  # type: ignore[arg-type]
    return created


DROPPED_STYLES = ["aio[key]", "one shared aio[key]", "hold", "one shared hold"]


async def _drop_a_generator_inside(locks: Any, style: str, shared: Any) -> asyncio.Task[Any]:
    """The current task (the consumer) breaks out of ``async for`` over an async generator
    suspended inside a block of ``style`` holding "k", and so drops it: asyncio's
    async-generator finalizer closes it in a task of its own (returned, done), whose
    GeneratorExit runs the block's exit while the consumer is alive and inside."""
    created = _recording_tasks(asyncio.get_running_loop())
    closed_in: list[Any] = []

    async def generator() -> AsyncIterator[int]:
        try:
            async with BLOCKS[style][1](locks, shared):
                yield 1
                yield 2
        finally:
            closed_in.append(asyncio.current_task())

    async for _ in generator():
        break  # the generator is dropped here (its last reference)
    await until(lambda: bool(closed_in), "asyncio's finalizer closes the generator")
    finalizer = closed_in[0]
    assert finalizer is not asyncio.current_task() and finalizer in created
    await until(finalizer.done, "the finalizer's task ends")
    assert not finalizer.cancelled() and finalizer.exception() is None
    return finalizer  # type: ignore[no-any-return]


@pytest.mark.parametrize("ending", ["releases", "ends"])
@pytest.mark.parametrize("style", DROPPED_STYLES)
def test_a_dropped_async_generator_finalized_by_asyncio_releases_nothing(impl, style,
                                                                       ending) -> None:
    """The finalizer's task is not inside and no task inside is gone: the exit is nobody's
    that can be told, so it releases nothing (neither the consumer's hold nor, in the
    finalizer's task, anything: no NotOwnedError) and the consumer keeps "k" until it
    releases it, or ends (AbandonedLockWarning)."""
    locks = impl.LockManager()
    shared = _shared(locks, style)
    errors: list[dict[str, Any]] = []

    async def consumer() -> None:
        await _drop_a_generator_inside(locks, style, shared)
        assert locks.owner("k") is asyncio.current_task()
        assert locks.aio.recursion_count("k") == 1
        if ending == "releases":
            locks.aio.release("k")
            assert "k" not in locks

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context:
                                                         errors.append(context))
        with abandoned_warnings() as caught:
            await asyncio.create_task(consumer())
            await until(lambda: "k" not in locks, "the consumer's end releases k")
        assert any("'k'" in str(warning.message) for warning in caught) == (ending == "ends")
        if style.startswith("one shared"):  # the consumer is left listed inside: done
            async with shared:
                assert locks.aio.recursion_count("k") == 1
            assert "k" not in locks

    run(main)
    assert not errors, errors
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_a_dropped_async_generator_finalized_by_asyncio_keeps_the_finalizers_own_hold(
        impl) -> None:
    """Case (3) never releases for the current task, even when it holds the key another
    way: here the consumer lets "k" go while still inside the generator's block, and the
    finalizer's task holds "k" (``acquire``) when it closes the generator."""
    locks = impl.LockManager()
    shared = locks.aio["k"]
    errors: list[dict[str, Any]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: errors.append(context))
        finalizers: list[asyncio.Task[Any]] = []
        levels_at_close: list[int] = []

        async def generator() -> AsyncIterator[int]:
            try:
                async with shared:
                    yield 1
            finally:
                levels_at_close.append(locks.aio.recursion_count("k"))

        async def holding_k(aclose: Any) -> None:  # the finalizer's task, holding "k"
            await locks.aio.acquire("k")
            await aclose
            assert locks.aio.recursion_count("k") == 1  # its own hold, kept
            locks.aio.release("k")

        def factory(loop: asyncio.AbstractEventLoop, coro: Any,
                    **kwargs: Any) -> asyncio.Task[Any]:
            task = asyncio.Task(holding_k(coro), loop=loop, **kwargs)
            finalizers.append(task)
            return task

        async for _ in generator():
            locks.aio.release("k")  # the consumer lets "k" go, still inside the block
            loop.set_task_factory(factory)  # type: ignore[arg-type]
            break  # the generator is dropped: asyncio's finalizer closes it
        await until(lambda: bool(finalizers), "asyncio's finalizer makes its task")
        loop.set_task_factory(None)
        await until(finalizers[0].done, "the finalizer's task ends")
        assert not finalizers[0].cancelled() and finalizers[0].exception() is None
        assert levels_at_close == [1]
        assert "k" not in locks

    run(main)
    assert not errors, errors
    assert len(locks) == 0


@pytest.mark.parametrize("style", ["one shared aio[key]", "one shared hold"])
def test_an_async_generator_closed_by_its_own_task_releases_a_shared_objects_key(impl,
                                                                               style) -> None:
    """Case (2), beside a task left listed inside that is live (not gone): the generator's
    own task's ``aclose()`` is its exit, and releases."""
    locks = impl.LockManager()
    shared = _shared(locks, style)

    async def main() -> None:
        generator = _inside_twice(shared)
        await generator.__anext__()
        assert locks.aio.recursion_count("k") == 2
        await generator.aclose()
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("style", SHARED_STYLES)
def test_a_done_task_left_listed_does_not_skip_other_tasks_ordinary_exits(impl, style) -> None:
    """A task that finished inside a shared object's block (its coroutine left suspended
    there, never closed) stays listed inside, gone (by a weak reference: the object does not
    keep it alive): the ordinary exits of other tasks are theirs all the same, and release."""
    locks = getattr(impl, BLOCKS[style][0])()
    shared = _shared(locks, style)
    left: list[Any] = []

    async def leaves_it_suspended() -> None:
        async def in_block() -> None:
            async with shared:
                await asyncio.Future()  # never set: suspended here for good
        coroutine = in_block()
        coroutine.send(None)
        left.append(coroutine)  # kept: never closed while the test runs

    async def main() -> None:
        with abandoned_warnings() as caught:
            finished = asyncio.create_task(leaves_it_suspended())
            await finished
            await until(lambda: "k" not in locks, "the finished task's keys are released")
        assert any("'k'" in str(warning.message) for warning in caught), caught
        finished_ref = weakref.ref(finished)
        del finished
        gc.collect()
        assert finished_ref() is None, "the object keeps a task inside alive"
        for _ in range(2):
            async with shared:
                async with shared:
                    assert locks.aio.owned("k")
                assert locks.aio.owned("k")
            assert "k" not in locks
            await asyncio.create_task(uses_it())
            assert "k" not in locks

    async def uses_it() -> None:
        async with shared:
            assert locks.aio.owned("k")
        assert not locks.aio.owned("k")

    run(main)
    for coroutine in left:
        coroutine.close()  # the gone task's exit: releases nothing, raises nothing
    assert len(locks) == 0 and locks.stats().waiting == 0
