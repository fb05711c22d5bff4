"""Whose hold an ``async with`` block gives back, on both engines.

The objects ``aio[key]``, ``aio.hold(key)``, ``aio.hold_many(keys)``, ``rw.aio.read(key)``,
``rw.aio.write(key)`` and ``rw.aio.hold_many(...)`` each record which task is inside them
and how many times: written once ``__aenter__`` has acquired (at once, or when its wait is
granted), never before. ``__aexit__`` gives back exactly that task's hold, whatever runs
it: the task itself, another task, none (the garbage collector), or another thread (then
the release is sent to the task's loop; if that loop is closed, the task is ended). If
lockmgr has ended that task, its ending released everything and the exit releases nothing;
if the task released the key itself inside the block, the exit raises NotOwnedError.

One task is inside an object at a time and may nest it. Another task's entry waits for the
key as usual, and raises RuntimeError, taking nothing, if the object is still another
task's when it would enter (two readers of one ``read()`` object; a task that ended inside
it, whose coroutine is not closed yet). An exit with no block inside raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import subprocess
import sys
import threading
import types
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import nullcontext
from typing import Any

import pytest

from conftest import (
    PATIENCE,
    Delegating,
    Worker,
    abandoned_warnings,
    block_records,
    held_by_another_task,
)
from lockmgr import AsyncRWLockManager, NotOwnedError
from lockmgr._errors import block_in_use, not_entered
from test_aio import run, until

#: What the RuntimeError of an entry says when the object is another task's.
IN_USE = "already entered by another task"
#: ... when it is a task's that ended inside it.
ENDED_INSIDE = "already entered by a task that ended inside it"
EXIT_NOT_ENTERED = "not entered"


@types.coroutine
def _suspend() -> Any:
    """Suspend the coroutine driving it, outside any event loop machinery."""
    yield "suspended"


def _stranded(coroutine: Coroutine[Any, Any, None], condition: Callable[[], bool],
              what: str) -> asyncio.Task[None]:
    """A task running ``coroutine`` on a loop closed (with the task pending, as after a
    second Ctrl-C) once ``condition`` holds: stranded, never to run again."""
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(coroutine)
        loop.run_until_complete(until(condition, what))
    finally:
        loop.close()
    task._log_destroy_pending = False  # pending for good, as meant: no log when collected
    return task


def _record(block: Any) -> Any:
    """The record of ``block`` (the compiled core's ``aio[key]`` is its own)."""
    return getattr(block, "_record", block)


def _is_rw(locks: Any) -> bool:
    return isinstance(locks.aio, AsyncRWLockManager)


def _take_write(locks: Any) -> Callable[..., Any]:
    return locks.aio.acquire_write if _is_rw(locks) else locks.aio.acquire


# -- the objects, each taking "k" (and for hold_many "j") -------------------------------------

KINDS: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], None]]] = {
    # kind: the manager's class, a fresh object of that kind, and the task's own release of
    # what a block of it holds
    "aio[key]": ("LockManager", lambda m: m.aio["k"], lambda m: m.aio.release("k")),
    "hold": ("LockManager", lambda m: m.aio.hold("k"), lambda m: m.aio.release("k")),
    "hold_many": ("LockManager", lambda m: m.aio.hold_many(["k", "j"]),
                  lambda m: m.aio.release_many(["k", "j"])),
    "read": ("RWLockManager", lambda m: m.aio.read("k"), lambda m: m.aio.release_read("k")),
    "write": ("RWLockManager", lambda m: m.aio.write("k"), lambda m: m.aio.release_write("k")),
    "rw hold_many": ("RWLockManager", lambda m: m.aio.hold_many(reads=["j"], writes=["k"]),
                     lambda m: m.aio.release_many(reads=["j"], writes=["k"])),
}

#: The current task's (write, read) levels of "k" then "j" inside one block of each kind.
ENTERED = {
    "aio[key]": (1, 0, 0, 0),
    "hold": (1, 0, 0, 0),
    "hold_many": (1, 0, 1, 0),
    "read": (0, 1, 0, 0),
    "write": (1, 0, 0, 0),
    "rw hold_many": (1, 0, 0, 1),
}
NOTHING = (0, 0, 0, 0)


def _manager(impl: Any, kind: str) -> Any:
    return getattr(impl, KINDS[kind][0])()


def _fresh(locks: Any, kind: str) -> Any:
    return KINDS[kind][1](locks)


def _levels(locks: Any) -> tuple[int, int, int, int]:
    """The current task's (write, read) levels of "k", then of "j"."""
    return tuple(locks._task_levels("k")) + tuple(locks._task_levels("j"))  # type: ignore


def _times(levels: tuple[int, ...], times: int) -> tuple[int, ...]:
    return tuple(level * times for level in levels)


def _free(locks: Any) -> bool:
    return "k" not in locks and "j" not in locks


# -- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_block_gives_back_its_tasks_hold_and_one_task_may_nest_it(impl, kind) -> None:
    locks = _manager(impl, kind)

    async def main() -> None:
        block = _fresh(locks, kind)
        me = asyncio.current_task()
        assert _record(block)._inside == (None, 0)
        async with block:
            assert _levels(locks) == ENTERED[kind] and _record(block)._inside == (me, 1)
            async with block:
                assert _levels(locks) == _times(ENTERED[kind], 2)
                assert _record(block)._inside == (me, 2)
            assert _levels(locks) == ENTERED[kind] and _record(block)._inside == (me, 1)
        assert _levels(locks) == NOTHING and _free(locks)
        assert _record(block)._inside == (None, 0)
        async with block:  # and it serves again
            assert _levels(locks) == ENTERED[kind]
        assert _free(locks)

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_object_records_its_task_once_the_key_is_granted(impl, kind) -> None:
    """A task waiting in ``__aenter__`` is not inside the object yet; the grant enters it."""
    locks = _manager(impl, kind)

    async def main() -> None:
        block = _fresh(locks, kind)
        inside, leave = asyncio.Event(), asyncio.Event()

        async def holder() -> None:  # holds "k" for writing, through another object
            await _take_write(locks)("k")
            inside.set()
            await leave.wait()
            (locks.aio.release_write if _is_rw(locks) else locks.aio.release)("k")

        async def enters() -> None:
            async with block:
                assert _record(block)._inside == (asyncio.current_task(), 1)
                assert _levels(locks) == ENTERED[kind]

        other = asyncio.create_task(holder())
        await inside.wait()
        entering = asyncio.create_task(enters())
        await until(lambda: locks.stats().waiting == 1, "the task waits to enter")
        assert _record(block)._inside == (None, 0)
        leave.set()
        await entering
        await other
        assert _free(locks) and _record(block)._inside == (None, 0)

    run(main)


@pytest.mark.parametrize("how", ["__aexit__", "driven out", "aclose"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_exit_run_by_another_task_gives_back_the_entering_tasks_hold(impl, kind,
                                                                       how) -> None:
    """A task is inside a block (entered by hand, or in an async generator); another live
    task runs the exit: by calling ``__aexit__``, by driving the generator out of the block,
    or by ``aclose()``. The entering task's hold goes, nothing is raised, and the entering
    task, living on, holds nothing (its end warns of nothing)."""
    locks = _manager(impl, kind)

    async def main() -> None:
        block = _fresh(locks, kind)

        async def in_block() -> AsyncIterator[None]:
            async with block:
                yield

        generator = in_block()
        entered, may_end = asyncio.Event(), asyncio.Event()

        async def enters() -> None:
            if how == "__aexit__":
                await block.__aenter__()
            else:
                await generator.__anext__()
            assert _levels(locks) == ENTERED[kind]
            entered.set()
            await may_end.wait()
            assert _levels(locks) == NOTHING  # another task's exit gave it back

        async def exits() -> None:
            assert _levels(locks) == NOTHING
            if how == "__aexit__":
                await block.__aexit__(None, None, None)
            elif how == "driven out":
                with pytest.raises(StopAsyncIteration):
                    await generator.__anext__()
            else:
                await generator.aclose()

        owner = asyncio.create_task(enters())
        await entered.wait()
        assert not _free(locks)
        await asyncio.create_task(exits())
        assert _free(locks) and _record(block)._inside == (None, 0)
        may_end.set()
        with abandoned_warnings() as caught:
            await owner
        assert not caught, caught

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_exit_run_on_another_thread_gives_back_the_hold_on_the_owners_loop(impl,
                                                                             kind) -> None:
    """A coroutine this task drove into a block is closed by another thread: the exit sends
    the release to this task's loop, which runs it at its next iteration."""
    locks = _manager(impl, kind)

    async def main() -> None:
        block = _fresh(locks, kind)

        async def in_block() -> None:
            async with block:
                await _suspend()

        coroutine = in_block()
        assert coroutine.send(None) == "suspended"
        assert _levels(locks) == ENTERED[kind]
        errors: list[BaseException] = []

        def close() -> None:
            try:
                coroutine.close()
            except BaseException as error:  # handed to the test
                errors.append(error)

        thread = threading.Thread(target=close)
        thread.start()
        thread.join(PATIENCE)  # (the loop does not run meanwhile: this task blocks it)
        assert not thread.is_alive() and not errors, errors
        assert _levels(locks) == ENTERED[kind], "released before the loop ran again"
        await until(lambda: _free(locks), "the release sent to the task's loop runs")
        assert _levels(locks) == NOTHING and _record(block)._inside == (None, 0)

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("closed_on", ["the loop's thread", "another thread"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_exit_for_a_task_whose_loop_is_closed_ends_that_task(impl, kind,
                                                                closed_on) -> None:
    """A task inside a block (and holding "x" besides) is stranded on a closed loop, not
    ended yet. Its coroutine is closed, by the thread that ran the loop or by another: the
    task can never run again (the release cannot be sent to its loop), so the exit ends it:
    everything it held goes, with AbandonedLockWarning."""
    locks = _manager(impl, kind)
    block = _fresh(locks, kind)

    async def in_block() -> None:
        await _take_write(locks)("x")
        async with block:
            await asyncio.get_running_loop().create_future()  # never done

    task = _stranded(in_block(), lambda: "k" in locks, "the task is inside")
    assert "x" in locks and "k" in locks
    errors: list[BaseException] = []

    def close() -> None:
        try:
            task.get_coro().close()
        except BaseException as error:  # handed to the test
            errors.append(error)

    with abandoned_warnings() as caught:
        if closed_on == "another thread":
            thread = threading.Thread(target=close)  # started inside: see abandoned_warnings
            thread.start()
            thread.join(PATIENCE)
            assert not thread.is_alive()
        else:
            close()
    assert not errors, errors
    assert _free(locks) and "x" not in locks and locks.stats().waiting == 0
    assert any("'k'" in str(warning.message) for warning in caught), caught
    assert _record(block)._inside == (None, 0)
    run(lambda: _enter_and_leave(block))  # the object serves again
    assert len(locks) == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_exit_of_an_object_not_entered_raises_runtime_error_and_changes_nothing(
        impl, kind) -> None:
    locks = _manager(impl, kind)
    block = _fresh(locks, kind)
    with pytest.raises(RuntimeError, match=EXIT_NOT_ENTERED):  # outside any loop
        block.__aexit__(None, None, None)

    async def main() -> None:
        with pytest.raises(RuntimeError, match=EXIT_NOT_ENTERED):
            await block.__aexit__(None, None, None)
        inside, leave = asyncio.Event(), asyncio.Event()

        async def other() -> None:  # another task inside an object of its own
            async with _fresh(locks, kind):
                inside.set()
                await leave.wait()
                assert _levels(locks) == ENTERED[kind]

        holder = asyncio.create_task(other())
        await inside.wait()
        with pytest.raises(RuntimeError, match=EXIT_NOT_ENTERED):
            await block.__aexit__(None, None, None)
        leave.set()
        await holder  # (its own check: the other task's hold was kept)
        async with _fresh(locks, kind):  # this task inside another object of that kind
            with pytest.raises(RuntimeError, match=EXIT_NOT_ENTERED):
                await block.__aexit__(None, None, None)
            assert _levels(locks) == ENTERED[kind]
        async with block:
            pass
        with pytest.raises(RuntimeError, match=EXIT_NOT_ENTERED):  # one exit too many
            await block.__aexit__(None, None, None)
        assert _free(locks)

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_exit_after_its_task_released_the_key_raises_not_owned_and_keeps_another_tasks(
        impl, kind) -> None:
    """A task releases what its block holds, inside the block; another task takes it. The
    block's exit raises NotOwnedError (as ``with lock: lock.release()`` does), and the other
    task keeps its hold."""
    locks = _manager(impl, kind)

    async def main() -> None:
        released, taken, leave = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first() -> None:
            with pytest.raises(NotOwnedError):
                async with _fresh(locks, kind):
                    KINDS[kind][2](locks)
                    assert _levels(locks) == NOTHING
                    released.set()
                    await taken.wait()
            assert _levels(locks) == NOTHING

        async def second() -> None:
            await released.wait()
            async with _fresh(locks, kind):
                taken.set()
                await leave.wait()
                assert _levels(locks) == ENTERED[kind], "another task's exit took this hold"

        a, b = asyncio.create_task(first()), asyncio.create_task(second())
        await a
        assert not _free(locks)
        leave.set()
        await b
        assert _free(locks)

    run(main)
    assert len(locks) == 0


def test_a_grant_into_a_shared_view_its_first_task_is_still_inside_raises_and_passes_on(
        impl) -> None:
    """Task a, inside a shared ``aio[key]`` view, releases "k" itself. The grant goes to
    task b, waiting to enter the same view, which is still a's: b's entry raises
    RuntimeError and hands the grant to the next waiter, c. a's exit then raises
    NotOwnedError, and c keeps "k"."""
    locks = impl.LockManager()
    shared = locks.aio["k"]

    async def main() -> None:
        a_inside, a_may_release, a_may_leave = (asyncio.Event() for _ in range(3))
        c_holds, c_may_end = asyncio.Event(), asyncio.Event()

        async def a_task() -> None:
            with pytest.raises(NotOwnedError):
                async with shared:
                    a_inside.set()
                    await a_may_release.wait()
                    locks.aio.release("k")
                    await a_may_leave.wait()

        async def b_task() -> None:
            async with shared:
                pytest.fail("b entered a view a is inside")

        async def c_task() -> None:
            await locks.aio.acquire("k")
            c_holds.set()
            await c_may_end.wait()
            assert locks.aio.recursion_count("k") == 1
            locks.aio.release("k")

        a = asyncio.create_task(a_task())
        await a_inside.wait()
        b = asyncio.create_task(b_task())
        await until(lambda: locks.stats().waiting == 1, "b waits to enter")
        c = asyncio.create_task(c_task())
        await until(lambda: locks.stats().waiting == 2, "c waits behind b")
        a_may_release.set()
        with pytest.raises(RuntimeError, match=IN_USE):
            await b
        await c_holds.wait()
        assert locks.owner("k") is c
        a_may_leave.set()
        await a
        assert locks.owner("k") is c and locks.stats().waiting == 0
        c_may_end.set()
        await c
        assert "k" not in locks
        async with shared:  # the view serves again
            assert locks.aio.recursion_count("k") == 1

    run(main)
    assert len(locks) == 0


INDIRECT = ["AsyncExitStack", "delegating wrapper", "by hand"]


@contextlib.asynccontextmanager
async def _indirectly(how: str, target: Any) -> AsyncIterator[None]:
    """A block on ``target`` entered and exited in other frames than the block's."""
    if how == "AsyncExitStack":
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(target)
            yield
    elif how == "delegating wrapper":
        async with Delegating(target):
            yield
    else:
        await target.__aenter__()
        try:
            yield
        finally:
            await target.__aexit__(None, None, None)


@pytest.mark.parametrize("how", INDIRECT)
@pytest.mark.parametrize("kind", list(KINDS))
def test_blocks_entered_and_exited_in_other_frames_give_back_the_tasks_hold(impl, kind,
                                                                           how) -> None:
    locks = _manager(impl, kind)

    async def main() -> None:
        block = _fresh(locks, kind)
        for _ in range(2):
            async with _indirectly(how, block):
                assert _levels(locks) == ENTERED[kind]
                async with _indirectly(how, block):
                    assert _levels(locks) == _times(ENTERED[kind], 2)
                assert _levels(locks) == ENTERED[kind]
            assert _free(locks) and _record(block)._inside == (None, 0)

    run(main)
    assert len(locks) == 0


def test_both_engines_word_their_errors_alike() -> None:
    """The same misuse raises the same error with the same text on both engines."""
    said: dict[str, dict[str, tuple[str, str]]] = {}
    for name in ("lockmgr._core", "lockmgr._pure"):
        impl = importlib.import_module(name)
        locks, rw = impl.LockManager(), impl.RWLockManager()
        got: dict[str, tuple[str, str]] = {}

        def note(what: str, error: BaseException, got: dict[str, tuple[str, str]] = got,
                 task: Any = None) -> None:
            text = str(error) if task is None else str(error).replace(repr(task), "<task>")
            got[what] = (type(error).__name__, text)

        async def main(locks: Any = locks, rw: Any = rw, note: Any = note) -> None:
            view = locks.aio["k"]
            with pytest.raises(RuntimeError) as caught:
                await view.__aexit__(None, None, None)
            note("not entered", caught.value)

            shared_read = rw.aio.read("k")
            inside, leave = asyncio.Event(), asyncio.Event()

            async def reads() -> None:
                async with shared_read:
                    inside.set()
                    await leave.wait()

            reader = asyncio.create_task(reads(), name="reader")
            await inside.wait()
            with pytest.raises(RuntimeError) as caught:
                async with shared_read:
                    pass
            note("another task inside", caught.value, task=reader)
            leave.set()
            await reader

            with pytest.raises(NotOwnedError) as caught:
                async with view:
                    locks.aio.release("k")
            # (the task's name, which differs from run to run, shown as <task>)
            note("released inside", caught.value, task=asyncio.current_task().get_name())

            async def ends_inside() -> Any:
                coroutine = _block_on(view)
                assert coroutine.send(None) == "suspended"
                return coroutine

            with abandoned_warnings():
                left = await asyncio.create_task(ends_inside())
                await until(lambda: "k" not in locks, "the ended task's key is released")
            with pytest.raises(RuntimeError) as caught:
                async with view:
                    pass
            note("a task ended inside", caught.value)
            left.close()

        run(main)
        said[name] = got
    assert said["lockmgr._core"] == said["lockmgr._pure"], said
    texts = said["lockmgr._core"]
    assert texts["not entered"] == ("RuntimeError", str(not_entered()))
    assert texts["released inside"] == ("NotOwnedError",
                                        "key 'k' is not held by the calling task <task>")
    assert texts["a task ended inside"] == ("RuntimeError", str(block_in_use(None, True)))
    assert texts["another task inside"] == ("RuntimeError", str(block_in_use("<task>", False))
                                            .replace("'<task>'", "<task>"))


async def _block_on(view: Any) -> None:
    async with view:
        await _suspend()


# -- one object shared by several tasks ---------------------------------------------------------
# A stored aio[key] view, or hold()/write() object, used by several tasks works as an
# asyncio.Lock does: one task is inside at a time, the others wait for the key.


def _shared(locks: Any, style: str) -> Any:
    """The one block object of "k" that every task of a test of ``style`` shares."""
    if style == "one shared hold":
        return locks.aio.hold("k")
    if style == "one shared read":
        return locks.aio.read("k")
    if style == "one shared write":
        return locks.aio.write("k")
    return None if _is_rw(locks) else locks.aio["k"]


def _reads(style: str) -> bool:
    return style in ("read", "one shared read")


SHARED_STYLES = ["one shared aio[key]", "one shared hold", "one shared read"]
EXCLUSIVE_SHARED_STYLES = ["one shared aio[key]", "one shared hold", "one shared write"]
SHARED_MANAGER = {"one shared aio[key]": "LockManager", "one shared hold": "LockManager",
                  "one shared read": "RWLockManager", "one shared write": "RWLockManager"}


@pytest.mark.parametrize("style", EXCLUSIVE_SHARED_STYLES)
def test_one_object_shared_by_two_tasks_gives_back_each_tasks_own_hold(impl, style) -> None:
    """Task a is inside; task b enters the same object and waits; a's exit gives back a's
    hold (a lives on), so b enters while a still runs; b's exit gives back b's."""
    locks = getattr(impl, SHARED_MANAGER[style])()
    shared = _shared(locks, style)

    async def main() -> None:
        a_inside, a_may_leave, a_left, a_may_end = (asyncio.Event() for _ in range(4))
        b_inside, b_may_leave = asyncio.Event(), asyncio.Event()

        async def a_task() -> None:
            async with shared:
                a_inside.set()
                await a_may_leave.wait()
            assert _levels(locks) == NOTHING
            a_left.set()
            await a_may_end.wait()  # a lives on after its block

        async def b_task() -> None:
            async with shared:
                assert _levels(locks) == (1, 0, 0, 0)
                b_inside.set()
                await b_may_leave.wait()
            assert _levels(locks) == NOTHING

        a = asyncio.create_task(a_task())
        await a_inside.wait()
        b = asyncio.create_task(b_task())
        await until(lambda: locks.stats().waiting == 1, "b waits to enter")
        a_may_leave.set()
        await a_left.wait()
        await b_inside.wait()  # while a runs on
        assert not a.done() and _record(shared)._inside == (b, 1)
        b_may_leave.set()
        await b
        assert "k" not in locks
        a_may_end.set()
        with abandoned_warnings() as caught:
            await a
        assert not caught, caught

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_one_aio_key_view_shared_by_three_tasks_grants_them_in_fifo_order_as_asyncio_lock(
        impl) -> None:
    locks = impl.LockManager()

    async def order(lock: Any, queued: Callable[[], int]) -> list[str]:
        entered: list[str] = []
        inside: list[str] = []

        async def user(name: str) -> None:
            async with lock:
                assert not inside, f"{name} entered while {inside} was inside"
                inside.append(name)
                entered.append(name)
                await asyncio.sleep(0)  # (let the others run while inside)
                inside.remove(name)

        async with lock:
            tasks = []
            for count, name in enumerate("abc", 1):
                tasks.append(asyncio.create_task(user(name)))
                await until(lambda count=count: queued() == count, f"{name} waits")
        await asyncio.gather(*tasks)
        return entered

    async def main() -> tuple[list[str], list[str]]:
        view = locks.aio["k"]
        by_lockmgr = await order(view, lambda: locks.stats().waiting)
        assert "k" not in locks
        lock = asyncio.Lock()
        by_asyncio = await order(lock, lambda: len(lock._waiters or ()))  # type: ignore
        return by_lockmgr, by_asyncio

    assert run(main) == (["a", "b", "c"], ["a", "b", "c"])
    assert len(locks) == 0


@pytest.mark.parametrize("when", ["at once", "granted together"])
def test_two_tasks_sharing_one_read_object_the_second_entry_raises_and_takes_nothing(
        impl, when) -> None:
    """Two readers could hold "k" at once, but one object has one task inside: the second
    task's entry (at once, or when both are granted by a writer's release) raises
    RuntimeError and gives its read back; once the first task's block exited, it serves."""
    rw = impl.RWLockManager()
    shared = rw.aio.read("k")

    async def main() -> None:
        leave = asyncio.Event()
        inside: list[asyncio.Task[Any]] = []

        async def reads() -> None:
            async with shared:
                inside.append(asyncio.current_task())  # type: ignore[arg-type]
                await leave.wait()
            assert _levels(rw) == NOTHING

        writer_may_leave = asyncio.Event()
        if when == "granted together":
            async def writes() -> None:
                async with rw.aio.write("k"):
                    await writer_may_leave.wait()
            writer = asyncio.create_task(writes())
            await until(lambda: rw.write_locked("k"), "the writer holds k")
        first = asyncio.create_task(reads())
        if when == "at once":
            await until(lambda: bool(inside), "the first reader is inside")
        second = asyncio.create_task(reads())
        if when == "granted together":
            await until(lambda: rw.stats().waiting == 2, "both readers wait")
            writer_may_leave.set()
            await writer
        done, _ = await asyncio.wait([first, second], return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        refused = done.pop()
        with pytest.raises(RuntimeError, match=IN_USE):
            refused.result()
        assert inside == [first if refused is second else second]
        assert rw.readers("k") == 1 and rw.stats().waiting == 0
        leave.set()
        await asyncio.gather(first, second, return_exceptions=True)
        assert "k" not in rw
        await asyncio.create_task(_enter_and_leave(shared))  # it serves another task now
        assert "k" not in rw

    run(main)
    assert len(rw) == 0


async def _inside_twice(view: Any) -> AsyncIterator[None]:
    """An async generator inside two nested blocks of ``view``."""
    async with view:
        async with view:
            yield


@pytest.mark.parametrize("style", ["one shared aio[key]", "one shared hold"])
def test_an_async_generator_closed_by_its_own_task_releases_a_shared_objects_key(impl,
                                                                               style) -> None:
    locks = impl.LockManager()
    shared = _shared(locks, style)

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
    assert len(locks) == 0


@pytest.mark.parametrize("how", ["cancelled", "never awaited"])
def test_a_task_whose_entry_into_a_shared_view_failed_is_not_inside(impl, how) -> None:
    """A task queued by the view's ``__aenter__`` whose wait ended without the key (it was
    cancelled, or it never awaited the wait) never was inside the block: once it is done,
    the view serves another task."""
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
        assert _record(shared)._inside == (None, 0)
        done.set()
        await holder
        generator = _inside_twice(shared)
        await generator.__anext__()
        await generator.aclose()
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


# -- tasks that end inside a block ---------------------------------------------------------------
# A task stranded on a closed loop (asyncio.run's shutdown cut short by a second Ctrl-C), or
# done with a coroutine it drove left suspended inside a block, is ended by lockmgr: its
# keys go to others. Its coroutine is closed later (by the garbage collector, or anyone),
# and the GeneratorExit runs the ``__aexit__`` of each block it was inside, in whatever
# task is current then (or none): those exits release nothing. Until then, an object it
# is inside is still its own: other tasks' entries raise RuntimeError.

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

#: A fresh object of the kind of each shared style.
UNSHARED = {"one shared aio[key]": "aio[key]", "one shared hold": "hold",
            "one shared read": "read"}


def _holding_k_then_waiting_for_x(locks: Any, style: str,
                                  shared: Any) -> Coroutine[Any, Any, None]:
    """A coroutine that holds "k" in a block of ``style``, then waits for "x"."""
    take_x = _take_write(locks)
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
    """A manager, its shared object of "k" (see _shared), and a task that held "k" in a
    block of ``style`` (``enters_after_a_wait``: granted once a thread released "k") and
    waited for "x" (held by a thread) when its loop was closed, then was ended by lockmgr:
    by the grant of "x" that found its loop closed, or by ``end_stranded_task``. "k" was
    released with an AbandonedLockWarning. Its coroutine is left suspended in the block."""
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


async def _refused_and_nothing_taken(locks: Any, shared: Any) -> None:
    """This task's entry into ``shared``, which a task that ended inside it still is,
    raises RuntimeError and changes none of this task's levels."""
    before = _levels(locks)
    with pytest.raises(RuntimeError, match=ENDED_INSIDE):
        async with shared:
            pytest.fail("entered an object an ended task is inside")
    assert _levels(locks) == before


async def _enter_and_leave(view: Any) -> None:
    async with view:
        pass


def test_an_exit_run_while_lockmgr_ends_its_task_releases_nothing_and_raises_nothing(
        impl) -> None:
    """A task finishes while a coroutine it drove is suspended inside a block. Its ending
    (which releases "k" with an AbandonedLockWarning) runs Python code: here the warning's
    display closes that coroutine, so the block's exit runs while the task is being ended.
    The exit is the ended task's: it releases nothing and raises nothing."""
    locks = impl.LockManager()
    left: list[Any] = []
    closed: list[BaseException | None] = []

    async def ends_inside() -> None:
        coroutine = _block_on(locks.aio["k"])
        assert coroutine.send(None) == "suspended"
        left.append(coroutine)

    async def main() -> None:
        with abandoned_warnings() as caught:
            shown = warnings.showwarning

            def closing_show(*args: Any, **kwargs: Any) -> None:
                if left:
                    try:
                        left.pop().close()
                        closed.append(None)
                    except BaseException as error:  # handed to the test
                        closed.append(error)
                shown(*args, **kwargs)

            warnings.showwarning = closing_show
            try:
                await asyncio.create_task(ends_inside())
                await until(lambda: "k" not in locks, "the ended task's key is released")
            finally:
                warnings.showwarning = shown
        assert closed == [None], closed
        assert len(caught) == 1, caught
        assert "k" not in locks and locks.stats().waiting == 0
        await _enter_and_leave(locks.aio["k"])

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("ending", ["a grant", "end_stranded_task"])
@pytest.mark.parametrize("style", list(BLOCKS))
def test_closing_an_ended_tasks_coroutine_keeps_another_tasks_hold(impl, style, ending) -> None:
    """The stranded task's coroutine closed by a task that now holds "k" in a block of the
    same kind: that task still holds "k" once, and its own exit releases it. A shared
    object refuses that task until the coroutine is closed, and serves it from then on."""
    locks, shared, stranded = _stranded_and_ended(impl, style, ending)

    async def main() -> None:
        shared_style = style in UNSHARED
        block = _fresh(locks, UNSHARED[style]) if shared_style else BLOCKS[style][1](locks,
                                                                                    shared)
        async with block:
            if shared_style:
                await _refused_and_nothing_taken(locks, shared)
            stranded.get_coro().close()  # GeneratorExit at its await: its blocks' exits run
            assert locks.aio.owned("k")
            if _reads(style):
                assert locks.readers("k") == 1 and locks.aio.recursion_count("k") == 0
            else:
                assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks
        if shared_style:
            async with shared:
                assert locks.aio.owned("k")
            assert "k" not in locks

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


@pytest.mark.parametrize("ending", ["a grant", "end_stranded_task"])
def test_a_shared_views_task_is_inside_once_its_wait_to_enter_is_granted(impl,
                                                                        ending) -> None:
    """As above, the stranded task having entered the shared aio["k"] after a wait: the
    grant entered it, so the view is the ended task's until its coroutine is closed."""
    locks, shared, stranded = _stranded_and_ended(impl, "one shared aio[key]", ending,
                                                  enters_after_a_wait=True)

    async def main() -> None:
        await _refused_and_nothing_taken(locks, shared)
        assert "k" not in locks
        stranded.get_coro().close()
        async with shared:
            assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


@pytest.mark.parametrize("closed_on", ["the loop's thread", "another thread"])
@pytest.mark.parametrize("style", list(BLOCKS))
def test_closing_an_ended_tasks_coroutine_with_no_loop_running_raises_nothing(impl, style,
                                                                              closed_on) -> None:
    locks, shared, stranded = _stranded_and_ended(impl, style, "a grant")
    if closed_on == "another thread":
        errors: list[BaseException] = []

        def close() -> None:
            try:
                stranded.get_coro().close()
            except BaseException as error:  # handed to the test
                errors.append(error)

        thread = threading.Thread(target=close)
        thread.start()
        thread.join(PATIENCE)
        assert not thread.is_alive() and not errors, errors
    else:
        stranded.get_coro().close()  # no task is current: its exits act for none
    assert len(locks) == 0 and locks.stats().waiting == 0
    if shared is not None:
        assert _record(shared)._inside == (None, 0)
        run(lambda: _enter_and_leave(shared))  # the shared object serves again
    assert len(locks) == 0


class _Key:
    """A key that can be referred to weakly: whether anything still keeps it."""


def test_a_task_stranded_on_its_own_future_inside_a_shared_view_is_collectable(impl) -> None:
    """A task inside a block of a long-lived view, waiting on a future of its own (not on
    lockmgr), is stranded on a closed loop and ended with ``end_stranded_task``: neither
    the view nor anything of lockmgr keeps the task. Once its coroutine is closed (with
    the task, by the collector), the view serves again."""
    locks = impl.LockManager()
    shared = locks.aio["k"]

    async def in_block() -> None:
        async with shared:
            await asyncio.get_running_loop().create_future()  # never done

    task = _stranded(in_block(), lambda: "k" in locks, "the task holds k")
    with abandoned_warnings():
        impl.end_stranded_task(task)
    assert "k" not in locks
    alive = weakref.ref(task)
    del task
    gc.collect()
    assert alive() is None, "the stranded task is kept alive"
    run(lambda: _enter_and_leave(shared))  # the view still serves
    assert len(locks) == 0


def test_a_shared_view_does_not_keep_a_stranded_task_alive(impl) -> None:
    """A task stranded inside a shared aio[key] view and ended by lockmgr, its coroutine
    not closed: the view (a module-level view is the documented way to share one) does not
    keep the task alive; collecting the task closes the coroutine, and the view serves."""
    locks, shared, stranded = _stranded_and_ended(impl, "one shared aio[key]", "a grant")
    alive = weakref.ref(stranded)
    del stranded
    for _ in range(3):
        gc.collect()
    assert alive() is None, "the shared view keeps the stranded task alive"
    run(lambda: _enter_and_leave(shared))
    assert len(locks) == 0


@pytest.mark.parametrize("style", list(BLOCKS))
def test_a_block_a_finished_task_left_suspended_releases_nothing_when_closed(impl,
                                                                            style) -> None:
    """A task drove a coroutine into a block (it holds "k" there) and finished, leaving it
    suspended: the task's end released "k". Another task that holds "k" now (in a block
    of the same kind; a fresh object, as the shared one refuses it meanwhile) closes that
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
        shared_style = style in UNSHARED
        block = _fresh(locks, UNSHARED[style]) if shared_style else BLOCKS[style][1](locks,
                                                                                    shared)
        async with block:
            if shared_style:
                await _refused_and_nothing_taken(locks, shared)
            coroutine.close()
            assert locks.aio.owned("k")
            if _reads(style):
                assert locks.readers("k") == 1
            else:
                assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks
        if shared_style:
            await _enter_and_leave(shared)

    run(main)
    worker.run(lambda: (locks.release_write if _is_rw(locks) else locks.release)("x"))
    worker.stop()
    assert len(locks) == 0


async def _inside(view: Any) -> AsyncIterator[None]:
    """An async generator suspended inside one block of ``view``."""
    async with view:
        yield


GONE = ["finished, a coroutine left inside", "finished, an async generator left inside",
        "stranded"]


@pytest.mark.parametrize("gone", GONE)
@pytest.mark.parametrize("style", SHARED_STYLES)
def test_an_object_a_task_ended_inside_refuses_others_until_that_block_is_closed(impl, style,
                                                                                gone) -> None:
    """A task that ended inside a shared object (finished, leaving a coroutine or an async
    generator it drove suspended in the block; or stranded on a closed loop): the object
    keeps nothing of the task (it is collectable), and refuses every other task's entry,
    taking nothing (at once, inside a hold of its own, or in an async generator), until
    that block is closed: its exit releases nothing, raises nothing, and the object serves
    again, nested and by several tasks."""
    left: list[Any] = []
    if gone == "stranded":  # (its coroutine, kept here, may keep it: not checked)
        locks, shared, stranded = _stranded_and_ended(impl, style, "a grant")
        left.append(stranded.get_coro())
        del stranded
    else:
        locks = getattr(impl, SHARED_MANAGER[style])()
        shared = _shared(locks, style)

    async def leaves_it_suspended() -> None:
        if gone.startswith("finished, a coroutine"):
            async def in_block() -> None:
                async with shared:
                    await asyncio.get_running_loop().create_future()  # never done
            coroutine = in_block()
            coroutine.send(None)
            left.append(coroutine)
        else:
            generator = _inside(shared)
            await generator.__anext__()
            left.append(generator)

    async def uses_it() -> None:
        async with shared:
            assert locks.aio.owned("k")
        assert not locks.aio.owned("k")

    async def refused_in_a_generator() -> None:
        generator = _inside(shared)
        with pytest.raises(RuntimeError, match=ENDED_INSIDE):
            await generator.__anext__()
        assert _levels(locks) == NOTHING

    async def main() -> None:
        if gone != "stranded":
            with abandoned_warnings() as caught:
                finished = asyncio.create_task(leaves_it_suspended())
                await finished
                await until(lambda: "k" not in locks, "the finished task's keys are released")
            assert any("'k'" in str(warning.message) for warning in caught), caught
            finished_ref = weakref.ref(finished)
            del finished
            gc.collect()
            assert finished_ref() is None, "the object keeps the task that ended inside alive"
        for _ in range(2):
            await _refused_and_nothing_taken(locks, shared)
            async with _fresh(locks, UNSHARED[style]):
                await _refused_and_nothing_taken(locks, shared)
            await asyncio.create_task(_refused_and_nothing_taken(locks, shared))
            await asyncio.create_task(refused_in_a_generator())
            assert "k" not in locks and locks.stats().waiting == 0
        closing = left.pop()
        if gone.startswith("finished, an async generator"):
            await closing.aclose()
        else:
            closing.close()
        assert "k" not in locks and _record(shared)._inside == (None, 0)
        for _ in range(2):
            async with shared:
                async with shared:
                    assert locks.aio.owned("k")
                assert locks.aio.owned("k")
            assert "k" not in locks
            await asyncio.create_task(uses_it())
            assert "k" not in locks
            generator = _inside(shared)  # a live task's own generator, closed by that task
            await generator.__anext__()
            assert locks.aio.owned("k")
            await generator.aclose()
            assert "k" not in locks

    run(main)
    assert len(locks) == 0 and locks.stats().waiting == 0


@pytest.mark.parametrize("collected_by", ["refcount", "gc"])
def test_an_ended_tasks_block_closed_by_its_collection_takes_nothing_of_the_running_tasks(
        impl, collected_by) -> None:
    """A task drove a coroutine into a block of a shared view and ended, leaving it
    suspended there. While another task holds "k" in a block of its own (in an async
    generator; the shared view refuses it meanwhile), that coroutine is collected: closing
    it runs its block's exit, which is the ended task's and takes nothing of the running
    task's. The running task's own block then exits, and releases "k"; the view serves."""
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

    async def main() -> tuple[int, bool, bool]:
        with abandoned_warnings():
            await asyncio.create_task(ends_leaving_it_inside())
            await until(lambda: "k" not in locks, "the ended task's key is released")
        await _refused_and_nothing_taken(locks, view)
        generator = _inside(locks.aio["k"])
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
        released = "k" not in locks
        generator = _inside(view)
        await generator.__anext__()
        await generator.aclose()
        return count, released, "k" in locks

    assert run(main) == (1, True, False)
    assert len(locks) == 0


async def _indirect_block(style: str, target: Any) -> None:
    """One block on ``target``, entered through ``style``, suspended inside."""
    async with _indirectly(style, target):
        await _suspend()


@pytest.mark.parametrize("target", ["aio[key]", "hold"])
@pytest.mark.parametrize("style", INDIRECT)
def test_closing_a_finished_tasks_indirect_block_releases_nothing_of_the_current_tasks(
        impl, style, target) -> None:
    """A task entered a shared ``aio[key]`` view (or hold() object) through an
    AsyncExitStack, a delegating wrapper or by hand, in a coroutine it drove, and finished
    leaving that coroutine suspended inside the block (its end released "k"). Another task
    holds "k" in a block of its own and closes that coroutine: the exit, run in other
    frames than the block's, is the finished task's and releases nothing; the current task
    keeps "k" until its own exit. The shared object then serves the same way again."""
    locks = impl.LockManager()
    shared = _fresh(locks, target)

    async def main() -> None:
        async def drives_and_leaves_it_suspended() -> Any:
            coroutine = _indirect_block(style, shared)
            assert coroutine.send(None) == "suspended"
            assert locks.aio.recursion_count("k") == 1
            return coroutine

        with abandoned_warnings():
            left = await asyncio.create_task(drives_and_leaves_it_suspended())
            await until(lambda: "k" not in locks, "the finished task's keys are released")
        async with _fresh(locks, target):
            with pytest.raises(RuntimeError, match=ENDED_INSIDE):
                async with _indirectly(style, shared):
                    pytest.fail("entered an object an ended task is inside")
            assert locks.aio.recursion_count("k") == 1
            left.close()  # the finished task's block: GeneratorExit, releases nothing
            assert locks.aio.recursion_count("k") == 1, \
                "closing another task's block released the current task's hold"
        assert "k" not in locks
        async with _indirectly(style, shared):
            assert locks.aio.recursion_count("k") == 1
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


def test_an_exception_thrown_into_an_ended_tasks_block_outside_a_loop_passes_unchanged() -> None:
    """A task entered a shared view in a coroutine it drove and finished, leaving it
    suspended inside the block; the task is then collected. Outside any event loop, an
    exception thrown into that coroutine reaches the block's exit, which is the ended
    task's: it releases nothing and raises nothing, so the exception comes out unchanged,
    on both engines alike; and the view serves again."""
    raised: dict[str, type[BaseException]] = {}
    for name in ("lockmgr._core", "lockmgr._pure"):
        impl = importlib.import_module(name)
        locks = impl.LockManager()
        shared = locks.aio["k"]

        async def main(locks: Any = locks, shared: Any = shared) -> Any:
            async def drives_and_leaves_it_suspended() -> Any:
                coroutine = _block_on(shared)
                assert coroutine.send(None) == "suspended"
                return coroutine

            with abandoned_warnings():
                left = await asyncio.create_task(drives_and_leaves_it_suspended())
                await until(lambda: "k" not in locks, "the finished task's keys are released")
            return left

        left = run(main)
        gc.collect()  # the finished task is gone
        with pytest.raises(BaseException) as caught:
            left.throw(ValueError("thrown into the gone task's block"))
        raised[name] = caught.type
        run(lambda shared=shared: _enter_and_leave(shared))
        assert len(locks) == 0
    assert raised == {"lockmgr._core": ValueError, "lockmgr._pure": ValueError}, raised


CLOSERS = r"""
import asyncio, collections, gc, importlib, sys, threading, time, warnings
warnings.simplefilter("ignore")
sys.setswitchinterval(1e-6)
impl = importlib.import_module(sys.argv[1])
locks = impl.LockManager()
view = locks.aio["k"]
left, errors, counts = collections.deque(), [], collections.Counter()
stop = time.monotonic() + 3.0
give_up = stop + 30.0
ENDED = "already entered by a task that ended inside it"

async def inside():
    async with view:
        yield

async def leaves():
    # A task that finishes with a generator suspended inside the view. While a generator
    # an ended task left there is not closed yet, the view refuses the entry (after the
    # grant, if it waited: the grant goes on to the next waiter): try again.
    while True:
        generator = inside()
        try:
            await generator.__anext__()
            counts["entered"] += 1
            return generator
        except RuntimeError as error:
            if ENDED not in str(error):
                raise
            counts["refused"] += 1
            if time.monotonic() > give_up:
                raise AssertionError("the view never served again") from None
            await asyncio.sleep(0)

def loop_thread():
    async def main():
        # The closers own these generators: without this, asyncio.run's shutdown_asyncgens
        # closes those still queued, racing a closer on the same generator.
        sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
        while time.monotonic() < stop:
            left.append(await asyncio.create_task(leaves()))
    try:
        asyncio.run(main())
    except BaseException as error:
        errors.append(repr(error))

def closer():  # closes those generators: each exit is a finished task's (no task current)
    while any(thread.is_alive() for thread in loop_threads) or left:
        try:
            generator = left.popleft()
        except IndexError:
            time.sleep(0)
            continue
        try:
            generator.aclose().send(None)
        except StopIteration:
            pass
        except BaseException as error:
            errors.append(repr(error))

loop_threads = [threading.Thread(target=loop_thread) for _ in range(2)]
threads = loop_threads + [threading.Thread(target=closer) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
gc.collect()
inside_now = getattr(view, "_record", view)._inside
print("errors", errors[:3], "counts", dict(counts), "inside", inside_now, "held", len(locks))
assert not errors, errors
assert counts["entered"] > 0, counts
assert inside_now == (None, 0), f"the view's record names {inside_now} once all exited"
assert len(locks) == 0 and locks.stats().waiting == 0
"""


def test_concurrent_closers_of_ended_tasks_blocks_in_several_loops_leave_the_view_empty(
        impl, tmp_path) -> None:
    """Tasks of two event loops, each in its thread, finish leaving a generator inside one
    shared view (each then retries until the view serves it); three threads close those
    generators (each exit is an ended task's, run with no task current). Nothing may
    raise but the view's refusals, and once all are closed the view's record is empty and
    nothing is held. (The record is changed by exits in any thread: a lost update would
    leave it naming a task, or refusing for good.)"""
    script = tmp_path / "closers.py"
    script.write_text(CLOSERS)
    done = subprocess.run([sys.executable, str(script), impl.__name__],
                          capture_output=True, text=True, timeout=PATIENCE * 6)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


# -- exits in other frames: helpers, wrappers, AsyncExitStack ------------------------------------
# Nothing is told by frames: an exit through a helper (whose frame may have the id of a
# frame that died) is the exit of the object's recorded task like any other.


async def _step(view: Any, enter: bool) -> None:
    """Enter or exit ``view`` in a frame of this helper's, as an ``AsyncExitStack`` or a
    wrapper does (the frame dies when the helper returns: another may get its id)."""
    if enter:
        await view.__aenter__()
    else:
        await view.__aexit__(None, None, None)


def _step_of_its_own(name: str) -> Callable[[Any, bool], Coroutine[Any, Any, None]]:
    """``_step`` under a code object of its own, of the same shape: the frame of one is
    often handed the memory, so the id, of another's freed frame."""
    return type(_step)(_step.__code__.replace(co_name=name), globals())


async def _enters_then_waits(view: Any) -> None:
    """A helper entering ``view`` for its caller, then waiting (where it is cancelled: its
    frame raises)."""
    await view.__aenter__()
    await asyncio.sleep(3600)


@pytest.mark.parametrize("ended_by", ["returning", "a cancellation"])
@pytest.mark.parametrize("helpers", ["one for both", "one each"])
def test_an_exit_through_a_helper_gives_back_the_tasks_own_block(impl, helpers,
                                                                 ended_by) -> None:
    """Round after round: a task enters a shared view through a helper and ends inside it
    (the helper's frame returned, or raised when the task was cancelled): its end releases
    "k" (AbandonedLockWarning), and the view refuses other tasks until an exit runs. An
    exit through a helper, in another task, is that ended task's: it releases nothing and
    raises nothing. Then another task enters (in its own frame, or through a helper) and
    exits through a helper (the same one or another, whose frame often has the id of a
    frame that died): the exit gives back that task's own hold at once."""
    locks = impl.LockManager()
    view = locks.aio["k"]
    def helper(name: str) -> Callable[[Any, bool], Coroutine[Any, Any, None]]:
        return _step if helpers == "one for both" else _step_of_its_own(name)

    async def own_block(round_: int, entered_in_a_helper: bool) -> tuple[int, int]:
        if entered_in_a_helper:
            await helper(f"enter_{round_}")(view, True)
        else:
            await view.__aenter__()
        held = locks.aio.recursion_count("k")
        await helper(f"exit_{round_}")(view, False)
        return held, locks.aio.recursion_count("k")

    async def refused() -> None:
        with pytest.raises(RuntimeError, match=ENDED_INSIDE):
            await view.__aenter__()
        assert locks.aio.recursion_count("k") == 0

    async def main() -> None:
        for round_ in range(20):
            with abandoned_warnings() as caught:
                if ended_by == "returning":
                    await asyncio.create_task(helper(f"enter_{round_}")(view, True))
                else:
                    entering = asyncio.create_task(_enters_then_waits(view))
                    await until(lambda: "k" in locks, "the helper entered")
                    entering.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await entering
                    del entering
                await until(lambda: "k" not in locks, "the ended task's key is released")
            assert len(caught) == 1, caught
            await asyncio.create_task(refused())
            await asyncio.create_task(helper(f"exit_{round_}")(view, False))
            assert "k" not in locks and _record(view)._inside == (None, 0)
            for entered_in_a_helper in (False, True):
                held = await asyncio.create_task(own_block(round_, entered_in_a_helper))
                assert (held, "k" in locks) == ((1, 0), False), f"round {round_}"

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("how", ["aio[key]", "hold()", "AsyncExitStack"])
def test_a_running_task_keeps_nothing_of_the_blocks_it_left(impl, how) -> None:
    """A long-lived task's blocks, each on a fresh view of a fresh key: once a block has
    exited, its key is collectable while the task runs on."""
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


def test_a_running_task_keeps_nothing_of_its_blocks_another_task_closed(impl) -> None:
    """A long-lived task drives async generators into blocks on fresh views, and another
    task closes each: the exit gives back the first task's hold. While the first task runs
    on, nothing of those blocks stays with it: each view's record goes with the view."""
    locks = impl.LockManager()

    async def closes(generator: Any) -> None:
        await generator.aclose()

    async def main() -> None:
        before = block_records()
        for index in range(20):
            generator = _inside(locks.aio[index])
            await generator.__anext__()
            assert locks.aio.recursion_count(index) == 1
            await asyncio.create_task(closes(generator))
            assert locks.aio.recursion_count(index) == 0 and index not in locks
            del generator
        kept = block_records() - before
        assert kept == 0, f"{kept} records of 20 views are kept by the running task"

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("target", ["aio[key]", "hold"])
@pytest.mark.parametrize("style", ["AsyncExitStack", "delegating wrapper"])
def test_a_long_lived_object_entered_indirectly_keeps_nothing_of_its_blocks(impl, style,
                                                                           target) -> None:
    """A long-lived ``aio[key]`` view (or hold() object) entered through an AsyncExitStack
    or a delegating wrapper, block after block, keeps nothing of those blocks once they
    exited: memory does not grow with the number of blocks."""
    locks = impl.LockManager()
    shared = _fresh(locks, target)
    refs: list[weakref.ref[Any]] = []

    async def main() -> None:
        for _ in range(50):
            if style == "AsyncExitStack":
                async with contextlib.AsyncExitStack() as stack:
                    refs.append(weakref.ref(stack))
                    await stack.enter_async_context(shared)
                del stack
            else:
                wrapper = Delegating(shared)
                refs.append(weakref.ref(wrapper))
                async with wrapper:
                    pass
                del wrapper
        assert "k" not in locks

    run(main)
    gc.collect()
    kept = sum(ref() is not None for ref in refs)
    assert kept == 0, f"{kept} of 50 exited blocks are still kept by the shared object"
    assert len(locks) == 0


# -- async generators finalized by asyncio --------------------------------------------------------


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
    GeneratorExit runs the block's exit while the consumer is alive."""
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
        assert locks.aio.recursion_count("k") == 1
        break  # the generator is dropped here (its last reference)
    await until(lambda: bool(closed_in), "asyncio's finalizer closes the generator")
    finalizer = closed_in[0]
    assert finalizer is not asyncio.current_task() and finalizer in created
    await until(finalizer.done, "the finalizer's task ends")
    assert not finalizer.cancelled() and finalizer.exception() is None
    asyncio.get_running_loop().set_task_factory(None)
    return finalizer  # type: ignore[no-any-return]


@pytest.mark.parametrize("then", ["releases", "ends"])
@pytest.mark.parametrize("style", DROPPED_STYLES)
def test_a_dropped_async_generator_finalized_by_asyncio_gives_back_the_consumers_hold(
        impl, style, then) -> None:
    """The finalizer's task runs the exit of the consumer's block: it gives back the
    consumer's hold (no error anywhere). The consumer, living on, holds nothing: its own
    release raises NotOwnedError, and its end warns of nothing. A shared object serves
    again."""
    locks = impl.LockManager()
    shared = _shared(locks, style)
    errors: list[dict[str, Any]] = []

    async def consumer() -> None:
        await _drop_a_generator_inside(locks, style, shared)
        assert locks.aio.recursion_count("k") == 0 and "k" not in locks
        if then == "releases":
            with pytest.raises(NotOwnedError):
                locks.aio.release("k")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context:
                                                         errors.append(context))
        with abandoned_warnings() as caught:
            await asyncio.create_task(consumer())
        assert not caught, caught
        if style.startswith("one shared"):
            async with shared:
                assert locks.aio.recursion_count("k") == 1
            assert "k" not in locks

    run(main)
    assert not errors, errors
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_a_dropped_async_generator_whose_consumer_released_inside_keeps_the_finalizers_hold(
        impl) -> None:
    """The consumer lets "k" go while still inside the generator's block, and the
    finalizer's task holds "k" (``acquire``) when it closes the generator: the exit is the
    consumer's, which no longer holds "k": NotOwnedError out of ``aclose()``, and the
    finalizer's own hold is kept."""
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
            with pytest.raises(NotOwnedError):
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
        await _enter_and_leave(shared)  # the view serves again

    run(main)
    assert not errors, errors
    assert len(locks) == 0


# -- empty hold_many; Ctrl-C while entering ------------------------------------------------------

@pytest.mark.parametrize("manager", ["LockManager", "RWLockManager"])
def test_an_empty_hold_many_runs_its_block_and_records_no_stray_object(impl, manager) -> None:
    """``async with aio.hold_many([])`` (a computed key list that happens to be empty), in a
    task that never acquired anything, runs its block and takes nothing; its record refers
    to nothing unrelated (a compiled core once read past None there)."""
    locks = getattr(impl, manager)()
    seen: list[Any] = []

    async def main() -> None:
        held = locks.aio.hold_many([]) if manager == "LockManager" else locks.aio.hold_many()
        record = _record(held)
        async with held:
            seen.extend(thing for thing in gc.get_referents(record)
                        if thing is not type(record))  # a heap type's instance
            assert len(locks) == 0
        assert record._inside == (None, 0)

    run(main)
    allowed = (types.FrameType, weakref.ref, type(None), tuple, int, type(threading.RLock()))
    # (The compiled core's hold_many object is its own record: its manager and items too.)
    stray = [thing for thing in seen if not isinstance(thing, allowed) and thing is not locks
             and thing != [] and type(thing).__name__ not in ("_TaskOwner", "_TaskToken")]
    assert not stray, f"the record refers to {stray!r}"
    assert len(locks) == 0


_EMPTY_HOLD_MANY = """
import asyncio
import lockmgr._core as core

async def main():
    # A fresh task that never acquired anything: it has no task owner yet.
    async with core.LockManager().aio.hold_many([]):
        pass
    async with core.RWLockManager().aio.hold_many():
        pass

asyncio.run(main())
print("survived")
"""


@pytest.mark.compiled
def test_an_empty_hold_many_in_a_fresh_task_does_not_crash() -> None:
    """The compiled core in a child process: an empty hold_many in a task that has no task
    owner yet must simply run its block (it once read through None there: a segmentation
    fault on 3.13t)."""
    child = subprocess.run([sys.executable, "-c", _EMPTY_HOLD_MANY], capture_output=True,
                           text=True, timeout=PATIENCE * 6)
    assert child.returncode == 0 and "survived" in child.stdout, (child.returncode, child.stderr)


@pytest.mark.parametrize(("when", "point"), [
    ("at once", "_answer"),
    ("at once", "_BlockRecord.enter"),
    ("at once", "_task_awaitable"),
    ("after a wait", "_BlockRecord.enter"),
])
def test_a_keyboard_interrupt_entering_a_block_leaves_nothing_held(point, when) -> None:
    """Pure twin: a KeyboardInterrupt raised (by a trace function, where a signal handler's
    could be: a Python function's start) while ``__aenter__`` enters the object's record,
    after the task took "k" (at once, or granted after a wait), propagates out of the
    ``async with``, whose exit never runs. The task must not be left holding "k", nor the
    object naming it (the compiled core has no check point there)."""
    import lockmgr._pure as pure

    locks = pure.LockManager()
    code = {"_answer": pure._answer, "_BlockRecord.enter": pure._BlockRecord.enter,
            "_task_awaitable": pure._task_awaitable}[point].__code__
    view = locks.aio["k"]

    def tracer(frame: Any, event: str, arg: object) -> Any:
        if event == "call" and frame.f_code is code:
            sys.settrace(None)
            raise KeyboardInterrupt("a handler's exception at a check point")
        return None

    async def main() -> None:
        if when == "after a wait":
            release = asyncio.Event()

            async def holder() -> None:
                async with locks.aio["k"]:
                    await release.wait()

            other = asyncio.create_task(holder())
            await until(lambda: locks.locked("k"), "the other task holds k")
            loop = asyncio.get_running_loop()
            loop.call_soon(release.set)
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                async with view:
                    pytest.fail("the block ran")
        finally:
            sys.settrace(None)
        held = locks.aio.recursion_count("k")
        while locks.aio.owned("k"):  # (give back whatever was kept, to end cleanly)
            locks.aio.release("k")
        if when == "after a wait":
            await other
        assert held == 0, "the task kept k"
        assert _record(view)._inside == (None, 0), "the view names the task"

    with abandoned_warnings() as warned:
        run(main)
    assert not warned
    assert len(locks) == 0
