"""The pure twin's asyncio tasks as owners (the compiled core's ``_c/tasks.pxi``; lockmgr._aio
states the protocol): task tokens, ``async with`` block records, a task's queued wait.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Hashable
from typing import TYPE_CHECKING, Any

from .._aio import _AsyncHolding, _AsyncHoldingMany, _wait_for_grant
from .._args import wait_seconds
from .._errors import block_in_use, not_entered, timed_out
from .._owners import CONTEXT_TASK, Waker, current_task_or_raise, running_loop
from ._state import (
    _GRANTED,
    _LEFT,
    _NOT_OWNED,
    _READ,
    _WRITE,
    _Request,
    _TaskToken,
    _failure,
    _get_ident,
    _section,
)
from ._runtime import _EXIT_ROUNDS, _release_abandoned
from ._table import _levels_of
from ._operations import _Operations

if TYPE_CHECKING:
    from .._contract import AsyncBlock, BlockRecord, Engine


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
    raise TypeError(f"Argument 'record' has incorrect type (expected "
                    f"{_BlockRecord.__module__}._BlockRecord, got {type(record).__name__})")


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
        CONTEXT_TASK.set(task)  # runs in the task's context: what it runs in a thread sees it
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


class _LoopStandIn:
    """What a done future is made with: asyncio's Future asks its loop only whether it runs
    in debug mode when it is made, and a done future never asks again."""

    def get_debug(self) -> bool:
        return False


def _ready(value: Any) -> Awaitable[Any]:
    """An awaitable whose outcome, ``value`` (True, False or None), is known already, made at
    its first use (lockmgr imports asyncio only for code that runs a loop). Its ``__await__``
    is a done asyncio Future's (a C iterator, with asyncio's C module): awaiting it runs no
    Python frame, so no signal handler's exception can come between an acquisition granted
    at once and its caller (the compiled core's ready objects are C too). It is no future
    itself, so asyncio wraps it as any awaitable (``ensure_future``, ``gather``)."""
    ready = _READIES.get(value)
    if ready is None:
        import asyncio

        done: asyncio.Future[Any] = asyncio.Future(loop=_LoopStandIn())  # type: ignore[arg-type]
        done.set_result(value)
        kind = type("_Ready", (), {
            "__slots__": (),
            "__doc__": "An awaitable whose outcome is known already: awaiting it returns it.",
            "__await__": staticmethod(done.__await__),
        })
        ready = _READIES[value] = kind()
    return ready


_READIES: dict[Any, Awaitable[Any]] = {}


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


def _named(coroutine: Coroutine[Any, Any, bool], name: str) -> Coroutine[Any, Any, bool]:
    """``coroutine`` named as the view's method users called (as the compiled core's are:
    a warning that it was never awaited says so)."""
    coroutine.__qualname__ = name  # type: ignore[attr-defined]
    return coroutine


async def _acquiring(manager: _Tasks, give_back: Callable[[], object],
                     enter: Callable[..., Awaitable[bool]], *args: Any) -> bool:
    """The coroutine of an ``acquire``: ``enter(*args)``, then its wait if it queued. An
    exception anywhere (a signal handler's, at a check point) gives back what the call took:
    a grant made at once (once ``enter`` returned, ``give_back()``; before, the token's
    request says so: ``_task_abandon``), or the wait it queued."""
    got: object = None
    try:
        got = enter(*args)
        return await got
    except BaseException:
        if got is _ready(True):
            give_back()
        else:
            manager._task_abandon()
        raise


def _give_back(got: object, release: Callable[[], object]) -> None:
    """An exception ended an acquisition after it took ``got``: what was taken at once goes
    back (``release()``), a queued wait leaves the queues."""
    if got is True:
        release()
    elif type(got) is _TaskWait:
        got.abandon()


def _nothing() -> None:
    pass


def _releases_here(token: _TaskToken, engine: _Tasks, key: Any, mode: int) -> bool:
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
        return _ready(True)
    if got is False:
        if raises_timeout:
            raise timed_out(keys, seconds)
        return _ready(False)
    assert type(got) is _TaskWait
    got.deadline = time.monotonic() + seconds if seconds > 0 else -1.0
    got.raises_timeout, got.keys, got.seconds = raises_timeout, keys, seconds
    return got


class _TaskWait:
    """A task's queued request (see lockmgr._aio for the protocol)."""

    __slots__ = ("awaited", "completed", "deadline", "entered", "entering", "keys", "log_at",
                 "manager", "raises_timeout", "request", "seconds", "taken", "waker")

    def __init__(self, manager: _Operations, request: _Request, waker: Waker) -> None:
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
        token = self.request.token
        assert type(token) is _TaskToken
        if token.wait is not self:
            # Ended already (its loop closed, say, and the coroutine awaiting it is closed
            # only now, maybe by the collector inside a section): the token's request, if
            # any, is another acquisition's, which this must leave alone.
            return
        _section(self.manager._abandon_section, token, None)
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


class _Tasks(_Operations):
    """Asyncio tasks as owners (over ``_Operations``)."""

    __slots__ = ()

    # -- asyncio tasks as owners (lockmgr._aio states the protocol) ----------------------------

    def _task_enter(self, key: Hashable, mode: int, seconds: float, raises_timeout: bool,
                    record: BlockRecord | None = None) -> Awaitable[bool]:
        entering = None if record is None else _own_record(record)
        token = _running_task_token()
        got = self._task_take(token, key, mode, seconds == 0, 1)
        # From here ``got`` says what was taken (no call before the ``try``): the token's
        # record of a grant made at once, there for an exception that ended _task_take as
        # its section ended (_task_abandon), goes.
        request = token.request
        if request is not None and request.state == _GRANTED and token.wait is None:
            token.request = None
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
            return _ready(True)
        token = _running_task_token()
        got = self._task_take_many(items, seconds == 0)
        request = token.request  # as in _task_enter
        if request is not None and request.state == _GRANTED and token.wait is None:
            token.request = None
        try:
            keys = tuple(key for key, _ in items) if raises_timeout else None
            return _answer(got, keys, seconds, raises_timeout, entering, token)
        except BaseException:
            _give_back(got, lambda: self._release_many(items, token))
            raise

    def _task_acquire(self, key: Hashable, blocking: bool = True,
                      timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """``aio.acquire`` (and ``rw.aio.acquire_write``), bound by the view as its own: lock
        ``key`` for the current task (see ``AsyncLockManager``).

        Raises, with nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``
        (as ``threading.Lock.acquire``; OverflowError past ``threading.TIMEOUT_MAX``),
        TypeError for an unhashable key, DeadlockError if waiting would close a cycle of
        tasks and threads, RuntimeError outside a running asyncio task."""
        view = "AsyncRWLockManager" if hasattr(self, "acquire_read") else "AsyncLockManager"
        return _named(self._acquiring_one(key, _WRITE, blocking, timeout),
                      f"{view}.acquire_write" if view == "AsyncRWLockManager"
                      else f"{view}.acquire")

    def _task_acquire_read(self, key: Hashable, blocking: bool = True,
                           timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """``rw.aio.acquire_read``, bound by the view as its own: ``key`` shared for the
        current task; raises what ``aio.acquire`` raises."""
        return _named(self._acquiring_one(key, _READ, blocking, timeout),
                      "AsyncRWLockManager.acquire_read")

    async def _acquiring_one(self, key: Hashable, mode: int, blocking: bool,
                             timeout: float) -> bool:
        return await _acquiring(self, lambda: self._task_release(key, mode), self._task_enter,
                                key, mode, wait_seconds(blocking, timeout), False)

    def _task_acquire_many(self, make_items: Callable[[], list[tuple[Hashable, int]]],
                           blocking: bool = True,
                           timeout: float = -1) -> Coroutine[Any, Any, bool]:
        """``aio.acquire_many``: the set's items are made by ``make_items()``; raises what
        ``aio.acquire`` raises, nothing taken. The coroutine is named as the view's method
        (a warning that it was never awaited says so)."""
        view = "AsyncRWLockManager" if hasattr(self, "acquire_read") else "AsyncLockManager"
        return _named(self._acquiring_many(make_items, blocking, timeout),
                      f"{view}.acquire_many")

    async def _acquiring_many(self, make_items: Callable[[], list[tuple[Hashable, int]]],
                              blocking: bool, timeout: float) -> bool:
        items = make_items()
        return await _acquiring(self, lambda: self._task_release_many(items),
                                self._task_enter_many, items, wait_seconds(blocking, timeout),
                                False)

    def _task_release_write(self, key: Hashable) -> Awaitable[None]:
        """``aio.release`` (and ``rw.aio.release_write``), bound by the view as its own: undo
        one acquire of ``key`` by the current task, at the call; answers a ready awaitable of
        None (awaiting it is optional, as for the PostgreSQL views'). Raises NotOwnedError if
        the task does not hold it, TypeError for an unhashable key, RuntimeError outside a
        running asyncio task."""
        self._task_release(key, _WRITE)
        return _ready(None)

    def _task_release_read(self, key: Hashable) -> Awaitable[None]:
        """``rw.aio.release_read``, bound by the view as its own; answers and raises what
        ``aio.release`` does (NotOwnedError if the current task does not read ``key``)."""
        self._task_release(key, _READ)
        return _ready(None)

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
        return _ready(None)

    def _task_exit_many(self, record: BlockRecord,
                        items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        own = _own_record(record)
        if not items:  # an empty hold_many entered nothing
            return _ready(None)
        token = own.leave()
        if token is not None and _releases_here(token, self, items, -1):
            self._release_many(items, token)
        return _ready(None)

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
            got = self._task_wait(token, self._run_on_key, self._take_read, key, token, seconds,
                                  self._limit_for(key))
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
        """An exception ended an acquiring call: give back a grant it was made at once
        (recorded as the token's request until the call has it), or abandon the wait it
        queued and never awaited."""
        try:
            token = _task_token(create=False)
        except RuntimeError:  # not in a task: it queued nothing
            return
        if token is None:
            return
        request = token.request
        if request is not None and request.state == _GRANTED and token.wait is None:
            _section(self._abandon_section, token, None)
        else:
            _abandon_stranded(token)

    def _task_release(self, key: Hashable, mode: int, owner: _TaskToken | None = None) -> None:
        """Give back one level of ``key`` held by ``owner``'s task: the current task's if None."""
        token = _task_token(create=False) if owner is None else owner
        key = self._table_key(key)
        if token is None:  # the task has acquired nothing
            raise _failure(_NOT_OWNED, key, current_task_or_raise(), self._rw_mode(mode))
        run = self._release_write_on if mode == _WRITE else self._release_read_on
        verdict = self._run_on_key(run, key, token)
        if verdict is not None:
            raise self._refusal(verdict, key, token, mode)

    def _task_release_many(self, items: list[tuple[Hashable, int]]) -> Awaitable[None]:
        token = _task_token(create=False)
        if items and token is None:  # the task has acquired nothing
            key, mode = items[0]
            raise _failure(_NOT_OWNED, key, current_task_or_raise(), self._rw_mode(mode))
        if items:
            self._release_many(items, token)
        return _ready(None)  # (as _task_release_write's)

    def _task_release_all(self) -> int:
        token = _task_token(create=False)
        return 0 if token is None else len(_section(self._release_held_section, token))

    def _task_levels(self, key: Hashable) -> tuple[int, int]:
        """The current task's write and read levels of ``key``."""
        token = _task_token(create=False)
        return self._run_on_key(
            _levels_of, self._table_key(key), token)
