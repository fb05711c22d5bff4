"""The pure-Python twin of ``lockmgr._core``: the same engine, the same semantics.

It is the reference the compiled core is tested against, the fallback where no compiled
core is available (PyPy, no compiler), and what type checkers read.

The engine (the compiled core follows it name for name): a manager keeps a table of
*entries*, one per key that is held or waited on. An entry has a write holder (a per-thread
*token*, never the integer ident) with its recursion count, read holders with theirs
(RWLockManager), and a FIFO queue of *requests*. A request belongs to one waiting thread,
which sleeps on its token's ``wakeup`` lock. When a holder or a request leaves, ``_pass_on``
grants what the head of the queue allows: a run of readers together, or one writer (strict
FIFO: the head becomes the holder before ``release`` returns; with ``fair=False`` and a head
that has waited less than ``HANDOFF_AFTER``, the key is freed and the head woken to race for
it).

Sections. Every read or write of a table, entry, request, hold or token happens in a
*section*: a function run by ``_section()`` (directly, or by ``_run_on_key``, which finds
the key's entry for it) under the one engine-wide mutex that every manager of this module
shares. Outside any section run only the public methods, ``_run_on_key``, ``_acquire`` and
the ``_acquire_*``/``_take_many``/``_release_write``/``_release_read``/``_release_many``
wrappers, ``_wait`` and ``_Unsure.settle``; every other method of ``_Engine`` runs inside
one. A section runs only the engine's own code: keys are hashed before it; a key whose
``__eq__`` could run Python code is compared after it (the section returns ``_Unsure``,
and is run again with the outcome, which it trusts only if no entry joined that hash's
chain meanwhile); errors and warnings are built after it (a section returns a *verdict*);
entries it drops wait in ``_retired`` until it has ended, so no key's ``__del__`` runs
inside. Python code can still run inside a section uninvited: the garbage collector's
finalizers and callbacks (at any bytecode), profile/trace functions, and (see below) a
signal handler. If that code calls a manager, ``_section()`` refuses with RuntimeError
(``_reentered``) instead of deadlocking on the mutex its own thread holds; such errors are
unraisable in finalizers anyway. Unlike the compiled core, sections post wakeup locks
themselves: ``Lock.release`` runs no Python code, and posting together with the state
change keeps the semaphore rule below simple.

Asynchronous exceptions. Python runs signal handlers on the main thread only, at *check
points* (a function's start, a call's return, a loop's jump back); a handler that raises
(KeyboardInterrupt) can interrupt whatever runs there. So:
- on the main thread, ``_section()`` blocks every signal that may have a Python handler
  (``_BLOCKABLE``: all but SIGKILL, SIGSTOP and those a fault raises synchronously) before
  it takes the mutex and restores the thread's mask after it has freed it. Blocking runs
  the handlers of signals already pending (after the mask changed, before anything else);
  restoring runs those that arrived meanwhile, after the section. Worker threads run no
  handlers and skip this (it costs two system calls per section);
- the mutex is the single slot ``_mutex[0]``, claimed with ``dict.setdefault`` (test-and-set
  and "who holds it" in one C call) inside the ``try`` whose ``finally`` frees it with
  ``del`` (no call, so no check point, before it): nothing can leak it;
- ``_acquire`` wraps everything from the section that decides to the outcome: an exception
  anywhere in there (the sleep between sections included, and a handler raising when a
  section restores the mask) takes the request out of the queues again or gives back what
  it was granted (``_abandon_section``, idempotent, retried if another handler raises
  meanwhile); on the main thread an immediate grant is recorded as a GRANTED request for
  that (``_granted_at_once``). Nothing stays queued or held that the caller does not know of.
The limits: a signal blocked on the main thread but delivered to another thread (a
process-directed one, such as a terminal's Ctrl-C, while the main thread is in a section)
still has its handler run on the main thread at its next check point, inside the section
(measured: within a millisecond on 3.11-3.13), and where ``pthread_sigmask`` does not exist
(Windows) nothing is blocked; an exception there stops that section's changes where they
got to. The docs' "When things go wrong" (docs/semantics.md) state this.

Lock ordering: there is one mutex, and nothing that blocks is ever called while it is held
(posting a wakeup lock does not block). A thread that finds it taken yields the GIL and
tries again; sections are short and never wait.

Invariants (each kept by the sections named):
- an entry is in its manager's table iff it has a holder or a queued request (``_pass_on``
  drops it when the last one leaves; an entry is only created to be taken or queued on in
  the same section);
- ``entry.count > 0`` iff ``entry.owner is not None``; every read count is > 0; no count
  exceeds ``MAX_COUNT`` (every section that adds levels checks first);
- in fair mode an entry whose head request could be granted has no queue: ``_pass_on``
  runs whenever a holder or a request leaves;
- with ``fair=False``, an entry without holders but with a queue has a WOKEN head, on its
  way to take the key;
- a token has at most one request, ``token.request``, from the section that queues it (or,
  on the main thread, grants it at once) until its acquiring call has the outcome
  (``_acquire`` clears it); a call that would queue another one gets NestedWaitError
  (``_NESTED`` verdict);
- a waiting multi-key request holds the levels of its re-entered keys already (*pinned*:
  taken when it queues, given back if it leaves, ordinary levels once it is granted);
  releases never take pinned levels (``_pinned``);
- a token's ``wakeup`` lock is released (posted) only on a request's WAITING -> WOKEN or
  WAITING -> GRANTED transition, inside the section that makes it (WOKEN -> GRANTED reuses
  the post already made), and the waiter consumes that post (``token.consume_post``) in the
  section where it sees the new state, before its request goes back to WAITING or ends;
  consuming twice is harmless (the lock is then simply held), so the lock acts as a binary
  semaphore whatever exceptions interrupt the wait.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, final

from ._aio import (
    AsyncKeyLock,
    AsyncLockManager,
    AsyncRWLockManager,
    _AsyncHolding,
    _AsyncHoldingMany,
    _take,
    _wait_for_grant,
)
if TYPE_CHECKING:
    from ._contract import AsyncBlock, BlockRecord, Engine
from ._observe import (
    HISTOGRAM_BOUNDS,
    HOT_KEY_SLOTS,
    KeyState,
    LockMetrics,
    bucket_of,
    build_metrics,
    build_snapshot,
    log_slow_wait,
    log_wait_end,
    log_waits_after_seconds,
)
from ._args import (
    MAX_COUNT,
    READ,
    WRITE,
    Stripe,
    hold_seconds,
    many_items,
    restored_count,
    rw_items,
    stripe_count,
    stripe_index,
    wait_seconds,
)
from ._errors import (
    block_in_use,
    count_overflow,
    deadlock,
    nested_wait,
    not_entered,
    not_owned,
    pinned,
    timed_out,
    warn_abandoned,
)
from ._owners import (
    LOOP_THREAD,
    Waker,
    current_task_or_none,
    current_task_or_raise,
    not_in_task,
    running_loop,
)
from ._tuning import HANDOFF_AFTER, MAIN_THREAD_SLICE
from ._views import PICKLE_ERROR, LockStats, key_lock_repr, manager_repr, synchronized

__all__ = ["AsyncKeyLock", "KeyLock", "LockManager", "RWLockManager", "end_stranded_task"]

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


def _failure(verdict: object, key: object) -> BaseException:
    """The error for a section's verdict about ``key``; a list verdict is a deadlock cycle."""
    if type(verdict) is list:
        return deadlock(verdict)
    if verdict is _PINNED:
        return pinned(key)
    if verdict is _NESTED:
        return nested_wait(key)
    if verdict is _OVERFLOW:
        return count_overflow(key)
    return not_owned(key)


_ABANDON_ATTEMPTS = 5  # see _Engine._acquire
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
_SIG_BLOCK = getattr(_signal, "SIG_BLOCK", 0)
_SIG_SETMASK = getattr(_signal, "SIG_SETMASK", 0)
_BLOCKABLE = frozenset(map(int, _signal.valid_signals())) - {
    getattr(_signal, name) for name in
    ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS")
    if hasattr(_signal, name)
}
_main_thread = [threading.main_thread().ident]  # a forked child's is the forking thread
_main_thread_mask: list[Iterable[int]] = [()]  # the main thread's mask outside sections


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
        raise _reentered()
    if ident != _main_thread[0] or _set_signal_mask is None:
        return _run_section(ident, run, args)
    mask = _main_thread_mask[0]  # the main thread's own mask, as last seen
    try:
        # Blocking runs the handlers of signals already pending, after the mask changed:
        # one that raises leaves nothing changed but the mask, which the finally restores.
        mask = _main_thread_mask[0] = _set_signal_mask(_SIG_BLOCK, _BLOCKABLE)
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
    """Post every task a section woke; a post may run Python code that raises (ending a task
    whose loop is closed warns): the others are posted all the same, then it is raised."""
    failure: BaseException | None = None
    for waker in woken:
        try:
            waker.post()
        except BaseException as error:
            if failure is None:
                failure = error
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
        self.is_main = False
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


class _BlockRecord:
    """Which task is inside an ``async with`` object's block, and how many times: the
    compiled core's ``_BlockRecord`` (see there). It keeps its task's token by a weak
    reference, so a record left behind by an ended task keeps nothing of it; a dead
    reference means an ended task. Changed under a lock of its own (an exit may run in
    another thread); reentrant, as the collector may close a coroutine inside an exit."""

    __slots__ = ("_lock", "_state")

    def __init__(self) -> None:
        self._state: tuple[weakref.ref[_TaskToken], int] | None = None  # (token, depth)
        self._lock = threading.RLock()

    def enter(self, token: _TaskToken) -> None:
        """``token``'s task holds what it asked for: it is inside (RuntimeError, and
        nothing changed, if another task is)."""
        with self._lock:
            state = self._state
            if state is None:
                self._state = (weakref.ref(token), 1)
                return
            inside = state[0]()
            if inside is token:
                self._state = (state[0], state[1] + 1)
                return
        raise _in_use(inside)

    def leave(self) -> _TaskToken | None:
        """One block exits: the token whose hold it gives back, or None if that task has
        ended. RuntimeError if no block is inside."""
        with self._lock:
            state = self._state
            if state is None:
                raise not_entered()
            self._state = None if state[1] == 1 else (state[0], state[1] - 1)
        token = state[0]()
        return None if token is None or token.ended else token

    @property
    def _inside(self) -> tuple[Any, int]:
        """The task inside and its depth (None, 0 if none), for tests."""
        state = self._state
        token = None if state is None else state[0]()
        if state is None or token is None or token.ended:
            return None, 0 if state is None else state[1]
        return token.ident, state[1]


def _own_record(record: object) -> _BlockRecord:
    """``record`` if this engine made it (``_task_record()``): TypeError for any other, as
    the compiled core's typed parameter raises."""
    if type(record) is _BlockRecord:
        return record
    raise TypeError(f"Argument 'record' has incorrect type (expected {__name__}._BlockRecord, "
                    f"got {type(record).__name__})")


def _in_use(inside: _TaskToken | None) -> RuntimeError:
    if inside is None or inside.ended:
        return block_in_use(None, True)
    return block_in_use(inside.ident, False)


def _abandon_stranded(token: _TaskToken) -> None:
    """Abandon the task's wait if nothing ever awaited it: an exception came between the
    call that queued it and the await (a signal handler's, at a check point), or a caller
    dropped what ``__aenter__`` answered. Called when the task starts another acquisition
    or an exception ends one; a wait being awaited is left alone (code running inside it,
    as a finalizer, may start an acquisition of its own)."""
    wait = token.wait
    if wait is not None and not wait.awaited:
        wait.abandon()


_task_tokens: dict[Any, _TaskToken] = {}  # running task -> its token (until it is done)


def _task_token(create: bool = True) -> _TaskToken | None:
    """The current task's token (RuntimeError outside a task); None if it has none yet and
    ``create`` is false."""
    task = current_task_or_raise()
    token = _task_tokens.get(task)
    if token is None and create:
        token = _task_tokens[task] = _TaskToken(task)
        task.add_done_callback(_task_done)
    return token


def _running_task_token() -> _TaskToken:
    """The current task's token, made at its first acquisition (RuntimeError outside a task)."""
    token = _task_token()
    assert token is not None
    return token


def _task_done(task: Any) -> None:
    """A task ended: release what it still holds (with AbandonedLockWarning), as a thread's
    exit does."""
    token = _task_tokens.pop(task, None)
    if token is not None:
        token.ended = True  # a block's exit from now on releases nothing: this does
        if token.wait is not None:  # a done task awaits nothing: it was stranded
            token.wait.abandon()
        for _ in range(_EXIT_ROUNDS):
            if not _release_abandoned(token):
                break
        token.loop = None


def end_stranded_task(task: Any) -> None:
    """The compiled core's ``end_stranded_task``: a task whose event loop was closed while
    it was pending can never run again; end it here, as its done-callback would."""
    _task_done(task)


class _Ready:
    """An awaitable whose outcome is known already: awaiting it returns ``value`` at once."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.value
        yield  # a generator that returns before its first yield


_READY_TRUE, _READY_FALSE, _READY_NONE = _Ready(True), _Ready(False), _Ready(None)


def _answer(got: object, keys: object, seconds: float, raises_timeout: bool,
            record: _BlockRecord | None, token: _TaskToken) -> Awaitable[bool]:
    """What ``_task_enter`` answers for the outcome ``got`` of an acquisition; an ``async
    with`` block enters ``record`` once its task holds what it asked for: now, last, or
    when its wait is granted. The caller gives back what was taken if this raises
    (another task is inside ``record``, or a signal handler raised at a call)."""
    awaitable = _task_awaitable(got, keys, seconds, raises_timeout)
    if record is not None:
        if got is True:
            record.enter(token)
        elif type(got) is _TaskWait:
            got.entering = record
    return awaitable


def _give_back(got: object, release: Callable[[], object]) -> None:
    """An exception ended an acquisition after it took ``got``: what was taken at once goes
    back (``release()``), a queued wait leaves the queues."""
    if got is True:
        release()
    elif type(got) is _TaskWait:
        got.abandon()


def _nothing() -> None:
    pass


def _releases_here(token: _TaskToken, engine: _Engine, key: Any, mode: int) -> bool:
    """Whether a block's exit releases ``token``'s hold now, in this thread: only its
    loop's thread may change a task's holds. An exit run elsewhere (a coroutine the
    collector closes in another thread) sends the release to that loop. If that loop is
    closed, the task can never run again: it is ended here instead."""
    loop = token.loop
    try:
        if loop is None or loop.is_closed():
            raise RuntimeError("its event loop is closed")
        if _get_ident() == token.loop_ident:
            return True
        loop.call_soon_threadsafe(engine._task_release_for, token, key, mode)
    except RuntimeError:  # closed (maybe just now)
        _task_done(token.ident)
    return False


def _task_awaitable(got: object, keys: object, seconds: float,
                    raises_timeout: bool) -> Awaitable[bool]:
    """What ``_task_enter`` answers for the outcome ``got`` of an acquisition."""
    if got is True:
        return _READY_TRUE
    if got is False:
        if raises_timeout:
            raise timed_out(keys, seconds)
        return _READY_FALSE
    assert type(got) is _TaskWait
    got.deadline = time.monotonic() + seconds if seconds > 0 else -1.0
    got.raises_timeout, got.keys, got.seconds = raises_timeout, keys, seconds
    return got


class _TaskWait:
    """A task's queued request (see lockmgr._aio for the protocol)."""

    __slots__ = ("awaited", "completed", "deadline", "entered", "entering", "keys", "log_at",
                 "manager", "raises_timeout", "request", "seconds", "taken", "waker")

    def __init__(self, manager: _Engine, request: _Request, waker: Waker) -> None:
        self.manager = manager
        self.request = request
        self.waker = waker
        self.awaited = False
        # The record of the ``async with`` object whose ``__aenter__`` queued it (else
        # None): the grant enters it.
        self.entering: _BlockRecord | None = None
        # Once completed: the record it entered, and how to give back what it took (set
        # by _task_take), for an exception that ends the await before it returns.
        self.completed = False
        self.entered: _BlockRecord | None = None
        self.taken: Callable[[], object] = _nothing
        waker.lost = self._loop_closed
        self.deadline = -1.0  # _task_awaitable sets these
        self.raises_timeout = False
        self.keys: object = None
        self.seconds = -1.0
        after = manager._log_after
        self.log_at = -1.0 if after < 0 else request.since + after  # the slow-wait log's time

    def __await__(self) -> Generator[Any, None, bool]:
        if self.awaited:
            raise RuntimeError("this acquisition's wait was awaited already")
        self.awaited = True
        return self._awaiting()

    def _awaiting(self) -> Generator[Any, None, bool]:
        # _wait_for_grant abandons on any exception, but only once inside its ``try``; this
        # frame narrows the gap after ``__aenter__`` to its own first instruction (the
        # compiled core's wait has none: it is a C iterator). A task done with a wait it
        # never awaited abandons it (_task_done).
        try:
            return (yield from _wait_for_grant(self).__await__())
        except BaseException:
            self.give_back()
            raise

    def give_back(self) -> None:
        """An exception ends the await: leave the queues, or, once completed (a signal
        handler's exception as the wait returns), give back what it took and leave the
        record it entered, as the block's exit would have."""
        if not self.completed:
            self.abandon()
            return
        self.completed = False
        record, self.entered = self.entered, None
        if record is not None:
            record.leave()
        self.taken()

    def timed_out(self) -> bool:
        if self.raises_timeout:
            raise timed_out(self.keys, self.seconds)
        return False

    def settle(self, consumed: bool, deadline: float) -> bool | None:
        if self.request.state == _LEFT:  # a forked child dropped it (_keep_only)
            return False
        verdict: bool | None = _section(self.manager._check_wait_section, self.request,
                                        None if deadline < 0 else deadline)
        if verdict is False:
            self._ended()
        return verdict

    def complete(self) -> None:
        # The block enters first: an exception there (another task is inside) finds the
        # grant not yet completed, which abandon() then gives back.
        record = self.entering
        if record is not None:
            token = self.request.token
            assert type(token) is _TaskToken
            record.enter(token)
            self.entering = None
        _section(self.manager._complete_section, self.request)
        self.entered, self.completed = record, True
        self._ended()

    def abandon(self) -> None:
        _section(self.manager._abandon_section, self.request.token, None)
        self._ended()

    def log_slow(self) -> None:
        self.manager._log_slow_wait(self.request)

    def log_end(self, granted: bool) -> None:
        self.manager._log_wait_end(self.request, granted)

    def observe(self) -> None:
        self.manager._observe_wait(self.request)

    def _ended(self) -> None:
        token = self.request.token
        assert type(token) is _TaskToken
        if token.request is self.request:
            token.request = None
        if token.wait is self:
            token.wait = None
        self.waker.lost = None

    def _loop_closed(self) -> None:
        """A grant found the task's loop closed: the task can never run again, so it is
        ended here, as its done-callback would (AbandonedLockWarning for what it held)."""
        self.abandon()
        _task_done(self.request.token.ident)


class _ThreadExit:
    """Held only by its thread's local storage, so it is finalized when the thread ends.

    It then releases whatever the thread still holds (waiters get those keys as usual).
    Entries refer to their owner's token, so the token itself may outlive its thread.
    """

    __slots__ = ("token",)

    def __init__(self, token: _Token) -> None:
        self.token = token

    def __del__(self) -> None:
        token: _Token | None = getattr(self, "token", None)  # a handler may cut __init__ short
        if token is None:
            return
        if sys.is_finalizing() or token.request is not None or os.getpid() != _fork_parent_pid:
            # Interpreter teardown (this module's globals may be gone already, and nobody
            # can take the keys any more), a daemon thread gone mid-wait, or a forked child,
            # where only the forking thread lives on and _after_fork_in_child frees the rest.
            return
        # Dropping the released keys and warning run Python code (finalizers, warning
        # filters) in this thread, while its local storage is being cleared: the token stays
        # the thread's own (``_exiting``) until that code is done, and what it takes is
        # released in the next round (bounded: a finalizer may take a key each time).
        own = token.ident == _get_ident()
        if own:
            _exiting[token.ident] = token
        try:
            for _ in range(_EXIT_ROUNDS):
                if not _release_abandoned(token):
                    break
        finally:
            if own:
                _exiting.pop(token.ident, None)


_EXIT_ROUNDS = 100  # bounds a finalizer that takes a key again each time it is released


def _release_abandoned(token: _Token) -> bool:
    """Release every key an ending thread holds, then drop them and warn (all of which may
    run Python code); False if it held none."""
    managers: dict[int, _Engine] = {}  # not a set of the references: a dead one's hash
    for manager_ref in _section(_holding_managers, token):  # may be unknown
        manager = manager_ref()
        if manager is not None:  # else it is being torn down: it unlinks its entries
            managers[id(manager)] = manager
    if not managers:
        return False
    abandoned: list[Hashable] = []
    for manager in managers.values():
        abandoned += _section(manager._release_held_section, token)
    if abandoned and not sys.is_finalizing():
        warn_abandoned(token.ident, abandoned)
    return True


def _holding_managers(token: _Token) -> list[weakref.ref[_Engine]]:
    """In a section: the managers (references) whose keys ``token`` holds."""
    return [*token.held.values(), *token.reads.values()]


_local = threading.local()
_thread_tokens: weakref.WeakValueDictionary[int, _Token] = weakref.WeakValueDictionary()
_exiting: dict[int, _Token] = {}  # ident -> token of a thread whose exit runs (_ThreadExit)
_managers: weakref.WeakSet[_Engine] = weakref.WeakSet()  # every live manager (for fork)
_fork_parent_pid = os.getpid()  # the process whose threads' exits release their keys


def _current_token() -> _Token:
    if _exiting:  # before _local: an ending thread's local storage is being cleared
        exiting = _exiting.get(_get_ident())
        if exiting is not None:
            return exiting
    try:
        token: _Token = _local.guard.token
    except AttributeError:
        token = _Token()
        _local.guard = _ThreadExit(token)
        _thread_tokens[token.ident] = token  # a cycle through a task may pass this thread
    return token


def _existing_token() -> _Token | None:
    if _exiting:
        exiting = _exiting.get(_get_ident())
        if exiting is not None:
            return exiting
    guard: _ThreadExit | None = getattr(_local, "guard", None)
    return None if guard is None else guard.token


class _Request:
    __slots__ = ("at_head", "count", "ended", "entry", "lead", "manager", "mode", "nodes",
                 "queued", "since", "state", "token")

    def __init__(
        self, token: _Token, manager: _Engine, entry: _Entry, mode: int, count: int
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
    __slots__ = ("count", "hash", "key", "owner", "plain", "queue", "read_since", "readers",
                 "same_hash", "since")

    def __init__(self, key: Hashable, key_hash: int, plain: bool) -> None:
        self.key = key  # the key as first given
        self.hash = key_hash
        self.plain = plain  # _is_plain(key): comparable inside a section
        self.same_hash: _Entry | None = None  # the next entry of the table's chain for hash
        self.owner: _Token | None = None  # the write holder
        self.count = 0  # the write holder's recursion level
        self.readers: dict[_Token, int] = {}  # read holders -> their recursion levels
        self.queue: deque[_Request] = deque()  # waiting requests, oldest first
        # When the write hold was granted to a request that waited, or else when the first
        # request queued behind it (0.0: not timed; see lockmgr._observe); the same for
        # read holds, by reader (None until one is timed).
        self.since = 0.0
        self.read_since: dict[_Token, float] | None = None


_LOOP_THREAD = _Entry(LOOP_THREAD, 0, True)  # what a task waits for in its loop's thread


# -- what the contended path measures (lockmgr._observe), inside sections ------------------------

def _entry_state(entry: _Entry) -> tuple[Any, ...]:
    """An entry as lockmgr._observe.build_snapshot takes it: the writer, then the readers
    oldest first, then the queue."""
    holders = []
    if entry.owner is not None:
        holders.append((entry.owner.ident, type(entry.owner) is _TaskToken, _WRITE, entry.count,
                        entry.since))
    read_since = entry.read_since or {}
    for token, level in entry.readers.items():
        holders.append((token.ident, type(token) is _TaskToken, _READ, level,
                        read_since.get(token, 0.0)))
    waiters = [(request.token.ident, type(request.token) is _TaskToken, request.mode,
                (request.lead or request).since) for request in entry.queue]
    return entry.key, holders, waiters


def _place_in(queue: deque[_Request], request: _Request) -> int:
    """How many requests are ahead of ``request`` in ``queue`` (all of them if it left)."""
    for place, queued in enumerate(queue):
        if queued is request:
            return place
    return len(queue)


_LONG_LONG = range(-(1 << 63), 1 << 63)


def _equal_without_code(a: object, b: object, depth: int = 0) -> bool:
    """Whether the core's lockmgr_key_equal would call ``a`` and ``b`` equal: exact str,
    bytes, ints of a long long and tuples of them (nested less than 16 deep). The hot-key
    summary matches keys this way on both engines."""
    return _compared_in_c(a, b, depth) == 1


def _compared_in_c(a: object, b: object, depth: int) -> int:
    """1 equal, 0 unequal, -1 unknown, as lockmgr_key_equal_at answers."""
    if a is b:
        return 1
    kind = type(a)
    exact = (str, bytes, int, tuple)
    if kind is not type(b):
        return 0 if kind in exact and type(b) in exact else -1
    if kind is str or kind is bytes:
        return int(a == b)
    if kind is int:
        return int(a == b) if a in _LONG_LONG and b in _LONG_LONG else -1
    if kind is tuple and depth < 16:
        if len(a) != len(b):  # type: ignore[arg-type]
            return 0
        unknown = False
        for x, y in zip(a, b):  # type: ignore[call-overload]
            item = _compared_in_c(x, y, depth + 1)
            if item == 0:
                return -1 if unknown else 0
            unknown = unknown or item < 0
        return -1 if unknown else 1
    return -1


def _time_grant(entry: _Entry, request: _Request) -> None:
    """A request that waited was granted: its hold is timed from now, unless it re-entered
    a hold timed already."""
    if request.mode == _WRITE:
        if not entry.since:
            entry.since = time.monotonic()
        return
    if entry.read_since is None:
        entry.read_since = {}
    entry.read_since.setdefault(request.token, time.monotonic())


def _time_holds(entry: _Entry, since: float) -> None:
    """A request queued on ``entry`` at ``since``: holds not timed yet are timed from then."""
    if entry.owner is not None and not entry.since:
        entry.since = since
    if entry.readers:
        if entry.read_since is None:
            entry.read_since = {}
        for token in entry.readers:
            entry.read_since.setdefault(token, since)


def _new_histogram() -> list[Any]:
    return [[0] * (len(HISTOGRAM_BOUNDS) + 1), 0, 0.0, 0.0]


def _count_in(histogram: list[Any], seconds: float) -> None:
    histogram[0][bucket_of(seconds)] += 1
    histogram[1] += 1
    histogram[2] += seconds
    if seconds > histogram[3]:
        histogram[3] = seconds


def _histogram_copy(histogram: list[Any]) -> tuple[Any, ...]:
    return tuple(histogram[0]), histogram[1], histogram[2], histogram[3]


@final
class _Unsure:
    """A section's verdict: these entries' keys hash like the caller's and must be compared
    with it outside the section. ``first`` was their chain's first entry then: entries join
    a chain at its front, so while it still is, no entry joined since the comparison."""

    __slots__ = ("entries", "first")

    def __init__(self, first: _Entry, entries: list[_Entry]) -> None:
        self.first = first
        self.entries = entries

    def settle(self, key: Hashable) -> tuple[_Entry, _Entry | None]:
        """Compare (may run the keys' ``__eq__``): what the next section may trust."""
        for entry in self.entries:
            if entry.key == key:  # the stored key first, as a dict compares
                return self.first, entry
        return self.first, None


class _Engine:
    """The table, holds, queues, grants and waits that every manager shares."""

    __slots__ = (
        "_acquisitions",
        "_contended",
        "_deadlocks",
        "_fair",
        "_held",
        "_holds",
        "_hot",
        "_log_after",
        "_observers",
        "_ref",
        "_stripe_keys",
        "_table",
        "_timeouts",
        "_waiting",
        "_waits",
        "__weakref__",
    )

    def __init__(self, stripes: int | None = None, log_waits_after: float | None = None) -> None:
        self._log_after = log_waits_after_seconds(log_waits_after)  # -1.0: off
        self._observers: tuple[Callable[[float], object], ...] = ()  # see _add_wait_observer
        count = stripe_count(stripes)
        # striped: one Stripe key per stripe; None: exact keys
        self._stripe_keys = None if count is None else tuple(map(Stripe, range(count)))
        self._fair = True
        self._table: dict[int, _Entry] = {}  # key hash -> first entry of its chain
        self._held = 0  # entries with a write or read holder
        self._waiting = 0
        self._acquisitions = 0
        self._contended = 0
        self._timeouts = 0
        self._deadlocks = 0
        # What the contended path measures (lockmgr._observe): waits that were granted and
        # holds that ended with someone waiting, as [bucket counts, count, sum, max]; the
        # hot-key summary's slots, [key, waited, error].
        self._waits: list[Any] = _new_histogram()
        self._holds: list[Any] = _new_histogram()
        self._hot: list[list[Any]] = []
        self._ref = weakref.ref(self)  # what tokens keep: they must not keep the manager alive
        _managers.add(self)

    def __del__(self) -> None:
        # Nobody waits here (a waiter's call keeps the manager alive), but keys may be held.
        # __init__ may have failed. A collection that runs inside a section of this thread
        # cannot take the mutex: the tokens then keep dead references until their thread
        # ends (they skip managers that are gone).
        if _mutex is None:  # a late finalization cleared this module: nothing runs a table now
            return
        if getattr(self, "_table", None) and _mutex.get(0) != _get_ident():
            _section(self._unlink_section)

    def _unlink_section(self) -> None:
        for first in self._table.values():
            entry: _Entry | None = first
            while entry is not None:
                if entry.owner is not None:
                    entry.owner.held.pop(entry, None)
                for reader in entry.readers:
                    reader.reads.pop(entry, None)
                _retired.append(entry)
                entry = entry.same_hash
        self._table.clear()

    def __repr__(self) -> str:
        return manager_repr(self, self._fair, self._held, self._waiting)

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_ERROR)

    def __len__(self) -> int:
        """Keys currently held (with stripes: stripes)."""
        return self._held

    @property
    def stripes(self) -> int | None:
        """How many stripes keys map onto, or None: one lock per key."""
        return None if self._stripe_keys is None else len(self._stripe_keys)

    def stripe_of(self, key: Hashable) -> int | None:
        """The stripe ``key`` maps onto (None without stripes): keys that share one share a lock."""
        if self._stripe_keys is None:
            return None
        return stripe_index(hash(key), len(self._stripe_keys))

    def _table_key(self, key: Hashable) -> Hashable:
        """The key the table uses for ``key``: the key itself, or its stripe."""
        if self._stripe_keys is None:
            hash(key)  # an unhashable key fails here, as on the exact path
            return key
        return self._stripe_keys[stripe_index(hash(key), len(self._stripe_keys))]

    def stats(self) -> LockStats:
        """A snapshot of this manager's counters."""
        return LockStats(*_section(self._stats_section))

    def _stats_section(self) -> tuple[int, ...]:
        return (self._held, self._waiting, self._acquisitions, self._contended,
                self._timeouts, self._deadlocks)

    # -- seeing contention (lockmgr._observe) ---------------------------------------------------

    @property
    def log_waits_after(self) -> float | None:
        """Seconds after which a waiting request logs a WARNING (None: never)."""
        return None if self._log_after < 0 else self._log_after

    def snapshot(self) -> list[KeyState]:
        """Every key held or waited on, with its holders and its queue, at one instant."""
        now, raw = _section(self._snapshot_section)
        return build_snapshot(raw, now)

    def _snapshot_section(self) -> tuple[float, list[Any]]:
        raw = []
        for first in self._table.values():
            entry: _Entry | None = first
            while entry is not None:
                if entry.owner is not None or entry.readers or entry.queue:
                    raw.append(_entry_state(entry))
                entry = entry.same_hash
        return time.monotonic(), raw

    def metrics(self) -> LockMetrics:
        """The ``stats()`` counters, wait- and hold-time histograms and the hot keys, read
        at one instant."""
        return build_metrics(*_section(self._metrics_section))

    def _metrics_section(self) -> tuple[Any, ...]:
        hot = [(key, waited, error) for key, waited, error in self._hot]
        return self._stats_section(), _histogram_copy(self._waits), _histogram_copy(self._holds), hot

    def _record_wait(self, request: _Request, granted: bool) -> None:
        """A wait ended (in its section): measure it, and charge it to the keys it queued on."""
        waited = max(request.ended - request.since, 0.0)
        if granted:
            _count_in(self._waits, waited)
        evicted = 0
        for node in request.members():
            if node.queued:
                evicted += self._charge(node.entry, waited, evicted < _DROP_ROOM)

    def _charge(self, entry: _Entry, waited: float, may_evict: bool) -> bool:
        """Space-Saving: add ``waited`` to the key's slot, or take a free slot, or replace
        the least-charged key (whose charge becomes this slot's error); True if it evicted
        one. Slots match by identity, or by value where comparing runs no Python code."""
        key = entry.key
        for slot in self._hot:
            if slot[0] is key or _equal_without_code(slot[0], key):
                slot[1] += waited
                return False
        if len(self._hot) < HOT_KEY_SLOTS:
            self._hot.append([key, waited, 0.0])
            return False
        if not may_evict:
            return False
        least = self._hot[0]
        for slot in self._hot:
            if slot[1] < least[1]:
                least = slot
        _retired.append(least[0])  # its reference goes after the section
        least[0], least[2] = key, least[1]
        least[1] += waited
        return True

    def _count_hold(self, since: float, entry: _Entry) -> None:
        """A timed hold ends: count it if someone waits for the key."""
        if since and entry.queue:
            _count_in(self._holds, max(time.monotonic() - since, 0.0))

    def _describe_wait(self, request: _Request) -> tuple[float, list[Any], list[int]]:
        """For the slow-wait log: the state of every key ``request`` queued on, and how many
        requests are ahead of it in each queue."""
        return _section(self._describe_wait_section, request)

    def _describe_wait_section(self, request: _Request) -> tuple[float, list[Any], list[int]]:
        raw, ahead = [], []
        for node in request.members():
            if node.queued:
                raw.append(_entry_state(node.entry))
                ahead.append(_place_in(node.entry.queue, node))
        return time.monotonic(), raw, ahead

    def _log_slow_wait(self, request: _Request) -> None:
        now, raw, ahead = self._describe_wait(request)
        log_slow_wait(request.token.ident, max(now - request.since, 0.0),
                      build_snapshot(raw, now), ahead)

    def _add_wait_observer(self, observer: Callable[[float], object]) -> None:
        """Call ``observer(seconds)`` after every wait that was granted (lockmgr.otel), in
        the waiting thread or task, before its acquisition returns; what it raises ends the
        acquisition (the key is given back)."""
        self._observers += (observer,)

    def _remove_wait_observer(self, observer: Callable[[float], object]) -> None:
        self._observers = tuple(other for other in self._observers if other is not observer)

    def _observe_wait(self, request: _Request) -> None:
        waited = max(request.ended - request.since, 0.0)
        for observer in self._observers:
            observer(waited)

    def _log_wait_end(self, request: _Request, granted: bool) -> None:
        keys = [node.entry.key for node in request.members() if node.queued]
        log_wait_end(request.token.ident, keys, max(request.ended - request.since, 0.0),
                     granted)

    def release_all(self) -> int:
        """Release every key of this manager the calling thread holds, all levels; returns how many.

        Levels a waiting ``acquire_many`` of this thread has pinned stay held."""
        token = _existing_token()
        return 0 if token is None else len(_section(self._release_held_section, token))

    # -- asyncio tasks as owners (lockmgr._aio states the protocol) ----------------------------

    def _task_enter(self, key: Hashable, mode: int, seconds: float, raises_timeout: bool,
                    record: BlockRecord | None = None) -> Awaitable[bool]:
        entering = None if record is None else _own_record(record)
        token = _running_task_token()
        got = self._task_take(token, key, mode, seconds == 0, 1)
        try:  # (here, not in _answer: a signal handler may raise as that call starts)
            return _answer(got, key, seconds, raises_timeout, entering, token)
        except BaseException:
            _give_back(got, lambda: self._task_release(key, mode, token))
            raise

    def _task_enter_many(self, items: list[tuple[Hashable, int]], seconds: float,
                         raises_timeout: bool,
                         record: BlockRecord | None = None) -> Awaitable[bool]:
        entering = None if record is None else _own_record(record)
        if not items:  # nothing to take, nor to record: the block's exit gives back nothing
            _task_token(create=False)  # outside a task: RuntimeError all the same
            return _READY_TRUE
        token = _running_task_token()
        got = self._task_take_many(items, seconds == 0)
        try:
            keys = tuple(key for key, _ in items) if raises_timeout else None
            return _answer(got, keys, seconds, raises_timeout, entering, token)
        except BaseException:
            _give_back(got, lambda: self._release_many(items, token))
            raise

    async def _task_acquire(self: Engine, key: Hashable, blocking: bool = True,
                            timeout: float = -1) -> bool:
        """``aio.acquire`` (and ``acquire_write``), bound by the view as its own."""
        return await _take(self, self._task_enter, key, _WRITE,
                           wait_seconds(blocking, timeout), False)

    async def _task_acquire_read(self: Engine, key: Hashable, blocking: bool = True,
                                 timeout: float = -1) -> bool:
        return await _take(self, self._task_enter, key, _READ,
                           wait_seconds(blocking, timeout), False)

    def _task_release_write(self, key: Hashable) -> None:
        self._task_release(key, _WRITE)

    def _task_release_read(self, key: Hashable) -> None:
        self._task_release(key, _READ)

    def _task_record(self) -> _BlockRecord:
        return _BlockRecord()

    # (``self`` is a manager: these make the views that call back into it)
    def _task_hold(self: Engine, key: Hashable, seconds: float, mode: int) -> AsyncBlock:
        return _AsyncHolding(self, key, seconds, mode)

    def _task_hold_many(self: Engine, items: list[tuple[Hashable, int]],
                        seconds: float) -> AsyncBlock:
        return _AsyncHoldingMany(self, items, seconds)

    def _task_exit(self, record: BlockRecord, key: Hashable, mode: int) -> Awaitable[None]:
        token = _own_record(record).leave()
        if token is not None and _releases_here(token, self, key, mode):
            self._task_release(key, mode, token)
        return _READY_NONE

    def _task_exit_many(self, record: BlockRecord,
                        items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        own = _own_record(record)
        if not items:  # an empty hold_many entered nothing
            return _READY_NONE
        token = own.leave()
        if token is not None and _releases_here(token, self, items, -1):
            self._release_many(items, token)
        return _READY_NONE

    def _task_release_for(self, owner: _TaskToken, key: Any, mode: int) -> None:
        """A block's exit run on another thread than its task's loop, sent there."""
        if owner.ended:
            return
        if mode < 0:
            self._release_many(key, owner)
        else:
            self._task_release(key, mode, owner)

    def _task_take(self, token: _TaskToken, key: Hashable, mode: int, try_only: bool,
                   count: int) -> object:
        _abandon_stranded(token)
        key = self._table_key(key)
        seconds = 0.0 if try_only else -1.0
        if mode == _WRITE:
            got = self._task_wait(token, self._run_on_key, self._take_write, key, token,
                                  seconds, count)
        else:
            got = self._task_wait(token, self._run_on_key, self._take_read, key, token, seconds)
        if type(got) is _TaskWait:
            got.taken = lambda: self._task_release(key, mode, token)
        return got

    def _task_take_many(self, items: list[tuple[Hashable, int]], try_only: bool) -> object:
        if not items:
            _task_token(create=False)  # outside a task: RuntimeError all the same
            return True
        token = _running_task_token()
        _abandon_stranded(token)
        got = self._task_wait(token, self._take_many, items, token, 0.0 if try_only else -1.0)
        if type(got) is _TaskWait:
            got.taken = lambda: self._release_many(items, token)
        return got

    def _task_wait(self, token: _TaskToken, take: Callable[..., Any], *args: Any) -> object:
        """``take(*args)`` for a task: True, False, or the _TaskWait of its queued request."""
        if token.wait is None:  # else the table refuses to queue this one: its waker stays
            token.wakeup.waker = Waker(running_loop())  # type: ignore[attr-defined]
        verdict = take(*args)
        if type(verdict) is _Request:
            waker = token.wakeup.waker  # type: ignore[attr-defined]
            token.wait = _TaskWait(self, verdict, waker)
            return token.wait
        if type(verdict) is bool:
            return verdict
        key, failure = verdict
        raise _failure(failure, key)

    def _task_abandon(self) -> None:
        try:
            token = _task_token(create=False)
        except RuntimeError:  # not in a task: it queued nothing
            return
        if token is not None:
            _abandon_stranded(token)

    def _task_release(self, key: Hashable, mode: int, owner: _TaskToken | None = None) -> None:
        """Give back one level of ``key`` held by ``owner``'s task: the current task's if None."""
        token = _task_token(create=False) if owner is None else owner
        key = self._table_key(key)
        run = self._release_write_on if mode == _WRITE else self._release_read_on
        verdict = self._run_on_key(run, key, token)
        if verdict is not None:
            raise _failure(verdict, key)

    def _task_release_many(self, items: list[tuple[Hashable, int]]) -> None:
        token = _task_token(create=False)
        if items:
            self._release_many(items, token)

    def _task_release_all(self) -> int:
        token = _task_token(create=False)
        return 0 if token is None else len(_section(self._release_held_section, token))

    def _task_levels(self, key: Hashable) -> tuple[int, int]:
        """The current task's write and read levels of ``key``."""
        token = _task_token(create=False)
        return self._run_on_key(
            _levels_of, self._table_key(key), token)

    # -- finding entries ---------------------------------------------------------------------

    def _find(
        self, key: Hashable, key_hash: int, plain: bool, known: tuple[_Entry, _Entry | None] | None
    ) -> _Entry | _Unsure | None:
        """In a section: the entry of ``key``, None, or the entries to compare it with
        (``known``: the outcome of that comparison, trusted if it is still current)."""
        first = self._table.get(key_hash)
        trusted = known is not None and known[0] is first
        unsure = None
        entry = first
        while entry is not None:
            stored = entry.key
            if stored is key or (plain and entry.plain and stored == key):
                return entry
            if not (plain and entry.plain):
                if trusted:
                    if entry is known[1]:  # type: ignore[index]
                        return entry
                elif unsure is None:
                    unsure = [entry]
                else:
                    unsure.append(entry)
            entry = entry.same_hash
        return None if unsure is None else _Unsure(first, unsure)  # type: ignore[arg-type]

    def _new_entry(self, key: Hashable, key_hash: int, plain: bool) -> _Entry:
        entry = _Entry(key, key_hash, plain)
        entry.same_hash = self._table.get(key_hash)
        self._table[key_hash] = entry
        return entry

    def _drop_entry(self, entry: _Entry) -> None:
        """Unlink ``entry`` from its chain, unless it is gone already (a request whose grant
        is undone may find its entry released and dropped by a handler meanwhile)."""
        table = self._table
        first = table.get(entry.hash)
        if first is entry:
            if entry.same_hash is None:
                del table[entry.hash]
                if not table:
                    table.clear()  # dicts never shrink on delete; this frees a grown one
            else:
                table[entry.hash] = entry.same_hash
        else:
            while first is not None and first.same_hash is not entry:
                first = first.same_hash
            if first is None:
                return
            first.same_hash = entry.same_hash
        _retired.append(entry)

    def _run_on_key(self, run: Callable[..., R], key: Hashable, *args: Any) -> R:
        """``run(entry, *args)`` in a section, with ``key``'s entry (or None) found for it."""
        key_hash = hash(key)
        kind = type(key)
        plain = kind is str or kind is int or kind is bytes or _is_plain(key)
        known = None
        on_key: Callable[..., R | _Unsure] = self._on_key_section
        while True:
            verdict = _section(on_key, run, key, key_hash, plain, known, args)
            if type(verdict) is not _Unsure:
                return verdict
            known = verdict.settle(key)

    def _on_key_section(
        self, run: Callable[..., R], key: Hashable, key_hash: int, plain: bool,
        known: tuple[_Entry, _Entry | None] | None, args: tuple[Any, ...],
    ) -> R | _Unsure:
        entry: _Entry | _Unsure | None = self._table.get(key_hash)
        if entry is not None and entry.key is not key:  # type: ignore[union-attr]
            entry = self._find(key, key_hash, plain, known)  # else: the common cases, at once
            if isinstance(entry, _Unsure):
                return entry
        return run(entry, key, key_hash, plain, *args)

    # -- acquiring ---------------------------------------------------------------------------

    def _acquire(self, token: _Token, seconds: float, take: Callable[..., Any],
                 *args: Any) -> bool:
        """One acquisition: ``take(*args)`` decides in a section and may queue a request,
        which ``_wait`` then waits for. An exception anywhere from the queueing on (a
        handler's, a finalizer's) takes the request out of the queues again or gives back
        what it was granted: nothing stays queued or held that the caller does not know of.
        Verdicts to raise come as ``(key, verdict)``."""
        outer = token.request  # not None: a handler or finalizer runs inside this wait
        try:
            verdict = take(*args)
            if type(verdict) is _Request:
                verdict = self._wait(verdict, seconds)
            if type(verdict) is bool:
                # The outcome is the caller's now: no check point (a call) from here to the
                # caller, where a handler's exception would leave a grant nobody knows of.
                token.request = outer
                return verdict
            token.request = outer
        except BaseException:
            # No call before the ``try`` below, so no asynchronous exception can skip it;
            # _abandon_section is idempotent, and tried again if another handler raises
            # meanwhile (a few times only, so that an engine bug cannot become a hang).
            attempts = 0
            while True:
                try:
                    _section(self._abandon_section, token, outer)
                    break
                except BaseException:
                    attempts += 1
                    if attempts == _ABANDON_ATTEMPTS:
                        raise
            raise
        key, failure = verdict
        raise _failure(failure, key)

    def _acquire_write(self, key: Hashable, seconds: float, count: int) -> bool:
        """Acquire ``count`` write levels of ``key``, waiting at most ``seconds`` (-1: forever)."""
        token = _current_token()
        return self._acquire(token, seconds, self._run_on_key, self._take_write, key, token,
                             seconds, count)

    def _take_write(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool, token: _Token,
        seconds: float, count: int,
    ) -> object:
        if entry is None:
            entry = self._new_entry(key, key_hash, plain)
            self._own(entry, token, count)
            return self._granted_at_once(entry, token, _WRITE, count)
        if entry.owner is token:
            if entry.count > MAX_COUNT - count:
                return key, _OVERFLOW
            entry.count += count
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _WRITE, count)
        upgrade = token in entry.readers
        if entry.owner is None and (
            (not entry.readers and (not entry.queue or entry.queue[0].state == _WOKEN))
            or (upgrade and len(entry.readers) == 1)
        ):
            # Free and nobody queued (with fair=False, a woken head that has not run yet
            # may be overtaken), or the caller is the only reader: an upgrade goes at once.
            self._own(entry, token, count)
            return self._granted_at_once(entry, token, _WRITE, count)
        return self._single(key, entry, token, seconds, count, _WRITE, upgrade)

    def _acquire_read(self, key: Hashable, seconds: float) -> bool:
        token = _current_token()
        return self._acquire(token, seconds, self._run_on_key, self._take_read, key, token,
                             seconds)

    def _take_read(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool, token: _Token,
        seconds: float,
    ) -> object:
        if entry is None:
            entry = self._new_entry(key, key_hash, plain)
            self._add_read(entry, token, 1)
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _READ, 1)
        level = entry.readers.get(token)
        if level is not None:  # reentrant, even past queued writers
            if level >= MAX_COUNT:
                return key, _OVERFLOW
            entry.readers[token] = level + 1
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _READ, 1)
        if entry.owner is token or (entry.owner is None and not entry.queue):
            self._add_read(entry, token, 1)
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _READ, 1)
        return self._single(key, entry, token, seconds, 1, _READ, False)

    def _granted_at_once(self, entry: _Entry, token: _Token, mode: int, count: int) -> bool:
        """On the main thread, record an immediate grant as ``token.request`` (GRANTED) for
        its acquiring call: a signal handler that raises when the call unblocks signals
        after this section makes that call give the grant back (see _section)."""
        if token.is_main and token.request is None:
            request = token.request = _Request(token, self, entry, mode, count)
            request.state = _GRANTED
        return True

    def _single(
        self, key: Hashable, entry: _Entry, token: _Token, seconds: float, count: int,
        mode: int, upgrade: bool,
    ) -> object:
        """The key is taken: give up (try-lock), refuse (nested wait, deadlock) or queue."""
        if seconds == 0:
            self._timeouts += 1
            return False
        if token.request is not None:
            return key, _NESTED
        request = _Request(token, self, entry, mode, count)
        request.at_head = upgrade
        verdict = self._queue(request)
        return verdict if verdict is request else (key, verdict)

    def _acquire_many(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        """Take every distinct ``(key, mode)`` of ``items`` at once, or none of them."""
        if not items:
            return True
        token = _current_token()
        return self._acquire(token, seconds, self._take_many, items, token, seconds)

    def _take_many(self, items: list[tuple[Hashable, int]], token: _Token,
                   seconds: float) -> object:
        hashes = [hash(key) for key, _ in items]
        plains = [_is_plain(key) for key, _ in items]
        known: list[tuple[_Entry, _Entry | None] | None] = [None] * len(items)
        while True:
            verdict = _section(self._take_many_section, items, hashes, plains, known, token,
                               seconds)
            if type(verdict) is not tuple:
                return verdict
            index, what = verdict
            if what is _NESTED or what is _OVERFLOW:  # a set is named whole, as the core does
                return tuple([key for key, _ in items]), what
            if type(what) is not _Unsure:
                return items[index][0], what
            known[index] = what.settle(items[index][0])

    def _take_many_section(
        self, items: list[tuple[Hashable, int]], hashes: list[int], plains: list[bool],
        known: list[tuple[_Entry, _Entry | None] | None], token: _Token, seconds: float,
    ) -> object:
        """A request, True, False, or ``(index of a key, what about it)``: an _Unsure or
        the verdict to raise for it."""
        entries: list[_Entry | None] = []
        for index, (key, _) in enumerate(items):
            entry = self._find(key, hashes[index], plains[index], known[index])
            if type(entry) is _Unsure:
                return index, entry
            entries.append(entry)
        blocked = None  # the first key that is not free for this set
        for index, ((_, mode), entry) in enumerate(zip(items, entries, strict=True)):
            if entry is None:
                continue
            if mode == _WRITE:
                if entry.owner is token:
                    if entry.count >= MAX_COUNT:
                        return index, _OVERFLOW
                    continue
                free = entry.owner is None and (
                    (not entry.readers and not entry.queue)
                    or (token in entry.readers and len(entry.readers) == 1))
            elif token in entry.readers:
                if entry.readers[token] >= MAX_COUNT:
                    return index, _OVERFLOW
                continue
            else:
                free = entry.owner is token or (entry.owner is None and not entry.queue)
            if not free and blocked is None:
                blocked = index
        if blocked is not None:
            if seconds == 0:
                self._timeouts += 1
                return False
            if token.request is not None:
                return blocked, _NESTED
        nodes = []
        for index, ((key, mode), entry) in enumerate(zip(items, entries, strict=True)):
            if entry is None:
                entry = self._new_entry(key, hashes[index], plains[index])
            node = _Request(token, self, entry, mode, 1)
            nodes.append(node)
            if mode == _WRITE:
                if entry.owner is token:
                    node.queued = False
                else:
                    node.at_head = token in entry.readers
            elif token in entry.readers or entry.owner is token:
                node.queued = False
        lead = nodes[0]
        lead.nodes = nodes
        for node in nodes:
            node.lead = lead
        if blocked is None:
            self._grant_nodes(lead, enqueued=False)
            self._acquisitions += len(nodes)
            if token.is_main and token.request is None:
                token.request = lead  # see _granted_at_once
            return True
        verdict = self._queue(lead)
        if verdict is not lead:
            return blocked, verdict  # the deadlock cycle
        for node in nodes:  # pin the re-entered levels: this set holds them from now on
            if not node.queued:
                self._add_levels(node)
        return lead

    def _queue(self, request: _Request) -> object:
        """Refuse ``request`` (single, or a multi-key lead) if waiting would deadlock (the
        cycle), else queue every node of it (the request)."""
        cycle = self._find_cycle(request.token, request)
        if cycle is not None:
            self._discard(request)
            self._deadlocks += 1
            return cycle
        for node in request.members():
            if node.queued:
                if node.at_head:  # no writer behind could get in before it anyway
                    node.entry.queue.appendleft(node)
                else:
                    node.entry.queue.append(node)
                _time_holds(node.entry, request.since)
        request.token.request = request
        self._waiting += 1
        return request

    def _find_cycle(self, me: _Token, request: _Request) -> list[tuple[Any, Hashable]] | None:
        """The cycle ``me`` would close by queueing ``request`` (not queued yet), or None.

        A waiting request waits for the holders it conflicts with and for the conflicting
        requests queued ahead of it (PostgreSQL's hard and soft edges), in any manager of
        this engine; see the compiled core's ``find_cycle``, which this follows step for
        step.
        """
        if type(me) is _TaskToken and not me.held and not me.reads:
            return None  # nobody can wait for a task that holds nothing (see _core)
        reached: dict[_Token, tuple[_Token, _Entry]] = {}  # thread -> who waits for it, where
        stack: list[_Token] = []

        def reach(thread: _Token, successor: _Token | None, waits_for: _Entry) -> bool:
            if successor is None or successor is thread:
                return False
            if successor is me:
                reached[me] = (thread, waits_for)
                return True
            if successor not in reached:
                reached[successor] = (thread, waits_for)
                stack.append(successor)
            return False

        def reach_waited_for(
            thread: _Token, waits_for: _Entry, mode: int, own: _Request | None, at_head: bool
        ) -> bool:
            successors = [waits_for.owner]
            if mode == _WRITE:
                successors += reversed(waits_for.readers)  # newest first, as in _core
            if not at_head:
                for ahead in waits_for.queue:
                    if ahead is own:
                        break
                    if mode == _WRITE or ahead.mode == _WRITE:
                        successors.append(ahead.token)
            return any(reach(thread, successor, waits_for) for successor in successors)

        def reach_request(thread: _Token, request: _Request, enqueued: bool) -> bool:
            return any(
                reach_waited_for(thread, node.entry, node.mode, node if enqueued else None,
                                 node.at_head)
                for node in request.members() if node.queued
            )

        closed = reach_request(me, request, False)
        while not closed and stack:
            thread = stack.pop()
            own = thread.request
            if own is not None and own.state in (_WAITING, _WOKEN):
                closed = reach_request(thread, own, True)
            if not closed and type(thread) is _TaskToken:
                # A task runs only when its loop's thread does: if that thread waits, so
                # does the task (the thread's wait is followed if it is one).
                closed = reach(thread, _thread_tokens.get(thread.loop_ident), _LOOP_THREAD)
        if not closed:
            return None
        cycle = []
        thread = me
        while True:  # walk back: whoever reached ``thread`` waits for it in ``via``
            waiter, via = reached[thread]
            cycle.append((waiter.ident, via.key))
            thread = waiter
            if thread is me:
                break
        cycle.reverse()
        return cycle

    # -- waiting (the only place that sleeps, and the only call that may raise midway) ------

    def _wait(self, request: _Request, seconds: float) -> bool:
        """Sleep until ``request`` (queued) is granted or its time runs out. The request
        stays ``token.request`` until the acquiring call has its outcome (see _acquired)."""
        deadline = None if seconds < 0 else request.since + seconds
        log_at = None if self._log_after < 0 else request.since + self._log_after
        logged = False
        wakeup = request.token.wakeup
        while True:
            outcome = _section(self._check_wait_section, request, deadline)
            if outcome is not None:
                # An exception from here on gives the key back (_acquire).
                if outcome:
                    self._observe_wait(request)
                if logged:
                    self._log_wait_end(request, outcome)
                if outcome:
                    _section(self._complete_section, request)
                return outcome
            # In slices, on every thread: on the main thread a slice bounds how late a
            # signal's handler runs; everywhere it bounds how late the waiter sees that its
            # request became grantable without a post (code that ran inside its own wait
            # took the key, or a forked child, where nobody passes the key on).
            now = time.monotonic()
            remaining = _WAIT_SLICE
            if deadline is not None:
                remaining = min(max(0.0, deadline - now), _WAIT_SLICE)
            if log_at is not None and not logged:
                if now >= log_at:
                    logged = True
                    self._log_slow_wait(request)
                else:
                    remaining = min(remaining, log_at - now)
            # Signal handlers (main thread) and finalizers run around this sleep and may
            # call the manager, or raise (the acquiring call then abandons the request).
            wakeup.acquire(timeout=remaining)

    def _check_wait_section(self, request: _Request, deadline: float | None) -> bool | None:
        """After a wake-up: True (granted), False (timed out) or None (sleep again)."""
        token = request.token
        if request.state != _WAITING:
            token.consume_post()
            if request.state == _WOKEN:  # single requests only
                if self._grantable(request.entry, request):
                    self._grant(request.entry, request)
                else:
                    request.state = _WAITING  # overtaken: sleep again at the head
        elif self._ready_by_itself(request):
            # A handler or finalizer of this thread took what the request waits for, or
            # (a forked child) nobody passed on a key the request may now take. Such a
            # grant owes no post.
            if request.nodes is None:
                self._grant(request.entry, request)
            else:
                self._grant_nodes(request, enqueued=True)
                self._waiting -= 1
                self._acquisitions += len(request.nodes)
                for node in request.nodes:
                    self._pass_on(node.entry)
        if request.state == _GRANTED:  # counted once the waiter keeps it (_complete_section)
            request.ended = time.monotonic()
            return True
        if deadline is not None and time.monotonic() >= deadline:
            request.ended = time.monotonic()
            self._record_wait(request, False)
            self._leave(request)
            self._timeouts += 1
            return False
        return None

    def _complete_section(self, request: _Request) -> None:
        """A granted wait returns: only now is it counted (as in the core, a grant given
        back because of an exception in between is not)."""
        self._contended += 1
        self._record_wait(request, True)

    def _abandon_section(self, token: _Token, outer: _Request | None) -> None:
        """An exception ends an acquisition: if it had queued a request, take it out of the
        queues, or give back what it was granted, as far as its thread still holds that."""
        request = token.request
        if request is None or request is outer:
            return  # it never queued, or this ran already
        token.request = None
        if request.state == _LEFT:
            return  # it timed out
        if request.state != _WAITING:
            token.consume_post()
        if request.state != _GRANTED:  # (else it was measured when its waiter saw the grant)
            request.ended = time.monotonic()
        self._record_wait(request, False)  # waited for all the same
        if request.state == _GRANTED:
            self._undo_grant(request)
        else:
            self._leave(request)

    def _ready_by_itself(self, request: _Request) -> bool:
        """Whether a WAITING ``request`` can be granted now by its own waiter: every queued
        node re-enters a key its thread took meanwhile, or is at the head of its queue and
        compatible (only in a forked child, where nobody passed the key on, or because
        something ran inside the wait)."""
        if request.nodes is not None:
            return self._group_grantable(request)
        entry = request.entry
        return self._grantable(entry, request) and (
            entry.owner is request.token or entry.queue[0] is request)

    def _leave(self, request: _Request) -> None:
        """Take a waiting ``request`` (single, or a multi-key lead) out of every queue, give
        back the levels it pinned."""
        for node in request.members():
            if node.queued:
                node.entry.queue.remove(node)
            else:
                self._give_back(node)
        self._waiting -= 1
        request.state = _LEFT
        self._discard(request)

    def _discard(self, request: _Request) -> None:
        """Let the entries of a request that was never granted move on (entries it created
        and nobody uses go)."""
        for node in request.members():
            self._pass_on(node.entry)

    def _undo_grant(self, request: _Request) -> None:
        """Give back what a granted request (single, or multi-key lead) took, as far as its
        thread still holds it (a handler may have released some already)."""
        for node in request.members():
            self._acquisitions -= 1
            self._give_back(node)
        request.state = _LEFT
        for node in request.members():
            self._pass_on(node.entry)

    def _give_back(self, node: _Request) -> None:
        """Remove the levels ``node`` took, or what is left of them."""
        entry, token = node.entry, node.token
        if node.mode == _WRITE:
            if entry.owner is token:
                if entry.count > node.count:
                    entry.count -= node.count
                else:
                    self._disown(entry)
        else:
            level = entry.readers.get(token, 0)
            if level > node.count:
                entry.readers[token] = level - node.count
            elif level:
                self._drop_read(entry, token)

    # -- releasing ---------------------------------------------------------------------------

    def _release_write(self, key: Hashable) -> None:
        verdict = self._run_on_key(self._release_write_on, key, _existing_token())
        if verdict is not None:
            raise _failure(verdict, key)

    def _release_write_on(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool,
        token: _Token | None,
    ) -> str | None:
        if entry is None or token is None or entry.owner is not token:
            return _NOT_OWNED
        if token.request is not None and entry.count <= self._pinned(token, entry, _WRITE):
            return _PINNED
        entry.count -= 1
        if entry.count == 0:
            self._disown(entry)
            self._pass_on(entry)
        return None

    def _release_read(self, key: Hashable) -> None:
        verdict = self._run_on_key(self._release_read_on, key, _existing_token())
        if verdict is not None:
            raise _failure(verdict, key)

    def _release_read_on(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool,
        token: _Token | None,
    ) -> str | None:
        if entry is None or token is None or token not in entry.readers:
            return _NOT_OWNED
        level = entry.readers[token]
        if token.request is not None and level <= self._pinned(token, entry, _READ):
            return _PINNED
        if level > 1:
            entry.readers[token] = level - 1
        else:
            self._drop_read(entry, token)
            self._pass_on(entry)
        return None

    def _release_many(self, items: list[tuple[Hashable, int]],
                      token: _Token | None | bool = False) -> None:
        """Undo one ``_acquire_many`` of ``items``: all of them, or (if one is not held as
        asked) none, with NotOwnedError. ``token``: the owner (default: this thread)."""
        if token is False:
            token = _existing_token()
        hashes = [hash(key) for key, _ in items]
        plains = [_is_plain(key) for key, _ in items]
        known: list[tuple[_Entry, _Entry | None] | None] = [None] * len(items)
        while True:
            verdict = _section(self._release_many_section, items, hashes, plains, known, token)
            if verdict is None:
                return
            index, what = verdict
            if type(what) is not _Unsure:
                raise _failure(what, items[index][0])
            known[index] = what.settle(items[index][0])

    def _release_many_section(
        self, items: list[tuple[Hashable, int]], hashes: list[int], plains: list[bool],
        known: list[tuple[_Entry, _Entry | None] | None], token: _Token | None,
    ) -> tuple[int, object] | None:
        entries = []
        for index, (key, mode) in enumerate(items):
            entry = self._find(key, hashes[index], plains[index], known[index])
            if isinstance(entry, _Unsure):
                return index, entry
            if entry is None or token is None or (
                entry.owner is not token if mode == _WRITE else token not in entry.readers
            ):
                return index, _NOT_OWNED
            level = entry.count if mode == _WRITE else entry.readers[token]
            if level <= self._pinned(token, entry, mode):
                return index, _PINNED
            entries.append(entry)
        for (_, mode), entry in zip(items, entries, strict=True):
            assert token is not None
            if mode == _WRITE:
                entry.count -= 1
                if entry.count == 0:
                    self._disown(entry)
            else:
                entry.readers[token] -= 1
                if entry.readers[token] == 0:
                    self._drop_read(entry, token)
            self._pass_on(entry)
        return None

    def _release_held_section(self, token: _Token) -> list[Hashable]:
        """Release every level of this manager's keys ``token`` holds, except pinned ones;
        returns the keys it stopped holding (for a thread that ended: the abandoned keys)."""
        released = []
        entries = [entry for entry, manager in token.reads.items() if manager is self._ref]
        entries += [entry for entry, manager in token.held.items()
                    if manager is self._ref and token not in entry.readers]
        for entry in entries:  # reads first: see _core
            keep_read = self._pinned(token, entry, _READ)
            keep_write = self._pinned(token, entry, _WRITE)
            if token in entry.readers:
                if keep_read:
                    entry.readers[token] = keep_read
                else:
                    self._drop_read(entry, token)
            if entry.owner is token:
                if keep_write:
                    entry.count = keep_write
                else:
                    self._disown(entry)
            if not (keep_read or keep_write):
                released.append(entry.key)
            self._pass_on(entry)
        return released

    def _pinned(self, token: _Token, entry: _Entry, mode: int) -> int:
        """The levels of ``entry`` in ``mode`` that a waiting set of ``token`` has pinned."""
        request = token.request
        if request is None or request.nodes is None or request.state != _WAITING:
            return 0
        for node in request.nodes:
            if node.entry is entry and not node.queued and node.mode == mode:
                return node.count
        return 0

    def _pass_on(self, entry: _Entry) -> None:
        """A holder or a request left ``entry``: grant what the queue's head allows (a run
        of readers together, or one writer), or drop the entry if nothing is left."""
        while True:
            if not entry.queue:
                if entry.owner is None and not entry.readers:
                    self._drop_entry(entry)
                return
            head = entry.queue[0]
            if head.lead is not None:  # a multi-key request: all of its keys or none
                if head.lead.state != _WAITING or not self._group_grantable(head.lead):
                    return
                self._grant_group(head.lead, entry)
                if head.mode == _WRITE:
                    return
                continue
            if not self._grantable(entry, head):
                return
            was = head.state
            if head.mode == _READ or self._fair or time.monotonic() - head.since >= HANDOFF_AFTER:
                # Also when already WOKEN: a woken thread may wait long for the GIL while
                # others keep taking the key; granting it is what bounds its wait.
                self._grant(entry, head)
            elif was == _WAITING:
                head.state = _WOKEN
            if was == _WAITING:  # a WOKEN head has its post already
                head.token.wakeup.release()
            if head.mode == _WRITE:
                return

    def _grantable(self, entry: _Entry, request: _Request) -> bool:
        owner = entry.owner
        if owner is not None:
            return owner is request.token  # its thread took the key meanwhile: re-entry
        readers = entry.readers
        return request.mode == _READ or not readers or (
            len(readers) == 1 and request.token in readers)

    def _grant(self, entry: _Entry, request: _Request) -> None:
        entry.queue.remove(request)
        self._take(entry, request)
        _time_grant(entry, request)
        self._acquisitions += 1
        self._waiting -= 1
        request.state = _GRANTED

    def _take(self, entry: _Entry, request: _Request) -> None:
        """Install a queued request's levels (on top of its thread's own, for a re-entry)."""
        token = request.token
        if request.mode == _READ:
            if token in entry.readers:
                entry.readers[token] += request.count
            else:
                self._add_read(entry, token, request.count)
        elif entry.owner is token:
            entry.count += request.count
        else:
            self._own_levels(entry, token, request.count)

    def _group_grantable(self, lead: _Request) -> bool:
        """Every queued node of a multi-key request is at the head of its queue and
        compatible (or its thread holds that key for writing itself)."""
        return all(
            node.entry.owner is node.token
            or (node.entry.queue[0] is node and self._grantable(node.entry, node))
            for node in lead.members() if node.queued
        )

    def _grant_nodes(self, lead: _Request, enqueued: bool) -> None:
        """Give a multi-key request every key at once: queued nodes take their entries; the
        others re-enter keys the caller holds (their levels were pinned when it queued)."""
        for node in lead.members():
            if node.queued:
                if enqueued:
                    node.entry.queue.remove(node)
                self._take(node.entry, node)
                if enqueued:
                    _time_grant(node.entry, node)
            elif not enqueued:
                self._add_levels(node)
        lead.state = _GRANTED

    def _add_levels(self, node: _Request) -> None:
        """Re-enter a key the caller holds (checked against MAX_COUNT before)."""
        entry, token = node.entry, node.token
        if node.mode == _WRITE:
            entry.count += 1
        elif token not in entry.readers:  # reading a key it writes
            self._add_read(entry, token, 1)
        else:
            entry.readers[token] += 1

    def _grant_group(self, lead: _Request, passing: _Entry) -> None:
        """_pass_on found ``lead`` grantable at the head of ``passing``."""
        self._grant_nodes(lead, enqueued=True)
        self._acquisitions += len(lead.members())
        self._waiting -= 1
        lead.token.wakeup.release()
        for node in lead.members():  # readers queued behind its read nodes may follow it in
            if node.queued and node.entry is not passing and node.mode == _READ:
                self._pass_on(node.entry)  # never drops the entry: it has a holder now

    # -- holders -----------------------------------------------------------------------------

    def _own(self, entry: _Entry, token: _Token, count: int) -> None:
        """An immediate write acquisition."""
        if entry.queue:  # past a queue (an upgrade, a barge with fair=False): timed
            entry.since = time.monotonic()
        if not entry.readers:
            self._held += 1
        entry.owner = token
        entry.count = count
        token.held[entry] = self._ref
        self._acquisitions += 1

    def _own_levels(self, entry: _Entry, token: _Token, count: int) -> None:
        if entry.queue:
            entry.since = time.monotonic()
        if not entry.readers:
            self._held += 1
        entry.owner = token
        entry.count = count
        token.held[entry] = self._ref

    # In these two, the call that frees a grown dict comes last: a signal handler raising at
    # the check point after it (see "Asynchronous exceptions") finds the hold fully undone.

    def _disown(self, entry: _Entry) -> None:
        owner = entry.owner
        assert owner is not None
        del owner.held[entry]
        since, entry.since = entry.since, 0.0
        entry.owner = None
        entry.count = 0
        if not entry.readers:
            self._held -= 1
        self._count_hold(since, entry)
        if not owner.held:
            owner.held.clear()  # dicts never shrink on delete; this frees a grown one

    def _add_read(self, entry: _Entry, token: _Token, count: int) -> None:
        """A new read hold; the caller counts the acquisition."""
        if entry.owner is None and not entry.readers:
            self._held += 1
        entry.readers[token] = count
        token.reads[entry] = self._ref
        if entry.queue:  # past a queue (a writer's re-entry, a downgrade): timed
            if entry.read_since is None:
                entry.read_since = {}
            entry.read_since[token] = time.monotonic()

    def _drop_read(self, entry: _Entry, token: _Token) -> None:
        del entry.readers[token]
        del token.reads[entry]
        if entry.owner is None and not entry.readers:
            self._held -= 1
        if entry.read_since is not None:
            self._count_hold(entry.read_since.pop(token, 0.0), entry)
        if not token.reads:
            token.reads.clear()  # dicts never shrink on delete; this frees a grown one

    def _keep_only(self, survivor: _Token | None) -> None:
        """In a forked child (see _after_fork_in_child): only ``survivor`` lives on."""
        entries = []
        for first in list(self._table.values()):
            entry: _Entry | None = first
            while entry is not None:
                entries.append(entry)
                entry = entry.same_hash
        self._waiting = 0
        for entry in entries:
            for request in entry.queue:
                if request.token is not survivor:
                    request.token.request = None
                    (request.lead or request).state = _LEFT  # a task's wait sees it ended
            entry.queue = deque(request for request in entry.queue if request.token is survivor)
            if entry.owner is not None and entry.owner is not survivor:
                self._disown(entry)
            for reader in [reader for reader in entry.readers if reader is not survivor]:
                self._drop_read(entry, reader)
        kept = None if survivor is None else survivor.request
        if kept is not None and kept.manager is self and kept.state in (_WAITING, _WOKEN):
            self._waiting = 1
        for entry in entries:
            # Nothing is passed on here: the kept request (the only one left) takes what
            # became free itself when it wakes next (_ready_by_itself), as in the core.
            if entry.owner is None and not entry.readers and not entry.queue:
                self._drop_entry(entry)


# Questions about one entry (or None), asked inside a section by ``_Engine._run_on_key``.

def _levels_of(entry: _Entry | None, key: object, key_hash: int, plain: bool,
               token: _Token | None) -> tuple[int, int]:
    if entry is None or token is None:
        return 0, 0
    return entry.count if entry.owner is token else 0, entry.readers.get(token, 0)


def _written(entry: _Entry | None, *_: object) -> bool:
    return entry is not None and entry.owner is not None


def _has_holder(entry: _Entry | None, *_: object) -> bool:
    return entry is not None and (entry.owner is not None or bool(entry.readers))


def _written_by(entry: _Entry | None, key: object, key_hash: int, plain: bool,
                token: _Token | None) -> bool:
    return entry is not None and token is not None and entry.owner is token


def _write_level(entry: _Entry | None, key: object, key_hash: int, plain: bool,
                 token: _Token | None) -> int:
    return entry.count if entry is not None and token is not None and entry.owner is token else 0


def _read_level(entry: _Entry | None, key: object, key_hash: int, plain: bool,
                token: _Token | None) -> int:
    return 0 if entry is None or token is None else entry.readers.get(token, 0)


def _reader_count(entry: _Entry | None, *_: object) -> int:
    return 0 if entry is None else len(entry.readers)


def _owner_and_count(entry: _Entry | None, *_: object) -> tuple[int | None, int]:
    if entry is None or entry.owner is None:
        return None, 0
    return entry.owner.ident, entry.count


@final
class LockManager(_Engine, Generic[K]):
    """Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

    Memory grows only with the keys currently held or waited on.
    """

    __slots__ = ()

    def __init__(self, *, fair: bool = True, stripes: int | None = None,
                 log_waits_after: float | None = None) -> None:
        super().__init__(stripes, log_waits_after)
        self._fair = bool(fair)

    @property
    def fair(self) -> bool:
        """True for strict FIFO hand-off, False for eventual fairness (see docs/semantics.md)."""
        return self._fair

    @property
    def aio(self) -> AsyncLockManager[K]:
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncLockManager(self)

    def acquire(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Lock ``key`` for the calling thread, like ``threading.RLock.acquire``.

        Returns True once held (reentrant: a holder always succeeds at once), False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first.
        """
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_write(self._table_key(key), seconds, 1)

    def release(self, key: K) -> None:
        """Undo one ``acquire`` of ``key``; raises NotOwnedError if the caller does not hold it."""
        self._release_write(self._table_key(key))

    def hold(self, key: K, timeout: float | None = None) -> KeyLock[K]:
        """A context manager holding ``key`` for its block.

        ``timeout``: None or -1 waits forever, 0 tries once; LockTimeout if not acquired.
        """
        seconds = hold_seconds(timeout)
        view = KeyLock(self, key)
        view._seconds = seconds
        return view

    def _task_key_lock(self, key: K) -> AsyncKeyLock[K]:
        """``aio[key]`` (the engine's task operations are in ``_Engine``)."""
        hash(key)  # an unhashable key fails here, as it does in the core
        return AsyncKeyLock(self, key)

    def __getitem__(self, key: K) -> KeyLock[K]:
        """The per-key lock view: behaves like a ``threading.RLock`` for this one key."""
        return KeyLock(self, key)

    def synchronized(
        self, key_func: Callable[..., K]
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs.

        The decorated function keeps its signature for type checkers.
        """
        return synchronized(self, key_func)

    def acquire_many(self, keys: Iterable[K], blocking: bool = True, timeout: float = -1) -> bool:
        """Lock every key of ``keys`` at once, or none: True, or False on timeout.

        Duplicates count once; keys the caller holds are re-entered. The request queues
        FIFO on every key it needs and keeps its place there, so it cannot starve, and it
        never deadlocks against other multi-key calls, whatever the order of the keys.
        """
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(many_items(keys, self._table_key), seconds)

    def release_many(self, keys: Iterable[K]) -> None:
        """Undo one ``acquire_many(keys)``; NotOwnedError (nothing released) if one is not held."""
        self._release_many(many_items(keys, self._table_key))

    def hold_many(self, keys: Iterable[K], timeout: float | None = None) -> _HoldingMany:
        """A context manager holding every key of ``keys`` for its block (LockTimeout)."""
        return _HoldingMany(self, many_items(keys, self._table_key), hold_seconds(timeout))

    def locked(self, key: K) -> bool:
        """Whether any thread holds ``key``."""
        return self._run_on_key(_written, self._table_key(key))

    def owned(self, key: K) -> bool:
        """Whether the calling thread holds ``key``."""
        return self._run_on_key(
            _written_by, self._table_key(key), _existing_token())

    def owner(self, key: K) -> int | None:
        """The ``threading.get_ident()`` of the thread holding ``key``, or None."""
        return self._owner_and_count(key)[0]

    def recursion_count(self, key: K) -> int:
        """How many times the calling thread holds ``key`` (0 if it does not)."""
        return self._run_on_key(
            _write_level, self._table_key(key), _existing_token())

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is currently held (by any thread)."""
        return self._run_on_key(_written, self._table_key(key))

    def _owner_and_count(self, key: K) -> tuple[int | None, int]:
        return self._run_on_key(
            _owner_and_count, self._table_key(key))

    def _release_save(self, key: K) -> tuple[int, int]:
        verdict = self._run_on_key(self._release_save_on, self._table_key(key), _existing_token())
        if type(verdict) is not tuple:
            raise _failure(verdict, key)
        return verdict

    def _release_save_on(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool,
        token: _Token | None,
    ) -> object:
        if entry is None or token is None or entry.owner is not token:
            return _NOT_OWNED
        if self._pinned(token, entry, _WRITE):
            return _PINNED
        saved = (entry.count, token.ident)
        self._disown(entry)
        self._pass_on(entry)
        return saved

    def _acquire_restore(self, key: K, state: tuple[int, int]) -> None:
        self._acquire_write(self._table_key(key), -1.0, restored_count(state))


@final
class RWLockManager(_Engine, Generic[K]):
    """Per-key reader/writer locks: many readers or one writer, reentrant, FIFO without
    writer starvation, upgrades and downgrades within a thread."""

    __slots__ = ()

    def __init__(self, *, stripes: int | None = None, log_waits_after: float | None = None) -> None:
        super().__init__(stripes, log_waits_after)

    @property
    def aio(self) -> AsyncRWLockManager[K]:
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncRWLockManager(self)

    def acquire_read(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Take ``key`` for reading; the same arguments and result as ``LockManager.acquire``."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_read(self._table_key(key), seconds)

    def acquire_write(self, key: K, blocking: bool = True, timeout: float = -1) -> bool:
        """Take ``key`` for writing (an upgrade if the caller reads it)."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_write(self._table_key(key), seconds, 1)

    def release_read(self, key: K) -> None:
        """Undo one ``acquire_read``; NotOwnedError if the caller does not read ``key``."""
        self._release_read(self._table_key(key))

    def release_write(self, key: K) -> None:
        """Undo one ``acquire_write``; NotOwnedError if the caller does not write ``key``."""
        self._release_write(self._table_key(key))

    def read(self, key: K, timeout: float | None = None) -> _Holding:
        """A context manager reading ``key`` for its block (LockTimeout if not acquired)."""
        seconds = hold_seconds(timeout)
        return _Holding(self, self._table_key(key), seconds, _READ)

    def write(self, key: K, timeout: float | None = None) -> _Holding:
        """A context manager writing ``key`` for its block (LockTimeout if not acquired)."""
        seconds = hold_seconds(timeout)
        return _Holding(self, self._table_key(key), seconds, _WRITE)

    def acquire_many(
        self, reads: Iterable[K] = (), writes: Iterable[K] = (), blocking: bool = True,
        timeout: float = -1,
    ) -> bool:
        """Read every key of ``reads`` and write every key of ``writes`` at once, or none
        (a key in both is written); see ``LockManager.acquire_many``."""
        seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(rw_items(reads, writes, self._table_key), seconds)

    def release_many(self, reads: Iterable[K] = (), writes: Iterable[K] = ()) -> None:
        """Undo one ``acquire_many`` with the same arguments."""
        self._release_many(rw_items(reads, writes, self._table_key))

    def hold_many(
        self, reads: Iterable[K] = (), writes: Iterable[K] = (), timeout: float | None = None
    ) -> _HoldingMany:
        """A context manager holding ``reads`` and ``writes`` for its block (LockTimeout)."""
        return _HoldingMany(self, rw_items(reads, writes, self._table_key), hold_seconds(timeout))

    def readers(self, key: K) -> int:
        """How many threads hold ``key`` for reading."""
        return self._run_on_key(_reader_count, self._table_key(key))

    def write_locked(self, key: K) -> bool:
        """Whether a thread holds ``key`` for writing."""
        return self._run_on_key(_written, self._table_key(key))

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has any holder."""
        return self._run_on_key(_has_holder, self._table_key(key))

    def _read_count(self, key: K) -> int:
        """How many times the calling thread reads ``key``."""
        return self._run_on_key(
            _read_level, self._table_key(key), _existing_token())


@final
class _Holding:
    """What ``RWLockManager.read()`` and ``write()`` return: holds the key for a block."""

    __slots__ = ("_key", "_manager", "_mode", "_seconds")

    def __init__(self, manager: _Engine, key: Hashable, seconds: float, mode: int) -> None:
        self._manager = manager
        self._key = key
        self._seconds = seconds
        self._mode = mode

    def __enter__(self) -> bool:
        if self._mode == _READ:
            acquired = self._manager._acquire_read(self._key, self._seconds)
        else:
            acquired = self._manager._acquire_write(self._key, self._seconds, 1)
        if not acquired:
            raise timed_out(self._key, self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        if self._mode == _READ:
            self._manager._release_read(self._key)
        else:
            self._manager._release_write(self._key)


@final
class _HoldingMany:
    """What ``hold_many()`` returns: holds a set of keys for a block."""

    __slots__ = ("_items", "_manager", "_seconds")

    def __init__(self, manager: _Engine, items: list[tuple[Hashable, int]], seconds: float) -> None:
        self._manager = manager
        self._items = items
        self._seconds = seconds

    def __enter__(self) -> bool:
        if not self._manager._acquire_many(self._items, self._seconds):
            raise timed_out(tuple(key for key, _ in self._items), self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        self._manager._release_many(self._items)


@final
class KeyLock(Generic[K]):
    """One key of a manager seen as a ``threading.RLock``.

    Views are cheap and not cached: two views of one key of one manager are the same lock
    (and compare equal). A view keeps its manager alive; the manager does not keep views.
    """

    __slots__ = ("_key", "_lock_key", "_manager", "_seconds", "__weakref__")

    def __init__(self, manager: LockManager[K], key: K) -> None:
        self._lock_key = manager._table_key(key)  # the table's key: ``key``, or its stripe
        self._manager = manager
        self._key = key
        self._seconds = -1.0  # how long ``with`` waits: -1 forever (hold() sets it)

    @property
    def key(self) -> K:
        return self._key

    @property
    def manager(self) -> LockManager[K]:
        return self._manager

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._manager._acquire_write(self._lock_key, wait_seconds(blocking, timeout), 1)

    def release(self) -> None:
        self._manager._release_write(self._lock_key)

    def locked(self) -> bool:
        return self._manager.locked(self._key)

    def __enter__(self) -> bool:
        if not self._manager._acquire_write(self._lock_key, self._seconds, 1):
            raise timed_out(self._key, self._seconds)
        return True

    def __exit__(self, *exc_info: object) -> None:
        self._manager._release_write(self._lock_key)

    def _is_owned(self) -> bool:
        return self._manager.owned(self._key)

    def _release_save(self) -> tuple[int, int]:
        return self._manager._release_save(self._key)

    def _acquire_restore(self, state: tuple[int, int]) -> None:
        self._manager._acquire_restore(self._key, state)

    def _recursion_count(self) -> int:
        return self._manager.recursion_count(self._key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyLock):
            return NotImplemented
        return self._manager is other._manager and bool(self._key == other._key)

    def __hash__(self) -> int:
        return hash((id(self._manager), self._key))

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_ERROR)

    def __repr__(self) -> str:
        owner, count = self._manager._owner_and_count(self._key)
        return key_lock_repr(self, self._key, owner, count)


def _before_fork() -> None:
    """Hold the engine mutex across fork(), so the child sees whole tables."""
    ident = _get_ident()
    while _mutex.setdefault(0, ident) != ident:
        _yield_gil(0)


def _after_fork_in_parent() -> None:
    ident = _get_ident()
    if 0 in _mutex and _mutex[0] == ident:
        del _mutex[0]


def _after_fork_in_child() -> None:
    """The child holds only what the forking thread held (and keeps its request, if it forked
    from inside a wait); the rest is free, the other queued requests are gone."""
    global _fork_parent_pid
    _mutex.clear()
    _fork_parent_pid = os.getpid()
    _main_thread[0] = _get_ident()  # the forking thread is the child's main thread
    survivor = _existing_token()
    if survivor is not None:
        survivor.is_main = True
    for manager in list(_managers):
        _section(manager._keep_only, survivor)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
