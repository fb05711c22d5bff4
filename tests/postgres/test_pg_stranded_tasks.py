"""Tasks stranded on a closed event loop while they hold or wait for PostgreSQL keys: the
sweep that ends them (before every acquisition, from a task or a thread), what it frees in
process and on the server, and the test harness's own server when a run is cut short.
Against a real server; each test states what must hold."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import warnings
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from conftest import PATIENCE, TESTS, wait_until
import pgserver  # noqa: F401  (first: it skips this module where psycopg cannot load libpq)
from lockmgr import postgres
from pg_support import (
    HOLDER, ScriptedWorker, child, expect, finish, quietly_collect, slow_abort, strand_a_holder,
    until, _waiting_on_server,
)

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


@pytest.fixture
def locks(pg_locks: postgres.PgLockManager[Any]) -> postgres.PgLockManager[Any]:
    return pg_locks  # the PostgreSQL manager (pg_fixtures), in place of conftest's ``locks``


# -- 1. the sweep runs only after the in-process acquisition: the stranded key blocks forever --


def test_a_task_acquiring_the_key_a_closed_loops_task_holds_gets_it(locks, dsn) -> None:  # noqa: F811
    """The sweep moved from ``_Tasks.session()`` (every acquire) to ``attach()`` (once a
    connection is needed), and ``end_stranded_task`` (new) is what frees a stranded task's
    in-process keys. But ``take`` acquires in process *before* it needs a connection: a task
    of a new loop acquiring the very key the stranded task held waits in process for a
    task that can never run, and never reaches the sweep that would end it. It times out
    here; without a timeout it waits forever (and so does a thread: ``_PgEngine._take``
    has the same order). Nothing else in the process calls lost_keys()."""
    stranded = strand_a_holder(locks, "mine")
    outcome: list[object] = []

    async def main() -> None:
        try:
            got = await locks.aio.acquire("mine", timeout=3.0)
        except Exception as error:  # noqa: BLE001
            got = error
        outcome.append(got)
        if got is True:
            await locks.aio.release("mine")

    with warnings.catch_warnings(record=True):  # AbandonedLockWarning, once swept
        warnings.simplefilter("always")
        try:
            asyncio.run(main())
        finally:
            locks.lost_keys()  # (for the fixtures: the sweep ends the stranded task)
            del stranded
            quietly_collect()
    assert outcome == [True], outcome


def test_a_thread_acquiring_the_key_a_closed_loops_task_holds_gets_it(locks, dsn) -> None:  # noqa: F811
    """The same from a thread: ``_PgEngine._take`` acquires in process first, and only
    ``_attach`` (after it) sweeps."""
    stranded = strand_a_holder(locks, "mine")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        outcome: list[object] = []

        def another_thread() -> None:  # (this one is the loop's: DeadlockError here)
            try:
                outcome.append(locks.acquire("mine", timeout=3.0))
                if outcome[0] is True:
                    locks.release("mine")
            except Exception as error:  # noqa: BLE001
                outcome.append(error)

        try:
            thread = threading.Thread(target=another_thread)
            thread.start()
            thread.join(PATIENCE)
        finally:
            locks.lost_keys()
            del stranded
            quietly_collect()
    assert outcome == [True], outcome


def close_the_holders_loop_while_waiting(locks: Any, start_waiting: Callable[[], object],
                                         waited: Callable[[], object]) -> None:
    """A task holds "mine"; ``start_waiting()`` starts a wait for it in process, and its loop
    is closed once that wait shows; ``waited()`` checks the wait's end (no other call to
    the manager is made meanwhile)."""

    def until_waiting() -> None:
        start_waiting()
        wait_until(lambda: any(state.waiters for state in locks.snapshot()),
                   "the waiter waits in process")

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        stranded = strand_a_holder(locks, "mine", before_close=until_waiting)
        try:
            waited()
        finally:
            del stranded
            quietly_collect()


def test_a_thread_already_waiting_for_the_key_gets_it_when_the_holders_loop_closes(
        locks, workers) -> None:  # noqa: F811
    """A thread that already waits in process when the holding task's loop is closed
    sweeps, from inside that wait, within a slice of it."""
    waiter = workers("waiter")
    waiting = []
    close_the_holders_loop_while_waiting(
        locks, lambda: waiting.append(waiter.submit(lambda: locks.acquire("mine"))),
        lambda: waiting[0].result())  # untimed: the sweep inside the wait woke it
    assert waiting[0].result() is True
    waiter.run(lambda: locks.release("mine"))


def test_a_task_already_waiting_for_the_key_gets_it_when_the_holders_loop_closes(
        locks) -> None:  # noqa: F811
    """The same for a task waiting in process, on a loop of another thread: it sweeps
    at its wait's next look."""
    outcome: list[object] = []

    async def wait_for_the_key() -> None:
        outcome.append(await locks.aio.acquire("mine"))  # untimed
        await locks.aio.release("mine")

    waiter = threading.Thread(
        target=lambda: asyncio.run(asyncio.wait_for(wait_for_the_key(), PATIENCE)))
    close_the_holders_loop_while_waiting(locks, waiter.start,
                                         lambda: waiter.join(PATIENCE * 2))
    assert outcome == [True], outcome


def test_a_task_stranded_while_waiting_in_process_and_collected_later_raises_nothing(
        locks) -> None:  # noqa: F811
    """Its coroutine is closed by the collector, in another context than the task's: the
    wait's clean-up there must let GeneratorExit through, raising nothing of its own."""
    async def holder(holding: asyncio.Event) -> None:
        await locks.aio.acquire("k")
        holding.set()
        await asyncio.sleep(3600)

    async def start() -> list[asyncio.Future[Any]]:
        holding = asyncio.Event()
        tasks = [asyncio.ensure_future(holder(holding))]
        await holding.wait()
        tasks.append(asyncio.ensure_future(locks.aio.acquire("k")))
        await until(lambda: any(state.waiters for state in locks.snapshot()),
                    "the second task waits in process")
        return tasks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (AbandonedLockWarning: the sweep's)
        loop = asyncio.new_event_loop()
        tasks = loop.run_until_complete(start())
        loop.close()  # both stranded
        assert locks.lost_keys() == set()  # swept: ended in process, connections closed
        del tasks, loop
        assert quietly_collect() == []


# -- 2. a coroutine closed in its clean-up's wait releases another task's key in process --------


def strand_a_cancelled_waiter(locks: postgres.PgLockManager[Any], dsn: str, key: str,
                              monkeypatch: pytest.MonkeyPatch) -> asyncio.Task[bool]:
    """A task cancelled while it waits for ``key`` on the server, whose loop is closed while
    its clean-up runs (a slow one: over a slow network, or a server slow to cancel): the
    task is left in ``take``'s ``except`` block, awaiting ``clean_up`` under shield."""
    slow_abort(monkeypatch, 30.0)
    loop = asyncio.new_event_loop()

    async def until_cleaning() -> asyncio.Task[bool]:
        task = asyncio.create_task(locks.aio.acquire(key))
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits on the server")
        session = locks._tasks.sessions[task]
        task.cancel()
        await until(lambda: session.cleaning is not None, "its clean-up started")
        await asyncio.sleep(0.05)  # the task is awaiting its clean-up
        return task

    task = loop.run_until_complete(until_cleaning())
    loop.close()
    return task


def test_a_coroutine_closed_during_its_clean_up_leaves_other_tasks_keys_alone(
        locks, dsn, namespace, monkeypatch) -> None:  # noqa: F811
    """``take`` decides ``unrun`` from the exception its ``except`` caught: a CancelledError.
    The GeneratorExit of the coroutine's close comes later, out of the ``await
    self.clean_up(session)`` in that same block, so ``unrun`` stays False and the
    ``finally`` runs ``local_release()`` — the in-process aio release, which acts on
    *the current task*: when the garbage collector finalizes the stranded task while a task
    of another loop of the same thread runs, it releases that task's in-process hold of
    the key. (With no loop running it raises RuntimeError instead, printed as "Exception
    ignored".) ``give`` (cancelled in ``settle``, then closed in ``hand_over``) and
    ``release_all`` (``local_release_all()``: every key of the current task) do the same."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    stranded = strand_a_cancelled_waiter(locks, dsn, "k", monkeypatch)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        locks.lost_keys()  # the sweep: its connection closes, the task is ended in process
    wait_until(lambda: _waiting_on_server(dsn) == 0, "its wait ended on the server")
    finish(holder)
    outcome: dict[str, object] = {}

    async def main() -> None:
        nonlocal stranded
        aio = locks.aio
        assert await aio.acquire("k", timeout=PATIENCE)
        before = aio.recursion_count("k")
        del stranded  # its last reference
        outcome["finalizing raised"] = quietly_collect()
        outcome["held by me"] = (before, aio.recursion_count("k"))
        try:
            await aio.release("k")
        except Exception as error:  # noqa: BLE001
            outcome["release"] = repr(error)

    try:
        asyncio.run(main())
    finally:
        locks.release_all()
    assert outcome == {"finalizing raised": [], "held by me": (1, 1)}, outcome


# -- 4. under pytest, SIGTERM fails one test and the run goes on ---------------------------------


TERMINATED_RUN = '''
import os, sys, time
import pytest
sys.path.insert(0, {tests!r})
import pgserver

@pytest.fixture(scope="module")
def dsn():
    with pgserver.running_server() as running:
        with open({started!r}, "w") as note:
            note.write(repr(pgserver._CONTROLS[running]))
        yield running

def test_one(dsn):
    time.sleep(30)  # still running when CI's time limit (or `timeout`) sends SIGTERM

def test_two(dsn):
    open({second!r}, "w").close()
    time.sleep(30)
'''


@pytest.mark.posix_only
def test_a_terminated_pytest_run_stops_at_once_and_stops_its_server(tmp_path) -> None:
    """``sigterm_exits`` turns SIGTERM into SystemExit "so that what the block started is
    stopped by its finally". But pgserver's block is a module-scoped pytest fixture, and
    pytest catches a SystemExit raised inside a test like any other exception
    (``CallInfo.from_call`` re-raises only ``Exit`` and KeyboardInterrupt): the running
    test fails, and the run goes on with the next tests, the server still running. The
    run ends only when CI's grace period runs out (SIGKILL), which no ``finally`` survives:
    the server is left running, as before the fix. KeyboardInterrupt (what SIGINT gives,
    and what pytest does stop for) would end the run and tear the fixture down."""
    import ast

    started, second = tmp_path / "started", tmp_path / "second-test-ran"
    test_file = tmp_path / "test_terminated.py"
    test_file.write_text(TERMINATED_RUN.format(tests=TESTS,
                                               started=str(started), second=str(second)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "-c", str(tmp_path / "pytest.ini"), str(test_file)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        wait_until(started.exists, "the server started", patience=120)
        time.sleep(1.0)  # test_one is running
        process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=10)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
    finally:
        process.kill()  # what CI does once its grace period is over
        out = process.communicate(timeout=PATIENCE)[0] if ended is False else out
        control = ast.literal_eval(started.read_text()) if started.exists() else None
        if control is not None:
            stopped = subprocess.run([*control[:control.index("-w")], "status"],
                                     capture_output=True).returncode != 0
            subprocess.run([*control[:control.index("-w")], "-m", "immediate", "stop"],
                           capture_output=True, timeout=60)
            datadir = control[control.index("-D") + 1]
            shutil.rmtree(os.path.dirname(datadir), ignore_errors=True)
    assert (ended, second.exists(), stopped) == (True, False, True), out[-2000:]


# -- 5. the distributed bench drops real overlaps ------------------------------------------------


def test_a_second_holder_before_the_first_ones_release_is_an_overlap(monkeypatch) -> None:
    """The fix for the second review's finding 5 reports overlap 0 for a second holder that
    answered after the pause, calling it "the race every lock has at a release". It is
    not: ``release`` answers when the first one's release *began* and ``acquire`` when
    the second one's acquisition had *returned*, so second_held_at < first_released_at
    means both held the key at once — the lease ran out during the pause (the pause's
    doing), the waiter's poll found it only just after. No correct lock ever shows it; a
    Redis lock whose waiter polls does, and its row now reads "no overlap"."""
    from lockmgr.bench import _distributed

    monkeypatch.setattr(_distributed, "PAUSE", 0.05)
    log: dict[str, Any] = {}
    pause = _distributed.paused_holder(ScriptedWorker("first", log),  # type: ignore[arg-type]
                                             ScriptedWorker("second", log), "k")  # type: ignore[arg-type]
    assert log["second acquired"] < time.monotonic()  # (it held "k" before the first released)
    assert pause.overlap > 0, pause


# -- 6. the sweep and a grant both end a stranded task: its token freed twice (compiled core) ----


BOTH_END_IT = """
import asyncio, os, sys, threading, warnings
from lockmgr import _owners, postgres
locks = postgres.PgLockManager(os.environ["DSN"], namespace=os.environ["NAMESPACE"])
g_has_lost, s_warns, g_done = threading.Event(), threading.Event(), threading.Event()
sweeper = threading.get_ident()

def post(self):  # Waker.post as it is, with a pause where the GIL may pass to another thread
    try:
        if self.loop.is_closed():
            raise RuntimeError("its event loop is closed")
        self.loop.call_soon_threadsafe(self._post_here)
    except RuntimeError:
        lost, self.lost = self.lost, None
        g_has_lost.set()
        s_warns.wait(5)  # (a switch of the GIL, or a free-threaded build, does it unaided)
        if lost is not None:
            lost()
        g_done.set()
_owners.Waker.post = post

def showwarning(message, *args, **kwargs):  # AbandonedLockWarning's handlers run Python code
    print("warned:", message, flush=True)
    if threading.get_ident() == sweeper and not s_warns.is_set():
        s_warns.set()
        g_done.wait(5)
warnings.showwarning = showwarning
warnings.simplefilter("always")

holding, release = threading.Event(), threading.Event()
def grantor():  # a thread holding "x", released later: the grant goes to the stranded task
    locks.acquire("x")
    holding.set()
    release.wait()
    locks.release("x")
thread = threading.Thread(target=grantor)
thread.start()
holding.wait()

loop = asyncio.new_event_loop()
async def stranded():
    await locks.aio.acquire("y")
    await locks.aio.acquire("x")  # waits in process
async def setup():
    task = asyncio.create_task(stranded())
    while "waiting=1" not in repr(locks._engine):  # its wait for "x" is queued
        await asyncio.sleep(0.01)
    return task
task = loop.run_until_complete(setup())
loop.close()  # asyncio.run's shutdown cut short: the task waits for "x", holding "y"
release.set()
g_has_lost.wait(5)  # the grant found the loop closed; its ``lost`` is on its way
locks.lost_keys()   # the sweep: end_stranded_task, beside the grant's _loop_closed
thread.join()
print("survived", flush=True)
"""


@pytest.mark.compiled
def test_a_sweep_beside_a_grant_to_a_stranded_task_frees_its_token_once(dsn, namespace) -> None:  # noqa: F811
    """Two paths now end a stranded task in the core: a grant that finds its loop closed
    (``_TaskWait._loop_closed`` -> ``_TaskOwner._task_done``, called directly) and the sweep
    (``end_stranded_task``, new). ``_task_done`` checks ``self.token`` on entry but clears
    it only at its end, after release_abandoned has run the AbandonedLockWarning's Python
    code: a grantor that took the waker's ``lost`` before the sweep's ``_task_done``
    abandoned the wait runs its own ``_task_done`` meanwhile, frees the token, and the
    sweep then uses it and frees it again (here: a crash under PYTHONMALLOC=debug). The
    pause in Waker.post only widens a window a GIL switch (or a free-threaded build) opens."""
    process = subprocess.run([sys.executable, "-c", BOTH_END_IT], capture_output=True,
                             text=True, timeout=120,
                             env={**os.environ, "DSN": dsn, "NAMESPACE": namespace,
                                  "PYTHONMALLOC": "debug"})
    assert process.returncode == 0 and "survived" in process.stdout, (
        process.returncode, process.stdout[-1500:], process.stderr[-3000:])


# -- a sweep that an exception interrupts ends every stranded task all the same --------------


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
