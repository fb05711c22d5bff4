"""Host locks from asyncio tasks (``locks.aio``) across real processes: exclusion between
tasks of two processes, between a task and a thread of one process, timed waits, cancelled
waits in the kernel, the loop running on while a task waits, readers and writers, a task
that ends holding keys. Each test on both engines (``impl``) and both kernel mechanisms."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

import pytest

from conftest import abandoned_warnings, wait_until
from host_fixtures import PATIENCE, counted
from lockmgr import AbandonedLockWarning, DeadlockError, LockTimeout, NotOwnedError
from lockmgr._args import WRITE
from lockmgr.host import HostLockManager, HostRWLockManager, Lease

pytestmark = [pytest.mark.timeout(120), pytest.mark.posix_only]

# A child's own event loop, in a thread, with tasks holding keys until told to let go:
# ``hold(name, acquire, release)`` answers once the task has acquired (or failed), and
# ``let_go(name)`` has it release and end.
_CHILD_TASKS = r"""
import asyncio, concurrent.futures
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
letting_go = {}
ending = {}

def run(coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

def hold(name, acquire, release):
    acquired = concurrent.futures.Future()
    async def body():
        letting_go[name] = asyncio.Event()
        got = await acquire()
        acquired.set_result(got)
        if got:
            await letting_go[name].wait()
            await release()
    ending[name] = asyncio.run_coroutine_threadsafe(body(), loop)
    return acquired.result(60)

def let_go(name):
    loop.call_soon_threadsafe(letting_go[name].set)
    ending.pop(name).result(60)
"""


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` as the task of a fresh event loop, bounded in time."""
    async def bounded() -> Any:
        return await asyncio.wait_for(main(), PATIENCE)
    return asyncio.run(bounded())


def held_here(locks: Any, key: str) -> bool:
    """Whether this process holds ``key`` in the kernel (its directory's table says)."""
    state = locks._shared._idents.get(locks.host_key(key))
    return state is not None and bool(state.writers)


@pytest.fixture
def locks(host_engine: ModuleType, lock_dir: str, mechanism: str) -> Any:
    manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    yield manager
    manager.close()


@pytest.fixture
def rw(host_engine: ModuleType, lock_dir: str, mechanism: str) -> Any:
    manager: HostRWLockManager[Any] = HostRWLockManager(lock_dir, mechanism=mechanism,
                                                        namespace="rw")
    yield manager
    manager.close()


async def waiting_in_the_kernel(locks: Any, key: str) -> asyncio.Future[bool]:
    """A task of this loop acquiring ``key``, once it waits for another process (it holds
    the key in process: its kernel try failed in the same step, and its wait runs)."""
    waiting = asyncio.ensure_future(locks.aio.acquire(key))
    while not locks.snapshot():
        await asyncio.sleep(0.001)
    return waiting


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """A blocking call (a child's answer) off the loop, so that its tasks run meanwhile."""
    return await asyncio.to_thread(function, *args)


def test_tasks_of_two_processes_exclude_each_other(locks: Any, children: Any) -> None:
    child = children(_CHILD_TASKS)

    async def main() -> None:
        assert await locks.aio.acquire("k")
        assert child.ask("hold('t', lambda: locks.aio.acquire('k', timeout=0),"
                         " lambda: locks.aio.release('k'))") is False
        child.send("hold('t', lambda: locks.aio.acquire('k'), lambda: locks.aio.release('k'))")
        await locks.aio.release("k")
        assert await in_thread(child.answer) is True  # the child's task has it now
        assert await locks.aio.acquire("k", timeout=0) is False
        letting_go = asyncio.ensure_future(in_thread(child.ask, "let_go('t')"))
        assert await locks.aio.acquire("k") is True and locks.aio.owned("k")
        await letting_go
        assert child.ask("hold('u', lambda: locks.aio.acquire('k', timeout=0),"
                         " lambda: locks.aio.release('k'))") is False
        await locks.aio.release("k")
        assert not locks.aio.owned("k")

    run(main)


def test_a_counter_in_a_file_loses_no_increment_to_tasks_of_three_processes(
        locks: Any, children: Any, lock_dir: str) -> None:
    bump = ("import asyncio\n"
            "async def bump(times):\n"
            "    for _ in range(times):\n"
            "        async with locks.aio['counter']:\n"
            "            with open(counter) as file:\n"
            "                value = int(file.read())\n"
            "            await asyncio.sleep(0)  # the other tasks run here\n"
            "            with open(counter, 'w') as file:\n"
            "                file.write(str(value + 1))\n"
            "async def bump_in_tasks(tasks, times):\n"
            "    await asyncio.gather(*(bump(times) for _ in range(tasks)))\n")
    assert counted(children, lock_dir, bump, "asyncio.run(bump_in_tasks(3, 100))", 3) == 900


def test_a_task_and_a_thread_of_one_process_exclude_each_other(
        locks: Any, children: Any) -> None:
    child = children()
    taken, let_go = threading.Event(), threading.Event()
    tried: list[bool] = []

    def thread_holding() -> None:
        assert locks.acquire("k")
        taken.set()
        let_go.wait(PATIENCE)
        locks.release("k")

    async def main() -> None:
        async with locks.aio["k"]:
            trying = threading.Thread(target=lambda: tried.append(locks.acquire("k", timeout=0.05)))
            trying.start()
            trying.join(PATIENCE)
            assert tried == [False]
            assert child.ask("locks.acquire('k', timeout=0)") is False
        holder = threading.Thread(target=thread_holding)
        holder.start()
        assert taken.wait(PATIENCE)
        assert await locks.aio.acquire("k", timeout=0.05) is False
        assert child.ask("locks.acquire('k', timeout=0)") is False
        let_go.set()
        assert await locks.aio.acquire("k") is True
        holder.join(PATIENCE)
        assert child.ask("locks.acquire('k', timeout=0)") is False
        await locks.aio.release("k")
        assert child.ask("locks.acquire('k', timeout=0)") is True

    run(main)


def test_a_timed_wait_in_a_task_times_out_holding_nothing(locks: Any, children: Any) -> None:
    holder, other = children(), children()
    assert holder.ask("locks.acquire('k')") is True

    async def main() -> None:
        assert await locks.aio.acquire("k", timeout=0.1) is False
        with pytest.raises(LockTimeout):
            async with locks.aio.hold("k", timeout=0.1):
                pass
        # A key taken in the kernel before "k" (they are taken in the order of their
        # identities) goes back when "k" is not had in time.
        free = next(key for key in "abcdefghij" if locks.host_key(key) < locks.host_key("k"))
        assert await locks.aio.acquire_many([free, "k"], timeout=0.1) is False
        assert not locks.aio.owned("k") and not locks.aio.owned(free) and len(locks) == 0
        assert other.ask(f"locks.acquire({free!r}, timeout=0)") is True
        other.ask(f"locks.release({free!r})")

    run(main)
    holder.ask("locks.release('k')")
    assert other.ask("locks.acquire('k', timeout=0)") is True


def test_a_cancelled_task_waiting_in_the_kernel_leaves_nothing_held(
        locks: Any, children: Any) -> None:
    holder, other = children(), children()
    assert holder.ask("locks.acquire('k')") is True

    async def main() -> None:
        waiting = await waiting_in_the_kernel(locks, "k")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not locks.aio.owned("k") and len(locks) == 0

    run(main)
    # The wait stops with the task, while the key is still held: it queues no more.
    wait_until(lambda: not any(thread.name == "lockmgr-host-wait"
                               for thread in threading.enumerate()),
               "the cancelled wait's thread ends")
    holder.ask("locks.release('k')")
    assert other.ask("locks.acquire('k', timeout=0)") is True
    other.ask("locks.release('k')")
    assert not locks.locked("k")


def test_ctrl_c_while_a_task_waits_in_the_kernel_leaves_nothing_held(children: Any) -> None:
    holder, waiter = children(), children("import asyncio\n")
    assert holder.ask("locks.acquire('k')") is True
    # asyncio.run turns Ctrl-C into the main task's cancellation, then raises it.
    waiter.send("threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
                "try:\n"
                "    asyncio.run(locks.aio.acquire('k'))\n"
                "except KeyboardInterrupt:\n"
                "    interrupted = True\n")
    assert waiter.answer() is None
    assert waiter.ask("interrupted and len(locks) == 0") is True
    wait_until(lambda: waiter.ask("threading.active_count()") == 1,
               "the interrupted wait's thread ends")
    holder.ask("locks.release('k')")
    assert waiter.ask("locks.acquire('k', timeout=0)") is True
    assert holder.ask("locks.acquire('k', timeout=0)") is False


def test_a_task_cancelled_as_its_kernel_wait_ends_gives_the_key_back(
        locks: Any, children: Any) -> None:
    holder, other = children(), children()
    assert holder.ask("locks.acquire('k')") is True

    async def main() -> None:
        waiting = await waiting_in_the_kernel(locks, "k")
        # The holder releases while this loop does not run: the waiting thread takes the
        # key and posts its answer, which the cancellation then overtakes.
        holder.ask("locks.release('k')")
        wait_until(lambda: held_here(locks, "k"), "the waiting thread holds the key")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    run(main)
    wait_until(lambda: not locks.locked("k"), "the key went back")
    assert other.ask("locks.acquire('k', timeout=0)") is True


def test_a_task_whose_loop_closed_while_it_waited_in_the_kernel_holds_nothing(
        locks: Any, children: Any) -> None:
    holder, other = children(), children()
    assert holder.ask("locks.acquire('k')") is True
    loop = asyncio.new_event_loop()

    async def stranded() -> None:
        assert await locks.aio.acquire("j")  # held, then a wait for "k" in the kernel
        await locks.aio.acquire("k")

    async def until_it_waits() -> None:
        while len(locks) < 2:  # "j" and "k" in process: it waits in the kernel for "k"
            await asyncio.sleep(0.001)

    with abandoned_warnings() as warned:
        task = loop.create_task(stranded())
        loop.run_until_complete(until_it_waits())
        loop.close()  # with the task pending: it never runs again
        holder.ask("locks.release('k')")  # its wait ends, and finds the loop closed
        wait_until(lambda: len(locks) == 0, "the stranded task's keys go in process")
    assert warned
    assert other.ask("locks.acquire_many(['j', 'k'], timeout=0)") is True
    assert not task.done()


def test_the_loop_runs_on_while_a_task_waits_for_another_process(
        locks: Any, children: Any) -> None:
    holder = children()
    assert holder.ask("locks.acquire('k')") is True

    async def main() -> None:
        progress = asyncio.Event()

        async def another_task() -> None:
            assert await locks.aio.acquire("other")
            await locks.aio.release("other")
            progress.set()

        async def release_once_the_other_task_ran() -> None:
            await progress.wait()
            await in_thread(holder.ask, "locks.release('k')")

        others = asyncio.gather(another_task(), release_once_the_other_task_ran())
        # The holder lets go only once the other task has run: meanwhile this one waits.
        assert await locks.aio.acquire("k") is True
        await others
        await locks.aio.release("k")

    run(main)


def test_readers_and_writers_from_tasks_across_processes(rw: Any, children: Any) -> None:
    child = children(_CHILD_TASKS)

    async def main() -> None:
        async with rw.aio.read("doc") as lease:
            assert isinstance(lease, Lease)
            assert child.ask("hold('r', lambda: rw.aio.acquire_read('doc', timeout=0),"
                             " lambda: rw.aio.release_read('doc'))") is True
            assert child.ask("rw.acquire_write('doc', timeout=0)") is False
            child.ask("let_go('r')")
            assert await rw.aio.acquire_write("doc", timeout=0) is True  # an upgrade
            assert rw.aio.recursion_count("doc") == 1
            assert child.ask("rw.acquire_read('doc', timeout=0)") is False
            await rw.aio.release_write("doc")  # back to reading
            assert child.ask("(rw.acquire_read('doc', timeout=0),"
                             " rw.release_read('doc'))[0]") is True
            assert await rw.aio.write_locked("doc") is False
        child.send("hold('w', lambda: rw.aio.acquire_write('doc'),"
                   " lambda: rw.aio.release_write('doc'))")
        assert await in_thread(child.answer) is True
        assert await rw.aio.write_locked("doc")
        assert await rw.aio.acquire_many(reads=["doc"], timeout=0.05) is False
        letting_go = asyncio.ensure_future(in_thread(child.ask, "let_go('w')"))
        assert await rw.aio.acquire_read("doc") is True and rw.aio.owned("doc")
        await letting_go
        await rw.aio.release_read("doc")

    run(main)


def test_a_task_that_ends_holding_a_key_frees_it_across_processes(
        locks: Any, children: Any) -> None:
    child = children()

    async def main() -> None:
        with abandoned_warnings() as warned:
            assert await asyncio.ensure_future(locks.aio.acquire("k"))
            await asyncio.sleep(0)  # (the task's done-callbacks run)
        assert warned

    run(main)
    assert child.ask("locks.acquire('k', timeout=0)") is True


def test_the_aio_surface_of_a_host_manager(locks: Any, children: Any) -> None:
    child = children()

    @locks.aio.synchronized(lambda name: name)
    async def guarded(name: str) -> bool:
        return bool(locks.aio.owned(name)) and child.ask(
            f"locks.acquire({name!r}, timeout=0)") is False

    async def main() -> None:
        assert await guarded("g") and not locks.aio.owned("g")
        async with locks.aio.hold_many(["a", "b"]) as lease:
            assert set(lease.keys) == {"a", "b"}
            assert await locks.aio.locked("a") and await locks.aio["b"].locked()
            assert child.ask("locks.acquire_many(['b'], timeout=0)") is False
        assert await locks.aio.acquire("a") and await locks.aio.acquire("a")
        assert locks.aio.recursion_count("a") == 2
        await locks.aio.release("a")
        assert child.ask("locks.acquire('a', timeout=0)") is False
        assert await locks.aio.release_all() == 1
        assert child.ask("locks.acquire('a', timeout=0)") is True
        with pytest.raises(NotOwnedError):
            locks.aio.release("a")
        with pytest.raises(NotOwnedError):
            locks.aio.release_many(["a", "b"])
        with pytest.raises(TypeError):
            await locks.aio.acquire(1.5)
        with pytest.raises(TypeError):
            locks.aio[object()]
        with pytest.raises(TypeError):
            locks.aio.synchronized(lambda: "k")(lambda: None)
        assert len(locks) == 0

    run(main)
    with pytest.raises(RuntimeError):
        locks.aio.owned("a")


def test_tasks_take_fences_that_increase_across_processes(
        host_engine: ModuleType, lock_dir: str, mechanism: str, children: Any) -> None:
    child = children(f"fenced = HostLockManager({lock_dir!r}, mechanism={mechanism!r},"
                     " fencing=True)\n"
                     "def fence_once(key):\n"
                     "    with fenced.hold(key) as lease:\n"
                     "        return lease.fence\n")
    fenced: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism,
                                                   fencing=True)

    async def main() -> list[int]:
        seen = []
        for _ in range(2):
            async with fenced.aio.hold("k") as lease:
                assert await fenced.aio.acquire("k")  # re-entry keeps the fence
                assert fenced.aio.fence("k") == lease.fence
                await fenced.aio.release("k")
                seen.append(lease.fence)
            with pytest.raises(NotOwnedError):
                fenced.aio.fence("k")
            seen.append(child.ask("fence_once('k')"))
        return seen

    try:
        seen = run(main)
    finally:
        fenced.close()
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen


def test_a_task_taking_a_key_whose_holder_died_is_warned(locks: Any, children: Any) -> None:
    child = children()
    assert child.ask("locks.acquire('k')") is True
    child.kill()

    async def main() -> None:
        with pytest.warns(AbandonedLockWarning, match=f"process {child.pid} ended holding"):
            assert await locks.aio.acquire("k")
        await locks.aio.release("k")
        with warnings.catch_warnings():
            warnings.simplefilter("error", AbandonedLockWarning)
            assert await locks.aio.acquire("k", timeout=0)  # released: no warning
            await locks.aio.release("k")

    run(main)


def test_a_cycle_through_a_task_and_another_process_ends_with_deadlock_error_in_one(
        locks: Any, children: Any) -> None:
    child = children()
    assert child.ask("locks.acquire('b')") is True

    async def watch_the_child() -> str:
        try:
            return repr(await in_thread(child.answer))
        except AssertionError as error:  # it gave up: it lets go of "b" for the task
            await in_thread(child.ask, "locks.release('b')")
            return str(error).split(":")[0]

    async def main() -> tuple[str, str]:
        assert await locks.aio.acquire("a")
        child.send("locks.acquire('a')")  # the child waits for the task, the task for it
        watcher = asyncio.ensure_future(watch_the_child())
        try:
            assert await locks.aio.acquire("b")
            await locks.aio.release("b")
            victim = "the child"
        except DeadlockError:
            victim = "the task"
        await locks.aio.release("a")
        return victim, await watcher

    assert run(main) in {("the task", "True"), ("the child", "DeadlockError")}


def test_a_stopped_kernel_wait_ends_holding_nothing(locks: Any, children: Any) -> None:
    holder = children()
    assert holder.ask("locks.acquire('k')") is True
    stop = threading.Event()
    results: list[bool] = []
    waiting = threading.Thread(target=lambda: results.append(
        locks._shared.take(locks.host_key("k"), WRITE, None, id(locks), stop=stop)))
    waiting.start()
    stop.set()
    waiting.join(PATIENCE)
    assert results == [False]
    holder.ask("locks.release('k')")
    assert not locks.locked("k")
