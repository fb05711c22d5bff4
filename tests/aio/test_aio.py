"""asyncio tasks and threads on one lock table (``locks.aio``), on both engines."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from conftest import (
    PATIENCE,
    TESTS,
    abandoned_warnings,
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
from lockmgr._owners import LOOP_THREAD


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
            await rw.aio.acquire_read("b", timeout=PATIENCE)

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


def test_aio_synchronized_written_bare_is_refused_and_says_how_to_write_it(impl) -> None:
    locks = impl.LockManager()
    with pytest.raises(TypeError, match=r"'.*deposit', a coroutine function, as its key "
                                        r"function: a bare @aio.synchronized over it\? Write "
                                        r"@aio.synchronized\(lambda"):
        @locks.aio.synchronized
        async def deposit(account: int) -> None: ...

    @locks.aio.synchronized  # over a plain function: caught at its first call
    def plain(account: int) -> None: ...

    with pytest.raises(TypeError, match=r"not a value of type int: is '.*plain' decorated with a bare "
                                        r"@aio.synchronized\?"):
        plain(7)
    assert locks.stats().acquisitions == 0


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


def _acquisitions(impl) -> list[Callable[[], object]]:
    locks = impl.LockManager()
    rw = impl.RWLockManager()
    return [lambda: locks.aio.acquire("k"), lambda: locks.aio["k"].acquire(),
            lambda: locks.aio.acquire_many(["k"]), lambda: rw.aio.acquire_read("k"),
            lambda: rw.aio.acquire_write("k"), lambda: rw.aio.acquire_many(writes=["k"])]


@pytest.mark.parametrize("which", range(6))
def test_an_acquisition_never_awaited_warns_when_collected(impl, which: int) -> None:
    acquiring = _acquisitions(impl)[which]()
    with pytest.warns(RuntimeWarning, match=r"^coroutine '\w+\.\w+' was never awaited$"):
        del acquiring
        gc.collect()


def _releases(impl) -> list[tuple[Any, Callable[[], Awaitable[bool]], Callable[[], object]]]:
    """(the manager, acquire "k", release it) in each form of the two views."""
    locks = impl.LockManager()
    rw = impl.RWLockManager()
    return [(locks, lambda: locks.aio.acquire("k"), lambda: locks.aio.release("k")),
            (locks, lambda: locks.aio["k"].acquire(), lambda: locks.aio["k"].release()),
            (locks, lambda: locks.aio.acquire_many(["k"]), lambda: locks.aio.release_many(["k"])),
            (rw, lambda: rw.aio.acquire_read("k"), lambda: rw.aio.release_read("k")),
            (rw, lambda: rw.aio.acquire_write("k"), lambda: rw.aio.release_write("k")),
            (rw, lambda: rw.aio.acquire_many(writes=["k"]),
             lambda: rw.aio.release_many(writes=["k"]))]


@pytest.mark.parametrize("which", range(6))
def test_a_release_is_done_at_the_call_and_may_be_awaited(impl, which: int) -> None:
    """As the PostgreSQL views' (``await aio.release(key)``) or not: the release is done
    when the call returns, and its answer, done already, may be awaited or dropped
    without a warning."""
    manager, acquire, release = _releases(impl)[which]

    async def main() -> None:
        for awaited in (True, False):
            assert await acquire()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                answer = release()
                assert len(manager) == 0  # released at the call
                if awaited:
                    assert await answer is None  # type: ignore[misc]
                del answer
                gc.collect()

    run(main)


@pytest.mark.parametrize("which", range(6))
def test_an_acquisition_closed_unawaited_warns_nothing(impl, which: int) -> None:
    acquiring = _acquisitions(impl)[which]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acquiring.close()  # type: ignore[attr-defined]
        del acquiring
        gc.collect()


CHILD = """
import asyncio, os, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
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


@pytest.mark.posix_only
@pytest.mark.parametrize("module", ["lockmgr._core", "lockmgr._pure"])
def test_ctrl_c_and_a_closed_loop_in_a_subprocess(module) -> None:
    import os
    import subprocess
    code = CHILD.format(tests=TESTS, module=module)
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


@pytest.mark.posix_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.parametrize("module", ["lockmgr._core", "lockmgr._pure"])
def test_a_forked_child_finds_its_task_as_asyncio_does(module) -> None:
    import subprocess
    code = FORK_CHILD.format(tests=TESTS, module=module)
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


def test_a_tasks_read_behind_a_waiting_sets_read_is_a_deadlock_edge(impl) -> None:
    # As with threads (test_rwlock): a task's read queued behind a waiting set's read node
    # waits for the whole set, so closing a cycle through it is refused at once.
    rw = impl.RWLockManager()

    async def take_the_set() -> tuple[int, bool]:
        await rw.aio.acquire_many(reads=["b"], writes=["c"])
        took = rw.readers("b"), rw.write_locked("c")
        rw.aio.release_many(reads=["b"], writes=["c"])
        return took

    async def main() -> None:
        await rw.aio.acquire_write("c")
        waiting = asyncio.ensure_future(take_the_set())
        await until(lambda: rw.stats().waiting == 1, "the set waits for c")
        with pytest.raises(DeadlockError):
            await rw.aio.acquire_read("b", timeout=PATIENCE)
        rw.aio.release_write("c")
        assert await asyncio.wait_for(waiting, PATIENCE) == (1, True)

    asyncio.run(main())
    assert len(rw) == 0


@pytest.mark.parametrize("releaser", ["task", "another-thread"])
def test_tasks_granted_one_read_together_resume_in_arrival_order(impl, releaser) -> None:
    # Both engines wake the readers a release lets in together in the order they queued, so
    # the tasks run on in that order (the compiled core woke the newest first).
    rw = impl.RWLockManager()
    resumed: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:
        with rw.write("k"):
            holding.set()
            release.wait(PATIENCE)

    thread = threading.Thread(target=writer)

    async def reader(name: str) -> None:
        async with rw.aio.read("k"):
            resumed.append(name)

    async def main() -> None:
        if releaser == "task":
            await rw.aio.acquire_write("k")
        else:
            thread.start()
            assert await asyncio.to_thread(holding.wait, PATIENCE)
        readers = []
        for count, name in enumerate(["first", "second", "third"], 1):
            readers.append(asyncio.ensure_future(reader(name)))
            await until(lambda count=count: rw.stats().waiting == count, f"{name} queues")
        if releaser == "task":
            rw.aio.release_write("k")
        else:
            release.set()
        await asyncio.wait_for(asyncio.gather(*readers), PATIENCE)

    asyncio.run(main())
    if releaser != "task":
        thread.join(PATIENCE)
    assert resumed == ["first", "second", "third"]
    assert len(rw) == 0


@pytest.mark.parametrize("tasks_request", ["read", "set"])
def test_a_read_behind_a_tasks_read_does_not_wait_for_the_tasks_loop(impl, tasks_request,
                                                                      workers) -> None:
    # A task queues a read of b (alone, or in a set) behind a writer; a thread holding x
    # queues a read of b (in a set, or alone) behind it. The thread waits for b's writer,
    # and for the task's read to be granted, which needs no run of the task: so the loop's
    # own thread asking for x waits (until the writer lets b go) instead of being refused
    # as if the task's loop closed a cycle.
    rw = impl.RWLockManager()
    writer, reader = workers("writer"), workers("reader")
    writer.run(lambda: rw.acquire_write("b"))
    reader.run(lambda: rw.acquire_write("x"))

    def read_b(reads: list[str]) -> bool:
        took = rw.acquire_many(reads=reads) if len(reads) > 1 else rw.acquire_read("b")
        rw.release_many(reads=reads) if len(reads) > 1 else rw.release_read("b")
        rw.release_write("x")
        return took

    async def task() -> None:
        await rw.aio.acquire_write("held")  # a task that holds a key takes part in cycles
        if tasks_request == "read":
            await rw.aio.acquire_read("b")
            rw.aio.release_read("b")
        else:
            await rw.aio.acquire_many(reads=["b", "d"])
            rw.aio.release_many(reads=["b", "d"])
        rw.aio.release_write("held")

    async def main() -> None:
        queued = asyncio.ensure_future(task())
        await until(lambda: rw.stats().waiting == 1, "the task waits for b")
        read = reader.submit(lambda: read_b(["b", "d"] if tasks_request == "read" else ["b"]))
        await until(lambda: rw.stats().waiting == 2, "the thread waits for b")
        releasing = writer.submit(lambda: (
            wait_until(lambda: rw.stats().waiting == 3, "the loop's thread waits for x"),
            rw.release_write("b")))
        assert rw.acquire_write("x", timeout=PATIENCE)  # the loop's thread, synchronously
        rw.release_write("x")
        releasing.result()
        assert read.result() is True
        await asyncio.wait_for(queued, PATIENCE)

    asyncio.run(main())
    assert len(rw) == 0 and rw.stats().deadlocks == 0
