"""A task's wait: published only once its request is queued, and never deaf to a grant.

Two promises of the asyncio layer, on both engines:

- Nothing of a task's wait exists before its request is queued: an exception while the
  request is being prepared (a key's ``__eq__`` raising, or a signal handler's
  KeyboardInterrupt inside it) leaves the table and the task's token as they were.
- The future a waiting task sleeps on exists before it checks for a post: a grant posted
  at any point of the wait (by a signal handler's release on the loop's thread, say) wakes
  the task.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from typing import Any

import pytest

from conftest import PATIENCE
from test_aio import until
from lockmgr import _aio, _owners

# A thread (the loop's own) holds a key whose __eq__ raises; a task asks for another key
# of the same hash, so the engine must compare them, and the comparison raises. The task
# then goes on acquiring and ends; nothing may crash, and nothing may stay held or queued.
RAISING_KEY = r"""
import asyncio, importlib, sys, warnings
warnings.simplefilter("error")
impl = importlib.import_module(sys.argv[1])
path, raised = sys.argv[2], {"ValueError": ValueError,
                             "KeyboardInterrupt": KeyboardInterrupt}[sys.argv[3]]

class Key:
    def __init__(self, raises):
        self.raises = raises
    def __hash__(self):
        return 7
    def __eq__(self, other):
        if self.raises or getattr(other, "raises", False):
            raise raised("comparison failed")
        return self is other

held, asked = Key(True), Key(False)
locks = impl.LockManager()
assert locks.acquire(held)

async def ask():
    if path == "async with aio[k]":
        async with locks.aio[asked]:
            pass
    elif path == "aio.acquire":
        await locks.aio.acquire(asked)
    else:
        await locks.aio.acquire_many([asked, "other"])

async def main():
    for _ in range(3):
        try:
            await ask()
        except raised:
            pass
        else:
            raise AssertionError("the comparison did not raise")
        assert locks.stats().waiting == 0 and len(locks) == 1
        async with locks.aio["after"]:  # the task goes on acquiring
            assert locks.aio.owned("after")
        await locks.aio.acquire("later")
        locks.aio.release("later")

asyncio.run(main())  # the task ends here: nothing of a half-made wait may be left
locks.release(held)
assert len(locks) == 0 and locks.stats().waiting == 0, (len(locks), locks.stats())
print("ok")
"""


@pytest.mark.parametrize("raised", ["ValueError", "KeyboardInterrupt"])
@pytest.mark.parametrize("path", ["async with aio[k]", "aio.acquire", "aio.acquire_many"])
def test_a_key_comparison_raising_while_a_task_asks_leaves_no_wait_behind(impl, path,
                                                                          raised) -> None:
    """Run in a child: on the compiled core a half-registered wait was abandoned as if
    queued, which crashed the process (NULL token or entry)."""
    done = subprocess.run(
        [sys.executable, "-c", RAISING_KEY, impl.__name__, path, raised],
        capture_output=True, text=True, timeout=PATIENCE * 3)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-3000:]


# -- a grant at every point of a wait ----------------------------------------------------

#: The Python code a waiting task runs (the compiled core's wait runs the same coroutine).
WAIT_CODE = {_aio._wait_for_grant.__code__, _owners.Waker.sleep.__code__}


class _ReleaseAtStep:
    """A trace function that runs ``release()`` once, before the ``target``-th step (counted
    from 0) of the wait's code, a step being an instruction or a line: what a signal handler
    would do there. (CPython 3.12.1 reports no instructions of a coroutine that C code
    resumes, the compiled core's case; its lines still cover every statement boundary.)
    ``seen`` counts the steps traced."""

    def __init__(self, target: int, release: Any) -> None:
        self.target = target
        self.release = release
        self.seen = 0
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code not in WAIT_CODE:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = True
        return self.local

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" or event == "line":
            if self.seen == self.target and not self.fired:
                self.fired = True
                self.release()
            self.seen += 1
        return self.local


def _waits_with_a_release_at(impl: Any, target: int) -> _ReleaseAtStep:
    """A task waits for "k", which its loop's thread holds; the thread's release runs
    before the ``target``-th step of the wait. If the wait parks before that step, the
    loop's thread releases "k" once it is parked, and the count goes on
    through the rest of the wait (a release there finds nothing to do). The task must get
    "k" either way."""
    locks = impl.LockManager()
    assert locks.acquire("k")  # the loop's thread, as a thread

    def release_if_held() -> None:
        if locks.owned("k"):
            locks.release("k")

    tracer = _ReleaseAtStep(target, release_if_held)

    async def waits() -> None:
        sys.settrace(tracer)
        try:
            assert await locks.aio.acquire("k")
        finally:
            sys.settrace(None)
        locks.aio.release("k")

    async def main() -> None:
        task = asyncio.create_task(waits())
        # The task runs only while this one is suspended: once it waits and the release
        # has not run, it is parked on its future.
        await until(lambda: task.done() or tracer.fired or locks.stats().waiting == 1,
                    "the task waits")
        if not tracer.fired:
            release_if_held()
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except TimeoutError:
            task.cancel()
            raise AssertionError(
                f"the grant posted before step {target} of the wait was lost: "
                "the task still waits") from None

    asyncio.run(main())
    assert len(locks) == 0 and locks.stats().waiting == 0
    return tracer


def test_a_grant_posted_at_any_step_of_a_wait_wakes_the_task(impl) -> None:
    """Driven step by step (a trace function stands in for the signal
    handler): before the fix, a post landing between the wait's check for a post and the
    creation of its future was lost, and the task slept for ever."""
    target = 0
    while True:
        tracer = _waits_with_a_release_at(impl, target)
        if tracer.seen <= target:  # past the wait's last step: all were tried
            break
        target += 1
        assert target < 5000, "the wait never ends"
    assert target > 10, f"only {target} steps traced: the trace missed the wait"


# -- one ending per wait ---------------------------------------------------------------------

# A task queued for "k" whose loop was closed (stranded). Two threads end its wait at once:
# one releases "k" (the grant finds the loop closed and ends the task), the other closes the
# task's coroutine (its wait gives up). Exactly one of them may end the wait.
TWO_ENDINGS = r"""
import asyncio, importlib, sys, threading, warnings
warnings.simplefilter("ignore")
impl = importlib.import_module(sys.argv[1])
for _ in range(int(sys.argv[2])):
    locks = impl.LockManager()
    held, go = threading.Event(), threading.Barrier(2)
    def holder():
        locks.acquire("k"); held.set(); go.wait(); locks.release("k")
    releaser = threading.Thread(target=holder); releaser.start(); held.wait()
    loop = asyncio.new_event_loop()
    async def waiter():
        await locks.aio.acquire("k")
    task = loop.create_task(waiter())
    async def until_queued():
        while not locks.stats().waiting:
            await asyncio.sleep(0)
    loop.run_until_complete(until_queued())
    loop.close()  # with the task queued for "k": stranded
    task._log_destroy_pending = False
    def closer():
        go.wait(); task.get_coro().close()
    closing = threading.Thread(target=closer); closing.start()
    releaser.join(); closing.join()
    assert len(locks) == 0 and locks.stats().waiting == 0, (len(locks), locks.stats())
print("ok")
"""


def test_a_wait_two_threads_end_at_once_is_ended_once(impl) -> None:
    """In a child, 2,000 rounds (free-threaded, both endings really run at once): the compiled
    core let both give the wait back, and the second freed an entry the first had freed
    (SIGSEGV on 3.13t with the GIL off, 2 runs of 3 at 1,500 rounds)."""
    done = subprocess.run([sys.executable, "-c", TWO_ENDINGS, impl.__name__, "2000"],
                          capture_output=True, text=True, timeout=PATIENCE * 6)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-3000:]


def test_one_acquisition_awaited_by_two_tasks_refuses_the_second(impl) -> None:
    """As a coroutine does: the second awaiter gets RuntimeError at once, and the first
    gets the key (two tasks on one wait would tell the wrong one it holds the key)."""
    locks = impl.LockManager()

    async def main() -> None:
        assert await locks.aio.acquire("k")
        shared = locks.aio.acquire("k")
        outcomes: dict[str, Any] = {}

        async def awaits(name: str) -> None:
            try:
                outcomes[name] = await shared
            except RuntimeError as error:
                outcomes[name] = str(error)
            outcomes[name, "owns"] = locks.aio.owned("k")
            if outcomes[name] is True:
                locks.aio.release("k")

        first = asyncio.create_task(awaits("first"))
        await until(lambda: locks.stats().waiting == 1, "the first task waits")
        second = asyncio.create_task(awaits("second"))
        locks.aio.release("k")
        await asyncio.gather(first, second)
        assert outcomes == {"first": True, ("first", "owns"): True,
                            "second": "coroutine is being awaited already",
                            ("second", "owns"): False}

    asyncio.run(asyncio.wait_for(main(), PATIENCE))
    assert len(locks) == 0 and locks.stats().waiting == 0


class _RaiseAfterTheGrant:
    """A trace function that raises KeyboardInterrupt (as a signal handler may, at the check
    point after a call) on the line of ``_wait_for_grant`` that follows ``wait.complete()``."""

    def __init__(self) -> None:
        lines, first = inspect.getsourcelines(_aio._wait_for_grant)
        at = next(i for i, line in enumerate(lines) if "wait.complete()" in line)
        self.line = first + at + 1
        assert "return True" in lines[at + 1], lines[at + 1]
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self.local if frame.f_code is _aio._wait_for_grant.__code__ else None

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == self.line and not self.fired:
            self.fired = True
            raise KeyboardInterrupt("a handler's, as the granted wait returns")
        return self.local


@pytest.mark.parametrize("kind", ["aio[key]", "hold", "hold_many"])
def test_an_exception_as_a_granted_wait_returns_gives_back_the_key_and_the_record(
        impl, kind) -> None:
    """The ``async with`` never reaches its body, so no exit runs: the grant and the
    object's record go back at once. A stored object stays usable by other tasks."""
    locks = impl.LockManager()
    stored = {"aio[key]": lambda: locks.aio["k"], "hold": lambda: locks.aio.hold("k"),
              "hold_many": lambda: locks.aio.hold_many(["k", "j"])}[kind]()

    async def main() -> None:
        release = asyncio.Event()

        async def holder() -> None:
            async with locks.aio["k"]:
                await release.wait()

        other = asyncio.create_task(holder())
        await until(lambda: "k" in locks, "another task holds k")
        asyncio.get_running_loop().call_soon(release.set)
        tracer = _RaiseAfterTheGrant()
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                async with stored:
                    raise AssertionError("the body ran")
        finally:
            sys.settrace(None)
        assert tracer.fired
        assert not locks.aio.owned("k") and len(locks) == 0
        await other

        async def later() -> None:
            async with stored:
                assert locks.aio.owned("k")

        await asyncio.create_task(later())

    asyncio.run(asyncio.wait_for(main(), PATIENCE))
    assert len(locks) == 0 and locks.stats().waiting == 0
