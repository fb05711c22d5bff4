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
it). Every table, entry, request and token field is guarded by the manager's ``_mutex``.

Invariants (kept under ``_mutex``):
- an entry is in the table iff it has a holder or a queued request;
- ``entry.count > 0`` iff ``entry.owner is not None``; every read count is > 0;
- in fair mode an entry whose head request could be granted has no queue: ``_pass_on``
  runs whenever a holder or a request leaves;
- with ``fair=False``, an entry without holders but with a queue has a WOKEN head, on its
  way to take the key;
- a token's ``wakeup`` lock is released (posted) only on a request's WAITING -> WOKEN or
  WAITING -> GRANTED transition (WOKEN -> GRANTED reuses the post already made), and the
  waiter consumes that post before its request goes back to WAITING or leaves the queue,
  so the lock acts as a binary semaphore.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar, final

from ._common import (
    HANDOFF_AFTER,
    MAIN_THREAD_SLICE,
    PICKLE_ERROR,
    READ,
    WRITE,
    LockStats,
    deadlock,
    hold_seconds,
    key_lock_repr,
    manager_repr,
    many_items,
    not_owned,
    restored_count,
    rw_items,
    Stripe,
    stripe_count,
    stripe_index,
    synchronized,
    timed_out,
    wait_seconds,
    warn_abandoned,
)

__all__ = ["KeyLock", "LockManager", "RWLockManager"]

K = TypeVar("K", bound=Hashable)

_WAITING = 0  # queued, asleep or about to sleep
_WOKEN = 1  # fair=False: the key was freed and this request was told to race for it
_GRANTED = 2  # the key was handed to this request; its thread holds it now
_LEFT = 3  # timed out or cancelled: out of the queue, its thread about to return

_READ = READ  # shared: any number of threads at once (RWLockManager)
_WRITE = WRITE  # exclusive (every LockManager request)


class _Token:
    """The identity of one thread towards every manager; ownership means this object."""

    __slots__ = ("held", "ident", "is_main", "reads", "request", "wakeup")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.is_main = threading.current_thread() is threading.main_thread()
        self.held: dict[_Entry, weakref.ref[_Engine]] = {}  # write-held entries -> manager
        self.reads: dict[_Entry, weakref.ref[_Engine]] = {}  # read-held entries -> manager
        self.wakeup = threading.Lock()  # held except while a grant/wake is posted
        self.wakeup.acquire()
        self.request: _Request | None = None  # the request its thread is waiting in


class _ThreadExit:
    """Held only by its thread's local storage, so it is finalized when the thread ends.

    It then releases whatever the thread still holds (waiters get those keys as usual).
    Entries refer to their owner's token, so the token itself may outlive its thread.
    """

    __slots__ = ("token",)

    def __init__(self, token: _Token) -> None:
        self.token = token

    def __del__(self) -> None:
        token = self.token
        if token.request is not None or _forking:
            return  # shutdown or a forked child: the thread is gone mid-wait or fork cleans up
        abandoned = [entry.key for entry in token.held]
        abandoned += [entry.key for entry in token.reads if entry.owner is not token]
        for manager_ref in {*token.held.values(), *token.reads.values()}:
            manager = manager_ref()
            if manager is not None:
                manager._release_held(token)
        if abandoned and not sys.is_finalizing():
            warn_abandoned(token.ident, abandoned)


_local = threading.local()
_managers: weakref.WeakSet[_Engine] = weakref.WeakSet()  # every live manager (for fork)
_forking = False  # between os.fork()'s before hook and its after hook


def _current_token() -> _Token:
    try:
        token: _Token = _local.guard.token
    except AttributeError:
        token = _Token()
        _local.guard = _ThreadExit(token)
    return token


def _existing_token() -> _Token | None:
    guard: _ThreadExit | None = getattr(_local, "guard", None)
    return None if guard is None else guard.token


class _Request:
    __slots__ = ("at_head", "count", "entry", "lead", "manager", "mode", "nodes", "queued",
                 "since", "state", "token")

    def __init__(
        self, token: _Token, manager: _Engine, entry: _Entry, mode: int, count: int
    ) -> None:
        self.token = token  # the waiting thread
        self.manager = manager  # whose queue it is (or would be) in
        self.entry = entry  # the entry whose queue it is (or would be) in
        self.mode = mode  # _READ or _WRITE
        self.count = count  # recursion level to install when granted
        self.state = _WAITING
        self.since = time.monotonic()  # when it queued (fair=False's hand-off rule)
        self.at_head = False  # an upgrade: queued before every other request
        self.lead: _Request | None = None  # multi-key: the first node, which speaks for all
        self.nodes: list[_Request] | None = None  # multi-key, on the lead: every node
        self.queued = True  # multi-key: it waits in its entry's queue (else it re-enters)

    def members(self) -> Sequence[_Request]:
        """The nodes of a multi-key lead, or the single request itself."""
        return (self,) if self.nodes is None else self.nodes


class _Entry:
    __slots__ = ("count", "key", "owner", "queue", "readers")

    def __init__(self, key: Hashable) -> None:
        self.key = key  # the key as first given
        self.owner: _Token | None = None  # the write holder
        self.count = 0  # the write holder's recursion level
        self.readers: dict[_Token, int] = {}  # read holders -> their recursion levels
        self.queue: deque[_Request] = deque()  # waiting requests, oldest first


class _Engine:
    """The table, holds, queues, grants and waits that every manager shares."""

    __slots__ = (
        "_acquisitions",
        "_contended",
        "_deadlocks",
        "_fair",
        "_held",
        "_mutex",
        "_ref",
        "_stripe_keys",
        "_table",
        "_timeouts",
        "_waiting",
        "__weakref__",
    )

    def __init__(self, stripes: int | None = None) -> None:
        count = stripe_count(stripes)
        # striped: one Stripe key per stripe; None: exact keys
        self._stripe_keys = None if count is None else tuple(map(Stripe, range(count)))
        self._fair = True
        self._mutex = threading.Lock()  # guards everything below and every entry and request
        self._table: dict[Hashable, _Entry] = {}
        self._held = 0  # entries with a write or read holder
        self._waiting = 0
        self._acquisitions = 0
        self._contended = 0
        self._timeouts = 0
        self._deadlocks = 0
        self._ref = weakref.ref(self)  # what tokens keep: they must not keep the manager alive
        _managers.add(self)

    def __del__(self) -> None:
        # Nobody waits here (a waiter's call keeps the manager alive), but keys may be held.
        for entry in getattr(self, "_table", {}).values():  # __init__ may have failed
            if entry.owner is not None:
                entry.owner.held.pop(entry, None)
            for reader in entry.readers:
                reader.reads.pop(entry, None)

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
        with self._mutex:
            return LockStats(
                held=self._held,
                waiting=self._waiting,
                acquisitions=self._acquisitions,
                contended=self._contended,
                timeouts=self._timeouts,
                deadlocks=self._deadlocks,
            )

    def release_all(self) -> int:
        """Release every key of this manager the calling thread holds, all levels; returns how many."""
        token = _existing_token()
        return 0 if token is None else self._release_held(token)

    # -- acquiring (everything below runs under _mutex unless it says otherwise) ------------

    def _acquire_write(self, key: Hashable, seconds: float, count: int) -> bool:
        """Acquire ``count`` write levels of ``key``, waiting at most ``seconds`` (-1: forever)."""
        token = _current_token()
        with self._mutex:
            entry = self._table.get(key)
            if entry is None:
                entry = self._table[key] = _Entry(key)
                self._own(entry, token, count)
                return True
            if entry.owner is token:
                entry.count += count
                self._acquisitions += 1
                return True
            upgrade = token in entry.readers
            if entry.owner is None and (
                (not entry.readers and (not entry.queue or entry.queue[0].state == _WOKEN))
                or (upgrade and len(entry.readers) == 1)
            ):
                # Free and nobody queued (with fair=False, a woken head that has not run yet
                # may be overtaken), or the caller is the only reader: an upgrade goes at once.
                self._own(entry, token, count)
                return True
            request = self._single(entry, token, seconds, count, _WRITE, upgrade)
        return request is not None and self._wait(request, seconds)

    def _acquire_read(self, key: Hashable, seconds: float) -> bool:
        token = _current_token()
        with self._mutex:
            entry = self._table.get(key)
            if entry is not None and token in entry.readers:
                entry.readers[token] += 1  # reentrant, even past queued writers
                self._acquisitions += 1
                return True
            if entry is None:
                entry = self._table[key] = _Entry(key)
            if entry.owner is token or (entry.owner is None and not entry.queue):
                self._add_read(entry, token, 1)
                return True
            request = self._single(entry, token, seconds, 1, _READ, False)
        return request is not None and self._wait(request, seconds)

    def _single(
        self, entry: _Entry, token: _Token, seconds: float, count: int, mode: int, upgrade: bool
    ) -> _Request | None:
        """The key is taken: give up (try-lock, None) or queue a request."""
        if seconds == 0:
            self._timeouts += 1
            return None
        request = _Request(token, self, entry, mode, count)
        request.at_head = upgrade
        self._queue(request)
        return request

    def _acquire_many(self, items: list[tuple[Hashable, int]], seconds: float) -> bool:
        """Take every distinct ``(key, mode)`` of ``items`` at once, or none of them."""
        if not items:
            return True
        token = _current_token()
        with self._mutex:
            nodes = []
            ready = True
            for key, mode in items:
                entry = self._table.get(key)
                if entry is None:
                    entry = self._table[key] = _Entry(key)
                node = _Request(token, self, entry, mode, 1)
                nodes.append(node)
                if mode == _WRITE:
                    if entry.owner is token:
                        node.queued = False
                    else:
                        node.at_head = token in entry.readers
                        ready = ready and entry.owner is None and (
                            (not entry.readers and not entry.queue)
                            or (node.at_head and len(entry.readers) == 1))
                elif token in entry.readers or entry.owner is token:
                    node.queued = False
                else:
                    ready = ready and entry.owner is None and not entry.queue
            lead = nodes[0]
            lead.nodes = nodes
            for node in nodes:
                node.lead = lead
            if ready:
                self._grant_nodes(lead, enqueued=False)
                return True
            if seconds == 0:
                self._discard(lead)
                self._timeouts += 1
                return False
            self._queue(lead)
        return self._wait(lead, seconds)

    def _queue(self, request: _Request) -> None:
        """Refuse ``request`` (single, or a multi-key lead) if waiting would deadlock, else
        queue every node of it."""
        cycle = self._find_cycle(request.token, request)
        if cycle is not None:
            self._discard(request)
            self._deadlocks += 1
            raise deadlock(cycle)
        for node in request.members():
            if node.queued:
                if node.at_head:  # no writer behind could get in before it anyway
                    node.entry.queue.appendleft(node)
                else:
                    node.entry.queue.append(node)
        request.token.request = request
        self._waiting += 1

    def _find_cycle(self, me: _Token, request: _Request) -> list[tuple[int, Hashable]] | None:
        """The cycle ``me`` would close by queueing ``request`` (not queued yet), or None.

        A waiting request waits for the holders it conflicts with and for the conflicting
        requests queued ahead of it (PostgreSQL's hard and soft edges); see the compiled
        core's ``find_cycle``, which this follows step for step.
        """
        reached: dict[_Token, tuple[_Token, _Entry]] = {}  # thread -> who waits for it, where
        stack: list[_Token] = []

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
            for successor in successors:
                if successor is None or successor is thread:
                    continue
                if successor is me:
                    reached[me] = (thread, waits_for)
                    return True
                if successor not in reached:
                    reached[successor] = (thread, waits_for)
                    stack.append(successor)
            return False

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
            if own is not None and own.state in (_WAITING, _WOKEN) and own.manager is self:
                closed = reach_request(thread, own, True)
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

    def _wait(self, request: _Request, seconds: float) -> bool:
        """Sleep until ``request`` (queued) is granted or its time runs out. Called without
        _mutex."""
        deadline = None if seconds < 0 else request.since + seconds
        wakeup = request.token.wakeup
        slice_ = MAIN_THREAD_SLICE if request.token.is_main else -1.0
        try:
            while True:
                if deadline is None:
                    remaining = slice_
                else:
                    remaining = max(0.0, deadline - time.monotonic())
                    if slice_ > 0:
                        remaining = min(remaining, slice_)
                # Signal handlers run inside this acquire (main thread) and may raise.
                posted = wakeup.acquire(timeout=remaining)
                with self._mutex:
                    if request.state != _WAITING:
                        if not posted:
                            wakeup.acquire(blocking=False)  # consume the post
                        if request.state == _WOKEN:  # single requests only
                            if self._grantable(request.entry, request):
                                self._grant(request.entry, request)
                            else:
                                request.state = _WAITING  # overtaken: sleep again at the head
                        if request.state == _GRANTED:
                            self._contended += 1
                            return True
                    if deadline is not None and time.monotonic() >= deadline:
                        self._leave(request)
                        self._timeouts += 1
                        return False
        except BaseException:
            with self._mutex:
                if request.state == _GRANTED:  # only this thread can release what it was granted
                    self._undo_grant(request)
                else:
                    wakeup.acquire(blocking=False)  # consume a post that raced us
                    self._leave(request)
            raise
        finally:
            request.token.request = None

    def _leave(self, request: _Request) -> None:
        """Take a waiting ``request`` (single, or a multi-key lead) out of every queue."""
        for node in request.members():
            if node.queued:
                node.entry.queue.remove(node)
        self._waiting -= 1
        request.state = _LEFT
        self._discard(request)

    def _discard(self, request: _Request) -> None:
        """Let the entries of a request that was never granted move on (entries it created
        and nobody uses go)."""
        for node in request.members():
            self._pass_on(node.entry)

    def _undo_grant(self, request: _Request) -> None:
        """Give back everything a granted request (single, or multi-key lead) took."""
        for node in request.members():
            self._acquisitions -= 1
            token = node.token
            if node.mode == _WRITE:
                if node.queued:
                    self._disown(node.entry)
                else:
                    node.entry.count -= 1
            elif node.entry.readers[token] == 1:  # the grant made this read hold
                self._drop_read(node.entry, token)
            else:
                node.entry.readers[token] -= 1
        for node in request.members():
            self._pass_on(node.entry)

    # -- releasing ---------------------------------------------------------------------------

    def _release_write(self, key: Hashable) -> None:
        token = _existing_token()
        with self._mutex:
            entry = self._table.get(key)
            if entry is None or token is None or entry.owner is not token:
                raise not_owned(key)
            entry.count -= 1
            if entry.count == 0:
                self._disown(entry)
                self._pass_on(entry)

    def _release_read(self, key: Hashable) -> None:
        token = _existing_token()
        with self._mutex:
            entry = self._table.get(key)
            if entry is None or token is None or token not in entry.readers:
                raise not_owned(key)
            entry.readers[token] -= 1
            if entry.readers[token] == 0:
                self._drop_read(entry, token)
                self._pass_on(entry)

    def _release_many(self, items: list[tuple[Hashable, int]]) -> None:
        """Undo one ``_acquire_many`` of ``items``: all of them, or (if one is not held as
        asked) none, with NotOwnedError."""
        token = _existing_token()
        with self._mutex:
            entries = [self._table.get(key) for key, _ in items]
            for (key, mode), entry in zip(items, entries, strict=True):
                if entry is None or token is None or (
                    entry.owner is not token if mode == _WRITE else token not in entry.readers
                ):
                    raise not_owned(key)
            for (_, mode), entry in zip(items, entries, strict=True):
                assert entry is not None and token is not None
                if mode == _WRITE:
                    entry.count -= 1
                    if entry.count == 0:
                        self._disown(entry)
                else:
                    entry.readers[token] -= 1
                    if entry.readers[token] == 0:
                        self._drop_read(entry, token)
                self._pass_on(entry)

    def _release_held(self, token: _Token) -> int:
        """Fully release every key of this manager ``token`` holds; returns how many keys."""
        released = 0
        with self._mutex:
            for entry, manager in list(token.reads.items()):  # reads first: see _core
                if manager is self._ref:
                    released += entry.owner is not token
                    self._drop_read(entry, token)
                    self._pass_on(entry)
            for entry, manager in list(token.held.items()):
                if manager is self._ref:
                    released += 1
                    self._disown(entry)
                    self._pass_on(entry)
        return released

    def _pass_on(self, entry: _Entry) -> None:
        """A holder or a request left ``entry``: grant what the queue's head allows (a run
        of readers together, or one writer), or drop the entry if nothing is left."""
        while True:
            if not entry.queue:
                if entry.owner is None and not entry.readers:
                    del self._table[entry.key]
                    if not self._table:
                        self._table.clear()  # dicts never shrink on delete; this frees a grown one
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
        if entry.owner is not None:
            return False
        readers = entry.readers
        return request.mode == _READ or not readers or (
            len(readers) == 1 and request.token in readers)

    def _grant(self, entry: _Entry, request: _Request) -> None:
        entry.queue.remove(request)
        self._take(entry, request)
        self._waiting -= 1
        request.state = _GRANTED

    def _take(self, entry: _Entry, request: _Request) -> None:
        if request.mode == _READ:
            self._add_read(entry, request.token, request.count)
        else:
            self._own(entry, request.token, request.count)

    def _group_grantable(self, lead: _Request) -> bool:
        """Every node of a multi-key request is at the head of its queue and compatible."""
        return all(
            node.entry.queue[0] is node and self._grantable(node.entry, node)
            for node in lead.members() if node.queued
        )

    def _grant_nodes(self, lead: _Request, enqueued: bool) -> None:
        """Give a multi-key request every key at once: queued nodes take their entries,
        the others re-enter keys the caller already holds."""
        for node in lead.members():
            entry, token = node.entry, node.token
            if node.queued:
                if enqueued:
                    entry.queue.remove(node)
                self._take(entry, node)
            elif node.mode == _WRITE:
                entry.count += 1
                self._acquisitions += 1
            elif token not in entry.readers:  # reading a key it writes
                self._add_read(entry, token, 1)
            else:
                entry.readers[token] += 1
                self._acquisitions += 1
        lead.state = _GRANTED

    def _grant_group(self, lead: _Request, passing: _Entry) -> None:
        """_pass_on found ``lead`` grantable at the head of ``passing``."""
        self._grant_nodes(lead, enqueued=True)
        self._waiting -= 1
        lead.token.wakeup.release()
        for node in lead.members():  # readers queued behind its read nodes may follow it in
            if node.queued and node.entry is not passing and node.mode == _READ:
                self._pass_on(node.entry)  # never drops the entry: it has a holder now

    # -- holders -----------------------------------------------------------------------------

    def _own(self, entry: _Entry, token: _Token, count: int) -> None:
        if not entry.readers:
            self._held += 1
        entry.owner = token
        entry.count = count
        token.held[entry] = self._ref
        self._acquisitions += 1

    def _disown(self, entry: _Entry) -> None:
        owner = entry.owner
        assert owner is not None
        del owner.held[entry]
        if not owner.held:
            owner.held.clear()  # dicts never shrink on delete; this frees a grown one
        entry.owner = None
        entry.count = 0
        if not entry.readers:
            self._held -= 1

    def _add_read(self, entry: _Entry, token: _Token, count: int) -> None:
        if entry.owner is None and not entry.readers:
            self._held += 1
        entry.readers[token] = count
        token.reads[entry] = self._ref
        self._acquisitions += 1

    def _drop_read(self, entry: _Entry, token: _Token) -> None:
        del entry.readers[token]
        del token.reads[entry]
        if not token.reads:
            token.reads.clear()  # dicts never shrink on delete; this frees a grown one
        if entry.owner is None and not entry.readers:
            self._held -= 1

    def _leave_queue(self, entry: _Entry, request: _Request) -> None:
        entry.queue.remove(request)
        self._waiting -= 1
        request.state = _LEFT

    def _keep_only(self, survivor: _Token | None) -> None:
        """In a forked child (see _after_fork_in_child); the mutex was held across fork()."""
        self._mutex = threading.Lock()
        for key, entry in list(self._table.items()):
            for request in entry.queue:
                request.token.request = None
            entry.queue.clear()
            if entry.owner is not None and entry.owner is not survivor:
                self._disown(entry)
            for reader in [reader for reader in entry.readers if reader is not survivor]:
                self._drop_read(entry, reader)
            if entry.owner is None and not entry.readers:
                del self._table[key]
        self._waiting = 0


@final
class LockManager(_Engine, Generic[K]):
    """Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

    Memory grows only with the keys currently held or waited on.
    """

    __slots__ = ()

    def __init__(self, *, fair: bool = True, stripes: int | None = None) -> None:
        super().__init__(stripes)
        self._fair = bool(fair)

    @property
    def fair(self) -> bool:
        """True for strict FIFO hand-off, False for eventual fairness (see the README)."""
        return self._fair

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

    def __getitem__(self, key: K) -> KeyLock[K]:
        """The per-key lock view: behaves like a ``threading.RLock`` for this one key."""
        return KeyLock(self, key)

    def synchronized(self, key_func: Any) -> Any:
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs."""
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
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return entry is not None and entry.owner is not None

    def owned(self, key: K) -> bool:
        """Whether the calling thread holds ``key``."""
        token = _existing_token()
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return entry is not None and token is not None and entry.owner is token

    def owner(self, key: K) -> int | None:
        """The ``threading.get_ident()`` of the thread holding ``key``, or None."""
        return self._owner_and_count(key)[0]

    def recursion_count(self, key: K) -> int:
        """How many times the calling thread holds ``key`` (0 if it does not)."""
        token = _existing_token()
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            if entry is None or token is None or entry.owner is not token:
                return 0
            return entry.count

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is currently held (by any thread)."""
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return entry is not None and entry.owner is not None

    def _owner_and_count(self, key: K) -> tuple[int | None, int]:
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            if entry is None or entry.owner is None:
                return None, 0
            return entry.owner.ident, entry.count

    def _release_save(self, key: K) -> tuple[int, int]:
        token = _existing_token()
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            if entry is None or token is None or entry.owner is not token:
                raise not_owned(key)
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

    def __init__(self, *, stripes: int | None = None) -> None:
        super().__init__(stripes)

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
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return 0 if entry is None else len(entry.readers)

    def write_locked(self, key: K) -> bool:
        """Whether a thread holds ``key`` for writing."""
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return entry is not None and entry.owner is not None

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has any holder."""
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return entry is not None and (entry.owner is not None or bool(entry.readers))

    def _read_count(self, key: K) -> int:
        """How many times the calling thread reads ``key``."""
        token = _existing_token()
        with self._mutex:
            entry = self._table.get(self._table_key(key))
            return 0 if entry is None or token is None else entry.readers.get(token, 0)


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
    """Hold every manager's mutex across fork(), so the child sees whole tables."""
    global _forking
    _forking = True
    for manager in sorted(_managers, key=id):
        manager._mutex.acquire()


def _after_fork_in_parent() -> None:
    global _forking
    for manager in sorted(_managers, key=id):
        manager._mutex.release()
    _forking = False


def _after_fork_in_child() -> None:
    """The child holds only what the forking thread held; the rest is free, queues are empty."""
    global _forking
    survivor = _existing_token()
    if survivor is not None:
        survivor.is_main = True  # the forking thread is the child's main thread
    for manager in list(_managers):
        manager._keep_only(survivor)
    _forking = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
