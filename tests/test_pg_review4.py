"""The fourth adversarial review of the PostgreSQL backend, of the fix round 2bf63ad..07fa2c4:
reproducers against a real server, one per finding. Each test states what must hold; each
fails on the reviewed commit (07fa2c4)."""

from __future__ import annotations

import asyncio
import threading
import warnings

from conftest import PATIENCE
from test_pg_aio import locks, quietly_collect  # noqa: F401
from test_postgres import children_reaped, dsn, engine, namespace, nothing_left_held  # noqa: F401


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
