"""``max_connections``: the cap on a manager's connections, and the first-come, first-served
queue of the threads and tasks waiting for one (``_Capacity``).

A connection takes a ``_Slot`` when it is opened and gives it back when it closes
(``_Link.close``, whatever closes it). A slot given back while threads or tasks wait goes
straight to the one that has waited longest: nobody who came later can take it first. A
connection that would go back to the idle list (or stay parked with its thread) while
someone waits is closed instead, so that its slot goes to them (a reconnect, only at the
cap, and the order kept); a newcomer at the cap takes an idle or parked one's slot."""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

from ._link import _Link, _Overdue, _answer_by

if TYPE_CHECKING:  # (asyncio itself only where tasks wait: importing lockmgr.postgres loads none)
    import asyncio

    from ._engine import _PgEngine


class _NoConnectionFree(_Overdue):
    """The call's deadline passed (a try: at once) before one of the manager's
    ``max_connections`` was free: it timed out, holding nothing (the call's clean-up finds
    no connection to clean)."""


def max_connections_arg(value: object) -> int | None:
    """``max_connections`` checked: None (no cap) or an int of at least 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_connections must be None or an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"max_connections must be at least 1, not {value}")
    return value


class _Slot:
    """One connection's place under the cap; ``free`` (once) gives it back."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: _Capacity) -> None:
        self.capacity: _Capacity | None = capacity

    def free(self) -> None:
        capacity, self.capacity = self.capacity, None
        if capacity is not None:
            capacity.give_back()


class _Waiter:
    """A thread (``loop`` None) or a task waiting for a slot: ``slot`` once given one."""

    __slots__ = ("event", "future", "loop", "slot")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.event = threading.Event() if loop is None else None
        self.future: asyncio.Future[None] | None = None if loop is None else loop.create_future()
        self.slot: _Slot | None = None


class _Capacity:
    """At most ``limit`` connections open at once, threads' and tasks' together (``of``).

    ``lock`` is reentrant: a connection collected inside one of its spans gives its slot
    back on the same thread. Whoever also needs the manager's ``_guard`` takes that first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.RLock()
        self.open = 0  # slots taken (connections open, or being opened)
        self.waiters: collections.deque[_Waiter] = collections.deque()

    @classmethod
    def of(cls, limit: object) -> _Capacity | None:
        """The cap ``max_connections=limit`` sets (None: none); TypeError or ValueError for a
        bad one."""
        checked = max_connections_arg(limit)
        return None if checked is None else cls(checked)

    def crowded(self) -> bool:
        """Whether someone waits for a slot (under ``lock``): an idle connection is then
        closed rather than kept."""
        return bool(self.waiters)

    def take_or_queue(self, loop: asyncio.AbstractEventLoop | None) -> _Slot | _Waiter:
        """A slot if one is free and nobody waits, else the caller's place at the end of the
        queue (under ``lock``)."""
        if not self.waiters and self.open < self.limit:
            self.open += 1
            return _Slot(self)
        waiter = _Waiter(loop)
        self.waiters.append(waiter)
        return waiter

    def give_back(self) -> None:
        """A slot is free: to the longest waiter still there, else back to the count."""
        with self.lock:
            while self.waiters:
                waiter = self.waiters.popleft()
                waiter.slot = _Slot(self)
                if waiter.event is not None:
                    waiter.event.set()
                    return
                assert waiter.loop is not None and waiter.future is not None
                try:
                    waiter.loop.call_soon_threadsafe(_wake, waiter.future)
                    return
                except RuntimeError:  # its loop is closed: nobody takes it there
                    waiter.slot.capacity = None
            self.open -= 1

    def wait(self, waiter: _Waiter, deadline: float | None) -> _Slot:
        """The calling thread's slot, once given, by ``deadline`` (None: however long it
        takes); past it, ``_NoConnectionFree``. Interrupted, it gives up its place (and a
        slot given meanwhile)."""
        assert waiter.event is not None
        try:
            waiter.event.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except BaseException:
            self._give_up(waiter)
            raise
        slot = self._leave(waiter)
        if slot is None:
            raise _NoConnectionFree("no connection free under max_connections in time")
        return slot

    async def wait_async(self, waiter: _Waiter, deadline: float | None) -> _Slot:
        """``wait`` for the current task: it awaits, the loop runs on."""
        import asyncio

        assert waiter.future is not None
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), left)
        except TimeoutError:
            pass
        except BaseException:
            self._give_up(waiter)
            raise
        slot = self._leave(waiter)
        if slot is None:
            raise _NoConnectionFree("no connection free under max_connections in time")
        return slot

    def _give_up(self, waiter: _Waiter) -> None:
        """An interrupted or cancelled wait: its place goes, and a slot given meanwhile to
        the next in line."""
        slot = self._leave(waiter)
        if slot is not None:
            slot.free()

    def _leave(self, waiter: _Waiter) -> _Slot | None:
        """The waiter's wait ended (given a slot, timed out, interrupted): its slot if it got
        one, after which it must use or free it; else its place in the queue goes."""
        with self.lock:
            if waiter.slot is None:
                self.waiters.remove(waiter)
            return waiter.slot


def crowded(manager: _PgEngine[Any]) -> bool:
    """Whether threads or tasks wait for one of ``manager``'s connections (asked under its
    ``_guard``): a connection that would go idle is closed instead, its slot theirs."""
    capacity = manager._capacity
    if capacity is None:
        return False
    with capacity.lock:
        return capacity.crowded()


def keep_idle(manager: _PgEngine[Any], link: _Link, idle: list[Any]) -> None:
    """A borrowed ``link`` back to ``idle`` (a list of ``manager``'s), or closed if someone
    waits for a connection (``crowded``)."""
    with manager._guard:
        keep = not crowded(manager)
        if keep:
            idle.append(link)
    if not keep:
        link.close()


def claim(manager: _PgEngine[Any],
          loop: asyncio.AbstractEventLoop | None = None) -> _Slot | _Waiter | None:
    """A slot for a new connection of ``manager`` (None without a cap): one free, or an
    idle connection's (threads' or tasks': it is closed), or else a place in the queue
    (``_Capacity.wait``, ``wait_async``)."""
    capacity = manager._capacity
    if capacity is None:
        return None
    with manager._guard:
        with capacity.lock:
            if capacity.waiters or capacity.open < capacity.limit:
                return capacity.take_or_queue(loop)
        link = manager._pop_idle() or (manager._task_idle.pop() if manager._task_idle else None)
        if link is None or link.slot is None:
            with capacity.lock:
                taken = capacity.take_or_queue(loop)
        else:
            taken, link.slot = link.slot, None
    if link is not None:
        link.close()
    return taken


def new_link(manager: _PgEngine[Any], deadline: float | bool | None,
             connect_by: float | None = None, counted: bool = True) -> _Link:
    """A new connection of ``manager``'s threads, in a slot under its cap, waited for until
    ``deadline`` (True: soon, ``_answer_by``) and given back if connecting fails; outside
    the cap if not ``counted``. Connected by ``connect_by`` (``_Link.connect``)."""
    slot = reserve(manager, _answer_by() if deadline is True else deadline) if counted else None
    try:
        link = _Link.connect(manager._dsn, manager._connect_kwargs, manager._fence_table.statements,
                             connect_by)
    except BaseException:
        if slot is not None:
            slot.free()
        raise
    link.slot = slot
    return link


def reserve(manager: _PgEngine[Any], deadline: float | bool | None) -> _Slot | None:
    """``claim`` for the calling thread: a place in the queue waited out until ``deadline``
    (``_NoConnectionFree``)."""
    taken = claim(manager)
    if isinstance(taken, _Waiter):
        assert manager._capacity is not None
        return manager._capacity.wait(taken, _answer_by() if deadline is True else deadline)
    return taken


async def reserve_async(manager: _PgEngine[Any], deadline: float | bool | None) -> _Slot | None:
    """``reserve`` for the current task: it awaits its turn."""
    import asyncio

    taken = claim(manager, asyncio.get_running_loop())
    if isinstance(taken, _Waiter):
        assert manager._capacity is not None
        return await manager._capacity.wait_async(
            taken, _answer_by() if deadline is True else deadline)
    return taken


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
