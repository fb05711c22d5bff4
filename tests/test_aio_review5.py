"""Review of 77295d3 ("aio: a block's exit acts for the task that entered it"): reproducers.

Each test states what must hold; each fails on 77295d3 (both engines unless noted).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest

from conftest import PATIENCE, abandoned_warnings
from test_aio import _stranded_and_ended, run, until


async def _inside(view: Any) -> AsyncIterator[None]:
    """An async generator suspended inside one block of ``view``."""
    async with view:
        yield


async def _a_finished_task_left_inside(locks: Any, shared: Any) -> Any:
    """A task entered ``shared`` in an async generator and finished, keeping the generator
    suspended inside the block (its end released "k"): the generator is returned."""
    async def leaves_it_suspended() -> Any:
        generator = _inside(shared)
        await generator.__anext__()
        return generator

    with abandoned_warnings():
        generator = await asyncio.create_task(leaves_it_suspended())
        await until(lambda: "k" not in locks, "the finished task's keys are released")
    return generator


@pytest.mark.parametrize("gone", ["finished", "stranded"])
def test_a_gone_task_inside_a_shared_view_does_not_take_a_live_tasks_exit(impl, gone) -> None:
    """A task that is gone (finished leaving a generator inside the shared view, or
    stranded on a closed loop and ended) is still counted inside the view. A live task's own
    async generator inside the same view, closed by that task's aclose(), must release the
    live task's hold: the GeneratorExit is the live task's own, not the gone task's.

    On 77295d3 the exit is attributed to the gone task (any gone task inside wins), so the
    live task keeps "k" until it ends: every other waiter for "k" hangs meanwhile."""
    if gone == "stranded":
        locks, shared, stranded = _stranded_and_ended(impl, "one shared aio[key]", "a grant")
    else:
        locks = impl.LockManager()
        shared = locks.aio["k"]

    async def main() -> None:
        if gone == "finished":
            left = await _a_finished_task_left_inside(locks, shared)  # noqa: F841 (kept)
        generator = _inside(shared)
        await generator.__anext__()
        assert locks.aio.recursion_count("k") == 1
        await generator.aclose()  # GeneratorExit run by the task inside: its own exit
        assert "k" not in locks, "the live task's own exit released nothing"

    run(main)
    assert len(locks) == 0


def test_closing_a_gone_tasks_block_later_keeps_the_current_tasks_hold(impl) -> None:
    """Follow-up of the misattribution above: once the live task's exit was counted as the
    gone task's, the gone task is no longer counted inside. When the gone task's suspended
    block is closed later, inside a block of the current task on the same view, that exit
    must still release nothing: the current task keeps "k" until its own exit.

    On 77295d3 it releases the current task's hold (a safety violation: the current task
    is inside its block without holding the key; its own exit then fails)."""
    locks = impl.LockManager()
    shared = locks.aio["k"]

    async def main() -> None:
        left = await _a_finished_task_left_inside(locks, shared)
        mine = _inside(shared)
        await mine.__anext__()
        await mine.aclose()  # (misattributed on 77295d3: "k" stays held by this task)
        while locks.aio.owned("k"):  # give back whatever that left, to start clean
            locks.aio.release("k")
        async with shared:
            await left.aclose()  # the finished task's block: its exit is not ours
            assert locks.aio.owned("k"), "the current task lost its hold inside its block"
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


def test_a_shared_view_does_not_keep_a_stranded_task_alive(impl) -> None:
    """A task stranded inside a shared aio[key] view and ended by lockmgr (its keys
    released) must be collectable while the view lives on (a module-level view is the
    documented way to share one).

    On 77295d3 the view keeps the task (and so its coroutine, frames and locals) alive for
    as long as the view lives: a reference leak per stranded task. Worse, since the task is
    never collected its coroutine is never closed, so the task stays counted inside for
    good and takes the next GeneratorExit exit of any task (see above)."""
    locks, shared, stranded = _stranded_and_ended(impl, "one shared aio[key]", "a grant")
    alive = weakref.ref(stranded)
    del stranded
    for _ in range(3):
        gc.collect()
    assert alive() is None, "the shared view keeps the stranded task alive"
    assert len(locks) == 0


def test_one_hold_object_shared_by_two_tasks_releases_for_each(impl) -> None:
    """``h = locks.aio.hold("k")`` used by two tasks: the sync ``locks.hold(k)`` object
    and, before 77295d3, the async one work when shared. Task A is inside; task B enters
    the same object and waits; A's exit must release A's hold so that B gets "k".

    On 77295d3 B's __aenter__ overwrites the recorded task, A's exit acts for B (not
    current): it releases nothing, A keeps "k" until it ends, and B waits until then (here:
    forever, A lives on)."""
    locks = impl.LockManager()
    shared_hold = locks.aio.hold("k")

    async def main() -> None:
        a_inside, a_may_leave, a_left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        a_may_end = asyncio.Event()

        async def task_a() -> None:
            async with shared_hold:
                a_inside.set()
                await a_may_leave.wait()
            a_left.set()
            await a_may_end.wait()  # A lives on after its block

        async def task_b() -> None:
            async with shared_hold:
                pass

        a = asyncio.create_task(task_a())
        await a_inside.wait()
        b = asyncio.create_task(task_b())
        await until(lambda: locks.stats().waiting == 1, "B waits for k")
        a_may_leave.set()
        await a_left.wait()
        try:
            await asyncio.wait_for(asyncio.shield(b), 2.0)
        except TimeoutError:
            raise AssertionError(f"B never got k: its owner is {locks.owner('k')!r}, "
                                 f"A is {a!r}") from None
        finally:
            a_may_end.set()
            with abandoned_warnings():
                await asyncio.gather(a, b, return_exceptions=True)
        assert "k" not in locks

    run(main)
    assert len(locks) == 0


def test_a_hold_block_exited_by_another_live_task_does_not_silently_keep_the_key(impl) -> None:
    """A live task enters ``locks.aio.hold("k")`` in an async generator and another live
    task drives the generator out of the block (no GeneratorExit: an ordinary exit). The
    entering task still runs, so its end will not release "k" any time soon. The exit
    must not pass silently with "k" still held: it releases, or it raises NotOwnedError as
    the same block on ``locks.aio["k"]`` does (and as hold() did before 77295d3).

    On 77295d3 hold()'s exit sees that the entering task is not the current one and does
    nothing at all: "k" stays held by the entering task with no error anywhere."""
    locks = impl.LockManager()

    async def in_hold() -> AsyncIterator[None]:
        async with locks.aio.hold("k"):
            yield

    async def main() -> None:
        generator = in_hold()
        await generator.__anext__()  # this task entered the block

        async def finish_it() -> None:
            with pytest.raises(StopAsyncIteration):
                await generator.__anext__()  # the block's exit runs in this other task

        outcome = await asyncio.gather(asyncio.create_task(finish_it()),
                                       return_exceptions=True)
        raised = isinstance(outcome[0], BaseException)
        released = "k" not in locks
        while locks.aio.owned("k"):  # clean up whatever the entering task kept
            locks.aio.release("k")
        assert raised or released, "the exit passed silently and the entering task kept k"

    run(main)
    assert len(locks) == 0


CLOSERS = r"""
import asyncio, collections, gc, importlib, sys, threading, time, warnings
warnings.simplefilter("ignore")
sys.setswitchinterval(1e-6)
impl = importlib.import_module(sys.argv[1])
locks = impl.LockManager()
view = locks.aio["k"]
left, errors = collections.deque(), []
stop = time.monotonic() + 3.0

async def inside():
    async with view:
        yield

async def leaves():  # a task that finishes with a generator suspended inside the view
    generator = inside()
    await generator.__anext__()
    return generator

def loop_thread():
    async def main():
        # The closers own these generators: without this, asyncio.run's shutdown_asyncgens
        # closes those still queued, racing a closer on the same generator ("aclose():
        # asynchronous generator is already running", seen on 3.13t).
        sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
        while time.monotonic() < stop:
            left.append(await asyncio.create_task(leaves()))
    asyncio.run(main())

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
record = getattr(view, "_inside", view)  # the pure twin's view holds one; the core's is one
held = gc.get_referents(record)
left = [type(o).__name__ for o in held if type(o).__name__ in ("frame", "_TaskOwner")]
left += [f"{len(o)} entries" for o in held if isinstance(o, dict) and o]
print("errors", errors[:3], "left in the view's record", left)
assert not errors, errors
assert not left, f"the view's record keeps {left} once every block has exited"
"""


def test_concurrent_closers_count_every_gone_task_out(impl, tmp_path) -> None:
    """Threads close generators that finished tasks left suspended inside one shared view
    (each exit is a gone task's). Once all are closed, the view's record must be empty
    (no frame, task or entry of an ended task) and no exit may raise. (Up to 9364149 the
    check looked for tasks, which no record holds; a review found the pure twin leaving
    entries of ended tasks there: a closer's exit raced the task's ending, 3.13t.)

    On 77295d3 an exit picks a gone task under the view's record (gone_task_inside) and
    counts it out afterwards (count_out): two exits racing between the two (a thread switch
    at the Python check point of _task_gone; free-threaded, truly parallel) pick the same
    task, one count-out is lost, and another gone task stays counted inside for good (kept
    alive, and it takes the next GeneratorExit exit of a live task: see above). The pure
    twin can also raise KeyError from __aexit__ (``del inside[task]`` after the check),
    where the core is silent. Reproduced on 3.11 (switch interval 1 us) and on 3.13t."""
    import subprocess
    import sys
    script = tmp_path / "closers.py"
    script.write_text(CLOSERS)
    done = subprocess.run([sys.executable, str(script), impl.__name__],
                          capture_output=True, text=True, timeout=PATIENCE * 6)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


assert PATIENCE > 2.0
