"""Singleflight for asyncio tasks (``flight.aio``), and tasks and threads sharing flights, on
both engines."""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import threading
import warnings
from types import ModuleType
from typing import Any

import pytest
from conftest import PATIENCE, wait_until
from test_aio import run, until

from lockmgr import DeadlockError, FlightAbortedError, LockTimeout, Singleflight
from lockmgr._singleflight import singleflight_on


@pytest.fixture
def flight(impl: ModuleType) -> Singleflight[Any, Any]:
    return singleflight_on(impl)()


def waiting(flight: Singleflight[Any, Any]) -> int:
    """How many callers wait for a call (their reads queue in the flights' lock table)."""
    return flight._table.locks.stats().waiting


class Gate:
    """A coroutine function that counts its runs and returns once the test opens it; it
    records a cancellation."""

    def __init__(self, result: object = "value") -> None:
        self.runs = 0
        self.cancelled = False
        self.running = asyncio.Event()
        self.open = asyncio.Event()
        self.result = result

    async def __call__(self, *args: object) -> object:
        self.runs += 1
        self.running.set()
        try:
            await self.open.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return (self.result, *args) if args else self.result


def test_concurrent_tasks_share_one_call(flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()
        callers = [asyncio.create_task(flight.aio.call("k", gate, 1)) for _ in range(20)]
        await gate.running.wait()
        await until(lambda: waiting(flight) == 20, "every caller waits (the runner is a task)")
        gate.open.set()
        assert await asyncio.gather(*callers) == [("value", 1)] * 20
        assert gate.runs == 1 and len(flight) == 0 and len(flight._table.locks) == 0

    run(main)


def test_tasks_asking_before_the_call_started_make_one_runner(
        flight: Singleflight[str, Any]) -> None:
    """Tasks of one loop that all ask before the first one's runner has run wait for that
    runner rather than each making one (the loop's task factory counts them)."""
    async def main() -> None:
        runners: list[str] = []
        loop = asyncio.get_running_loop()

        def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
            runners.extend([coro.__qualname__] if coro.__qualname__.endswith("._run") else [])
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(counting)
        gate = Gate()
        gate.open.set()
        assert await asyncio.gather(*(flight.aio.call("k", gate) for _ in range(20))) == (
            ["value"] * 20)
        assert runners == ["AsyncSingleflight._run"] and gate.runs == 1
        assert not flight._table.starting

    run(main)


def test_callers_of_a_runner_cancelled_before_it_ran_start_anew(
        flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()
        gate.open.set()
        callers = [asyncio.create_task(flight.aio.call("k", gate)) for _ in range(2)]
        await asyncio.sleep(0)  # both run up to their wait for the first one's runner
        runner, = (task for task in asyncio.all_tasks()
                   if task.get_coro().__qualname__ == "AsyncSingleflight._run")
        runner.cancel()  # before its first step, as its loop's shutdown would
        assert await asyncio.gather(*callers) == ["value", "value"] and gate.runs == 1

    run(main)


def test_the_first_caller_s_cancellation_leaves_the_call_to_the_others(
        flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()
        first = asyncio.create_task(flight.aio.call("k", gate))
        await gate.running.wait()
        second = asyncio.create_task(flight.aio.call("k", gate))
        await until(lambda: waiting(flight) == 2, "both callers wait")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not gate.cancelled and "k" in flight
        gate.open.set()
        assert await second == "value" and gate.runs == 1

    run(main)


@pytest.mark.parametrize("opt_in", [False, True])
def test_a_caller_cancelled_before_its_call_started_leaves_it_to_the_rule(
        flight: Singleflight[str, Any], opt_in: bool) -> None:
    """The starter is cancelled while its runner task has not run yet: the call still
    starts, and then runs for the others (or is cancelled, if its one caller opted in)."""
    async def main() -> None:
        gate = Gate()
        first = asyncio.create_task(flight.aio.call("k", gate, cancel_when_abandoned=opt_in))
        await asyncio.sleep(0)  # ``first`` runs up to its wait for the runner, which has not run
        assert "k" not in flight and not gate.running.is_set()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await gate.running.wait()
        if opt_in:
            await until(lambda: gate.cancelled, "the call nobody waits for is cancelled")
            return
        second = asyncio.create_task(flight.aio.call("k", gate))
        await until(lambda: waiting(flight) == 1, "a second caller joins the call")
        gate.open.set()
        assert await second == "value" and gate.runs == 1 and not gate.cancelled

    run(main)


def test_a_call_nobody_waits_for_runs_to_its_end_unless_every_caller_opted_in(
        flight: Singleflight[str, Any]) -> None:
    async def abandon(gate: Gate, *opt_ins: bool) -> None:
        callers = [asyncio.create_task(
            flight.aio.call("k", gate, cancel_when_abandoned=opt_in)) for opt_in in opt_ins]
        await gate.running.wait()
        await until(lambda: waiting(flight) == len(opt_ins), "every caller waits")
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)

    async def main() -> None:
        kept = Gate()
        await abandon(kept, True, False)
        assert "k" in flight and not kept.cancelled  # one caller did not opt in
        kept.open.set()
        await until(lambda: len(flight) == 0, "the call ran to its end")
        assert kept.runs == 1 and not kept.cancelled

        dropped = Gate()
        await abandon(dropped, True, True)
        assert "k" not in flight  # the next caller starts a new call at once
        await until(lambda: dropped.cancelled, "the abandoned call is cancelled")
        await until(lambda: len(flight._table.locks) == 0, "its task ended")

    run(main)


def test_a_timeout_abandons_the_caller_s_wait_only(flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()
        first = asyncio.create_task(flight.aio.call("k", gate))
        await gate.running.wait()
        with pytest.raises(LockTimeout, match="^the call for key 'k' did not finish within"):
            await flight.aio.call("k", gate, timeout=0.05, cancel_when_abandoned=True)
        assert "k" in flight and not gate.cancelled
        gate.open.set()
        assert await first == "value"

    run(main)


def test_an_exception_is_shared_by_every_task(flight: Singleflight[str, Any]) -> None:
    failure = ConnectionError("backend down")

    async def fail() -> None:
        await asyncio.sleep(0)
        raise failure

    async def main() -> list[BaseException]:
        return await asyncio.gather(*(flight.aio.call("k", fail) for _ in range(5)),
                                    return_exceptions=True)

    assert run(main) == [failure] * 5
    assert len(flight) == 0


def test_waiters_of_a_cancelled_call_get_a_clear_error(flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()
        waiter = asyncio.create_task(flight.aio.call("k", gate))
        await gate.running.wait()
        runner = flight._table.flights["k"].task
        assert runner is not None
        runner.cancel()  # as its loop's shutdown would
        with pytest.raises(FlightAbortedError, match="ended with CancelledError") as caught:
            await waiter
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)

    run(main)


def test_a_keyboard_interrupt_in_a_task_s_call_ends_its_loop_and_fails_its_waiters(
        flight: Singleflight[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """KeyboardInterrupt raised by the coroutine goes where asyncio sends it (out of the
    loop, in the thread that ran the call), once: the runner task's finalizer does not log
    it again; a thread waiting for the call gets FlightAbortedError."""
    release = threading.Event()

    async def interrupted() -> None:
        await asyncio.to_thread(release.wait, PATIENCE)
        raise KeyboardInterrupt

    waiter: list[BaseException] = []

    def wait_for_the_call() -> None:
        try:
            flight.call("k", str)
        except BaseException as error:  # handed to the test
            waiter.append(error)

    async def main() -> None:
        call = asyncio.create_task(flight.aio.call("k", interrupted))
        await until(lambda: "k" in flight, "the call runs")
        thread = threading.Thread(target=wait_for_the_call, daemon=True)
        thread.start()
        await until(lambda: waiting(flight) == 2, "the thread waits for the call")
        release.set()
        await call

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    gc.collect()  # the runner task's finalizer, which logs an exception never retrieved
    assert "never retrieved" not in caplog.text
    wait_until(lambda: bool(waiter), "the thread has its answer")
    assert isinstance(waiter[0], FlightAbortedError)
    assert isinstance(waiter[0].__cause__, KeyboardInterrupt)
    assert len(flight) == 0


def test_a_thread_joins_a_task_s_call_and_a_task_joins_a_thread_s(
        flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()
        task_call = asyncio.create_task(flight.aio.call("from-task", gate))
        await gate.running.wait()
        thread_call = asyncio.create_task(asyncio.to_thread(
            flight.call, "from-task", lambda: "not run"))
        await until(lambda: waiting(flight) == 2, "the task and the thread wait")
        gate.open.set()
        assert await task_call == await thread_call == "value"

        opened = threading.Event()
        in_thread = asyncio.create_task(asyncio.to_thread(
            flight.call, "from-thread", lambda: opened.wait(PATIENCE) and "thread value"))
        await until(lambda: "from-thread" in flight, "the thread runs the call")

        async def not_run() -> str:
            return "not run"

        joined = asyncio.create_task(flight.aio.call("from-thread", not_run))
        await until(lambda: waiting(flight) == 1, "the task waits for the thread's call")
        opened.set()
        assert await joined == await in_thread == "thread value"
        assert len(flight) == 0

    run(main)


def test_a_task_asking_for_the_key_its_call_runs_raises_deadlock_error(
        flight: Singleflight[str, Any]) -> None:
    async def recurse() -> object:
        return await flight.aio.call("k", recurse)

    async def main() -> None:
        with pytest.raises(DeadlockError, match="the call for key 'k' is run by this caller"):
            await flight.aio.call("k", recurse)
        assert len(flight) == 0

    run(main)


def test_blocking_the_loop_for_a_call_its_task_runs_raises_deadlock_error(
        flight: Singleflight[str, Any]) -> None:
    """A synchronous call from the loop's thread would wait for a task of that loop."""
    async def main() -> None:
        gate = Gate()
        task_call = asyncio.create_task(flight.aio.call("k", gate))
        await gate.running.wait()
        with pytest.raises(DeadlockError):
            flight.call("k", lambda: "not run")
        gate.open.set()
        assert await task_call == "value"

    run(main)


def test_a_loop_inside_a_thread_s_call_asking_for_its_key_raises_deadlock_error(
        flight: Singleflight[str, Any]) -> None:
    async def ask() -> object:
        return await flight.aio.call("k", ask)

    def call_in_a_loop() -> object:
        return asyncio.run(asyncio.wait_for(ask(), PATIENCE))

    with pytest.raises(DeadlockError):
        flight.call("k", call_in_a_loop)


@pytest.mark.parametrize(("fn", "message"), [
    (lambda: "plain", "runs a coroutine function"),
    (42, "must be callable"),
])
def test_a_function_that_is_no_coroutine_function_is_refused(
        flight: Singleflight[str, Any], fn: Any, message: str) -> None:
    async def main() -> None:
        tasks = asyncio.all_tasks()
        with pytest.raises(TypeError, match=message):
            await flight.aio.call("k", fn)
        with pytest.raises(TypeError, match="unhashable"):
            await flight.aio.call(["k"], Gate())  # type: ignore[arg-type]
        assert len(flight) == 0 and asyncio.all_tasks() == tasks  # no runner started

    run(main)


def test_a_partial_of_a_coroutine_function_is_one(flight: Singleflight[str, Any]) -> None:
    async def fetch(url: str, *, retries: int) -> tuple[str, int]:
        return url, retries

    async def main() -> object:
        return await flight.aio.call("k", functools.partial(fetch, retries=2), "u")

    assert run(main) == ("u", 2)


def test_a_decorated_coroutine_function_shares_calls_by_its_key(
        flight: Singleflight[str, Any]) -> None:
    async def main() -> None:
        gate = Gate()

        @flight.shared(key=lambda url: url)
        async def fetch(url: str) -> object:
            return await gate(url)

        assert inspect.iscoroutinefunction(fetch)
        calls = [asyncio.create_task(fetch("u")) for _ in range(3)]
        other = asyncio.create_task(fetch("v"))
        await until(lambda: gate.runs == 2 and waiting(flight) == 4, "u and v run, once each")
        gate.open.set()
        assert await asyncio.gather(*calls, other) == [("value", "u")] * 3 + [("value", "v")]

    run(main)


def test_an_abandoned_call_being_cancelled_is_not_joined(flight: Singleflight[str, Any]) -> None:
    """A caller coming after the last one left starts a new call rather than joining the
    one being cancelled (and getting its FlightAbortedError)."""
    async def main() -> None:
        dropped = Gate("dropped")
        caller = asyncio.create_task(
            flight.aio.call("k", dropped, cancel_when_abandoned=True))
        await dropped.running.wait()
        doomed = flight._table.flights["k"]
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        assert "k" not in flight
        assert not doomed.join(True)  # a caller that found it a moment before passes it by
        fresh = Gate("fresh")
        fresh.open.set()
        assert await flight.aio.call("k", fresh) == "fresh"
        assert dropped.cancelled

    run(main)


def test_an_abandoned_call_left_in_the_table_is_passed_by_tasks_and_threads(
        flight: Singleflight[str, Any]) -> None:
    """The state a handler's exception leaves as the last caller leaves (the flight marked
    abandoned, neither taken out nor cancelled): a task or a thread asking next starts a
    new call, never spinning on the old one (a task's loop would never run again)."""
    async def main() -> None:
        old = Gate("old")
        runner = asyncio.create_task(flight.aio.call("k", old))
        await old.running.wait()
        stuck = flight._table.flights["k"]
        stuck.abandoned = True  # (its leave stopped right after this)
        fresh = Gate("fresh")
        fresh.open.set()
        assert await asyncio.wait_for(flight.aio.call("k", fresh), PATIENCE) == "fresh"
        flight._table.flights["k"] = stuck  # (left again, for a thread now)
        got = await asyncio.wait_for(
            asyncio.to_thread(flight.call, "k", lambda: "a thread's"), PATIENCE)
        assert got == "a thread's"
        old.open.set()
        assert await runner == "old"
        assert len(flight) == 0 and len(flight._table.locks) == 0

    run(main)


def test_many_tasks_and_threads_make_one_call(flight: Singleflight[str, Any]) -> None:
    runs: list[int] = []
    opened = threading.Event()

    async def backend() -> str:
        runs.append(1)
        await asyncio.to_thread(opened.wait, PATIENCE)
        return "payload"

    async def main() -> list[object]:
        tasks = [asyncio.create_task(flight.aio.call("hot", backend)) for _ in range(50)]
        await until(lambda: "hot" in flight, "a task runs the call")
        threads = [asyncio.create_task(asyncio.to_thread(flight.call, "hot", str))
                   for _ in range(4)]
        await until(lambda: waiting(flight) == 54, "every caller waits")
        opened.set()
        return await asyncio.gather(*tasks, *threads)

    assert run(main) == ["payload"] * 54 and runs == [1]
    wait_until(lambda: len(flight._table.locks) == 0, "nothing is left in the lock table")


def test_a_flight_whose_loop_closed_with_its_call_pending_is_started_anew(
        flight: Singleflight[Any, Any]) -> None:
    """A loop stopped and closed with a runner pending (a framework shutting down, not
    ``asyncio.run``): its call will never answer; the next caller, a thread or a task of
    another loop, starts a new one, and nothing of the old flight stays published."""
    async def never() -> str:
        await asyncio.Event().wait()
        return "never"

    async def fresh() -> str:
        return "fresh"

    async def starter() -> None:
        with pytest.raises(LockTimeout):
            await flight.aio.call("k", never, timeout=0.05)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(starter())
    assert "k" in flight  # (its runner pending)
    loop.close()
    assert flight.call("k", lambda: "fresh", timeout=PATIENCE) == "fresh"
    assert "k" not in flight
    loop = asyncio.new_event_loop()
    loop.run_until_complete(starter())
    loop.close()
    assert run(lambda: flight.aio.call("k", fresh)) == "fresh"
    assert len(flight) == 0


def test_a_call_raising_generator_exit_is_aborted_and_leaves_nothing_held(
        flight: Singleflight[Any, Any]) -> None:
    async def exits() -> str:
        raise GeneratorExit

    async def main() -> object:
        try:
            return await flight.aio.call("k", exits)
        except BaseException as error:  # (what the caller gets, whatever it is)
            return error

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(main)
        gc.collect()
    assert [str(w.message) for w in caught if "ended holding" in str(w.message)] == []
    assert len(flight) == 0 and len(flight._table.locks) == 0
