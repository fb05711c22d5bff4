"""asyncio tasks as owners: the task of the running code, the event loop thread's token, and
the ``Waker`` a waiting task sleeps on."""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn


class _LoopThread:
    """The "key" a task waits for in a deadlock cycle when what it needs is the thread that
    runs its event loop (blocked in a synchronous acquire)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<its event loop's thread>"


LOOP_THREAD: Any = _LoopThread()


class _AwaitedThread:
    """The "key" a task waits for in a deadlock cycle when what it needs is a thread it
    awaits (``asyncio.to_thread``) that waits for the task itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<the thread it awaits>"


AWAITED_THREAD: Any = _AwaitedThread()


# -- a thread's wait --------------------------------------------------------------------------


class _WaitCheck(threading.local):
    """Per thread: ``call``, or None. Both engines run it after each slice of the thread's
    wait in a synchronous acquire (a task's wait never), on that thread, with no engine lock
    held. What it raises ends the wait as a signal handler's exception does: the request
    leaves the queues, nothing of it stays held, and the acquiring call raises it.

    ``lockmgr.postgres`` sets it around the in-process part of an acquisition: the waiting
    thread looks there for a deadlock that goes through the server, and for keys a task
    stranded on a closed event loop holds."""

    call: Callable[[], object] | None = None


WAIT_CHECK = _WaitCheck()

#: A task's ``WAIT_CHECK``: ``(every, check)``, or None, in the task's context. A task's
#: wait in process (``lockmgr._aio``) awaits ``check()`` every ``every`` seconds while it
#: waits; what that raises ends the wait as a cancellation does.
TASK_WAIT_CHECK: contextvars.ContextVar[tuple[float, Callable[[], Awaitable[object]]] | None] = \
    contextvars.ContextVar("TASK_WAIT_CHECK", default=None)


# -- asyncio tasks as owners -------------------------------------------------------------------

#: The task whose context this is: set by an engine in a task's context when the task first
#: acquires through ``aio``. What that context is copied into inherits it: a thread that
#: ``asyncio.to_thread`` runs for the task, but also a task it creates, so a thread finding a
#: task here only knows that it may run on that task's behalf (see ``awaits_this_thread``).
CONTEXT_TASK: contextvars.ContextVar[Any] = contextvars.ContextVar("CONTEXT_TASK", default=None)

# Marks the context the calling thread runs in, for ``awaits_this_thread`` to recognise it.
_PROBE: contextvars.ContextVar[object] = contextvars.ContextVar("_PROBE", default=None)


def awaits_this_thread(task: Any) -> bool:
    """True if ``task`` is in ``asyncio.to_thread`` running the calling thread's function:
    that call runs the function in a context of its own (its local ``ctx``), which is the
    calling thread's current context exactly when this thread runs it. A task awaiting the
    thread through anything else (another task, ``run_in_executor``) answers False: a
    deadlock is declared only when it is certain."""
    to_thread = getattr(sys.modules.get("asyncio"), "to_thread", None)
    if to_thread is None or task.done():
        return False
    mark = _PROBE.set(object())
    try:
        for frame in _frames_of(task):
            if frame.f_code is to_thread.__code__:
                context = frame.f_locals.get("ctx")
                if isinstance(context, contextvars.Context) and context.get(_PROBE) is _PROBE.get():
                    return True
        return False
    finally:
        _PROBE.reset(mark)


def _frames_of(task: Any) -> list[Any]:
    """The frames of the coroutines ``task`` is in. A task that is running (its loop's thread
    has not come back from the step that called ``to_thread`` yet: that thread may start
    the function first) is found on that thread's stack; a suspended one through the
    coroutines it awaits. Without the GIL the task may suspend while its loop's stack is
    read: it is then read again, suspended (a few times at most)."""
    coro = task.get_coro()
    for _ in range(_FRAME_READS):
        if not getattr(coro, "cr_running", False):
            frames = []
            awaited = coro
            while getattr(awaited, "cr_frame", None) is not None:
                frames.append(awaited.cr_frame)
                awaited = awaited.cr_await
            return frames
        for innermost in sys._current_frames().values():
            stack = []
            frame: Any = innermost
            while frame is not None:
                stack.append(frame)
                if frame is coro.cr_frame:
                    return stack
                frame = frame.f_back
        time.sleep(0)  # it stopped running meanwhile, or is between frames: read again
    return []


_FRAME_READS = 100


#: What an engine's ``settle`` answers when a wake-up is already on its way to the task: it
#: must wait for that wake-up (its ``Waker`` post) before its request may change again.
AWAIT_POST = "await post"


def current_task_or_none() -> Any:
    """The running asyncio task, or None outside one."""
    try:
        return sys.modules["asyncio"].current_task()  # imported by whoever runs a loop
    except (KeyError, RuntimeError):  # no asyncio yet, or no running loop
        return None


def current_task_or_raise() -> Any:
    """The running asyncio task: the owner of every ``aio`` call (RuntimeError outside one)."""
    task = current_task_or_none()
    if task is None:
        not_in_task()
    return task


def not_in_task() -> NoReturn:
    raise RuntimeError(
        "lockmgr's aio methods must be called from an asyncio task (the task owns the "
        "keys it acquires); threads use the manager's own methods"
    )


def running_loop() -> Any:
    """The running event loop (the caller runs in a task: asyncio is imported)."""
    return sys.modules["asyncio"].get_running_loop()


#: How many times an engine delivers one post before it gives up (``Waker``): each attempt
#: cut short by a signal handler's exception ran that handler, so a retry meets fewer.
POST_ATTEMPTS = 64


class Waker:
    """How a lock table wakes one waiting task: the task sleeps on a future of its loop; a
    grant or wake-up *posts* (from any thread, never inside a section); the task takes the
    post before it looks at its request again. A binary semaphore, like a waiting thread's
    wakeup lock, whose count is touched on the loop's thread only.

    A post is numbered (``next_post``) and then delivered (``deliver``), which the engines
    repeat until it returns: a signal handler's exception may cut a delivery short anywhere,
    and a post delivered twice is counted once. A post the loop drops unrun (the loop was
    closed with it in its ready queue) ends the task as a closed loop's grant does
    (``lost``): the task can never run again to take what it was granted."""

    __slots__ = ("delivered", "future", "loop", "lost", "numbered", "posts", "thread")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.thread = threading.get_ident()  # the thread running the task (and its loop)
        self.posts = 0  # loop thread only
        self.numbered = 0  # the posters: the number of the newest post (one is due at a time)
        self.delivered = 0  # loop thread only: the number of the newest post counted
        self.future: Any = None  # loop thread only: what the task sleeps on
        # Set by the engine while the task waits: what to do if its loop is closed (the
        # task can never run again): leave the queues, release what the task holds.
        self.lost: Callable[[], object] | None = None

    def next_post(self) -> int:
        """Number a post (any thread; once per grant or wake-up the task has to see)."""
        number = self.numbered = self.numbered + 1
        return number

    def deliver(self, number: int) -> None:
        """Wake the task with post ``number`` (any thread; it runs in a releasing call's
        finish). Delivering the same number again does nothing more."""
        try:
            if self.loop.is_closed():
                raise RuntimeError("its event loop is closed")
            if threading.get_ident() == self.thread:
                self._count(number)
            else:
                self.loop.call_soon_threadsafe(_Delivery(self, number))
        except RuntimeError:  # closed (maybe just now): the task never runs again
            self.end_lost()

    def end_lost(self) -> None:
        """The task can never run again: end its wait as ``lost`` says (once; ``lost`` is
        idempotent, should two threads both find the loop closed). Run by a finalizer the
        collector called inside a section of this thread, the engine refuses it
        (RuntimeError): it then runs in a thread of its own, once that section is over."""
        lost, self.lost = self.lost, None
        if lost is None:
            return
        try:
            lost()
        except RuntimeError:
            threading.Thread(target=lost, name="lockmgr: a task whose loop closed",
                             daemon=True).start()

    def _count(self, number: int) -> None:
        if number <= self.delivered:
            return
        self.delivered = number
        self.posts += 1
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)

    def take_post(self) -> bool:
        if self.posts:
            self.posts -= 1
            return True
        return False

    async def sleep(self, deadline: float) -> None:
        """Until a post is there, or the monotonic ``deadline`` (< 0: none) passed. The
        future is published before ``posts`` is read: a post from code that runs in
        between (a signal handler's release, a collection's finalizer) is counted before
        the check, or finds the future to resolve after it."""
        future = self.future = self.loop.create_future()
        # Dropped unrun (the loop closed before the task resumed), it ends the task's wait.
        future.add_done_callback(_Resumption(self))
        if self.posts:
            self.future = None
            return
        timer = None
        if deadline >= 0:
            timer = self.loop.call_later(max(deadline - time.monotonic(), 0.0), _settle_future,
                                         future)
        try:
            await future
        finally:
            self.future = None
            if timer is not None:
                timer.cancel()


class _Resumption:
    """A callback the loop runs before a woken task resumes (a delivery, or the callback of
    the future it sleeps on). The loop drops what it has not run when it is closed: the task
    then never resumes, so it is ended here (``Waker.lost``), in whichever thread closed the
    loop, as the grant that finds the loop closed would have ended it."""

    __slots__ = ("ran", "waker")

    def __init__(self, waker: Waker) -> None:
        self.waker = waker
        self.ran = False

    def __call__(self, *_: object) -> None:
        self.ran = True

    def __del__(self) -> None:
        if not self.ran and self.waker.loop.is_closed():
            self.waker.end_lost()


class _Delivery(_Resumption):
    """A post delivered from another thread: counted on the loop's thread."""

    __slots__ = ("number",)

    def __init__(self, waker: Waker, number: int) -> None:
        super().__init__(waker)
        self.number = number

    def __call__(self, *_: object) -> None:
        self.ran = True
        self.waker._count(self.number)


def _settle_future(future: Any) -> None:
    if not future.done():
        future.set_result(None)
