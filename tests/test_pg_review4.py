"""The fourth adversarial review of the PostgreSQL backend, of the fix round 2bf63ad..07fa2c4:
reproducers against a real server, one per finding. Each test states what must hold; each
fails on the reviewed commit (07fa2c4)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import warnings
from typing import Any

import pytest

from conftest import PATIENCE
from lockmgr import postgres
from test_pg_aio import HOLDER, locks, until  # noqa: F401
from test_pg_review3 import quietly_collect
from test_postgres import (  # noqa: F401
    _waiting_on_server,
    child,
    children_reaped,
    dsn,
    engine,
    expect,
    finish,
    held_on_server,
    namespace,
    nothing_left_held,
)


@pytest.fixture
def rwlocks(engine, dsn, namespace):  # noqa: F811
    manager = postgres.PgRWLockManager(dsn, namespace=namespace)
    yield manager
    manager.close()


def run_in_thread(main, seconds: float) -> list[object]:
    """asyncio.run(main()) in a daemon thread: [result or exception], or [] if still running
    after ``seconds`` (the thread is then left waiting forever)."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(main()))
        except BaseException as error:  # noqa: BLE001
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome


# -- 1. the loop's async-generator finalizer is "another task": it closes the consumer's link --


def test_an_abandoned_async_generator_leaves_its_consumers_other_keys_held(locks, dsn) -> None:  # noqa: F811
    """``_AsyncHeld.__aexit__`` now takes "the running task is not the entering one" to mean
    "the entering task's coroutine is being closed unrun" and closes *the entering task's*
    connection. But asyncio finalizes an async generator dropped mid-iteration (``break``
    out of ``async for``, or any early exit) by running ``agen.aclose()`` in a *new task*
    (``loop._asyncgen_finalizer_hook``): its ``async with locks.aio.hold("g")`` exits there,
    and the consumer's connection is closed while the consumer runs on, inside its own
    ``async with locks.aio.hold("other")``: "other" is free on the server for any other
    process while the consumer believes it holds it. (Before, the release in the finalizer's
    task failed with NotOwnedError and nothing else happened.)"""
    seen: dict[str, object] = {}

    async def rows():
        async with locks.aio.hold("g"):
            yield 1
            yield 2

    async def main() -> None:
        async with locks.aio.hold("other"):
            async for _ in rows():
                break  # the generator is dropped: the loop's finalizer closes it in a new task
            for _ in range(20):
                await asyncio.sleep(0.01)
            seen["other held on the server, inside its async with"] = held_on_server(
                dsn, locks, "other")
        await locks.aio.release_all()

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        outcome = run_in_thread(main, PATIENCE * 3)
    locks.release_all()
    assert seen == {"other held on the server, inside its async with": True}, (seen, outcome)


def test_an_abandoned_async_generator_does_not_hang_its_consumers_wait(locks, dsn, namespace) -> None:  # noqa: F811
    """The same close, landing while the consumer awaits a round trip on that connection
    (here a timed wait for a key another process holds): the socket is closed under its
    ``add_reader`` (epoll forgets a closed descriptor), its future is never set, and the
    consumer waits forever, whatever its timeout (the timeout is the server's)."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)

    async def rows():
        async with locks.aio.hold("g"):
            yield 1
            yield 2

    async def main() -> object:
        async with locks.aio.hold("other"):
            async for _ in rows():
                break
            return await locks.aio.acquire("k", timeout=1.0)

    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            outcome = run_in_thread(main, 1.0 + PATIENCE)
    finally:
        finish(holder)
    assert outcome and not isinstance(outcome[0], BaseException), (
        outcome or "the consumer still waits")


# -- 2. one hold()/read() object entered by several tasks: the last to enter is "the" task ----


def test_a_shared_read_guard_releases_each_tasks_own_read(rwlocks, dsn) -> None:  # noqa: F811
    """``_AsyncHeld`` keeps one ``_task``, overwritten by each ``__aenter__``: an object
    entered by two tasks at once (a shared ``guard = locks.aio.read("config")``, as one
    shares an ``asyncio.Lock``; readers are meant to overlap) takes the first task's exit
    for "the second task's coroutine closed unrun": it closes the *second* task's connection
    (its read, and all else it holds, gone on the server) and releases nothing for the first,
    whose read stays held, in process and on the server, until the task ends. (Before, the
    object had no state: each exit released its own task's read.)"""
    guard = rwlocks.aio.read("config")
    seen: dict[str, object] = {}

    async def reader(name: str, inside: asyncio.Event, leave: asyncio.Event) -> None:
        async with guard:
            inside.set()
            await leave.wait()
        seen[name + " still holds"] = rwlocks.aio.owned("config")

    async def main() -> None:
        a_in, b_in, a_out, b_out = (asyncio.Event() for _ in range(4))
        a = asyncio.create_task(reader("a", a_in, a_out))
        await a_in.wait()
        b = asyncio.create_task(reader("b", b_in, b_out))
        await b_in.wait()
        a_out.set()
        await asyncio.sleep(0.1)
        seen["b's read held on the server"] = held_on_server(dsn, rwlocks, "config")
        b_out.set()
        results = await asyncio.gather(a, b, return_exceptions=True)
        seen["errors"] = [repr(r) for r in results if r is not None]

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))
    assert seen == {"a still holds": False, "b's read held on the server": True,
                    "b still holds": False, "errors": []}, seen


# -- 3. PgAsyncKeyLock: a GeneratorExit exit of the running task is charged to a stranded one --


def test_a_key_lock_closed_by_aclose_in_its_own_task_releases_the_key(locks, dsn) -> None:  # noqa: F811
    """``PgAsyncKeyLock.__aexit__`` with GeneratorExit picks any *other* entered task that is
    done or whose loop is closed as the one exiting, even when the running task itself is
    exiting (an async generator holding ``async with lock:`` closed by ``await
    agen.aclose()`` in the task that entered it). With a stranded task still listed in the
    shared object's ``_entered`` (its loop was closed in the body; its coroutine not yet
    collected), the running task's exit decrements the stranded task's depth instead of its
    own and releases nothing: the running task keeps the key, in process and on the server,
    until it ends. (On 2bf63ad this test fails otherwise: the stranded task's key blocked
    ``take``, the third review's finding 1.)"""
    lock = locks.aio["k"]
    loop = asyncio.new_event_loop()
    started = asyncio.Event()

    async def holds() -> None:
        async with lock:
            started.set()
            await asyncio.sleep(3600)

    async def until_held() -> asyncio.Task[None]:
        task = asyncio.create_task(holds())
        await started.wait()
        return task

    stranded = loop.run_until_complete(until_held())
    loop.close()
    seen: dict[str, object] = {}

    async def gen():
        async with lock:
            yield

    async def main() -> None:
        agen = gen()
        await agen.__anext__()  # entered (the sweep ended the stranded task first)
        await agen.aclose()  # exits in this very task, with GeneratorExit
        seen["still held by me"] = locks.aio.recursion_count("k")
        seen["held on the server"] = held_on_server(dsn, locks, "k")
        await locks.aio.release_all()

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))
        finally:
            locks.lost_keys()
            del stranded
            quietly_collect()
    assert seen == {"still held by me": 0, "held on the server": False}, seen


# -- 4. the sweep pops every stranded session first, then ends them one by one ---------------------


def test_an_interrupted_sweep_leaves_no_stranded_key_held_in_process(locks, dsn) -> None:  # noqa: F811
    """``sweep_closed_loops`` (now before every acquisition, from any thread) takes the
    closed loops out of ``loops`` and *all* their tasks' sessions out of ``sessions`` under
    the guard, then ends the tasks one at a time (``end_stranded_task``: Python code,
    warnings, finalizers). An exception out of one ending — the AbandonedLockWarning it
    warns, under ``-W error`` or pytest's ``filterwarnings = error``; a KeyboardInterrupt,
    which SIGINT (and now SIGTERM, in the bench) raises at any bytecode — leaves the other
    stranded tasks listed nowhere and never ended in process: no later sweep finds them,
    and their keys are held in process for good (a waiter without a timeout waits forever).
    (The pop-all-then-end shape predates this round; the round runs it before every
    acquisition, so the caller of any acquisition, of any key, meets it.)"""
    loop = asyncio.new_event_loop()

    async def holds(key: str, held: asyncio.Event) -> None:
        async with locks.aio.hold(key):
            held.set()
            await asyncio.sleep(3600)

    async def until_held() -> list[asyncio.Task[None]]:
        events = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(holds(key, event)) for key, event in zip("ab", events)]
        for event in events:
            await event.wait()
        return tasks

    stranded = loop.run_until_complete(until_held())
    loop.close()
    outcome: dict[str, object] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # as under -W error
            try:
                locks.acquire("x", timeout=1.0)
                locks.release("x")
                outcome["first acquisition"] = "ok"
            except Exception as error:  # noqa: BLE001
                outcome["first acquisition"] = type(error).__name__
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")

            def another_thread() -> None:  # (this one's acquisition may not be the point)
                for key in "ab":
                    got = locks.acquire(key, timeout=2.0)
                    outcome[key] = got
                    if got:
                        locks.release(key)

            thread = threading.Thread(target=another_thread)
            thread.start()
            thread.join(PATIENCE)
    finally:
        del stranded
        quietly_collect()
    assert outcome["a"] is True and outcome["b"] is True, outcome


def test_a_key_lock_with_a_done_task_listed_still_releases_the_running_tasks_key(locks, dsn) -> None:  # noqa: F811
    """The same with no loop closed: a task that left a shared ``PgAsyncKeyLock`` through an
    abandoned async generator (the loop's finalizer ran the exit in its own task: NotOwnedError
    there, nothing decremented) stays in ``_entered`` after it is done, for good (a strong
    reference to the task, too). Every later exit with GeneratorExit of *any* task (an
    ``await agen.aclose()`` of its own) is charged to that done task: the running task's key
    is not released, in process or on the server, until it ends."""
    lock = locks.aio["k"]
    seen: dict[str, object] = {}

    async def gen():
        async with lock:
            yield

    async def first() -> None:
        async for _ in gen():
            break  # dropped: the finalizer's task exits the lock (and cannot release it)
        for _ in range(10):
            await asyncio.sleep(0.01)

    async def second() -> None:
        agen = gen()
        await agen.__anext__()
        await agen.aclose()  # its own exit, in this very task
        seen["still held by me"] = locks.aio.recursion_count("k")
        seen["held on the server"] = held_on_server(dsn, locks, "k")
        await locks.aio.release_all()

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        await asyncio.create_task(first())  # ends holding "k": released at its end, warned
        await asyncio.sleep(0.05)
        await asyncio.create_task(second())

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))
    assert seen == {"still held by me": 0, "held on the server": False}, seen
