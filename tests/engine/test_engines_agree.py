"""The compiled core and the pure twin agree: hypothesis writes random programs for a few
threads and asyncio tasks on an ``RWLockManager`` (read, write, try, timeout, upgrade,
downgrade, ``*_many``, release, ``release_all``, ``async with`` objects shared by tasks), and
both engines run each program side by side, step by step. After every step they must agree on
what each call returned or raised, which actors are still waiting, ``snapshot()``,
``stats()``, the metrics' counts and ``len()``. At the end of a program every actor that is
not waiting releases what it holds, until nobody is waiting: a waiter left when nobody else
can release anything is a deadlock that went undetected (both engines may agree on that).

How a step is observed, without sleeps: a call that may wait (no timeout) ends the step once
it returned or its actor shows among the snapshot's waiters; a call with a timeout or a
try-lock must return within ``STEP`` (nobody releases while it waits, so a timed wait surely
times out). Then the table *settles*: the actors the snapshot shows waiting are exactly those
whose call has not returned (a granted waiter leaves the queue before its call returns).

``LOCKMGR_FUZZ_EXAMPLES`` sets how many programs run (CI's long run sets it; the default is
a short run for the suite).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, given, settings

import lockmgr._core
import lockmgr._pure
from conftest import Call, Worker, wait_until
from lockmgr._owners import WAIT_CHECK

pytestmark = pytest.mark.compiled

EXAMPLES = int(os.environ.get("LOCKMGR_FUZZ_EXAMPLES", "800"))

THREADS = ("T0", "T1", "T2")
TASKS = ("A0", "A1")
KEYS = ("a", "b", "c")
#: How many ``async with`` objects the tasks share (by slot).
SLOTS = 2

#: How long one step may take: a call that returns at once, or a timed wait. Short, so a
#: wrong wait fails fast and hypothesis can shrink it; long for a loaded 2-core machine.
STEP = 5.0
#: A timed wait's timeout: nobody releases while it waits, so it times out (or is refused).
TIMED = 0.01

HOW: dict[str, dict[str, Any]] = {
    "wait": {}, "try": {"blocking": False}, "zero": {"timeout": 0}, "timed": {"timeout": TIMED},
}


# -- the program: steps of actors ----------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """One call an actor makes. ``waits``: it may queue until another actor releases."""

    name: str
    args: tuple[Any, ...] = ()
    how: str = "wait"

    def __repr__(self) -> str:
        how = "" if self.how == "wait" or self.name not in _HOW_TAKERS else f", {self.how}"
        return f"{self.name}({', '.join(map(repr, self.args))}{how})"


_HOW_TAKERS = {"acquire_read", "acquire_write", "acquire_many", "block"}


@dataclass(frozen=True)
class Step:
    actor: str
    op: Op

    def __repr__(self) -> str:
        return f"{self.actor}.{self.op!r}"


keys = st.sampled_from(KEYS)
some_keys = st.lists(keys, unique=True, max_size=2).map(tuple)
#: Mostly calls that may wait: the interesting states are queues.
hows = st.sampled_from(["wait", "wait", "wait", "try", "zero", "timed"])


def _common_ops() -> st.SearchStrategy[Op]:
    """What threads and tasks both do (tasks through ``rw.aio``)."""
    return st.one_of(
        st.builds(lambda mode, key, how: Op(f"acquire_{mode}", (key,), how),
                  st.sampled_from(["read", "write"]), keys, hows),
        st.builds(lambda mode, key: Op(f"release_{mode}", (key,)), st.sampled_from(["read", "write"]), keys),
        st.builds(lambda reads, writes, how: Op("acquire_many", (reads, writes), how),
                  some_keys, some_keys, hows),
        st.builds(lambda reads, writes: Op("release_many", (reads, writes)), some_keys, some_keys),
        st.just(Op("release_all")),
    )


def _block_ops() -> st.SearchStrategy[Op]:
    """A task makes an ``async with`` object in a slot (``read``/``write``/``hold_many``),
    enters or exits the object in a slot; any task may use any slot's object."""
    slots = st.sampled_from([0, 0, 1])  # mostly one object: tasks meet on it
    kinds = st.one_of(st.tuples(st.sampled_from(["read", "write"]), keys),
                      st.tuples(st.just("hold_many"), some_keys, some_keys))
    return st.one_of(
        st.builds(lambda slot, kind, how: Op("block", (slot, kind), how), slots, kinds,
                  st.sampled_from(["wait", "wait", "zero", "timed"])),
        st.builds(lambda slot: Op("enter", (slot,)), slots),
        st.builds(lambda slot: Op("enter", (slot,)), slots),
        st.builds(lambda slot: Op("exit", (slot,)), slots),
    )


steps = st.one_of(
    st.builds(Step, st.sampled_from(THREADS), _common_ops()),
    st.builds(Step, st.sampled_from(TASKS), st.one_of(_common_ops(), _block_ops())),
)


# -- the actors ---------------------------------------------------------------------------------

class Abandoned(Exception):
    """Raised in a thread stuck in a wait the harness gives up on (its wait check)."""


class TaskActor:
    """An asyncio task on ``loop`` that runs the coroutine functions submitted to it, one at a
    time (the owner of what they take is this one task)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: asyncio.Queue[tuple[Callable[[], Awaitable[object]], threading.Event, list[object]] | None]
        self.task: asyncio.Task[None] = asyncio.run_coroutine_threadsafe(self._start(), loop).result(STEP)

    async def _start(self) -> asyncio.Task[None]:
        self._calls = asyncio.Queue()
        return asyncio.create_task(self._run())

    async def _run(self) -> None:
        while (item := await self._calls.get()) is not None:
            func, done, box = item
            try:
                box.append(("ok", await func()))
            except BaseException as exc:  # handed to the harness; a cancellation included
                box.append(("error", exc))
            done.set()

    def submit(self, func: Callable[[], Awaitable[object]]) -> Call:
        done, box = threading.Event(), []
        self._loop.call_soon_threadsafe(self._calls.put_nowait, (func, done, box))
        return Call(done, box)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._calls.put_nowait, None)

    def abandon(self) -> None:
        self._loop.call_soon_threadsafe(self.task.cancel)


class Arena:
    """One engine's manager, its actors (threads and tasks on an event loop of their own) and
    the calls still waiting."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rw = engine.RWLockManager()
        self.abandoning = False
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self._loop_thread.start()
        self.threads = {name: Worker(f"fuzz-{name}") for name in THREADS}
        for worker in self.threads.values():
            worker.run(self._install_wait_check)
        self.tasks = {name: TaskActor(self.loop) for name in TASKS}
        self.names: dict[object, str] = {w.thread.ident: n for n, w in self.threads.items()}
        self.names.update({actor.task: n for n, actor in self.tasks.items()})
        self.blocks: list[Any] = [None] * SLOTS
        self.block_waits = [False] * SLOTS  # whether entering the slot's object may queue
        self.waiting: dict[str, Call] = {}  # actor -> its call that queued
        self.last: dict[str, Call] = {}  # actor -> its latest call

    def _install_wait_check(self) -> None:
        def check() -> None:
            if self.abandoning:
                raise Abandoned

        WAIT_CHECK.call = check

    # -- running a step --

    def submit(self, step: Step) -> Call:
        if step.actor in self.threads:
            call = self.threads[step.actor].submit(self._thread_call(step.op))
        else:
            call = self.tasks[step.actor].submit(self._task_call(step.op))
        self.last[step.actor] = call
        return call

    def may_wait(self, op: Op) -> bool:
        """Whether ``op`` may queue until another actor releases (no timeout)."""
        if op.name == "enter":
            return self.block_waits[op.args[0]]
        if op.name == "block":
            self.block_waits[op.args[0]] = op.how == "wait"
        return op.how == "wait" and op.name in {"acquire_read", "acquire_write", "acquire_many"}

    def _thread_call(self, op: Op) -> Callable[[], object]:
        rw, how = self.rw, HOW[op.how]
        if op.name.startswith("acquire_") and op.name != "acquire_many":
            return lambda: getattr(rw, op.name)(*op.args, **how)
        if op.name == "acquire_many":
            return lambda: rw.acquire_many(*op.args, **how)
        return lambda: getattr(rw, op.name)(*op.args)

    def _task_call(self, op: Op) -> Callable[[], Awaitable[object]]:
        aio, how = self.rw.aio, HOW[op.how]

        async def call() -> object:
            if op.name in {"acquire_read", "acquire_write", "acquire_many"}:
                return await getattr(aio, op.name)(*op.args, **how)
            if op.name == "block":
                slot, kind = op.args
                timeout = how.get("timeout")
                if kind[0] == "hold_many":
                    self.blocks[slot] = aio.hold_many(*kind[1:], timeout=timeout)
                else:
                    self.blocks[slot] = getattr(aio, kind[0])(kind[1], timeout=timeout)
                return None
            if op.name in {"enter", "exit"}:
                block = self.blocks[op.args[0]]
                if block is None:
                    return "no object"
                if op.name == "enter":
                    return await block.__aenter__()
                return await block.__aexit__(None, None, None)
            return getattr(aio, op.name)(*op.args)

        return call

    # -- what the table shows --

    def snapshot(self) -> list[tuple[Any, ...]]:
        """``snapshot()`` without times, owners named by actor, keys in order."""
        def name(owner: object) -> str:
            return self.names.get(owner, repr(owner))

        return sorted(
            (state.key,
             tuple((name(h.owner), h.kind, h.mode, h.count) for h in state.holders),
             tuple((name(w.owner), w.kind, w.mode) for w in state.waiters))
            for state in self.rw.snapshot())

    def waiters(self) -> set[str]:
        return {actor for _, _, waiters in self.snapshot() for actor, _, _ in waiters}

    def counters(self) -> tuple[Any, ...]:
        metrics = self.rw.metrics()
        return (self.rw.stats(), len(self.rw), metrics.wait_time.count, metrics.hold_time.count)

    def is_queued(self, actor: str) -> bool:
        return actor in self.waiters()

    def settle(self) -> dict[str, tuple[str, Any]]:
        """Wait until the actors shown waiting are those whose call has not returned; answer
        the outcomes of the waiting calls that returned (granted, refused, timed out)."""
        def settled() -> bool:
            pending = {actor for actor, call in self.waiting.items() if not call.done()}
            return self.waiters() == pending

        wait_until(settled, f"the {self.engine.__name__} table settled", patience=STEP)
        ended = {actor: outcome(call) for actor, call in self.waiting.items() if call.done()}
        for actor in ended:
            del self.waiting[actor]
        return ended

    # -- the end --

    def release_everything(self) -> list[tuple[str, tuple[str, Any]]]:
        """Every actor not waiting releases all it holds, until nobody waits or nothing moves
        any more; answers each release's and each waiter's outcome, in order."""
        log: list[tuple[str, tuple[str, Any]]] = []
        while True:
            for actor in THREADS + TASKS:
                if actor not in self.waiting:
                    log.append((actor, outcome(self.submit(Step(actor, Op("release_all"))), STEP)))
            ended = self.settle()
            log += sorted(ended.items())
            if not self.waiting or not ended:
                return log

    def close(self) -> None:
        """Stop the actors; one stuck in a call (waiting, or a failed step's) gives it up
        first, then each releases what it holds (its end would warn)."""
        self.abandoning = True
        for actor, call in self.last.items():
            if not call.done() and actor in self.tasks:
                self.tasks[actor].abandon()
        for call in self.last.values():
            call.wait(STEP)
        for actor in THREADS + TASKS:
            self.submit(Step(actor, Op("release_all"))).wait(STEP)
        for worker in self.threads.values():
            worker.stop(STEP)
        for actor in self.tasks.values():
            actor.stop()
        asyncio.run_coroutine_threadsafe(
            asyncio.wait([a.task for a in self.tasks.values()], timeout=STEP), self.loop).result(2 * STEP)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(STEP)
        self.loop.close()


def outcome(call: Call, patience: float = STEP) -> tuple[str, Any]:
    """What a call returned, or the type of what it raised."""
    try:
        return ("returned", call.result(patience))
    except AssertionError:
        raise
    except BaseException as exc:
        return ("raised", type(exc).__name__)


# -- running a program on both engines ----------------------------------------------------------

def run_step(arena: Arena, step: Step, call: Call) -> tuple[str, Any]:
    """Observe a submitted step: its outcome, or "waiting" once it queued."""
    if arena.may_wait(step.op):
        wait_until(lambda: call.done() or arena.is_queued(step.actor),
                   f"{step} returned or queued", patience=STEP)
        if not call.done():
            arena.waiting[step.actor] = call
            return ("waiting", None)
    return outcome(call)


def agree(what: str, core: object, twin: object, program: list[Step], at: int) -> None:
    if core != twin:
        done = "\n  ".join(map(repr, program[:at + 1]))
        raise AssertionError(f"the engines disagree on {what} after step {at}:\n  {done}\n"
                             f"core: {core!r}\ntwin: {twin!r}")


def run_program(core: Arena, twin: Arena, program: list[Step]) -> None:
    for at, step in enumerate(program):
        if step.actor in core.waiting or step.actor in twin.waiting:
            continue  # busy waiting in both (the waiting sets agree after every step)
        calls = [arena.submit(step) for arena in (core, twin)]
        outcomes = [run_step(arena, step, call) for arena, call in zip((core, twin), calls)]
        agree("what the step did", *outcomes, program, at)
        agree("how the waiting calls ended", core.settle(), twin.settle(), program, at)
        agree("who is waiting", sorted(core.waiting), sorted(twin.waiting), program, at)
        agree("snapshot()", core.snapshot(), twin.snapshot(), program, at)
        agree("stats(), len() and the metrics' counts", core.counters(), twin.counters(), program, at)
    end = len(program) - 1
    agree("releasing everything at the end", core.release_everything(), twin.release_everything(),
          program, end)
    for arena in (core, twin):
        if arena.waiting:
            done = "\n  ".join(map(repr, program))
            raise AssertionError(
                f"an undetected deadlock on {arena.engine.__name__}: {sorted(arena.waiting)} still "
                f"wait once everyone else released everything:\n  {done}\n"
                f"snapshot: {arena.snapshot()}")
    agree("snapshot() at the end", core.snapshot(), twin.snapshot(), program, end)
    agree("stats() at the end", core.counters(), twin.counters(), program, end)


#: Hypothesis stops shrinking after 5 minutes of it; the test must outlive that so a failure
#: ends with its counterexample, not with pytest-timeout's 300 s.
@pytest.mark.timeout(900 + EXAMPLES)
def test_engines_agree_on_random_programs_of_threads_and_tasks() -> None:
    programs = failed = 0

    # No "explain" phase: its notes repeat a long failing program in another, noisier form.
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              phases=[p for p in Phase if p is not Phase.explain])
    @given(st.lists(steps, max_size=25))
    def program_runs_alike(program: list[Step]) -> None:
        nonlocal programs, failed
        programs += 1
        core, twin = Arena(lockmgr._core), Arena(lockmgr._pure)
        try:
            run_program(core, twin, program)
        except AssertionError:
            if not failed:  # how hard the search was, in the failure's captured output
                failed = programs
                print(f"the first failing program was program {programs}")
            raise
        finally:
            core.close()
            twin.close()

    program_runs_alike()
