"""The compiled core and the pure twin agree: hypothesis writes random programs for a few
threads and asyncio tasks on one manager, and both engines run each program side by side, step
by step. The managers: ``RWLockManager()`` (read, write, try, timeout, upgrade, downgrade,
``*_many``, release, ``release_all``; tasks' ``aio.read``/``write``/``hold_many`` objects),
``LockManager(fair=True)`` and ``LockManager(fair=False)`` (acquire, release, ``*_many``,
``release_all``; tasks' ``aio.hold``/``hold_many`` objects and ``aio[key]``), and
``SemaphoreManager`` with 2 slots per key, fair and not, and with a limit per key (1, 2 and 3:
the exclusive path and the shared one in one table), with the LockManager's programs. A task's
``async with`` object sits in a slot that any task may enter or exit. After every step the
engines must agree on what each call returned or raised (the exception's type; its message
with owners named by actor; a DeadlockError's ``cycle`` as (actor, key) pairs), which actors
are still waiting, ``snapshot()``, ``stats()``, the metrics' counts and ``len()``. At the end
of a program every actor that is not waiting releases what it holds, until nobody is waiting:
a waiter left when nobody else can release anything is a deadlock that went undetected (both
engines may agree on that), unless it waits on semaphore slots held only by waiters, a cycle
the deadlock search leaves alone by design (docs/semaphores.md).

How a step is observed, without sleeps: a call that may wait (no timeout) ends the step once
it returned or its actor shows among the snapshot's waiters; a call with a timeout or a
try-lock must return within ``STEP`` (nobody releases while it waits, so a timed wait surely
times out). Then the table *settles*: the actors the snapshot shows waiting are exactly those
whose call has not returned (a granted waiter leaves the queue before its call returns), and
no key nobody holds has a single-key waiter first in its queue.

That last condition is what makes ``fair=False`` deterministic here. An unfair release hands
the key to its queue's head only if the head has waited ``HANDOFF_AFTER`` (1 ms); otherwise it
frees the key and wakes the head to race for it, and whoever acquires first wins: a head that
waited 0.9 ms or 1.1 ms, or an acquirer that runs before the woken head, changes the outcome.
Here nothing else runs between a release and the next step, and the next step starts only
once every woken head has taken its key: so the head always wins, as a fair hand-off would,
and everything above is compared for unfair managers as for fair ones. Barging itself (an
acquirer overtaking a woken head) is timing and is not generated; the outcome does not depend
on which side of ``HANDOFF_AFTER`` the head's wait fell (both grant it, counted alike). Steps
are slower than 1 ms, so a head has mostly waited longer by the next release: a woken head
shows in about one program in a thousand, the unfair manager otherwise hands off directly.

``LOCKMGR_FUZZ_EXAMPLES`` sets how many programs run, spread over the managers (CI's
long run sets it; the default is a short run for the suite).
"""

from __future__ import annotations

import asyncio
import os
import re
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
from lockmgr._errors import describe_owner
from lockmgr._owners import LOOP_THREAD, WAIT_CHECK

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


#: The calls that take ``blocking``/``timeout`` (``HOW``).
_ACQUIRERS = {"acquire", "acquire_read", "acquire_write", "acquire_many"}
_HOW_TAKERS = _ACQUIRERS | {"block"}


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
#: Mostly one ``async with`` object: tasks meet on it.
slots = st.sampled_from([0, 0, 1])
block_hows = st.sampled_from(["wait", "wait", "zero", "timed"])


def _mostly_acquiring(acquire: st.SearchStrategy[Op], acquire_many: st.SearchStrategy[Op],
                      release: st.SearchStrategy[Op], release_many: st.SearchStrategy[Op]
                      ) -> st.SearchStrategy[Op]:
    """Acquisitions outweigh releases, so that queues, cycles and deadlocks form."""
    return st.one_of(acquire, acquire, acquire, acquire_many, acquire_many, release, release,
                     release_many, st.just(Op("release_all")))


def _evenly(acquire: st.SearchStrategy[Op], acquire_many: st.SearchStrategy[Op],
            release: st.SearchStrategy[Op], release_many: st.SearchStrategy[Op]
            ) -> st.SearchStrategy[Op]:
    """Each kind of call as likely as the others (see ``MANAGERS``)."""
    return st.one_of(acquire, release, acquire_many, release_many, st.just(Op("release_all")))


def _rw_ops(weigh: Callable[..., st.SearchStrategy[Op]]) -> st.SearchStrategy[Op]:
    """What threads and tasks both do on an ``RWLockManager`` (tasks through ``rw.aio``)."""
    modes = st.sampled_from(["read", "write"])
    return weigh(
        st.builds(lambda mode, key, how: Op(f"acquire_{mode}", (key,), how), modes, keys, hows),
        st.builds(lambda reads, writes, how: Op("acquire_many", (reads, writes), how),
                  some_keys, some_keys, hows),
        st.builds(lambda mode, key: Op(f"release_{mode}", (key,)), modes, keys),
        st.builds(lambda reads, writes: Op("release_many", (reads, writes)), some_keys, some_keys),
    )


def _lock_ops() -> st.SearchStrategy[Op]:
    """What threads and tasks both do on a ``LockManager`` (tasks through ``locks.aio``)."""
    return _mostly_acquiring(
        st.builds(lambda key, how: Op("acquire", (key,), how), keys, hows),
        st.builds(lambda keys, how: Op("acquire_many", (keys,), how), some_keys, hows),
        st.builds(lambda key: Op("release", (key,)), keys),
        st.builds(lambda keys: Op("release_many", (keys,)), some_keys),
    )


def _block_ops(kinds: st.SearchStrategy[tuple[Any, ...]]) -> st.SearchStrategy[Op]:
    """A task makes an ``async with`` object of one of ``kinds`` in a slot, enters or exits
    the object in a slot; any task may use any slot's object. ``("item", key)`` is
    ``aio[key]``, which has no timeout: it always may wait."""
    return st.one_of(
        st.builds(lambda slot, kind, how: Op("block", (slot, kind), "wait" if kind[0] == "item" else how),
                  slots, kinds, block_hows),
        st.builds(lambda slot: Op("enter", (slot,)), slots),
        st.builds(lambda slot: Op("enter", (slot,)), slots),
        st.builds(lambda slot: Op("exit", (slot,)), slots),
    )


_RW_BLOCKS = st.one_of(st.tuples(st.sampled_from(["read", "write"]), keys),
                       st.tuples(st.just("hold_many"), some_keys, some_keys))
_LOCK_BLOCKS = st.one_of(st.tuples(st.sampled_from(["hold", "item"]), keys),
                         st.tuples(st.just("hold_many"), some_keys))


def _steps(common: st.SearchStrategy[Op], blocks: st.SearchStrategy[tuple[Any, ...]]
           ) -> st.SearchStrategy[Step]:
    return st.one_of(
        st.builds(Step, st.sampled_from(THREADS), common),
        st.builds(Step, st.sampled_from(TASKS), st.one_of(common, _block_ops(blocks))),
    )


def _program(steps: st.SearchStrategy[Step]) -> st.SearchStrategy[list[Step]]:
    """Up to 36 steps, in runs of a few: a flat list of steps would mostly be a handful long
    (hypothesis' usual list lengths), too short for cycles of waits to form. Some runs are
    one step two or three times: an owner taking a key again (a lock's re-entry, one more
    slot of a semaphore's key, up to all of them and a wait for its own)."""
    repeated = st.builds(lambda step, times: [step] * times, steps, st.integers(2, 3))
    return st.lists(st.one_of(st.lists(steps, min_size=1, max_size=6), repeated),
                    max_size=6).map(lambda runs: [step for run in runs for step in run])


_LOCK_PROGRAMS = _program(_steps(_lock_ops(), _LOCK_BLOCKS))


def limit_by_key(key: str) -> int:
    """A semaphore's limit per key: "a" is exclusive, "b" has 2 slots, "c" 3."""
    return KEYS.index(key) + 1

#: The managers a program runs on, by name: how to make one, and its programs.
#:
#: ``RWLockManager`` programs come in two shapes: flat lists of a handful of steps, each kind
#: of call equally likely, and longer, more acquisitive ones (``_program``,
#: ``_mostly_acquiring``), in which queues, upgrades and cycles form (they found a multi-key
#: write upgrading a read, queued ahead of another owner's waiting read, missed by the
#: deadlock search).
MANAGERS: dict[str, tuple[Callable[[Any], Any], st.SearchStrategy[list[Step]]]] = {
    "RWLockManager()": (lambda engine: engine.RWLockManager(),
                        st.lists(_steps(_rw_ops(_evenly), _RW_BLOCKS), max_size=25)),
    "RWLockManager()  # long programs": (
        lambda engine: engine.RWLockManager(),
        _program(_steps(_rw_ops(_mostly_acquiring), _RW_BLOCKS))),
    "LockManager(fair=True)": (lambda engine: engine.LockManager(fair=True), _LOCK_PROGRAMS),
    "LockManager(fair=False)": (lambda engine: engine.LockManager(fair=False), _LOCK_PROGRAMS),
    # A semaphore's calls are a LockManager's: the same programs.
    "SemaphoreManager(2)": (lambda engine: engine.SemaphoreManager(2), _LOCK_PROGRAMS),
    "SemaphoreManager(2, fair=False)": (lambda engine: engine.SemaphoreManager(2, fair=False),
                                        _LOCK_PROGRAMS),
    "SemaphoreManager(limit_by_key)": (lambda engine: engine.SemaphoreManager(limit_by_key),
                                       _LOCK_PROGRAMS),
}

programs = st.sampled_from(list(MANAGERS)).flatmap(
    lambda manager: st.tuples(st.just(manager), MANAGERS[manager][1]))


# -- the actors ---------------------------------------------------------------------------------

class Abandoned(Exception):
    """Raised in a thread stuck in a wait the harness gives up on (its wait check)."""


class TaskActor:
    """An asyncio task on ``loop`` that runs the coroutine functions submitted to it, one at a
    time (the owner of what they take is this one task)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._calls: asyncio.Queue[tuple[Callable[[], Awaitable[object]], threading.Event, list[object]] | None]
        self.task: asyncio.Task[None] = asyncio.run_coroutine_threadsafe(
            self._start(name), loop).result(STEP)

    async def _start(self, name: str) -> asyncio.Task[None]:
        self._calls = asyncio.Queue()
        return asyncio.create_task(self._run(), name=name)

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

    def __init__(self, engine: Any, manager: str) -> None:
        self.engine = engine
        self.manager = MANAGERS[manager][0](engine)
        self.abandoning = False
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self._loop_thread.start()
        self.threads = {name: Worker(f"fuzz-{name}") for name in THREADS}
        for worker in self.threads.values():
            worker.run(self._install_wait_check)
        self.tasks = {name: TaskActor(self.loop, f"fuzz-{name}") for name in TASKS}
        self.names: dict[object, str] = {w.thread.ident: n for n, w in self.threads.items()}
        self.names.update({actor.task: n for n, actor in self.tasks.items()})
        self.blocks: list[Any] = [None] * SLOTS
        self.block_waits = [False] * SLOTS  # whether entering the slot's object may queue
        self.block_many = [False] * SLOTS  # whether the slot's object takes several keys
        self.waiting: dict[str, Call] = {}  # actor -> its call that queued
        self.waiting_many: set[str] = set()  # the actors whose queued call takes several keys
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
            slot, kind = op.args
            self.block_waits[slot] = op.how == "wait"
            self.block_many[slot] = kind[0] == "hold_many"
        return op.how == "wait" and op.name in _ACQUIRERS

    def takes_many(self, op: Op) -> bool:
        """Whether ``op`` asks for several keys at once (one request: never woken to race)."""
        return op.name == "acquire_many" or (op.name == "enter" and self.block_many[op.args[0]])

    def _thread_call(self, op: Op) -> Callable[[], object]:
        manager, how = self.manager, HOW[op.how]
        if op.name in _ACQUIRERS:
            return lambda: getattr(manager, op.name)(*op.args, **how)
        return lambda: getattr(manager, op.name)(*op.args)

    def _task_call(self, op: Op) -> Callable[[], Awaitable[object]]:
        aio, how = self.manager.aio, HOW[op.how]

        async def call() -> object:
            if op.name in _ACQUIRERS:
                return await getattr(aio, op.name)(*op.args, **how)
            if op.name == "block":
                slot, (kind, *args) = op.args
                if kind == "item":
                    self.blocks[slot] = aio[args[0]]
                else:
                    self.blocks[slot] = getattr(aio, kind)(*args, timeout=how.get("timeout"))
                return None
            if op.name in {"enter", "exit"}:
                block = self.blocks[op.args[0]]
                if block is None:
                    return "no object"
                if op.name == "enter":
                    return await block.__aenter__()
                return await block.__aexit__(None, None, None)
            if op.name == "release_all":
                return aio.release_all()
            return await getattr(aio, op.name)(*op.args)  # a release answers a done awaitable

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
            for state in self.manager.snapshot())

    def waiters(self) -> set[str]:
        return {actor for _, _, waiters in self.snapshot() for actor, _, _ in waiters}

    def counters(self) -> tuple[Any, ...]:
        metrics = self.manager.metrics()
        return (self.manager.stats(), len(self.manager), metrics.wait_time.count,
                metrics.hold_time.count)

    def is_queued(self, actor: str) -> bool:
        return actor in self.waiters()

    def settle(self) -> dict[str, tuple[Any, ...]]:
        """Wait until the actors shown waiting are those whose call has not returned; answer
        the outcomes of the waiting calls that returned (granted, refused, timed out)."""
        def settled() -> bool:
            pending = {actor for actor, call in self.waiting.items() if not call.done()}
            return self.waiters() == pending and not self._woken_heads(pending)

        wait_until(settled, f"the {self.engine.__name__} table settled", patience=STEP)
        ended = {actor: self.outcome(call) for actor, call in self.waiting.items() if call.done()}
        for actor in ended:
            del self.waiting[actor]
            self.waiting_many.discard(actor)
        return ended

    def _woken_heads(self, pending: set[str]) -> list[str]:
        """The single-key waiters first in the queue of a key nobody holds: with
        ``fair=False``, woken to take it, but not yet run (nobody can overtake them between
        steps, so this waits until they have taken it). A fair manager grants such a head
        before the release returns; a multi-key head is granted directly too (or waits for
        another of its keys)."""
        return [waiters[0][0] for _, holders, waiters in self.snapshot()
                if not holders and waiters and waiters[0][0] in pending
                and waiters[0][0] not in self.waiting_many]

    def outcome(self, call: Call, patience: float = STEP) -> tuple[Any, ...]:
        """What a call returned; or what it raised: its type, its message with the owners
        named by actor, and a DeadlockError's cycle as (actor, key) pairs."""
        try:
            return ("returned", call.result(patience))
        except AssertionError:
            raise
        except BaseException as exc:
            message = _named_tasks(str(exc))
            for owner, name in self.names.items():
                message = message.replace(describe_owner(owner), f"<{name}>")
            cycle = getattr(exc, "cycle", None)
            if cycle is not None:
                cycle = [(self.names.get(owner, repr(owner)), "LOOP_THREAD" if key is LOOP_THREAD else key)
                         for owner, key in cycle]
            return ("raised", type(exc).__name__, message, cycle)

    # -- the end --

    def release_everything(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Every actor not waiting releases all it holds, until nobody waits or nothing moves
        any more; answers each release's and each waiter's outcome, in order."""
        log: list[tuple[str, tuple[Any, ...]]] = []
        while True:
            for actor in THREADS + TASKS:
                if actor not in self.waiting:
                    log.append((actor, self.outcome(self.submit(Step(actor, Op("release_all"))))))
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


# -- running a program on both engines ----------------------------------------------------------

def run_step(arena: Arena, step: Step, call: Call) -> tuple[Any, ...]:
    """Observe a submitted step: its outcome, or "waiting" once it queued."""
    if arena.may_wait(step.op):
        wait_until(lambda: call.done() or arena.is_queued(step.actor),
                   f"{step} returned or queued", patience=STEP)
        if not call.done():
            arena.waiting[step.actor] = call
            if arena.takes_many(step.op):
                arena.waiting_many.add(step.actor)
            return ("waiting", None)
    return arena.outcome(call)


def _named_tasks(message: str) -> str:
    """``message`` with each task's repr (its callbacks are the engine's own) shown as
    ``<A0>``, by the name the actor gave its task."""
    while (start := message.find("<Task ")) >= 0:
        depth, end = 0, start
        for end, char in enumerate(message[start:], start):
            depth += {"<": 1, ">": -1}.get(char, 0)
            if depth == 0:
                break
        name = re.search(r"name='fuzz-(\w+)'", message[start:end])
        message = f"{message[:start]}<{name[1] if name else 'a task'}>{message[end + 1:]}"
    return message


def listing(manager: str, program: list[Step]) -> str:
    return "\n  ".join([f"manager = {manager}", *map(repr, program)])


def _stuck_on_slots(arena: Arena) -> bool:
    """Whether the waiters left wait on a semaphore's slots held only by waiters: a cycle
    through slots, which the deadlock search does not follow (docs/semaphores.md says why:
    one holder outside a cycle ends a slot wait, so it raises nothing for slot waits)."""
    if not hasattr(arena.manager, "available"):
        return False
    for key, holders, waiters in arena.snapshot():
        if not waiters:
            continue
        if waiters[0][0] in arena.waiting_many and arena.manager.available(key) > 0:
            continue  # a set at the head, waiting for another of its keys
        if arena.manager.available(key) > 0 or any(
                mode != "read" or holder not in arena.waiting for holder, _, mode, _ in holders):
            return False
    return True


def run_program(core: Arena, twin: Arena, manager: str, program: list[Step]) -> None:
    def agree(what: str, in_core: object, in_twin: object, at: int) -> None:
        if in_core != in_twin:
            raise AssertionError(
                f"the engines disagree on {what} after step {at}:\n  "
                f"{listing(manager, program[:at + 1])}\ncore: {in_core!r}\ntwin: {in_twin!r}")

    for at, step in enumerate(program):
        if step.actor in core.waiting or step.actor in twin.waiting:
            continue  # busy waiting in both (the waiting sets agree after every step)
        calls = [arena.submit(step) for arena in (core, twin)]
        outcomes = [run_step(arena, step, call) for arena, call in zip((core, twin), calls)]
        agree("what the step did", *outcomes, at)
        agree("how the waiting calls ended", core.settle(), twin.settle(), at)
        agree("who is waiting", sorted(core.waiting), sorted(twin.waiting), at)
        agree("snapshot()", core.snapshot(), twin.snapshot(), at)
        agree("stats(), len() and the metrics' counts", core.counters(), twin.counters(), at)
    end = len(program) - 1
    agree("releasing everything at the end", core.release_everything(), twin.release_everything(), end)
    for arena in (core, twin):
        if arena.waiting and not _stuck_on_slots(arena):
            raise AssertionError(
                f"an undetected deadlock on {arena.engine.__name__}: {sorted(arena.waiting)} still "
                f"wait once everyone else released everything:\n  {listing(manager, program)}\n"
                f"snapshot: {arena.snapshot()}")
    agree("snapshot() at the end", core.snapshot(), twin.snapshot(), end)
    agree("stats() at the end", core.counters(), twin.counters(), end)


#: Hypothesis stops shrinking after 5 minutes of it; the test must outlive that so a failure
#: ends with its counterexample, not with pytest-timeout's 300 s.
@pytest.mark.timeout(900 + EXAMPLES)
def test_engines_agree_on_random_programs_of_threads_and_tasks() -> None:
    programs_run = failed = 0

    # No "explain" phase: its notes repeat a long failing program in another, noisier form.
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              phases=[p for p in Phase if p is not Phase.explain])
    @given(programs)
    def program_runs_alike(manager_and_program: tuple[str, list[Step]]) -> None:
        nonlocal programs_run, failed
        manager, program = manager_and_program
        programs_run += 1
        core, twin = Arena(lockmgr._core, manager), Arena(lockmgr._pure, manager)
        try:
            run_program(core, twin, manager, program)
        except AssertionError:
            if not failed:  # how hard the search was, in the failure's captured output
                failed = programs_run
                print(f"the first failing program was program {programs_run}")
            raise
        finally:
            core.close()
            twin.close()

    program_runs_alike()
