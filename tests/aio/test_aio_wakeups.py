"""A waiting task's wake-up: a signal handler's exception inside the post that carries it
delays nothing (the post is delivered again, and counted once), and a post the event loop
drops unrun (the loop closed first) ends the task, so what it was granted is released."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import PATIENCE, abandoned_warnings, wait_until


class Interrupted(Exception):
    """What the simulated signal handler raises."""


def raising_in(function: str, event: str) -> Any:
    """A trace function that raises Interrupted once, at ``event`` ('call' or 'return') of
    the first call of ``function``: a signal handler's exception at that point."""

    def tracer(frame: Any, seen: str, arg: object) -> Any:
        if frame.f_code.co_name != function:
            return None
        if seen == event:
            sys.settrace(None)
            raise Interrupted(f"a handler's exception at the {event} of {function}")
        return tracer

    return tracer


class LoopThread:
    """An event loop run by a thread of its own, one coroutine at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def start(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(PATIENCE)
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    running = LoopThread()
    yield running
    if not running.loop.is_closed():
        running.close()


@pytest.mark.parametrize("event", ["call", "return"])
def test_a_handlers_exception_inside_a_post_loses_no_wake_up(impl, loop_thread, event) -> None:
    # The main thread releases a key a task of another loop waits for; the handler's
    # exception cuts the post short before it reached the loop ("call") or after ("return").
    # The release raises it, the task is woken all the same, and only once.
    locks = impl.LockManager()
    locks.acquire("k")

    async def twice() -> int:
        took = 0
        for _ in range(2):
            took += await locks.aio.acquire("k", timeout=PATIENCE)
            locks.aio.release("k")
        return took

    tasks = loop_thread.start(twice())
    wait_until(lambda: locks.stats().waiting == 1, "the task waits")
    sys.settrace(raising_in("call_soon_threadsafe", event))
    try:
        with pytest.raises(Interrupted):
            locks.release("k")
    finally:
        sys.settrace(None)
    assert tasks.result(PATIENCE) == 2
    assert len(locks) == 0


def test_a_grant_posted_as_the_loop_closes_is_released(impl) -> None:
    # The loop stops with the task waiting; another thread's release grants the task the
    # key and posts it; the loop is closed before it ran the post: the task can never run
    # again, so it is ended and its key goes to the next waiter.
    locks = impl.LockManager()
    locks.acquire("k")
    loop = asyncio.new_event_loop()

    async def waiter() -> None:
        await locks.aio.acquire("k")
        raise AssertionError("the task ran after its loop was closed")

    async def until_queued() -> None:
        while locks.stats().waiting != 1:
            await asyncio.sleep(0.001)

    task = loop.create_task(waiter())
    loop.run_until_complete(asyncio.wait_for(until_queued(), PATIENCE))
    locks.release("k")  # granted to the task, whose loop is not running
    assert locks.owner("k") is task
    loop.close()
    assert not locks.locked("k") and len(locks) == 0
    assert locks.acquire("k", timeout=0)
    locks.release("k")


def test_a_grant_made_by_the_loops_own_thread_before_it_closes_is_released(impl) -> None:
    # The same with the post made on the loop's own thread (its future resolved): the loop
    # stops before the task resumes, and closing it drops that resumption.
    locks = impl.LockManager()
    loop = asyncio.new_event_loop()

    async def waiter() -> None:
        await locks.aio.acquire("k")
        raise AssertionError("the task ran after its loop was closed")

    def release_and_stop() -> None:
        locks.release("k")
        loop.stop()

    async def until_queued() -> None:
        while locks.stats().waiting != 1:
            await asyncio.sleep(0.001)

    locks.acquire("k")
    task = loop.create_task(waiter())
    loop.run_until_complete(asyncio.wait_for(until_queued(), PATIENCE))
    loop.call_soon(release_and_stop)
    loop.run_forever()
    assert locks.owner("k") is task
    loop.close()
    assert not locks.locked("k") and len(locks) == 0


def test_a_dropped_post_collected_inside_a_section_still_ends_the_task(impl) -> None:
    # The closed loop's dropped post is kept alive by a reference cycle, and the collector
    # finalizes it while this thread runs a section of the pure twin (a section of the
    # compiled core runs no Python code: there it is collected after). The manager cannot
    # be called there, so the task is ended from a thread of its own: its keys still go.
    locks = impl.LockManager()
    loop = asyncio.new_event_loop()

    async def waiter() -> None:
        await locks.aio.acquire("t")
        await locks.aio.acquire("k")

    async def until_queued() -> None:
        while locks.stats().waiting != 1:
            await asyncio.sleep(0.001)

    def collect_in_a_section(frame: Any, event: str, arg: object) -> None:
        name = frame.f_code.co_name
        if event == "call" and name.endswith("_section") and name not in ("_section",
                                                                          "_run_section"):
            sys.settrace(None)
            gc.collect()

    locks.acquire("k")
    task = loop.create_task(waiter())
    loop.run_until_complete(asyncio.wait_for(until_queued(), PATIENCE))
    with abandoned_warnings() as warned:  # the task may be ended by a thread of its own
        gc.disable()
        try:
            locks.release("k")  # granted to the task: its post waits in the loop's ready queue
            kept = list(loop._ready)  # type: ignore[attr-defined]
            kept.append(kept)  # a cycle: only the collector frees the dropped post
            del kept
            loop.close()
            assert locks.owner("t") is task
            sys.settrace(collect_in_a_section)
            try:
                locks.acquire_many(["o1", "o2"])
            finally:
                sys.settrace(None)
            locks.release_many(["o1", "o2"])
        finally:
            gc.enable()
        gc.collect()
        # The ending thread releases the keys, then warns: wait for the warning, not the keys.
        wait_until(lambda: bool(warned), "the task whose loop closed is ended")
    assert not locks.locked("t") and not locks.locked("k")
    assert [str(w.message) for w in warned] == [
        f"task {task.get_name()!r} ended holding key 't'; released it"]
