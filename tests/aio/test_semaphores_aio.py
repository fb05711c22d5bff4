"""``SemaphoreManager.aio``: tasks and threads in the same queues of one table, on both
engines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from conftest import PATIENCE, abandoned_warnings
from lockmgr import AsyncSemaphoreManager, DeadlockError, LockTimeout, NotOwnedError
from test_aio import joined, run, until

LIMITS = pytest.mark.parametrize("limit", [1, 3], ids=["limit-1", "limit-3"])


@LIMITS
def test_tasks_take_at_most_limit_slots_and_give_them_back(impl, limit) -> None:
    slots = impl.SemaphoreManager(limit)
    assert isinstance(slots.aio, AsyncSemaphoreManager)

    async def holder(entered: asyncio.Event, leave: asyncio.Event) -> None:
        async with slots.aio.hold("k"):
            assert slots.aio.owned("k")
            entered.set()
            await leave.wait()

    async def main() -> None:
        leave = asyncio.Event()
        entered = [asyncio.Event() for _ in range(limit)]
        tasks = [asyncio.create_task(holder(event, leave)) for event in entered]
        for event in entered:
            await event.wait()
        assert slots.aio.holders("k") == limit and slots.aio.available("k") == 0
        assert await slots.aio.acquire("k", timeout=0) is False
        with pytest.raises(LockTimeout):
            async with slots.aio.hold("k", timeout=0.01):
                pass
        leave.set()
        await asyncio.gather(*tasks)
        assert await slots.aio.acquire("k") is True
        slots.aio.release("k")
        assert await slots.aio.acquire("k") is True
        await slots.aio.release("k")
        with pytest.raises(NotOwnedError):
            slots.aio.release("k")
        async with slots.aio["k"], slots.aio.hold_many(["i", "j"]):
            assert slots.aio.holders("j") == 1
        assert await slots.aio.acquire_many(["a", "b"]) is True
        await slots.aio.release_many(["a", "b"])

        @slots.aio.synchronized(lambda key: key)
        async def work(key: str) -> int:
            return slots.aio.holders(key)

        assert await work("w") == 1

    run(main)
    assert len(slots) == 0


@LIMITS
def test_tasks_and_threads_queue_together_in_arrival_order(impl, limit, workers) -> None:
    """Threads hold every slot; tasks and threads queue alternately; each slot given back
    goes to the oldest waiter, whichever kind: no waiter overtakes another."""
    slots = impl.SemaphoreManager(limit)
    fillers = [workers(f"filler{i}") for i in range(limit)]
    for filler in fillers:
        filler.run(lambda: slots.acquire("k"))

    async def main() -> None:
        async def task_waiter(leave: asyncio.Event) -> None:
            assert await slots.aio.acquire("k") is True
            await leave.wait()
            slots.aio.release("k")

        granted: list[Callable[[], bool]] = []  # per waiter, in arrival order
        give_back: list[Callable[[], Awaitable[object]]] = [
            lambda filler=filler: asyncio.to_thread(filler.run, lambda: slots.release("k"))
            for filler in fillers]
        tasks = []
        for number in range(4):
            if number % 2:
                waiter = workers(f"waiter{number}")
                granted.append(waiter.submit(lambda: slots.acquire("k")).done)
                give_back.append(lambda waiter=waiter: asyncio.to_thread(
                    waiter.run, lambda: slots.release("k")))
            else:
                leave = asyncio.Event()
                tasks.append(asyncio.create_task(task_waiter(leave)))
                granted.append(lambda task=tasks[-1]: _holds(slots, task))
                give_back.append(lambda leave=leave: _set(leave))
            await until(lambda: slots.stats().waiting == number + 1, f"waiter {number} queued")
        for number in range(4):
            await give_back[number]()
            await until(granted[number], f"waiter {number} granted")
            assert not any(later() for later in granted[number + 1:]), "a waiter overtook"
        for rest in give_back[4:]:
            await rest()
        await asyncio.gather(*tasks)

    run(main)
    assert len(slots) == 0


@LIMITS
def test_a_task_takes_a_slot_for_each_acquire_and_never_waits_for_its_own(impl, limit) -> None:
    """A task's acquires each take one more slot; once every slot is its own, a try gives
    up and a wait is a DeadlockError; a release gives back one."""
    slots = impl.SemaphoreManager(limit)

    async def main() -> None:
        for taken in range(1, limit + 1):
            assert await slots.aio.acquire("k", timeout=0) is True
            assert slots.aio.holders("k") == taken
        assert await slots.aio.acquire("k", timeout=0) is False
        for wait in (lambda: slots.aio.acquire("k"), lambda: slots.aio.acquire_many(["j", "k"])):
            with pytest.raises(DeadlockError) as refused:
                await wait()
            assert [key for _, key in refused.value.cycle] == ["k"]
        assert "j" not in slots and slots.stats().deadlocks == 2
        await slots.aio.release("k")
        assert slots.aio.available("k") == 1 and slots.aio.owned("k") is (limit > 1)
        for _ in range(limit - 1):
            await slots.aio.release("k")

    run(main)
    assert len(slots) == 0


def _holds(slots: Any, task: asyncio.Task[None]) -> bool:
    """Whether ``task`` holds a slot of "k" (the snapshot names each holder)."""
    return any(holder.owner is task for state in slots.snapshot() for holder in state.holders)


async def _set(event: asyncio.Event) -> None:
    event.set()


@pytest.mark.parametrize("taken", [[1], [2, 1]], ids=["limit-1", "limit-3"])
def test_tasks_that_end_holding_slots_give_them_all_up_with_a_warning_per_key(
        impl, taken) -> None:
    """Tasks end holding every slot of "k" (one of them two): all are released, and each
    task warns once for "k", however many slots it held."""
    slots = impl.SemaphoreManager(sum(taken))

    async def take(count: int, entered: asyncio.Event, leave: asyncio.Event) -> bool:
        assert all([await slots.aio.acquire("k") for _ in range(count)])
        entered.set()
        await leave.wait()
        return True

    async def main() -> None:
        leave = asyncio.Event()
        entered = [asyncio.Event() for _ in taken]
        tasks = [asyncio.create_task(take(count, event, leave))
                 for count, event in zip(taken, entered)]
        for event in entered:
            await event.wait()
        assert slots.aio.holders("k") == sum(taken) and slots.aio.available("k") == 0
        leave.set()
        assert all(await asyncio.gather(*tasks))  # each task ended holding its slots
        await until(lambda: slots.holders("k") == 0, "the ended tasks' slots are released")

    with abandoned_warnings() as caught:
        run(main)
    assert len(slots) == 0 and len(caught) == len(taken)
    assert all(str(w.message).endswith("ended holding key 'k'; released it") for w in caught)


def test_tasks_get_the_limit_callables_limits_and_its_errors(impl) -> None:
    slots = impl.SemaphoreManager(lambda key: 0 if key == "bad" else len(key))

    async def main() -> None:
        assert await slots.aio.acquire("ab") is True
        assert await asyncio.create_task(slots.aio.acquire("ab", timeout=0)) is True
        # the second task ended holding its slot: its end gives it back
        await until(lambda: slots.aio.available("ab") == 1, "the ended task's slot is free")
        with pytest.raises(ValueError, match=r"limit\('bad'\) must return"):
            await slots.aio.acquire("bad")
        with pytest.raises(ValueError, match=r"limit\('bad'\) must return"):
            await slots.aio.acquire_many(["ab", "bad"])
        with pytest.raises(ValueError, match=r"limit\('bad'\) must return"):
            async with slots.aio.hold("bad"):
                pass
        assert slots.holders("ab") == 1 and "bad" not in slots
        slots.aio.release("ab")

    with abandoned_warnings():
        run(main)
    assert len(slots) == 0 and slots.stats().waiting == 0


def test_a_cancelled_waiting_task_takes_no_slot_and_holds_nobody_up(impl, workers) -> None:
    slots = impl.SemaphoreManager(2)
    holders = [workers(f"holder{i}") for i in range(2)]
    for holder in holders:
        holder.run(lambda: slots.acquire("k"))

    async def main() -> None:
        cancelled = asyncio.create_task(slots.aio.acquire("k"))
        await until(lambda: slots.stats().waiting == 1, "the task waits")
        behind_worker = workers("behind")
        behind = behind_worker.submit(lambda: slots.acquire("k"))
        await until(lambda: slots.stats().waiting == 2, "a thread waits behind it")
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert slots.stats().waiting == 1 and slots.holders("k") == 2
        await asyncio.to_thread(holders[0].run, lambda: slots.release("k"))
        assert await asyncio.to_thread(behind.result) is True
        assert slots.holders("k") == 2 and slots.stats().waiting == 0
        for giver in (behind_worker, holders[1]):
            await asyncio.to_thread(giver.run, lambda: slots.release("k"))

    run(main)
    assert len(slots) == 0
