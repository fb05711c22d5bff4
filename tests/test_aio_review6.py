"""Review of abb7cc6 ("a block's exit is told by the frame running the block"): reproducers.

Each test states what must hold; each fails on abb7cc6 (both engines unless noted).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import threading
import types
import weakref
from typing import Any

import pytest

from conftest import abandoned_warnings
from test_aio import run, until


@types.coroutine
def _suspend() -> Any:
    """Suspend the coroutine driving it, outside any event loop machinery."""
    yield "suspended"


class _Delegating:
    """A user's async context manager that delegates to a lockmgr one: the common wrapper
    pattern. Its ``__aenter__``/``__aexit__`` are coroutine functions, so lockmgr sees the
    wrapper's own frames, not the frame of the ``async with`` block."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> Any:
        return await self.inner.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self.inner.__aexit__(*exc_info)


async def _block(style: str, target: Any) -> None:
    """One block on ``target``, entered through ``style``, suspended inside."""
    if style == "AsyncExitStack":
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(target)
            await _suspend()
    else:
        async with _Delegating(target):
            await _suspend()


def _targets(locks: Any) -> dict[str, Any]:
    return {"aio[key]": locks.aio["k"], "hold()": locks.aio.hold("k")}


STYLES = ["AsyncExitStack", "delegating wrapper"]


@pytest.mark.parametrize("target", ["aio[key]", "hold()"])
@pytest.mark.parametrize("style", STYLES)
def test_closing_a_finished_tasks_indirect_block_keeps_the_current_tasks_hold(
        impl, style, target) -> None:
    """A task entered a shared ``aio[key]`` view (or hold() object) through an
    AsyncExitStack or a delegating wrapper, in a coroutine it drove by hand, and finished
    leaving that coroutine suspended inside the block (its end released "k"). Another task
    now holds "k" in its own block on the same object and closes (or collects) that
    coroutine: the GeneratorExit is the finished task's exit, which must release nothing.
    The current task must keep "k" until its own exit, which must succeed.

    On abb7cc6 the exit's frame (AsyncExitStack.__aexit__, the wrapper's __aexit__) has no
    entry (the entry is under the frame of enter_async_context / the wrapper's __aenter__),
    so it falls back to the current task and releases ITS hold: the current task is inside
    its block without the key (another task may take it), and its own exit raises
    NotOwnedError."""
    locks = impl.LockManager()
    shared = _targets(locks)[target]

    async def main() -> None:
        async def drives_and_leaves_it_suspended() -> Any:
            coroutine = _block(style, shared)
            assert coroutine.send(None) == "suspended"
            assert locks.aio.recursion_count("k") == 1
            return coroutine

        with abandoned_warnings():
            left = await asyncio.create_task(drives_and_leaves_it_suspended())
            await until(lambda: "k" not in locks, "the finished task's keys are released")
        async with shared:
            assert locks.aio.recursion_count("k") == 1
            left.close()  # the finished task's block: GeneratorExit, released nothing
            assert locks.aio.recursion_count("k") == 1, \
                "closing another task's block released the current task's hold"
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


@pytest.mark.parametrize("target", ["aio[key]", "hold()"])
@pytest.mark.parametrize("style", STYLES)
def test_a_long_lived_object_entered_indirectly_keeps_no_frames(impl, style, target) -> None:
    """A long-lived ``aio[key]`` view (or hold() object) entered through an AsyncExitStack
    or a delegating wrapper, block after block, must not keep anything of those blocks once
    they exited: memory must not grow with the number of blocks.

    On abb7cc6 each block is counted in under the frame of enter_async_context (or of the
    wrapper's __aenter__) and its exit, run in another frame, finds no entry: the entry and
    its frame (with the frame's locals: the AsyncExitStack, the wrapper) stay in the
    object's record for as long as the object lives, one per block."""
    locks = impl.LockManager()
    shared = _targets(locks)[target]
    refs: list[weakref.ref[Any]] = []

    async def main() -> None:
        for _ in range(50):
            if style == "AsyncExitStack":
                async with contextlib.AsyncExitStack() as stack:
                    refs.append(weakref.ref(stack))
                    await stack.enter_async_context(shared)
                del stack
            else:
                wrapper = _Delegating(shared)
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
    """``async with aio.hold_many([])`` (a computed key list that happens to be empty) in a
    task that never acquired anything must simply run its block.

    On abb7cc6 the core's ``_task_enter_many`` counts the block in with
    ``count_block_in(got, task_owner(False), ...)``: for an empty list ``_task_take_many``
    answers True without creating the task's owner, so ``task_owner(False)`` is None and
    ``count_block_in`` reads ``owner.task_ref`` through None (Cython does not check None
    for a typed attribute): it reads past ``_Py_NoneStruct`` and INCREFs whatever pointer
    lies there. A segmentation fault on the free-threaded 3.13t build (whose larger object
    header puts the read elsewhere); memory corruption waiting to happen on GIL builds
    (see the next test)."""
    child = subprocess.run([sys.executable, "-c", _EMPTY_HOLD_MANY], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0 and "survived" in child.stdout, (child.returncode, child.stderr)


@pytest.mark.compiled
def test_an_empty_hold_many_records_no_stray_object(impl) -> None:
    """Inside ``async with aio.hold_many([])`` in a fresh task, the object's record of its
    blocks may refer to the block's frame, to its task (weakly) and to a lock of its own
    (the pure twin's), nothing else.

    On abb7cc6 (compiled core) the record holds a strong reference to an unrelated object
    read from memory past ``None`` (``type`` on CPython 3.11): see the previous test."""
    locks = impl.LockManager()
    seen: list[Any] = []

    async def main() -> None:
        held = locks.aio.hold_many([])
        async with held:
            seen.extend(thing for thing in gc.get_referents(held._inside)
                        if thing is not type(held._inside))  # a heap type's instance

    run(main)
    allowed = (types.FrameType, weakref.ref, type(None), dict, list, int, type(threading.RLock()))
    stray = [thing for thing in seen if not isinstance(thing, allowed)]
    assert not stray, f"the record refers to {stray!r}"


def test_both_engines_raise_the_same_error_for_a_gone_tasks_block_outside_a_loop() -> None:
    """A task entered a shared view in a coroutine it drove by hand and finished, leaving it
    suspended inside the block; the task is then collected. Outside any event loop, an
    exception thrown into that coroutine reaches the block's exit: the block is another
    (gone) task's, which both engines must report the same way (the docstrings of
    ``_exit_releases``/``exit_releases``: another task's block is NotOwnedError unless its
    coroutine is being closed).

    On abb7cc6 the compiled core raises NotOwnedError (the dead weak reference is not the
    current task's), while the pure twin raises RuntimeError("... outside a running task"):
    ``BlocksInside._leave`` answers None for a gone task, which ``_exit_releases`` takes for
    "the block is the current task's" since no task is current either."""
    import importlib

    from lockmgr import NotOwnedError

    raised: dict[str, type[BaseException]] = {}
    for name in ("lockmgr._core", "lockmgr._pure"):
        impl = importlib.import_module(name)
        locks = impl.LockManager()
        shared = locks.aio["k"]

        async def plain(shared: Any = shared) -> None:
            async with shared:
                await _suspend()

        async def main(locks: Any = locks, plain: Any = plain) -> Any:
            async def drives_and_leaves_it_suspended() -> Any:
                coroutine = plain()
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
    assert raised == {"lockmgr._core": NotOwnedError, "lockmgr._pure": NotOwnedError}, raised


@pytest.mark.parametrize(("when", "point"), [("at once", "_count_block_in"),
                                             ("at once", "_count_in"),
                                             ("after a wait", "_count_in")])
def test_a_keyboard_interrupt_counting_a_block_in_leaves_nothing_held(point, when) -> None:
    """Pure twin: a KeyboardInterrupt raised (by a trace function, where a signal handler's
    could be: a Python function's start) as ``__aenter__`` counts the block in, after the
    task took "k" (at once, or granted after a wait), propagates out of the ``async with``,
    whose exit never runs. The task must not be left holding "k" (the compiled core has no
    check point there: it never is).

    Not new in abb7cc6 (the same windows existed before the views' count-in and before
    ``_task_awaitable``), but the new count-in now sits in every hold()/hold_many() entry.
    On abb7cc6 the take is not given back: ``__aenter__``'s ``except`` only abandons a
    queued request (``_task_abandon``), and ``_wait_for_grant``'s ``abandon()`` after
    ``complete()`` gives back nothing, so the task keeps "k" until it ends (then an
    AbandonedLockWarning), and every other task waits for it meanwhile."""
    import lockmgr._pure as pure

    from lockmgr._common import BlocksInside

    locks = pure.LockManager()
    code = (pure._count_block_in if point == "_count_block_in"
            else BlocksInside._count_in).__code__

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
                async with locks.aio["k"]:
                    pytest.fail("the block ran")
        finally:
            sys.settrace(None)
        assert locks.aio.recursion_count("k") == 0, "the task kept k"
        if when == "after a wait":
            await other

    with abandoned_warnings() as warned:
        run(main)
    assert not warned
    assert len(locks) == 0
