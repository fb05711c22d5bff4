"""``max_connections``: the cap on a manager's connections, and the first-come, first-served
queue of the threads and tasks waiting for one (``_Capacity``).

A connection takes a ``_Slot`` when it is opened and gives it back when it closes
(``_Link.close``, whatever closes it). A slot given back while threads or tasks wait goes
straight to the one that has waited longest: nobody who came later can take it first. A
connection that would go back to the idle list (or stay parked with its thread) while
someone waits is closed instead, so that its slot goes to them (a reconnect, only at the
cap, and the order kept); a newcomer at the cap takes an idle or parked one's slot."""

from __future__ import annotations

import _thread
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
    """One connection's place under the cap once ``capacity`` is set; ``free`` (once) gives
    it back. Its owner makes it empty, before the ``try`` that frees it whatever happens
    (an interrupt, a signal handler's exception, at any point): the cap sets ``capacity``
    together with its count, with no check point between (``_Capacity``), so no place
    exists that nobody owns."""

    __slots__ = ("capacity",)

    def __init__(self) -> None:
        self.capacity: _Capacity | None = None

    def free(self) -> None:
        capacity, self.capacity = self.capacity, None
        if capacity is not None:
            capacity.give_back()


class _Waiter:
    """A thread (``loop`` None) or a task claiming its owner's ``slot``: it waits in line
    (``queued``) until given one. Made before the ``try`` that gives it up (``leave``)."""

    __slots__ = ("woken", "future", "loop", "queued", "slot")

    def __init__(self, loop: asyncio.AbstractEventLoop | None, slot: _Slot) -> None:
        self.loop = loop
        self.slot = slot
        self.queued = False
        # A thread's: a bare lock, held until it is given a slot; released by one C call,
        # which no signal handler can interrupt half-way (threading.Event's set is Python).
        self.woken = None if loop is not None else _thread.allocate_lock()
        if self.woken is not None:
            self.woken.acquire()
        self.future: asyncio.Future[None] | None = None if loop is None else loop.create_future()

    def wake(self) -> bool:
        """Tell the waiter it has its slot; False if nobody can take it (its loop is closed)."""
        if self.woken is not None:
            self.woken.release()
            return True
        assert self.loop is not None and self.future is not None
        try:
            self.loop.call_soon_threadsafe(_wake, self.future)
        except RuntimeError:  # its loop is closed
            return False
        return True


class _Capacity:
    """At most ``limit`` connections open at once, threads' and tasks' together (``of``).

    ``lock`` is reentrant: a connection collected inside one of its spans gives its slot
    back on the same thread. Whoever also needs the manager's ``_guard`` takes that first.
    Every change of ``open`` sets or clears a slot's ``capacity`` with no call between
    (where CPython runs signal handlers): an exception anywhere leaves each place counted
    and owned, or free. A place left free while someone waits (an interrupt between giving
    one back and handing it out) goes to them at the next give-back (``hand_out``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.RLock()
        self.open = 0  # slots taken (connections open, or being opened)
        self.waiters: collections.deque[_Waiter] = collections.deque()
        # Tasks given a slot that have not taken it yet (``leave``): one whose loop stops,
        # then closes, never will (``reclaim_stranded``).
        self.handed: set[_Waiter] = set()

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

    def take_or_queue(self, waiter: _Waiter) -> bool:
        """``waiter``'s slot taken if one is free and nobody waits (True), else its place at
        the end of the queue (under ``lock``)."""
        if not self.waiters and self.open < self.limit:
            self.open += 1
            waiter.slot.capacity = self
            return True
        waiter.queued = True  # first: an interrupt as append returns finds it in line
        self.waiters.append(waiter)
        return False

    def give_back(self) -> None:
        """A slot is free: to the longest waiter still there, else back to the count."""
        with self.lock:
            self.open -= 1
            self.hand_out()

    def hand_out(self) -> None:
        """Free places to the longest waiters (under ``lock``)."""
        while self.waiters and self.open < self.limit:
            waiter = self.waiters[0]
            self.open += 1
            waiter.slot.capacity = self
            self.waiters.popleft()
            waiter.queued = False
            if waiter.loop is not None:
                self.handed.add(waiter)
            if not waiter.wake():  # nobody takes it there
                self.handed.discard(waiter)
                waiter.slot.capacity = None
                self.open -= 1

    def reclaim_stranded(self) -> None:
        """The slots given to tasks whose loop was closed before they took them (a loop
        stopped with them waiting, then closed): nobody takes them there."""
        with self.lock:
            stranded = [waiter for waiter in self.handed
                        if waiter.loop is not None and waiter.loop.is_closed()]
            for waiter in stranded:
                self.handed.discard(waiter)
                waiter.slot.free()

    def wait(self, waiter: _Waiter, deadline: float | None) -> None:
        """The calling thread's slot, once given, by ``deadline`` (None: however long it
        takes); past it, ``_NoConnectionFree``. Its caller gives up its place, and frees a
        slot given, whatever happens (``leave``)."""
        assert waiter.woken is not None
        waiter.woken.acquire(timeout=-1 if deadline is None
                             else max(0.0, deadline - time.monotonic()))
        self._given_or_overdue(waiter)

    async def wait_async(self, waiter: _Waiter, deadline: float | None) -> None:
        """``wait`` for the current task: it awaits, the loop runs on."""
        import asyncio

        assert waiter.future is not None
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), left)
        except TimeoutError:
            pass
        self._given_or_overdue(waiter)

    def _given_or_overdue(self, waiter: _Waiter) -> None:
        if not self.leave(waiter):
            raise _NoConnectionFree("no connection free under max_connections in time")

    def leave(self, waiter: _Waiter) -> bool:
        """The waiter's wait ended (given a slot, timed out, interrupted): whether it got
        one, after which its owner must use or free it; else its place in the queue goes."""
        with self.lock:
            self.handed.discard(waiter)
            if waiter.slot.capacity is not None:
                return True
            if waiter.queued:
                self.waiters.remove(waiter)
                waiter.queued = False
            return False


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


def claim(manager: _PgEngine[Any], waiter: _Waiter) -> bool:
    """``waiter``'s slot for a new connection of ``manager`` (with a cap): one free, or an
    idle connection's (threads' or tasks': it is closed), True; or else its place in the
    queue (``_Capacity.wait``, ``wait_async``)."""
    capacity = manager._capacity
    assert capacity is not None
    with manager._guard:
        with capacity.lock:
            if capacity.waiters or capacity.open < capacity.limit:
                return capacity.take_or_queue(waiter)
        # (an interrupt as it returns: the link, collected, closes and frees its slot)
        link = manager._pop_idle() or (manager._task_idle.pop() if manager._task_idle else None)
        if link is None or link.slot is None:
            with capacity.lock:
                taken = capacity.take_or_queue(waiter)
        else:  # its place moves to the waiter's slot, in one step
            waiter.slot.capacity, link.slot.capacity = link.slot.capacity, None
            taken = True
    if link is not None:
        link.close()
    return taken


def new_link(manager: _PgEngine[Any], deadline: float | bool | None,
             connect_by: float | None = None, counted: bool = True) -> _Link:
    """A new connection of ``manager``'s threads, in a slot under its cap, waited for until
    ``deadline`` (True: soon, ``_answer_by``) and given back if connecting fails; outside
    the cap if not ``counted``. Connected by ``connect_by`` (``_Link.connect``)."""
    slot = _Slot()
    try:
        if counted:
            reserve(manager, _answer_by() if deadline is True else deadline, slot)
        link = _Link.connect(manager._dsn, manager._connect_kwargs, manager._fence_table.statements,
                             connect_by)
        link.slot = slot if slot.capacity is not None else None
    except BaseException:
        slot.free()
        raise
    return link


def reserve(manager: _PgEngine[Any], deadline: float | bool | None, slot: _Slot) -> None:
    """``slot`` (empty, its caller's to free) takes a place under ``manager``'s cap, if it
    has one: a free one, or one waited for in line until ``deadline``
    (``_NoConnectionFree``)."""
    capacity = manager._capacity
    if capacity is None:
        return
    waiter = _Waiter(None, slot)
    try:
        if not claim(manager, waiter):
            capacity.wait(waiter, _answer_by() if deadline is True else deadline)
    finally:
        capacity.leave(waiter)  # out of the line, whatever ended the wait


async def reserve_async(manager: _PgEngine[Any], deadline: float | bool | None,
                        slot: _Slot) -> None:
    """``reserve`` for the current task: it awaits its turn."""
    import asyncio

    capacity = manager._capacity
    if capacity is None:
        return
    waiter = _Waiter(asyncio.get_running_loop(), slot)
    try:
        if not claim(manager, waiter):
            await capacity.wait_async(waiter, _answer_by() if deadline is True else deadline)
    finally:
        capacity.leave(waiter)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
