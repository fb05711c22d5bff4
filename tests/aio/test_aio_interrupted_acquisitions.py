"""A signal handler's exception that ends a task's acquiring call leaves nothing held: the
call raises, and what it was granted goes back (or it returned, and holds what it said).

The handler runs in the main thread at the first check point after its signal arrived. The
signal is sent while the engine decides (inside a section of the pure twin, which blocks
signals there and so runs the handler as the section ends, the moment a grant made at once
is not yet the caller's; the compiled core's sections and task calls run no Python code, so
there the call returns its grant)."""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from conftest import PATIENCE

pytestmark = pytest.mark.posix_only


class Interrupted(Exception):
    """What the signal handler raises."""


#: Called inside a section when a grant is made at once (the pure twin's names).
GRANTING = ("_granted_at_once", "_grant_nodes")


@pytest.fixture
def interrupting() -> Iterator[Callable[[], None]]:
    """Arms a SIGUSR1 to the main thread at the next grant made at once; its handler raises
    Interrupted."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    def tracer(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name in GRANTING:
            sys.settrace(None)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield lambda: sys.settrace(tracer)
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGUSR1, previous)


async def _entered(block: Any) -> bool:
    async with block:
        return True


STYLES: dict[str, Callable[[Any], Awaitable[bool]]] = {
    "acquire": lambda rw: rw.aio.acquire_write("k"),
    "acquire_read": lambda rw: rw.aio.acquire_read("k"),
    "acquire_many": lambda rw: rw.aio.acquire_many(reads=["j"], writes=["k"]),
    "async-with write": lambda rw: _entered(rw.aio.write("k")),
    "async-with read": lambda rw: _entered(rw.aio.read("k")),
    "async-with hold_many": lambda rw: _entered(rw.aio.hold_many(reads=["j"], writes=["k"])),
}

KEY_STYLES: dict[str, Callable[[Any], Awaitable[bool]]] = {
    "key's acquire": lambda locks: locks.aio["k"].acquire(),
    "async-with key": lambda locks: _entered(locks.aio["k"]),
    "lock's acquire_many": lambda locks: locks.aio.acquire_many(["j", "k"]),
}


def run_interrupted(manager: Any, call: Callable[[Any], Awaitable[bool]],
                    interrupt: Callable[[], None]) -> tuple[object, int]:
    """Run ``call(manager)`` in a task of a loop on the main thread, interrupted as armed:
    what it returned or raised, and how many keys the task held after it."""

    async def main() -> tuple[object, int]:
        interrupt()
        try:
            outcome: object = await call(manager)
        except Interrupted as interrupted:
            outcome = interrupted
        finally:
            sys.settrace(None)
        return outcome, manager.aio.release_all()

    return asyncio.run(asyncio.wait_for(main(), PATIENCE))


def check(impl: Any, manager: Any, outcome: object, held: int, keys: int) -> None:
    if impl.__name__ == "lockmgr._pure":  # the handler ran as the section ended
        assert isinstance(outcome, Interrupted), outcome
    if isinstance(outcome, Interrupted):
        assert held == 0, "the interrupted call left keys held"
    else:
        assert outcome is True and held == keys
    assert manager.stats().waiting == 0 and len(manager) == 0


@pytest.mark.parametrize("style", list(STYLES))
def test_a_handlers_exception_ending_an_acquisition_leaves_nothing_held(
        impl, interrupting, style) -> None:
    rw = impl.RWLockManager()
    outcome, held = run_interrupted(rw, STYLES[style], interrupting)
    check(impl, rw, outcome, held, 0 if style.startswith("async-with") else
          2 if style == "acquire_many" else 1)
    assert asyncio.run(_entered(rw.aio.write("k")))  # nothing in the way, nor queued


@pytest.mark.parametrize("style", list(KEY_STYLES))
def test_a_handlers_exception_ending_a_key_views_acquisition_leaves_nothing_held(
        impl, interrupting, style) -> None:
    locks = impl.LockManager()
    outcome, held = run_interrupted(locks, KEY_STYLES[style], interrupting)
    check(impl, locks, outcome, held, 0 if style.startswith("async-with") else
          2 if style.endswith("acquire_many") else 1)
    assert asyncio.run(_entered(locks.aio["k"]))


BLOCKS: dict[str, Callable[[Any], Any]] = {
    "async-with write": lambda rw: rw.aio.write("k"),
    "async-with read": lambda rw: rw.aio.read("k"),
    "async-with hold_many": lambda rw: rw.aio.hold_many(reads=["j"], writes=["k"]),
    "async-with key": lambda locks: locks.aio["k"],
}


@pytest.mark.compiled
@pytest.mark.parametrize("style", list(STYLES) + list(KEY_STYLES))
def test_the_compiled_cores_task_acquisitions_are_c_from_the_call_to_the_caller(style) -> None:
    # What keeps a handler's exception out of them there: the call answers a C coroutine
    # (or a block's C enter answers a C awaitable), so no Python code of lockmgr runs from
    # the grant to the caller (an ``async def`` would check for signals as a call returns).
    from lockmgr import _core

    manager = _core.LockManager() if style in KEY_STYLES else _core.RWLockManager()

    async def main() -> None:
        if style in BLOCKS:
            block = BLOCKS[style](manager)
            assert inspect.ismethoddescriptor(type(block).__aenter__)
            assert await block.__aenter__() is True
            await block.__aexit__(None, None, None)
        else:
            acquiring = (KEY_STYLES.get(style) or STYLES[style])(manager)
            assert isinstance(acquiring, collections.abc.Coroutine)
            assert not inspect.iscoroutine(acquiring)  # not a Python coroutine
            assert await acquiring is True
            manager.aio.release_all()

    asyncio.run(main())
    assert len(manager) == 0
