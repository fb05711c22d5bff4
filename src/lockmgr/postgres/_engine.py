"""The thread manager: ``_PgEngine``, what ``PgLockManager`` and ``PgRWLockManager`` share."""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from .._args import READ, WRITE, hold_seconds
from .._errors import LockError, not_owned, timed_out
from .._keyhash import KeyIdents
from .._layered import Lease, _no_fencing, _read_has_no_fence
from .._owners import WAIT_CHECK
from .._views import LockStats
from .._observe import LockMetrics
from ._capacity import _Capacity, crowded, keep_idle, new_link
from ._deadlock import (
    LOOK_EVERY,
    Look,
    Lookout,
    Waiting,
    alone,
    deadlock_through_server,
    managers_after_fork,
    register,
)
from ._elsewhere import attach_bounds, refuse_own_locks_elsewhere
from ._inspect import _Inspecting, application_name
from ._xact import (
    note_xact_lock,
    refuse_own_session_lock,
    refuse_own_xact_lock,
    wait_in_transaction,
)
from ._fences import DEFAULT_FENCE_TABLE, _FenceTable
from ._link import _CANCEL_GRACE, _CLIENT_TIMEOUTS, _Link, _call_deadline, _drive
from ._protocol import (
    _at_once, _lock_at_once, _lock_steps, _locked_at_once, _unlock_at_once, _unlock_steps,
    _unlocked)
from ._server import _KEEPALIVES, _conninfo
from ._session import _ThreadEnd, _XactLock, _holding, _lost_error
from ._sql import _GRANTED_ADVISORY, _OWN_TRANSACTION, _drop_sql

if TYPE_CHECKING:
    from .._contract import Engine
    from ._aio_link import _AsyncLink
    from ._session import _Session
    from ._tasks import _Tasks

K = TypeVar("K", bound=Hashable)
_Manager = TypeVar("_Manager", bound="_PgEngine[Any]")


def _forget_parent_sessions() -> None:
    for manager in managers_after_fork():
        manager._forget_parent_sessions()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_forget_parent_sessions)


class _PgEngine(_Inspecting, Generic[K]):
    """What both PostgreSQL managers share: sessions, the advisory-lock calls, loss."""

    _engine: Engine  # the in-process manager (lockmgr._contract)

    def __init__(
        self,
        dsn: str,
        engine: Engine,
        *,
        namespace: str = "",
        on_lost: Callable[[list[Hashable]], None] | None = None,
        connect_kwargs: dict[str, Any] | None = None,
        fencing: bool = False,
        fence_table: str = DEFAULT_FENCE_TABLE,
        max_connections: int | None = None,
        trusted_roles: Iterable[str] = (),
    ) -> None:
        self._capacity = _Capacity.of(max_connections)  # first: a bad one leaves nothing made
        self._connect_kwargs = {**_KEEPALIVES,
                                "fallback_application_name": application_name(namespace),
                                **(connect_kwargs or {})}
        _conninfo(dsn, self._connect_kwargs)  # a bad one fails here, with nothing made
        self._dsn = dsn
        self._engine = engine
        self._namespace = namespace
        self._fencing = fencing
        self._fence_table = _FenceTable(fence_table)
        self._fence_table_made = False  # set once this manager has made sure it exists
        self._idents = KeyIdents(namespace)
        self._params: dict[str, list[bytes]] = {}  # recent str keys' (``_protocol._params_of``)
        self._on_lost = on_lost
        self._local = threading.local()
        self._guard = threading.Lock()  # guards _idle, _parked, _sessions and loss reports
        self._idle: list[_Link] = []  # connections holding nothing
        # Sessions that hold nothing and keep their connection for their thread's next call
        # (``_return_if_idle``): idle connections all the same, which whoever needs one
        # takes first (``_pop_idle``).
        self._parked: set[_Session] = set()
        self._sessions: set[_Session] = set()  # sessions with a connection in use or lost keys
        # The asyncio tasks' sessions, from the first ``aio``: held by the views and by the
        # tasks with a session (their done-callbacks), and so alive while anything may use
        # them; they hold this manager. A strong reference back would make a cycle, and a
        # manager dropped after ``aio`` would keep its connections until the cyclic
        # collector ran. Their idle connections are this manager's (``_task_idle``).
        self._tasks_ref: weakref.ref[_Tasks] | None = None
        self._task_idle: list[_AsyncLink] = []  # task connections holding nothing
        # Each task's xact_lock records (a thread's are in ``_local``), under ``_guard``.
        self._task_xact_locks: weakref.WeakKeyDictionary[Any, list[_XactLock]] = \
            weakref.WeakKeyDictionary()
        self._lookout = Lookout(trusted_roles)  # the connection of its waiters' looks
        register(self)  # last: a look may use it from now on

    def __repr__(self) -> str:
        return f"<lockmgr.{type(self).__name__} namespace={self._namespace!r} at {id(self):#x}>"

    def close(self) -> None:
        """Close the idle connections (those of threads and tasks holding keys stay theirs),
        and end the tasks of event loops closed while they waited. Raises nothing."""
        tasks = self._tasks
        if tasks is not None:
            tasks.sweep_closed_loops()
        with self._guard:
            idle: list[_Link] = [*self._idle, *self._task_idle]
            self._idle, self._task_idle = [], []
            while (link := self._pop_idle()) is not None:  # the parked ones
                idle.append(link)
        for link in idle:
            link.close()

    @property
    def _tasks(self) -> _Tasks | None:
        """The tasks' sessions, if any view or task still has them."""
        tasks_ref = self._tasks_ref
        return None if tasks_ref is None else tasks_ref()

    def __enter__(self: _Manager) -> _Manager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_idle"):  # __init__ may have failed
            self.close()

    def _task_sessions(self) -> _Tasks:
        from ._tasks import _Tasks

        with self._guard:
            tasks = self._tasks
            if tasks is None:
                tasks = _Tasks(self)
                self._tasks_ref = weakref.ref(tasks)
            return tasks

    def _check_key(self, key: Hashable) -> int:
        return self._idents.of(key)

    def advisory_key(self, key: Hashable) -> int:
        """The advisory key ``key`` uses in this manager's namespace (``advisory_key(key,
        namespace)``). Raises TypeError for a key PostgreSQL cannot take (keys are str,
        bytes, int and tuples of them)."""
        return self._idents.of(key)

    def stats(self) -> LockStats:
        """The in-process engine's counters (this process's threads). Raises nothing."""
        stats: LockStats = self._engine.stats()
        return stats

    @property
    def log_waits_after(self) -> float | None:
        """Seconds after which a thread waiting for another thread of this process logs a
        WARNING (None: never); waits on the server are PostgreSQL's ``log_lock_waits``."""
        after: float | None = self._engine.log_waits_after
        return after

    def metrics(self) -> LockMetrics:
        """The in-process engine's metrics (waits between this process's threads). Raises
        nothing."""
        metrics: LockMetrics = self._engine.metrics()
        return metrics

    def __len__(self) -> int:
        """Keys held by this process's threads and tasks (lost ones are not held)."""
        held: int = len(self._engine)
        lost = self._lost_items()
        # (two reads: a key taken and lost between them must not make it negative)
        return max(0, held - sum(1 for key in {key for key, _ in lost} if self._only_lost(key, lost)))

    def _only_lost(self, key: Hashable,
                   lost: collections.Counter[tuple[Hashable, int]]) -> bool:
        """Whether every holder of ``key`` in process lost it (``lost``: ``_lost_items``)."""
        return bool(lost[key, WRITE])

    def lost_keys(self) -> set[Hashable]:
        """Keys whose session was lost and that their holders (living threads of this
        process) have not yet released.

        Checks first, without waiting, the connection of every thread holding keys.
        Raises nothing."""
        session = self._session_or_none()
        if session is not None:
            self._settle(session)
        with self._guard:
            others = [other for other in self._sessions if other is not session]
        for other in others:
            link = other.link
            if link is not None and link.idle_unless_busy() is False:
                self._report(other, dead_link=link)
        tasks = self._tasks
        if tasks is not None:
            tasks.sweep_closed_loops()
            tasks.check_others(None)
        return {key for key, _ in self._lost_items()}

    def release_all(self) -> int:
        """Release every key the calling thread holds, all levels; returns how many.

        Raises LockLost, after releasing everything, if some of them had been lost."""
        session = self._session_or_none()
        try:
            if session is not None:
                self._settle(session)
                if session.levels:
                    session.unsure = list(session.levels)
                    self._unlock(session, session.unsure)
        finally:  # interrupted or not, the thread holds nothing afterwards
            lost: list[Hashable] = []
            if session is not None:
                lost = sorted({key for key, _ in session.lost}, key=repr)
                session.forget_levels()
                session.lost.clear()
                session.reported.clear()
                self._return_if_idle(session)
            released: int = self._engine.release_all()
        if lost:
            raise _lost_error(lost)
        return released

    def fence(self, key: K) -> int:
        """The fence under which the calling thread holds ``key`` for writing: the one its
        first acquisition took, kept by reentrant ones (``lease.fence`` of ``hold``).

        Raises LockError without ``fencing=True`` or for a key only read, NotOwnedError if
        the thread does not hold it, LockLost if its session was lost."""
        self.advisory_key(key)  # a key PostgreSQL cannot take fails before anything else
        if not self._fencing:
            raise _no_fencing()
        session = self._session_or_none()
        if session is not None:
            self._settle(session)  # a connection found dead loses its keys first
            if session.lost.get((key, WRITE)):
                raise _lost_error([key])
            if session.levels.get((key, WRITE)):
                return session.fences[key, WRITE]
            if session.levels.get((key, READ)) or session.lost.get((key, READ)):
                raise _read_has_no_fence(key)
        raise not_owned(key, threading.get_ident())

    def _fences_of(self, fresh: list[tuple[Hashable, int]],
                   fences: dict[int, int]) -> dict[tuple[Hashable, int], int]:
        """What ``_lock`` answered (fences by advisory key) for the fresh written items."""
        if not self._fencing:
            return {}
        return {(key, mode): fences[self.advisory_key(key)] for key, mode in fresh if mode == WRITE}

    def _lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease:
        """The calling thread's lease on ``items``, which it has just acquired."""
        keys = tuple(key for key, _ in items)
        if not self._fencing:
            return Lease(keys, None)
        session = self._session()
        return Lease(keys, {key: session.fences[key, mode] for key, mode in items if mode == WRITE})

    @contextmanager
    def xact_lock(
        self, conn: psycopg.Connection[Any], key: K, *, shared: bool = False,
        timeout: float | None = None,
    ) -> Iterator[None]:
        """Lock ``key`` inside ``conn``'s open transaction (``pg_advisory_xact_lock*``).

        The same key and namespace are the same lock as the managers' session-level ones.
        Leaving the block does **not** release it: the end of the transaction does, so the
        lock and the transaction's writes commit or roll back together. ``shared=True``
        takes it shared (as a read); ``timeout``: None or -1 waits as long as it takes, 0
        tries once.

        Raises LockTimeout if not acquired within ``timeout``, with nothing held and the
        caller's transaction intact; LockError if ``conn`` has no open transaction;
        DeadlockError if PostgreSQL finds a cycle, or at once if the calling thread or task
        holds ``key`` as a session lock in a conflicting mode (it would wait for itself);
        TypeError for a key PostgreSQL cannot take, TypeError/ValueError for a bad
        ``timeout``.
        """
        seconds = hold_seconds(timeout)
        ident = self.advisory_key(key)
        refuse_own_session_lock(self, key, shared)
        if conn.info.transaction_status != TransactionStatus.INTRANS:
            raise LockError("xact_lock needs an open transaction on conn: "
                            "use it inside `with conn.transaction():`")
        # The caller's session and search_path: every name is qualified, nothing is set
        # beyond the transaction.
        kind = "_shared" if shared else ""
        if seconds == 0:
            row = conn.execute(f"SELECT pg_catalog.pg_try_advisory_xact_lock{kind}(%s),"
                               f" {_OWN_TRANSACTION}", (ident,)).fetchone()
            if not row or not row[0]:
                raise timed_out(key, seconds)
        else:
            row = wait_in_transaction(self, conn, key, ident, kind, seconds)
        assert row is not None
        note_xact_lock(self, conn, ident, shared, row[1])
        yield

    # -- taking and giving back ---------------------------------------------------------------

    def _take(self, items: Sequence[tuple[Hashable, int]], seconds: float,
              local_acquire: Callable[[float], bool],
              local_release: Callable[[], None]) -> bool:
        """Take ``items`` ((key, mode) pairs) in-process, then in PostgreSQL, within
        ``seconds``: all of them, or none."""
        started = time.monotonic()
        tasks = None if self._tasks_ref is None else self._tasks  # (the usual: no call)
        if tasks is not None:
            tasks.sweep_closed_loops()  # a stranded task may hold one of the keys in process
        session = self._session()
        # (a parked connection stays parked while the call waits in process: ``_lock``
        # takes it back once the keys are the thread's in process, if nobody took it;
        # a parked session holds nothing, and has nothing to settle or refuse: the checks
        # are skipped by their own first tests, here without a call each)
        if not session.parked:
            self._settle(session, _call_deadline(started, seconds))
            session.refuse_lost(items)
        if self._local.__dict__.get("xact_locks"):  # (no AttributeError made when missing)
            refuse_own_xact_lock(self, items)
        if seconds != 0 and not alone():  # (a try never waits: it finds the key taken;
            # alone: no other manager holds anything)
            try:
                refuse_own_locks_elsewhere(self, session, items, *attach_bounds(started, seconds))
            except _CLIENT_TIMEOUTS:
                if seconds < 0:
                    raise
                return False  # no connection in time: timed out, holding nothing
        if seconds != 0 and tasks is not None:
            tasks.refuse_unfinished_releases(items)
        if len(items) == 1:  # (the usual: one key, without a comprehension's call)
            levels = session.levels.get(items[0], 0)
            before, fresh = {items[0]: levels}, [] if levels else [items[0]]
        else:
            before = {item: session.levels.get(item, 0) for item in items}
            fresh = [item for item, levels in before.items() if not levels]
        acquired = taken = False
        try:
            acquired = self._acquire_in_process(items, seconds, local_acquire)
            if not acquired:
                return False
            session.taking = (before, fresh)
            left = seconds if seconds <= 0 else max(0.0, seconds - (time.monotonic() - started))
            fences = self._lock(session, fresh, left) if fresh else {}
            # A connection lost on the way lost the keys this call re-entered too: the
            # call fails, whatever a fresh connection then gave (the clean-up drops it).
            if session.lost:
                session.refuse_lost(items)
            if fences is not None:
                session.granted(items, self._fences_of(fresh, fences) if fences else {})
            # No check point from the last call to the end of the block: answered, counted.
            session.unsure, session.taking = [], None
            taken = fences is not None  # last: an interrupt before it finds the counts undone below
        except BaseException as error:
            if not acquired:
                # An interrupt as the in-process acquisition returned (CPython checks for
                # signals right after a call) finds it done all the same.
                acquired = self._acquired_in_process(session, items)
                raise
            # Wherever the failure or interrupt came, the call failed: nothing it took stays
            # held (a connection lost on the way already moved what it held to ``lost``).
            session.undo_take(before, fresh)
            client_timeout = seconds >= 0 and isinstance(error, _CLIENT_TIMEOUTS)
            if fresh:
                self._drop_or_lose(session, fresh, time.monotonic() + _CANCEL_GRACE
                                   if client_timeout else True)
            if not client_timeout:
                raise
            # A timed call that passed its deadline on the client timed out.
            session.refuse_lost(items)
            return False
        finally:
            # Timed out, failed or interrupted: the in-process acquisition goes back, from
            # this one place only (an interrupt right after it must not give it back twice).
            if acquired and not taken:
                try:
                    local_release()
                finally:
                    self._return_if_idle(session)
        return taken

    def _acquire_in_process(self, items: Sequence[tuple[Hashable, int]], seconds: float,
                            local_acquire: Callable[[float], bool]) -> bool:
        """``local_acquire(seconds)``, looking around while it waits (``_look_while_waiting``)."""
        waiting = Waiting(self, items, None if seconds < 0 else time.monotonic() + seconds)
        previous = WAIT_CHECK.call  # a handler's call inside another wait: that wait's
        WAIT_CHECK.call = waiting.check
        try:
            # (-1 as the int: the compiled engine takes it as "for ever" without checking
            # the argument again, as it does a float)
            return local_acquire(-1 if seconds < 0 else seconds)
        finally:
            WAIT_CHECK.call = previous
            if waiting.look is not None:
                waiting.look.stop()

    def _look_while_waiting(self, look: Look) -> None:
        """The calling thread's wait check while it waits in process: a task stranded on a
        closed loop gives back what it held (which may be what this thread waits for), and
        every ``LOOK_EVERY`` seconds a cycle through the server ends the wait with
        DeadlockError (``_deadlock``)."""
        tasks = self._tasks
        if tasks is not None:
            tasks.sweep_closed_loops()
        if time.monotonic() < look.due:
            return
        try:
            found = self._in_cycle_through_server(look)
        finally:  # from its end: two looks that confirm each other are LOOK_EVERY apart
            look.due = time.monotonic() + LOOK_EVERY
        if found:
            raise deadlock_through_server(threading.get_ident(), look.items)

    def _in_cycle_through_server(self, look: Look) -> bool:
        """Whether the calling thread, waiting in process, is in a cycle through the
        server, as this look confirms the last one (``Look``): answered within
        ``LOOK_FOR`` seconds or taken as no. On the manager's ``Lookout``, never the
        thread's connection, which holds its keys: an interrupt there would lose them."""
        look.lookout, look.owner = self._lookout, threading.get_ident()
        return look.confirms(self._lookout.look(self, look))

    def _acquired_in_process(self, session: _Session, items: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether the in-process engine holds every one of ``items`` for the calling
        thread one level above what ``session`` records: an acquisition (all or none of
        them: one call) whose result an interrupt took. Asked only then (a snapshot of
        every key)."""
        me = threading.get_ident()
        counts: collections.Counter[tuple[Hashable, str]] = collections.Counter()
        for state in self._engine.snapshot():
            for holder in state.holders:
                if holder.kind == "thread" and holder.owner == me:
                    counts[state.key, holder.mode] += holder.count
        return all(counts[key, "read" if mode == READ else "write"]
                   > session.levels.get((key, mode), 0) + session.lost.get((key, mode), 0)
                   for key, mode in items)

    def _give(self, items: Sequence[tuple[Hashable, int]],
              local_release: Callable[[], None]) -> None:
        """Undo one ``_take`` of ``items``; LockLost (after undoing it) if any was lost."""
        end: _ThreadEnd | None = getattr(self._local, "end", None)  # (``_session_or_none``)
        session = None if end is None else end.session
        if session is None or len(items) != 1 or not session.levels.get(items[0]):
            session = _holding(session, items, threading.get_ident())  # (else, it holds it)
        last = ([items[0]] if session.levels.get(items[0]) == 1 else []) if len(items) == 1 \
            else [item for item in items if session.levels.get(item) == 1]
        # No round trip to the server will tell whether the connection lives, or an earlier
        # clean-up was interrupted: settle first.
        if (not last or session.unsure or session.link is None or session.taking is not None
                or session.giving is not None):
            self._settle(session)
            last = [item for item in items if session.levels.get(item) == 1]
        session.giving = list(items)
        try:
            if last:
                session.unsure = last  # counted down below whatever happens
                self._unlock(session, last)  # a connection lost on the way moves them to lost
        finally:
            # Each step however the one before ended: an interrupt at the count-down's entry
            # leaves it to the next call (``giving``), never the in-process release undone.
            try:
                lost = session.given(items)
            finally:
                try:
                    local_release()
                finally:
                    self._return_if_idle(session)
        if lost:
            raise _lost_error(sorted(set(lost), key=repr))

    def _lock(self, session: _Session, items: list[tuple[Hashable, int]],
              seconds: float) -> dict[int, int] | None:
        """``_lock_steps`` in the calling thread, on its connection taken back if a step
        before parked it (a question on it: ``_elsewhere``), or on another; the usual
        call's one round trip made at once (``_lock_at_once``)."""
        if session.parked:
            self._unpark(session)
        started = time.monotonic() if seconds == 0 else None
        need = _lock_at_once(self, session, items, seconds)
        results, tried = None, None
        if need is not None:  # (the usual: one round trip, no step driver)
            session.unsure = items  # as the steps set it
            results, tried = _at_once(*need)  # (a failure is answered by the steps)
            if results is not None:
                return _locked_at_once(results, seconds)
        return _drive(_lock_steps(self, session, items, seconds, started), self._attach,
                      self._lose, tried=tried)

    def _unlock(self, session: _Session, items: list[tuple[Hashable, int]]) -> None:
        """``_unlock_steps`` in the calling thread (the usual call's one round trip made at
        once: ``_unlock_at_once``): a failed or interrupted release drops what it may
        still hold at once (``_drop_or_lose``)."""
        need = _unlock_at_once(self, session, items)
        results, tried = None, None
        if need is not None:  # (the usual: one round trip, no step driver)
            results, tried = _at_once(*need)  # (a failure is answered by the steps)
            if results is not None:
                _unlocked(self, session, items, results[-1])
                return
        _drive(_unlock_steps(self, session, items), lose=self._lose, drop=self._drop_or_lose,
               tried=tried)

    def _drop_or_lose(self, session: _Session, items: Sequence[tuple[Hashable, int]],
                      deadline: float | None | bool = True) -> None:
        """After a failed or interrupted call: release on the server whichever of ``items``
        this call may have taken (the levels it recorded before are not among them), by
        ``deadline`` (``_Link.run``). If that cannot be done, end the session: its keys
        are lost, nothing stays held. ``items`` are the session's ``unsure``, cleared once
        done."""
        link = session.link
        if link is None:
            session.unsure = []
            return
        try:
            if not link.idle():
                raise psycopg.OperationalError("the connection is not idle after an interrupt")
            link.run(_drop_sql(items, self.advisory_key), deadline)
            session.unsure = []
        except Exception:
            self._lose(session)  # the original failure is what the caller re-raises
        except BaseException:
            self._lose(session)
            raise

    # -- sessions and loss ----------------------------------------------------------------------

    def _session_or_none(self) -> _Session | None:
        end: _ThreadEnd | None = getattr(self._local, "end", None)
        return None if end is None else end.session

    def _session(self) -> _Session:
        end: _ThreadEnd | None = getattr(self._local, "end", None)
        if end is None:
            end = self._local.end = _ThreadEnd(self)
        return end.session

    def _attach(self, session: _Session, deadline: float | None = None,
                connect_by: float | None = None) -> tuple[_Link, bool]:
        """Give the session a connection: an idle one still alive, or a new one (``new_link``:
        a place under ``max_connections`` waited for until ``deadline``, connected by
        ``connect_by``)."""
        tasks = self._tasks
        if tasks is not None:
            tasks.sweep_closed_loops()  # their connections may hold what we wait for
        while True:
            with self._guard:
                link = self._pop_idle()
            if link is None:
                link, fresh = new_link(self, deadline, connect_by), True
                break
            if link.idle():
                fresh = False
                break
            link.close()
        session.link = link
        with self._guard:
            self._sessions.add(session)
        return link, fresh

    def _return_if_idle(self, session: _Session) -> None:
        """A thread that holds nothing gives its connection back: it parks it, keeping it
        for its next call (a thread using the manager again and again goes through no idle
        list), while any thread or task that needs a connection takes it first
        (``_pop_idle``); closed if someone waits for a place under ``max_connections``."""
        if session.levels or session.lost or session.unsure:  # (``holds_anything``)
            return
        with self._guard:
            if session.parked:
                return  # (a release_all holding nothing: taken meanwhile, or still there)
            link, session.link = session.link, None
            self._sessions.discard(session)
            session.reported.clear()
            if (link is not None and not session.dead and not link.broken()
                    and (self._capacity is None or not crowded(self))):
                session.link, session.parked = link, True  # checked again before its next use
                self._parked.add(session)
                return
        session.dead = False
        if link is not None:
            link.close()

    def _unpark(self, session: _Session) -> None:
        """The owner's next acquisition takes its parked connection back, if nobody took it
        (then it has none: ``_attach``), and checks it as ``_attach`` checks an idle one:
        one the server ended, or a parent's (an at-fork handler of the application's runs
        before lockmgr's), is closed (a parent's only on this side), and another attached."""
        with self._guard:
            if not session.parked:
                return
            session.parked = False
            self._parked.discard(session)
            self._sessions.add(session)
        link = session.link
        if link is not None and not link.idle():
            session.link = None
            link.close()

    def _pop_idle(self) -> _Link | None:
        """An idle connection of the threads' (under ``_guard``): from the idle list, else
        one a thread keeps parked (that thread's next call attaches another), else None.
        The taker checks it (``_Link.idle``) before using it."""
        if self._idle:
            return self._idle.pop()
        if not self._parked:
            return None
        session = self._parked.pop()
        link, session.link = session.link, None  # first: see _settle
        session.parked = session.dead = False
        return link

    def _settle(self, session: _Session, deadline: float | None | bool = True) -> None:
        """The owner's check at every call: a dead connection loses what it held, and keys
        an interrupted clean-up left unsure are released now (by ``deadline``). A parked
        session holds nothing: its connection is checked when it is used again (another
        thread may be taking it now: ``_pop_idle`` clears ``link`` before ``parked``)."""
        if session.parked:
            return
        if session.taking is not None:  # an interrupt kept a failed acquisition's undo from running
            session.undo_take(*session.taking)
        if session.giving is not None:  # ... or a release's count-down
            session.given(session.giving)
        link = session.link
        if link is None:
            if session.levels or session.unsure:  # a _lose interrupted half-way: finish it
                self._lose(session)
            return
        if session.unsure:
            self._drop_or_lose(session, session.unsure, deadline)
            link = session.link
            if link is None:
                return
        if session.dead or not link.idle():
            self._lose(session)

    def _lose(self, session: _Session) -> None:
        """The session's connection is gone, and with it every lock it held (owner only)."""
        link, session.link = session.link, None
        session.unsure = []
        with self._guard:
            session.lose_levels()
        if link is not None:
            link.close()
        self._report(session)
        if not session.lost:
            self._return_if_idle(session)

    def _report(self, session: _Session, *, dead_link: _Link | None = None,
                items: list[tuple[Hashable, int]] | None = None) -> None:
        """Tell ``on_lost`` once about each key newly lost by ``session``: all it holds
        (from another thread, which found ``dead_link`` dead), or just ``items`` (the
        owner)."""
        with self._guard:
            if items is not None:
                for item in items:
                    session.lost[item] = session.lost.get(item, 0) + session.levels.pop(item)
                    session.fences.pop(item, None)
            if dead_link is not None:
                # Checked under the guard, and probed before it: the owner may have handled
                # that loss meanwhile and moved on to a new connection, which lives.
                if session.link is not dead_link:
                    return
                session.dead = True
            held = {key for key, _ in list(session.lost)}
            if session.dead:
                held |= {key for key, _ in list(session.levels)}
            news = sorted(held - session.reported, key=repr)
            session.reported |= held
        if news and self._on_lost is not None:
            self._on_lost(news)

    def _lost_items(self) -> collections.Counter[tuple[Hashable, int]]:
        """(key, mode) of every living thread's lost, unreleased keys: how many threads."""
        lost: collections.Counter[tuple[Hashable, int]] = collections.Counter()
        with self._guard:
            for session in self._sessions:
                lost.update(set(session.lost) | (set(session.levels) if session.dead else set()))
            tasks = self._tasks
            if tasks is not None:
                lost.update(tasks.lost_items())
        return lost

    def _lost_here(self, key: Hashable, mode: int) -> bool:
        session = self._session_or_none()
        if session is None:
            return False
        self._settle(session)
        return bool(session.lost.get((key, mode)))

    def _thread_ended(self, session: _Session) -> None:
        """A thread ended: its session goes, and with it its locks and lost keys; a
        connection it kept parked, holding nothing, goes to the idle list (the next thread
        does not connect again), or closes if someone waits for a place."""
        with self._guard:
            self._sessions.discard(session)
            link, session.link = session.link, None
            if session.parked:
                session.parked = False
                self._parked.discard(session)
                if link is not None and not crowded(self):
                    self._idle.append(link)  # checked again before its next use
                    return
        if link is not None:
            link.close()

    def _forget_parent_sessions(self) -> None:
        """In a forked child: no connection of the parent's is ever used or closed here.
        Keys the forking thread held belong to the parent: they are lost to the child."""
        self._guard = threading.Lock()  # another thread of the parent may have held it
        self._lookout = Lookout(self._lookout.trusted_roles)  # (not the parent's connection)
        self._capacity = self._capacity and _Capacity(self._capacity.limit)  # (for the child's)
        me = threading.get_ident()
        links: list[_Link] = [*self._idle, *self._task_idle]
        self._idle, self._task_idle = [], []
        while (link := self._pop_idle()) is not None:  # the parked ones
            links.append(link)
        for session in list(self._sessions):
            if session.link is not None:
                links.append(session.link)
                session.link = None
            session.unsure, session.taking, session.giving = [], None, None  # the parent's
            if session.ident == me:
                for item, levels in session.levels.items():
                    session.lost[item] = session.lost.get(item, 0) + levels
                session.forget_levels()
                session.reported = {key for key, _ in session.lost}
            else:
                self._sessions.discard(session)
        for link in links:
            link.close()
        tasks = self._tasks
        if tasks is not None:
            tasks.forget_parent_sessions()

    def _borrow(self, own: bool = True, deadline: float | None = None) -> tuple[_Link, bool]:
        """A connection for a question: the calling thread's (if ``own``), or one from the
        idle list, or a new one (connected by ``deadline``: ``_Link.connect``)."""
        session = self._session_or_none() if own else None
        if (session is not None and not session.parked and session.link is not None
                and session.link.idle()):
            return session.link, False
        with self._guard:
            link = self._pop_idle()  # (perhaps the one the calling thread parked)
        if link is None or not link.idle():
            if link is not None:
                link.close()
            # (the lookout's is not counted: a look must not wait behind the waiters it looks at)
            link = new_link(self, True if deadline is None else deadline, deadline, counted=own)
        return link, True

    def _held_on_server(self, key: Hashable, mode: str | None) -> bool:
        return self._ask(
            f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {self.advisory_key(key)}"
            f" AND database = (SELECT oid FROM pg_catalog.pg_database"
            " WHERE datname = pg_catalog.current_database())"
            + ("" if mode is None else f" AND mode = '{mode}'") + ")")

    def _ask(self, question: str, deadline: float | bool = True, own: bool = True) -> bool:
        """A yes-or-no ``question`` to the server, on a connection ``_borrow(own)`` gives,
        answered by ``deadline`` (``_Link.run``)."""
        link, borrowed = self._borrow(own, None if deadline is True else deadline)
        try:
            result = link.run(question, deadline)
        except BaseException:
            if borrowed:
                link.close()
            raise
        if borrowed:
            keep_idle(self, link, self._idle)
        return _yes(result)


def _yes(result: Any) -> bool:
    """The answer of a yes-or-no question's result."""
    return bool(result.get_value(0, 0) == b"t")
