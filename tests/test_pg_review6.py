"""Review of abb7cc6 for the PostgreSQL backend: reproducers against a real server. Each
test states what must hold; each fails on abb7cc6."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
import weakref
from typing import Any

import pytest

from test_aio_review6 import _Delegating
from test_pg_aio import locks, run  # noqa: F401
from test_pg_review3 import quietly_collect, strand_a_holder
from test_postgres import dsn, engine, held_on_server, namespace  # noqa: F401


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_closing_a_stranded_tasks_wrapped_block_keeps_the_current_tasks_hold(  # noqa: F811
        locks, dsn) -> None:
    """A task held "k" through a shared ``locks.aio["k"]`` entered by a delegating wrapper
    (a user's async context manager around it) and was stranded on a closed loop; the sweep
    ended it. A task of a new loop now holds "k" in its own block on the same view, and the
    stranded coroutine is collected meanwhile: its GeneratorExit is the stranded task's
    exit, which must release nothing. The current task must keep "k", here and on the
    server, until its own exit.

    On abb7cc6 ``_exit_block`` finds no entry for the wrapper's ``__aexit__`` frame (the
    block was counted in under the wrapper's ``__aenter__`` frame) and releases for the
    current task: the GeneratorExit reaches the current task's release, whose unlock cannot
    run in a closing coroutine, so it closes the CURRENT task's connection (its server lock
    is lost, another process may take "k" while the task is inside its block) and the
    task's own exit raises LockLost."""
    shared = locks.aio["k"]
    stranded = strand_a_holder(locks, "k", _Delegating(shared))
    outcome: dict[str, Any] = {}

    async def main() -> None:
        await locks.aio.lost_keys()  # the sweep ends the stranded task
        async with shared:
            nonlocal stranded
            del stranded
            outcome["raised"] = quietly_collect()  # the stranded coroutine is closed here
            outcome["count"] = locks.aio.recursion_count("k")
            outcome["on server"] = held_on_server(dsn, locks, "k")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AbandonedLockWarning of the stranded task
        try:
            run(main)
        except Exception as error:  # noqa: BLE001 (its own exit: reported below)
            outcome["own exit"] = repr(error)
        finally:
            outcome["raised"] += quietly_collect()  # the wrapper's __aexit__ coroutine
    assert outcome["count"] == 1 and outcome["on server"] and "own exit" not in outcome, outcome


def test_a_long_lived_view_entered_indirectly_keeps_no_frames(locks) -> None:  # noqa: F811
    """A long-lived ``locks.aio["k"]`` entered through an AsyncExitStack, block after block,
    must keep nothing of the blocks that exited. On abb7cc6 each block's entry (and its
    frame, with the stack) stays in the view's ``BlocksInside``."""
    shared = locks.aio["k"]
    refs: list[weakref.ref[Any]] = []

    async def main() -> None:
        for _ in range(20):
            async with contextlib.AsyncExitStack() as stack:
                refs.append(weakref.ref(stack))
                await stack.enter_async_context(shared)
            del stack

    run(main)
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
