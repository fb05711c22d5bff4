"""The pure twin's state (the compiled core's ``_c/state.pxi``): the request states and
verdicts, the one engine-wide mutex and the sections run under it (with the main thread's
signals blocked), the tokens of threads and tasks, requests and entries.

See ``lockmgr._pure`` for the design: *Sections* and *Asynchronous exceptions* describe
``_section``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .._args import READ, WRITE
from .._errors import count_overflow, deadlock, nested_wait, not_owned, pinned
from .._observe import HOT_KEY_SLOTS
from .._owners import AWAITED_THREAD, LOOP_THREAD, POST_ATTEMPTS, Waker
from .._quiet import MAIN_THREAD_MASK, hold_handlers_off
from .._tuning import MAIN_THREAD_SLICE

if TYPE_CHECKING:
    from ._engine import _Engine
    from ._operations import _Operations
    from ._tasks import _TaskWait


K = TypeVar("K", bound=Hashable)
P = ParamSpec("P")  # a synchronized function's parameters
T = TypeVar("T")  # and its result
R = TypeVar("R")  # what a section answers

_WAITING = 0  # queued, asleep or about to sleep
_WOKEN = 1  # fair=False: the key was freed and this request was told to race for it
_GRANTED = 2  # the key was handed to this request; its thread holds it now
_LEFT = 3  # timed out or cancelled: out of the queue, its thread about to return

_READ = READ  # shared: any number of threads at once (RWLockManager)
_WRITE = WRITE  # exclusive (every LockManager request)

# Verdicts a section returns when the caller must raise (built after the section ends).
_NOT_OWNED = "not owned"
_PINNED = "pinned"
_NESTED = "nested"
_OVERFLOW = "overflow"


def _failure(verdict: object, key: object, owner: object = None,
             mode: int | None = None) -> BaseException:
    """The error for a section's verdict about ``key``; a list verdict is a deadlock cycle.
    A refused release names its ``owner`` and ``mode`` (see ``_errors.not_owned``)."""
    if type(verdict) is list:
        return deadlock(verdict)
    if verdict is _PINNED:
        return pinned(key, owner)
    if verdict is _NESTED:
        return nested_wait(key)
    if verdict is _OVERFLOW:
        return count_overflow(key)
    return not_owned(key, owner, mode)


_DROP_ROOM = HOT_KEY_SLOTS  # keys one section may evict from a hot-key summary (the core's)
_WAIT_SLICE = MAIN_THREAD_SLICE  # the longest sleep of a waiter between two checks

_mutex: dict[int, int] = {}  # {0: ident of the thread inside a section}; see the docstring
_retired: list[object] = []  # entries and keys dropped by the running section (see _section)
_to_wake: list[Waker] = []  # tasks the running section granted or woke: posted after it
_get_ident = threading.get_ident
_yield_gil = time.sleep  # time.sleep(0): let the section's holder run

# Python runs signal handlers on the main thread only; there sections run with every signal
# blocked that may have one (all but those a fault raises synchronously, which cannot wait).
_signal: Any = sys.modules.get("_signal", signal)  # its C functions take and return ints
_set_signal_mask = getattr(_signal, "pthread_sigmask", None)  # None: Windows
_SIG_SETMASK = getattr(_signal, "SIG_SETMASK", 0)
_main_thread = [threading.main_thread().ident]  # a forked child's is the forking thread
# The main thread's mask outside sections, shared with ``lockmgr._quiet``'s calls (which
# run sections with the handlers held off, and put the thread's own mask back after).
_main_thread_mask: list[Iterable[int]] = MAIN_THREAD_MASK


# The pid of the process whose thread holds the mutex across its fork() (0: none), and what
# sets a forked child up (``_runtime._after_fork_in_child``): see ``_section``.
_forked_from = [0]
_catch_up_after_fork: list[Callable[[], None]] = [lambda: None]


def _reentered() -> RuntimeError:
    return RuntimeError(
        "lockmgr: a finalizer or signal handler called a lock manager while its thread was "
        "inside the manager's own bookkeeping; the call was refused (it cannot wait for itself)"
    )


def _section(run: Callable[..., R], *args: Any) -> R:
    """``run(*args)`` under the engine mutex; returns its verdict. On the main thread, with
    the signals that may have Python handlers blocked: see the module docstring."""
    ident = _get_ident()
    if _mutex.get(0) == ident:
        if not _forked_from[0] or _forked_from[0] == os.getpid():
            raise _reentered()
        # A forked child, in an at-fork handler registered before lockmgr's (it runs first):
        # the child is set up now, as the compiled core's would be by then.
        _catch_up_after_fork[0]()
    if ident != _main_thread[0] or _set_signal_mask is None:
        return _run_section(ident, run, args)
    # Blocking runs the handlers of signals already pending, after the mask changed: one
    # that raises leaves nothing changed, the mask included (``hold_handlers_off``).
    mask = _main_thread_mask[0] = hold_handlers_off()
    try:
        return _run_section(ident, run, args)
    finally:
        # Handlers of signals that arrived meanwhile run here, after the section: one that
        # raises reaches the acquiring call, which gives back what it got (_acquire).
        _set_signal_mask(_SIG_SETMASK, mask)


def _run_section(ident: int, run: Callable[..., R], args: tuple[Any, ...]) -> R:
    woken = None
    try:
        while _mutex.setdefault(0, ident) != ident:
            _yield_gil(0)
        return run(*args)
    finally:
        # No call before ``del _mutex[0]``: an asynchronous exception cannot skip it. The
        # entries the section dropped are freed with this frame, once the mutex is free;
        # the tasks it woke are posted then (waking a task runs its loop's code).
        if 0 in _mutex and _mutex[0] == ident:
            if _retired:
                dropped = _retired[:]  # unused: it only keeps them alive until then
                del _retired[:]
            if _to_wake:
                woken = _to_wake[:]
                del _to_wake[:]
            del _mutex[0]
        if woken is not None:
            _post_all(woken)


def _post_all(woken: list[Waker]) -> None:
    """Post every task a section woke, as the compiled core's ``post_task`` does: a post may
    run Python code that raises (a signal handler; ending a task whose loop is closed
    warns), so each is delivered again until a delivery returns (``Waker`` counts a number
    once, at most ``POST_ATTEMPTS`` times), the others are posted all the same, and the
    first exception is raised after."""
    failure: BaseException | None = None
    for waker in woken:
        number = attempts = 0
        while attempts < POST_ATTEMPTS:
            try:
                if not number:
                    number = waker.next_post()
                waker.deliver(number)
                break
            except BaseException as error:
                if failure is None:
                    failure = error
                attempts += 1
    if failure is not None:
        raise failure


def _is_plain(key: object) -> bool:
    """Whether comparing ``key`` with another plain key runs no Python code."""
    kind = type(key)
    if kind is str or kind is int or kind is bytes:
        return True
    return kind is tuple and all(map(_is_plain, key))  # type: ignore[call-overload]


class _Token:
    """The identity of one thread towards every manager; ownership means this object."""

    __slots__ = ("__weakref__", "held", "ident", "is_main", "reads", "request", "wakeup")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.is_main = threading.current_thread() is threading.main_thread()
        self.held: dict[_Entry, weakref.ref[_Engine]] = {}  # write-held entries -> manager
        self.reads: dict[_Entry, weakref.ref[_Engine]] = {}  # read-held entries -> manager
        self.wakeup = threading.Lock()  # held except while a grant/wake is posted
        self.wakeup.acquire()
        self.request: _Request | None = None  # the request its thread is waiting in

    def consume_post(self) -> None:
        """The post of a transition seen in this section, unless a sleep consumed it."""
        self.wakeup.acquire(False)


class _TaskWakeup:
    """A task token's stand-in for a thread's wakeup lock: a section's post queues the
    task's current Waker, posted once the section has ended (``_run_section``). A task
    needs no post to see its state change: it reads its request in a section."""

    __slots__ = ("waker",)

    def __init__(self) -> None:
        self.waker: Waker | None = None  # set by the task before each acquisition

    def release(self) -> None:
        if self.waker is not None:
            _to_wake.append(self.waker)

    def acquire(self, blocking: bool = True) -> bool:
        return True


class _TaskToken(_Token):
    """The identity of one asyncio task towards every manager (``ident`` is the task)."""

    __slots__ = ("ended", "loop", "loop_ident", "wait")

    def __init__(self, task: Any) -> None:  # noqa: D107 - not a thread: no _Token.__init__
        self.ident = task
        # A task of the main thread's loop: signal handlers run in its calls, so a grant
        # made at once is recorded as its request until the acquiring call has it
        # (_granted_at_once, _Tasks._task_enter).
        self.is_main = threading.current_thread() is threading.main_thread()
        self.held = {}
        self.reads = {}
        self.wakeup = _TaskWakeup()  # type: ignore[assignment]
        self.request = None
        self.loop_ident = _get_ident()  # the thread running its loop (a cycle may pass it)
        self.loop: Any = task.get_loop()  # where a block's exit run elsewhere sends its release
        # Set once by _task_done, first thing: a block's exit releases nothing from then on.
        self.ended = False
        # Its queued request's wait, until settle or abandon ends it (one at a time: the
        # table refuses a second with NestedWaitError).
        self.wait: _TaskWait | None = None

class _Request:
    __slots__ = ("at_head", "count", "ended", "entry", "lead", "manager", "mode", "nodes",
                 "queued", "since", "state", "token")

    def __init__(
        self, token: _Token, manager: _Operations, entry: _Entry, mode: int, count: int
    ) -> None:
        self.token = token  # the waiting thread
        self.manager = manager  # whose queue it is (or would be) in
        self.entry = entry  # the entry whose queue it is (or would be) in
        self.mode = mode  # _READ or _WRITE
        self.count = count  # recursion levels it takes (installed when granted)
        self.state = _WAITING
        self.since = time.monotonic()  # when it queued (fair=False's hand-off rule)
        self.ended = 0.0  # when its waiter's section saw its wait end (every measure uses it)
        self.at_head = False  # an upgrade: queued before every other request
        self.lead: _Request | None = None  # multi-key: the first node, which speaks for all
        self.nodes: list[_Request] | None = None  # multi-key, on the lead: every node
        # multi-key: it waits in its entry's queue; else it re-enters a held key, and its
        # level is taken (pinned) when the request queues
        self.queued = True

    def members(self) -> Sequence[_Request]:
        """The nodes of a multi-key lead, or the single request itself."""
        return (self,) if self.nodes is None else self.nodes


class _Entry:
    __slots__ = ("count", "hash", "key", "limit", "owner", "plain", "queue", "read_since",
                 "readers", "same_hash", "since", "slots")

    def __init__(self, key: Hashable, key_hash: int, plain: bool) -> None:
        self.key = key  # the key as first given
        self.hash = key_hash
        self.plain = plain  # _is_plain(key): comparable inside a section
        self.same_hash: _Entry | None = None  # the next entry of the table's chain for hash
        self.owner: _Token | None = None  # the write holder
        self.count = 0  # the write holder's recursion level
        self.readers: dict[_Token, int] = {}  # read holders -> their recursion levels
        self.slots = 0  # the read levels, all readers together (a semaphore's taken slots)
        # A SemaphoreManager's key: how many read holders (slots) it admits; 0: any number.
        self.limit = 0
        self.queue: deque[_Request] = deque()  # waiting requests, oldest first
        # When the write hold was granted to a request that waited, or else when the first
        # request queued behind it (0.0: not timed; see lockmgr._observe); the same for
        # read holds, by reader (None until one is timed).
        self.since = 0.0
        self.read_since: dict[_Token, float] | None = None


_LOOP_THREAD = _Entry(LOOP_THREAD, 0, True)  # what a task waits for in its loop's thread
_AWAITED_THREAD = _Entry(AWAITED_THREAD, 0, True)  # what a task waits for in a thread it awaits
