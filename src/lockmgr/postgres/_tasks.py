"""The task sessions of one manager (``_Tasks``): asyncio tasks as owners and their clean-ups
(which task is inside an ``async with`` block: ``_layered_aio.AsyncBlockRecord``)."""

from __future__ import annotations

import asyncio
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

import psycopg

from .._args import READ, WRITE
from .._errors import DeadlockError, not_owned
from .._owners import TASK_WAIT_CHECK, current_task_or_raise
from ._aio_link import _AsyncLink, _TaskSession, _clean_up_done, _drive_async, _retrieve
from ._deadlock import LOOK_EVERY, Look, deadlock_through_server
from ._elsewhere import attach_bounds, held_elsewhere, refuse_waiting_for_oneself
from .._layered import Lease, _no_fencing, _read_has_no_fence
from ._capacity import _Slot, crowded, keep_idle, reserve_async
from ._link import (
    _CANCEL_GRACE,
    _CLIENT_TIMEOUTS,
    _call_deadline,
    _call_steps,
)
from ._protocol import _lock_steps, _unlock_steps
from ._xact import xact_conflicts
from ._session import _holding, _lost_error, _xact_deadlock, _xact_question
from ._sql import (
    _GRANTED_ADVISORY,
    _UNLOCK,
    _drop_sql,
    _not_released,
    _unlock_sql,
)

if TYPE_CHECKING:
    from .._contract import EngineModule
    from ._engine import _PgEngine


class _Tasks:
    """The sessions of a PostgreSQL manager's tasks, and their calls to the server. Runs
    on the event loops of the tasks; the lists it shares with other threads (``idle``,
    ``sessions``) are changed under the manager's ``_guard``."""

    def __init__(self, manager: _PgEngine[Any]) -> None:
        self.manager = manager
        # The in-process engine's module (the compiled core or the pure twin): its tasks.
        self.engine = cast("EngineModule", sys.modules[type(manager._engine).__module__])
        self.sessions: dict[asyncio.Task[Any], _TaskSession] = {}  # running tasks' sessions
        # The loops those tasks run on (and ran on: a closed one leaves at the next sweep),
        # so that the sweep before every acquisition costs a look at each loop, not each task.
        self.loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    # -- taking and giving back ---------------------------------------------------------------

    async def take(self, items: Sequence[tuple[Hashable, int]], seconds: float,
                   local_acquire: Callable[[float], Awaitable[bool]],
                   local_release: Callable[[], object]) -> bool:
        """``_PgEngine._take`` for the current task: in-process first, then on the server,
        all of ``items`` within ``seconds`` or none."""
        started = time.monotonic()
        self.sweep_closed_loops()  # a stranded task may hold one of the keys in process
        session = self.session()
        try:
            await self.settle(session, _call_deadline(started, seconds))
        except _CLIENT_TIMEOUTS:
            if seconds < 0:
                raise
            return False  # an earlier call's clean-up still runs: timed out
        session.refuse_lost(items)
        await self.refuse_own_xact_lock(items)
        if seconds != 0:  # (a try never waits: it finds the key taken)
            try:
                await self.refuse_own_locks_elsewhere(session, items,
                                                      *attach_bounds(started, seconds))
            except _CLIENT_TIMEOUTS:
                if seconds < 0:
                    raise
                return False  # no connection in time: timed out, holding nothing
        if not await self.acquire_in_process(items, seconds, local_acquire):
            return False
        before = {item: session.levels.get(item, 0) for item in items}
        fresh = [item for item, levels in before.items() if not levels]
        taken = unrun = False
        try:
            left = seconds if seconds <= 0 else max(0.0, seconds - (time.monotonic() - started))
            fences = await self.lock(session, fresh, left) if fresh else {}
            # A connection lost on the way lost the keys this call re-entered too: the
            # call fails, whatever a fresh connection then gave (the clean-up drops it).
            session.refuse_lost(items)
            if fences is not None:
                session.granted(items, self.manager._fences_of(fresh, fences))
            session.unsure = []  # answered, counted (``_lock_steps``)
            taken = fences is not None
        except BaseException as error:
            session.undo_take(before, fresh)
            unrun = isinstance(error, GeneratorExit)
            client_timeout = seconds >= 0 and isinstance(error, _CLIENT_TIMEOUTS)
            try:
                if fresh and not unrun:
                    await self.clean_up(session, time.monotonic() + _CANCEL_GRACE
                                        if client_timeout else True)
            except GeneratorExit:  # closed while it cleaned up: unrun all the same
                unrun = True
                raise
            except _CLIENT_TIMEOUTS:
                pass  # the clean-up goes on; the next call waits for it (settle)
            finally:
                if unrun:
                    _close_link(session)
            if not client_timeout:
                raise
            # A timed call that passed its deadline on the client timed out.
            session.refuse_lost(items)
            return False
        finally:
            if not taken:
                try:
                    if not unrun:
                        local_release()
                finally:
                    self.return_if_idle(session)
        return taken

    async def refuse_own_xact_lock(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """``_xact.refuse_own_xact_lock`` for the current task."""
        manager = self.manager
        if not manager._task_xact_locks:
            return
        task = current_task_or_raise()
        with manager._guard:
            records = manager._task_xact_locks.get(task)
        for key, record in xact_conflicts(manager, records, items):
            if await self.ask(_xact_question(record)):
                raise _xact_deadlock(task, key)

    async def refuse_own_locks_elsewhere(self, session: _TaskSession,
                                         items: Sequence[tuple[Hashable, int]],
                                         deadline: float | None,
                                         connect_by: float | None) -> None:
        """``_elsewhere.refuse_own_locks_elsewhere`` for the current task (its own locks
        only: its loop's thread may release its own while the task waits)."""
        found = held_elsewhere(self.manager, [(current_task_or_raise(), True)],
                               [item for item in items if not session.levels.get(item)])
        if not found:
            return
        try:
            link = session.link if session.link is not None else (await self.attach(session, deadline, connect_by))[0]
            refuse_waiting_for_oneself(found, link)
        finally:
            self.return_if_idle(session)

    async def acquire_in_process(self, items: Sequence[tuple[Hashable, int]], seconds: float,
                                 local_acquire: Callable[[float], Awaitable[bool]]) -> bool:
        """``local_acquire(seconds)``, looking around every ``LOOK_EVERY`` seconds while it
        waits (``look_while_waiting``)."""
        look = Look(items, None if seconds < 0 else time.monotonic() + seconds)
        check = TASK_WAIT_CHECK.set((LOOK_EVERY, lambda: self.look_while_waiting(look)))
        try:
            return await local_acquire(seconds)
        finally:
            try:
                TASK_WAIT_CHECK.reset(check)
            except ValueError:
                pass  # the collector closed the coroutine in another context: ours is gone
            look.stop()

    async def look_while_waiting(self, look: Look) -> None:
        """The current task's wait check while it waits in process: a task stranded on a
        closed loop gives back what it held, and a cycle through the server ends the wait
        with DeadlockError (``_deadlock``)."""
        self.sweep_closed_loops()
        task = current_task_or_raise()
        manager = self.manager
        lookout = look.lookout = manager._lookout
        look.owner = task
        try:  # (a round trip: not on the loop)
            looking = asyncio.get_running_loop().run_in_executor(
                lookout.task_executor(), lookout.look, manager, look)
            # A timed wait waits for no look past its deadline (one may be queued behind
            # another waiter's, in the one thread): the look goes on without it.
            found = await asyncio.wait_for(
                looking, None if look.deadline is None else look.deadline - time.monotonic())
        except TimeoutError:
            found = None
        except RuntimeError:  # the interpreter is shutting down: no thread starts any more
            found = None
        if look.confirms(found):
            raise deadlock_through_server(task, look.items)

    def give(self, items: Sequence[tuple[Hashable, int]],
             local_release: Callable[[], object]) -> _Release:
        """``_PgEngine._give`` for the current task, done at the call as in process: the
        levels counted down and the keys released in process at once, and the server locks
        of the last levels released by a task of the session's, started now
        (``release_on_server``; the task's next call waits for it, as for a clean-up), so
        that a release nobody awaits still releases. Raises NotOwnedError, and LockLost
        for keys already known lost (the levels given back all the same), at the call;
        awaiting the answer (``_Release``) waits for the server's release and raises
        LockLost if it found the key gone."""
        session = _holding(self.session_or_none(), items, current_task_or_raise())
        assert isinstance(session, _TaskSession)
        link, last, earlier = session.link, [], False
        try:
            # What ``settle`` finds without waiting: a lose() interrupted half-way, finished;
            # a connection found dead (here, or by another thread): its keys are lost.
            if (link is None and (session.levels or session.unsure) or link is not None
                    and session.cleaning is None and (session.dead or not link.idle())):
                self.lose(session)
            link, earlier = session.link, bool(session.unsure)
            last = [item for item in items if session.levels.get(item) == 1]
            if last and link is not None:  # unsure until the server has answered
                session.unsure = [*session.unsure,
                                  *(item for item in last if item not in session.unsure)]
        finally:  # interrupted or not, the levels are given back (as ``given`` says)
            try:
                lost = session.given(items)
            finally:
                local_release()
        if session.unsure and session.cleaning is None:
            # What an earlier call left unsure may or may not be held: the clean-up's drop.
            releasing = self.drop_or_lose(session) if earlier else self.release_on_server(session)
            session.cleaning = asyncio.get_running_loop().create_task(releasing)
            session.cleaning.add_done_callback(_retrieve)
        answer = _Release(session, session.cleaning if last else None, last)
        self.return_if_idle(session)
        if lost:
            raise _lost_error(sorted(set(lost), key=repr))
        return answer

    async def release_on_server(self, session: _TaskSession) -> set[tuple[Hashable, int]]:
        """Release on the server the levels ``give`` counted down (``session.unsure``, and
        those later releases add meanwhile), one round trip a turn; the items not released:
        those the server no longer held (lost: told to ``on_lost``) and, if the connection
        fails, those still unanswered (it is closed: its keys are lost, none stays held)."""
        gone: set[tuple[Hashable, int]] = set()
        try:
            while session.unsure:
                link = session.link
                if link is None:  # lost meanwhile (and closed): unanswered
                    gone.update(session.unsure)
                    break
                releasing = list(session.unsure)
                if len(releasing) == 1:  # the statement prepared once per session
                    ((key, mode),) = releasing
                    result = await _drive_async(_call_steps(
                        link, _UNLOCK[mode], self.manager.advisory_key(key), True))
                else:
                    result = (await link.run_all_async(
                        _unlock_sql(releasing, self.manager.advisory_key)))[-1]
                session.unsure = [item for item in session.unsure if item not in releasing]
                gone.update(_not_released(result, releasing))
        except Exception:
            gone.update(session.unsure)
            self.lose(session)
        except BaseException:
            self.lose(session)  # cancelled itself: the loop is closing
            raise
        finally:
            session.unsure = []
            session.cleaning = None
            self.return_if_idle(session)
        news = {key for key, _ in gone} - session.reported
        on_lost = self.manager._on_lost
        if news and on_lost is not None:
            on_lost(sorted(news, key=repr))
        return gone

    async def release_all(self, local_release_all: Callable[[], int]) -> int:
        session = self.session_or_none()
        unrun = False
        try:
            if session is not None:
                await self.settle(session)
                if session.levels:
                    session.unsure = list(session.levels)
                    await self.unlock(session, session.unsure)
        except BaseException as error:
            unrun = isinstance(error, GeneratorExit)
            try:
                if session is not None and not unrun:
                    await self.hand_over(session, list(session.levels))
            except GeneratorExit:
                unrun = True
                raise
            finally:
                if session is not None and unrun:
                    _close_link(session)
            raise
        finally:
            lost: list[Hashable] = []
            if session is not None:
                lost = sorted({key for key, _ in session.lost}, key=repr)
                session.forget_levels()
                session.lost.clear()
                session.reported.clear()
                self.return_if_idle(session)
            released = 0 if unrun else local_release_all()
        if lost:
            raise _lost_error(lost)
        return released

    async def lock(self, session: _TaskSession, items: list[tuple[Hashable, int]],
                   seconds: float) -> dict[int, int] | None:
        """``_lock_steps`` on the task's connection."""
        return await _drive_async(_lock_steps(self.manager, session, items, seconds),
                                  self.attach, self.lose)

    async def unlock(self, session: _TaskSession, items: list[tuple[Hashable, int]]) -> None:
        """``_unlock_steps`` on the task's connection: a failed or cancelled release leaves
        what it may still hold to the clean-up task; a closed coroutine (which can await
        nothing more) closes the connection instead."""
        async def clean_up(session: _TaskSession, items: list[tuple[Hashable, int]]) -> None:
            await self.clean_up(session)  # it releases all the session's unsure: these

        try:
            await _drive_async(_unlock_steps(self.manager, session, items), lose=self.lose,
                               drop=clean_up)
        except GeneratorExit:
            _close_link(session)
            raise

    async def clean_up(self, session: _TaskSession, deadline: float | bool = True) -> None:
        """Give back, in a task of its own that a cancellation cannot stop halfway, what a
        failed call may hold (``session.unsure``); wait for it unless cancelled again, or
        until ``deadline`` (True: however long it takes): then ``_Overdue``, and it goes on."""
        if session.cleaning is None:
            session.cleaning = asyncio.get_running_loop().create_task(self.drop_or_lose(session))
            # Whoever still waits for it gets its exception (an on_lost that raised); if
            # nobody does any more, it must not be reported as never retrieved.
            session.cleaning.add_done_callback(_retrieve)
        await _clean_up_done(session.cleaning, deadline)

    async def hand_over(self, session: _TaskSession, items: list[tuple[Hashable, int]]) -> None:
        """A release interrupted before its unlock was sent: the clean-up releases ``items``
        (still on the connection, if it lives) with whatever it gives back already."""
        if session.link is None:
            return
        session.unsure = [*session.unsure, *(item for item in items if item not in session.unsure)]
        if session.unsure:
            await self.clean_up(session)

    async def drop_or_lose(self, session: _TaskSession) -> None:
        """``_PgEngine._drop_or_lose`` for a task: end a statement still running, release
        whichever of ``session.unsure`` this session holds (items added meanwhile too);
        failing that, close the connection (its keys are lost)."""
        talking = session.link
        if talking is not None:
            with talking.guard:
                talking.talking = True  # others' checks keep off until the end of the clean-up
        try:
            try:
                while session.unsure:
                    link = session.link
                    if link is None:
                        session.unsure = []
                        return
                    dropping = list(session.unsure)
                    await link.abort()
                    if not link.idle():
                        raise psycopg.OperationalError("the connection is not idle after a cancel")
                    await link.run_async(_drop_sql(dropping, self.manager.advisory_key))
                    session.unsure = [item for item in session.unsure if item not in dropping]
            except Exception:
                self.lose(session)  # the caller re-raises what made it clean up
            except BaseException:
                self.lose(session)  # cancelled itself: the loop is closing
                raise
        finally:
            if talking is not None:
                talking.talking = False
            session.cleaning = None
            self.return_if_idle(session)

    # -- sessions and loss ----------------------------------------------------------------------

    def session_or_none(self) -> _TaskSession | None:
        return self.sessions.get(current_task_or_raise())

    def session(self) -> _TaskSession:
        task = current_task_or_raise()
        session = self.sessions.get(task)
        if session is None:
            with self.manager._guard:
                session = self.sessions[task] = _TaskSession()
                self.loops.add(task.get_loop())
            task.add_done_callback(self.task_done)
        return session

    def task_done(self, task: asyncio.Task[Any]) -> None:
        """A task ended: its session goes, and its connection closes (ending its server
        locks) once a clean-up still running on it is over; the in-process engine releases
        what the task held with a warning."""
        session = self.sessions.get(task)
        if session is not None and session.cleaning is not None:
            # Until then the session stays listed: a loop closed meanwhile is swept.
            session.cleaning.add_done_callback(lambda _: self.end(task))
        else:
            self.end(task)

    def refuse_unfinished_releases(self, items: Sequence[tuple[Hashable, int]]) -> None:
        """For a thread about to wait for ``items``: a task's release of one of them (in a
        conflicting mode) still under way on the server (``give``: not awaited) on an event
        loop that cannot run while the thread waits — the thread's own running loop, which
        its wait blocks, or a loop not running at all — would keep it waiting for ever:
        DeadlockError at once. A loop running in another thread finishes it: waited for."""
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        manager = self.manager
        with manager._guard:
            under_way = [(task, list(session.unsure)) for task, session in self.sessions.items()
                         if session.cleaning is not None and not session.cleaning.done()]
        for task, releasing in under_way:
            loop = task.get_loop()
            if loop.is_running() and loop is not here:
                continue
            for key, mode in items:
                ident = manager.advisory_key(key)
                if any(manager.advisory_key(other) == ident and WRITE in (mode, other_mode)
                       for other, other_mode in releasing):
                    raise DeadlockError(
                        f"task {task.get_name()!r} released {key!r} without awaiting it, and"
                        " its release on the server waits for its event loop, which cannot"
                        " run while this thread waits (it is this thread's, or not running):"
                        " await the release first", [(task, key)])

    def end(self, task: asyncio.Task[Any]) -> None:
        with self.manager._guard:
            session = self.sessions.pop(task, None)
        if session is not None:
            session.ended = True
            _close_link(session)

    async def settle(self, session: _TaskSession, deadline: float | bool = True) -> None:
        """``_PgEngine._settle`` for the task: first wait for a clean-up still running (by
        ``deadline``: ``clean_up``)."""
        if session.cleaning is not None:
            await _clean_up_done(session.cleaning, deadline)
        link = session.link
        if link is None:
            if session.levels or session.unsure:  # a lose() interrupted half-way: finish it
                self.lose(session)
            return
        if session.unsure:
            await self.clean_up(session, deadline)
            link = session.link
            if link is None:
                return
        if session.dead or not link.idle():
            self.lose(session)

    async def attach(self, session: _TaskSession, deadline: float | None = None,
                     connect_by: float | None = None) -> tuple[_AsyncLink, bool]:
        """Give the session a connection: an idle one still alive (False), or a new one
        (under ``max_connections``, waiting for one to be free until ``deadline``, connected
        by ``connect_by``: ``_AsyncLink.connect_async``)."""
        manager = self.manager
        self.sweep_closed_loops()  # their connections may hold what this one will wait for
        while True:
            with manager._guard:
                link = manager._task_idle.pop() if manager._task_idle else None
            if link is None:
                link = await self.connect(deadline, connect_by)
                fresh = True
                break
            if link.idle():
                fresh = False
                break
            link.close()
        session.link = link
        return link, fresh

    def return_if_idle(self, session: _TaskSession) -> None:
        if session.holds_anything() or session.cleaning is not None:
            return
        link, session.link = session.link, None
        with self.manager._guard:
            session.reported.clear()
            if (link is not None and not session.dead and not link.broken()
                    and not crowded(self.manager)):
                self.manager._task_idle.append(link)
                link = None
        session.dead = False
        if link is not None:
            link.close()

    def lose(self, session: _TaskSession) -> None:
        """The session's connection is gone, and with it every lock it held."""
        link, session.link = session.link, None
        session.unsure = []
        session.losses += 1
        with self.manager._guard:
            session.lose_levels()
        if link is not None:
            link.close()
        self.manager._report(session)
        if not session.lost:
            self.return_if_idle(session)

    def check_others(self, mine: _TaskSession | None) -> None:
        """Mark dead the sessions of other tasks whose connection died (their owners
        settle them), as ``lost_keys()`` does for threads."""
        with self.manager._guard:
            # A session with a clean-up pending is using its connection (or about to).
            others = [session for session in self.sessions.values() if session is not mine
                      and session.cleaning is None and not session.unsure]
        for other in others:
            link = other.link
            if link is not None and link.idle_unless_busy() is False:
                self.manager._report(other, dead_link=link)

    def entered(self) -> tuple[asyncio.Task[Any], _TaskSession]:
        """The current task, which has just acquired, and its session: an ``async with``
        object's record (``_layered_aio.TaskOwners``)."""
        task = current_task_or_raise()
        return task, self.sessions[task]

    def lease(self, items: Sequence[tuple[Hashable, int]]) -> Lease:
        """The current task's lease on ``items``, which it has just acquired."""
        keys = tuple(key for key, _ in items)
        if not self.manager._fencing:
            return Lease(keys, None)
        session = self.session()
        return Lease(keys, {key: session.fences[key, mode] for key, mode in items if mode == WRITE})

    def fence(self, key: Hashable) -> int:
        manager = self.manager
        manager.advisory_key(key)  # a key PostgreSQL cannot take fails before anything else
        if not manager._fencing:
            raise _no_fencing()
        session = self.session_or_none()
        if session is not None:
            self.check(session)
            if session.lost.get((key, WRITE)):
                raise _lost_error([key])
            if session.levels.get((key, WRITE)):
                return session.fences[key, WRITE]
            if session.levels.get((key, READ)) or session.lost.get((key, READ)):
                raise _read_has_no_fence(key)
        raise not_owned(key, current_task_or_raise())

    def check(self, session: _TaskSession) -> None:
        """What ``settle`` can find without waiting: a dead connection loses its keys (and a
        loss interrupted half-way is finished)."""
        link = session.link
        if session.cleaning is not None or session.unsure and link is not None:
            return
        if link is None and session.levels or link is not None and (session.dead or not link.idle()):
            self.lose(session)

    def lost_here(self, key: Hashable, mode: int) -> bool:
        session = self.session_or_none()
        if session is None:
            return False
        self.check(session)
        return bool(session.lost.get((key, mode)))

    def lost_items(self) -> list[tuple[Hashable, int]]:
        """(key, mode) of every running task's lost, unreleased keys (under ``_guard``)."""
        return [item for session in self.sessions.values()
                for item in {*session.lost, *(session.levels if session.dead else ())}]

    def sweep_closed_loops(self) -> None:
        """Sessions of tasks whose event loop was closed with them pending (a shutdown
        interrupted by another Ctrl-C): nobody can talk on their connections any more,
        and a wait queued there would be granted to nobody; a place under max_connections
        given to one of them is given back. Close them, and end the tasks
        in the in-process engine too, one at a time: ending one runs Python code (its
        AbandonedLockWarning) that may raise, and the others stay listed for the next
        sweep whatever it raises."""
        capacity = self.manager._capacity
        if capacity is not None and capacity.handed:  # (a task of no session's too: ``ask``)
            capacity.reclaim_stranded()  # slots given to them, which no session holds
        while True:
            with self.manager._guard:
                closed = [loop for loop in self.loops if loop.is_closed()]
                if not closed:
                    return
                task = next((task for task in self.sessions if task.get_loop().is_closed()), None)
                if task is None:  # none left: the closed loops need no more looking at
                    for loop in closed:
                        self.loops.discard(loop)
                    return
                session = self.sessions[task]
            session.ended = True  # a block's exit releases nothing from now on
            try:
                _close_link(session)
                self.engine.end_stranded_task(task)  # and in process: what it held goes to others
            finally:  # ended or not: a task ends once (end_stranded_task is a no-op after)
                with self.manager._guard:
                    self.sessions.pop(task, None)

    def forget_parent_sessions(self) -> None:
        """In a forked child: the parent's tasks and connections are not the child's."""
        links = [s.link for s in self.sessions.values() if s.link is not None]
        self.sessions = {}
        self.loops = weakref.WeakSet()
        for link in links:
            link.close()

    async def held_on_server(self, key: Hashable, mode: str | None) -> bool:
        """``_PgEngine._held_on_server`` for a task."""
        manager = self.manager
        return await self.ask(
            f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} {manager.advisory_key(key)}"
            f" AND database = (SELECT oid FROM pg_catalog.pg_database"
            " WHERE datname = pg_catalog.current_database())"
            + ("" if mode is None else f" AND mode = '{mode}'") + ")")

    async def borrow(self, deadline: float | None = None) -> _AsyncLink:
        """An idle connection of the tasks', or a new one (connected by ``deadline``)."""
        manager = self.manager
        with manager._guard:
            link = manager._task_idle.pop() if manager._task_idle else None
        if link is not None and link.idle():
            return link
        if link is not None:
            link.close()
        return await self.connect(True if deadline is None else deadline, deadline)

    async def connect(self, deadline: float | bool | None,
                      connect_by: float | None) -> _AsyncLink:
        """A new connection, in a slot under ``max_connections`` waited for until ``deadline``
        (``reserve_async``; given back if connecting fails), connected by ``connect_by``."""
        manager = self.manager
        slot = _Slot()
        try:
            await reserve_async(manager, deadline, slot)
            link = await _AsyncLink.connect_async(
                manager._dsn, manager._connect_kwargs, manager._fence_table.statements, connect_by)
            link.slot = slot if slot.capacity is not None else None
        except BaseException:
            slot.free()
            raise
        return link

    async def ask(self, question: str, deadline: float | bool = True) -> bool:
        """``_PgEngine._ask`` on an idle connection of the tasks'."""
        manager = self.manager
        link = await self.borrow(None if deadline is True else deadline)
        try:
            result = await link.run_async(question, deadline)
        except BaseException:
            link.close()
            raise
        keep_idle(manager, link, manager._task_idle)
        return bool(result.get_value(0, 0) == b"t")


class _Release:
    """What a PostgreSQL ``aio.release`` answers (``_Tasks.give``): the release is done in
    process, and on the server under way or done. Awaiting it waits for the server's answer
    (a cancelled awaiting task does not stop it) and raises LockLost if the key was found
    gone there, or its connection lost first; not awaiting it loses only that report
    (``on_lost`` has it too)."""

    __slots__ = ("_items", "_losses", "_releasing", "_session")

    def __init__(self, session: _TaskSession, releasing: asyncio.Task[Any] | None,
                 items: list[tuple[Hashable, int]]) -> None:
        self._session = session
        self._releasing = releasing  # what releases ``items`` on the server (None: nothing to)
        self._losses = session.losses  # a loss from now on may have taken them first
        self._items = items

    def __await__(self) -> Generator[Any, None, None]:
        return self._answer().__await__()  # made here: an answer never awaited makes none

    async def _answer(self) -> None:
        releasing = self._releasing
        if releasing is None:
            return
        try:
            not_released = await asyncio.shield(releasing)
        except asyncio.CancelledError:
            if not releasing.cancelled():
                raise  # the awaiting task is cancelled; the release goes on
            not_released = None
        if not_released is None:  # a clean-up's drop, or cut short: lost if it lost the connection
            lost = self._items if self._session.losses != self._losses else []
        else:
            lost = [item for item in self._items if item in not_released]
        if lost:
            raise _lost_error(sorted({key for key, _ in lost}, key=repr))


def _close_link(session: _TaskSession) -> None:
    link, session.link = session.link, None
    if link is not None:
        session.losses += 1  # (its keys go with it: a release under way cannot say when)
        link.close()
