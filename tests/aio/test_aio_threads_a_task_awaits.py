"""A thread a task awaits (``asyncio.to_thread``) waiting for that task: refused at once when
certain, else logged as such when it waits long; on both engines."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from conftest import PATIENCE
from lockmgr import DeadlockError
from lockmgr._owners import AWAITED_THREAD
from test_aio import run, until


def acquire_in_thread(locks: Any, key: object) -> tuple[int, Any]:
    """What ``locks.acquire(key)`` did in this thread: (its ident, the error it raised, or
    True once it got the key and gave it back)."""
    try:
        locks.acquire(key, timeout=PATIENCE)
    except DeadlockError as error:
        return threading.get_ident(), error
    locks.release(key)
    return threading.get_ident(), True


def test_a_thread_the_task_awaits_waiting_for_its_key_is_a_deadlock_error(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        async with locks.aio["k"]:
            ident, error = await asyncio.to_thread(acquire_in_thread, locks, "k")
            assert isinstance(error, DeadlockError)
            task = asyncio.current_task()
            assert error.cycle == [(ident, "k"), (task, AWAITED_THREAD)]
            assert "awaits the thread (asyncio.to_thread)" in str(error)
            assert locks.owner("k") is task and locks.stats().waiting == 0
        assert not locks.locked("k")

    run(main)
    assert len(locks) == 0 and locks.stats().deadlocks == 1


def test_a_thread_the_task_awaits_waiting_for_a_task_that_waits_for_it_is_refused(impl) -> None:
    locks = impl.LockManager()

    async def main() -> None:
        async with locks.aio["a"]:
            async def other() -> None:
                async with locks.aio["b"]:
                    async with locks.aio["a"]:  # waits for main
                        pass

            waiter = asyncio.create_task(other(), name="other")
            await until(lambda: locks.stats().waiting == 1, "the other task waits for a")
            ident, error = await asyncio.to_thread(acquire_in_thread, locks, "b")
            assert isinstance(error, DeadlockError)
            assert error.cycle == [(ident, "b"), (waiter, "a"),
                                   (asyncio.current_task(), AWAITED_THREAD)]
        await waiter

    run(main)
    assert len(locks) == 0


def test_a_thread_of_a_task_the_holder_created_waits_for_the_key(impl) -> None:
    """The child task inherits the holder's context, but the holder does not await it."""
    locks = impl.LockManager()

    async def main() -> None:
        async with locks.aio["k"]:
            child = asyncio.create_task(asyncio.to_thread(acquire_in_thread, locks, "k"))
            await until(lambda: locks.stats().waiting == 1, "the child's thread waits")
        _, outcome = await child
        assert outcome is True

    run(main)
    assert len(locks) == 0 and locks.stats().deadlocks == 0


def test_a_thread_run_in_executor_knows_no_task_and_waits(impl) -> None:
    """run_in_executor does not copy the task's context: the thread cannot know it is
    awaited, and waits (here until its timeout)."""
    locks = impl.LockManager()

    async def main() -> None:
        async with locks.aio["k"]:
            got = await asyncio.get_running_loop().run_in_executor(
                None, lambda: locks.acquire("k", timeout=0.05))
            assert got is False
            assert locks.stats().timeouts == 1

    run(main)
    assert len(locks) == 0 and locks.stats().deadlocks == 0


@contextmanager
def warnings_logged() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("lockmgr")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_slow_wait_of_a_thread_in_the_holders_context_says_so(impl) -> None:
    locks = impl.LockManager(log_waits_after=0.01)

    async def main() -> None:
        with warnings_logged() as records:
            async with locks.aio["k"]:
                child = asyncio.create_task(asyncio.to_thread(acquire_in_thread, locks, "k"))
                await until(lambda: records, "the slow-wait warning")
            await child
        text = records[0].getMessage()
        name = asyncio.current_task().get_name()  # type: ignore[union-attr]
        assert f"held by task {name!r}" in text, text
        assert text.endswith(
            f"; this thread runs in the context of task {name!r} (likely asyncio.to_thread), "
            "which it waits for: if that task awaits this thread, it waits for itself"), text

    run(main)
    assert len(locks) == 0


def test_a_slow_wait_of_a_thread_in_no_holders_context_says_nothing_of_it(impl) -> None:
    locks = impl.LockManager(log_waits_after=0.01)

    async def main() -> None:
        with warnings_logged() as records:
            async with locks.aio["k"]:
                async def holder() -> None:
                    async with locks.aio["other"]:
                        await asyncio.to_thread(acquire_in_thread, locks, "k")

                child = asyncio.create_task(holder())
                await until(lambda: records, "the slow-wait warning")
            await child
        assert "context" not in records[0].getMessage()

    run(main)
    assert len(locks) == 0
