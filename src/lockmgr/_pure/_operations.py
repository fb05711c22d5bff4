"""The pure twin's operations (the compiled core's ``_c/operations.pxi``): acquiring (one key,
several at once), the deadlock search, waiting, releasing and granting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from .._args import MAX_COUNT
from .._owners import AWAITED_THREAD, CONTEXT_TASK, WAIT_CHECK, awaits_this_thread
from .._quiet import block_handlers, run_blocked
from .._tuning import HANDOFF_AFTER
from ._state import (
    _AWAITED_THREAD,
    _GRANTED,
    _LEFT,
    _LOOP_THREAD,
    _NESTED,
    _NOT_OWNED,
    _OVERFLOW,
    _PINNED,
    _READ,
    _WAIT_SLICE,
    _WAITING,
    _WOKEN,
    _WRITE,
    _Entry,
    _Request,
    _TaskToken,
    _Token,
    _failure,
    _get_ident,
    _is_plain,
    _section,
)
from ._runtime import _current_token, _existing_token, _thread_tokens
from ._table import _has_slot, _holds_every_slot, _Table, _time_grant, _time_holds, _Unsure


class _Operations(_Table):
    """Acquiring, waiting and releasing (over ``_Table``)."""

    __slots__ = ()

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
            # The handlers blocked inline, by a C call, before the section: a Python call's
            # start is a check point where another handler's exception would skip it (the
            # compiled core's C has none); that exception is raised after the section.
            try:
                blocked: Iterable[int] | BaseException = block_handlers()
            except BaseException as stopped:  # (pending: blocked now too)
                blocked = stopped
            run_blocked(blocked, _section, self._abandon_section, token, outer)
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
            if self._counts_slots:  # a semaphore's one slot, held by the caller itself
                return self._refuse_own_wait(key, token, seconds)
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
                             seconds, self._limit_for(key))

    def _take_read(
        self, entry: _Entry | None, key: Hashable, key_hash: int, plain: bool, token: _Token,
        seconds: float, limit: int = 0,
    ) -> object:
        if entry is None:
            entry = self._new_entry(key, key_hash, plain, limit)
            self._add_read(entry, token, 1)
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _READ, 1)
        level = entry.readers.get(token)
        if level is not None and not entry.limit:  # RWLockManager: reentrant, past writers
            if level >= MAX_COUNT:
                return key, _OVERFLOW
            self._read(entry, token, 1)
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _READ, 1)
        if entry.owner is token or (entry.owner is None and _has_slot(entry) and (
                not entry.queue or not self._fair)):  # fair=False: a free slot past a queue
            self._read(entry, token, 1)  # a semaphore's holder: one more slot
            self._acquisitions += 1
            return self._granted_at_once(entry, token, _READ, 1)
        if _holds_every_slot(entry, token):
            return self._refuse_own_wait(key, token, seconds)
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
        limits = [self._limit_for(key) for key, _ in items]
        while True:
            verdict = _section(self._take_many_section, items, hashes, plains, known, token,
                               seconds, limits)
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
        limits: list[int],
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
        refused = self._refuse_own_waits(items, entries, token, seconds)
        if refused is not None:
            return refused
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
            elif token in entry.readers and not entry.limit:
                if entry.readers[token] >= MAX_COUNT:
                    return index, _OVERFLOW
                continue
            else:
                free = entry.owner is token or (
                    entry.owner is None and not entry.queue and _has_slot(entry))
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
                entry = self._new_entry(key, hashes[index], plains[index], limits[index])
            node = _Request(token, self, entry, mode, 1)
            nodes.append(node)
            if mode == _WRITE:
                if entry.owner is token:
                    node.queued = False
                else:
                    node.at_head = token in entry.readers
            elif entry.owner is token or (token in entry.readers and not entry.limit):
                node.queued = False  # re-entered (a semaphore's slot is one more: queued)
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

        A thread that runs in a task's context (``lockmgr._owners.CONTEXT_TASK``) may run for
        that task (``asyncio.to_thread``): the search has the task wait for it too. A cycle
        closed through that edge counts only if the task is indeed suspended awaiting this
        thread; else the search runs again without it (the core's ``execute_for_thread``).
        """
        if type(me) is _TaskToken:
            if not me.held and not me.reads:
                return None  # nobody can wait for a task that holds nothing (see _core)
            return self._search_cycle(me, request, None)
        awaiting = CONTEXT_TASK.get()
        cycle = self._search_cycle(me, request, awaiting)
        if (cycle is not None and awaiting is not None
                and any(key is AWAITED_THREAD for _, key in cycle)
                and not awaits_this_thread(awaiting)):
            cycle = self._search_cycle(me, request, None)
        return cycle

    def _search_cycle(self, me: _Token, request: _Request,
                      awaiting: Any) -> list[tuple[Any, Hashable]] | None:
        """``_find_cycle``'s search, with the task ``awaiting`` (or None) waiting for ``me``.

        A waiting request waits for the holders it conflicts with and for the requests
        queued ahead of it that ``_pass_on`` grants first (PostgreSQL's hard and soft edges),
        in any manager of this engine: exactly the list beside the compiled core's
        ``reach_waited_for``, which this follows step for step.
        """
        reached: dict[_Token, tuple[_Token, _Entry]] = {}  # thread -> who waits for it, where
        stack: list[_Token] = []
        # Keys ``request`` upgrades: queued at their head, before every request there.
        upgrades = [node.entry for node in request.members() if node.queued and node.at_head]

        def mark(thread: _Token, successor: _Token | None, waits_for: Any) -> bool:
            # ``thread`` waits for ``successor``: True if that closes the cycle.
            if successor is None or successor is thread:
                return False
            if successor is me:
                reached[me] = (thread, waits_for)
                return True
            if successor not in reached:
                reached[successor] = (thread, waits_for)
                stack.append(successor)
            return False

        def reach(thread: _Token, successor: _Token | None, waits_for: Any,
                  to_run: bool) -> bool:
            # As the core's ``reach``: to be granted and, ``to_run``, to run on (a task runs
            # only when its loop's thread does: that thread is reached from it too, and so
            # is ``me`` if the task may be awaiting it). Not recursive: no closure of this
            # search refers to itself, so its dictionary goes with its frame, collector or
            # not (a free-threaded build kept every search's until a collection).
            if mark(thread, successor, waits_for):
                return True
            if to_run and type(successor) is _TaskToken:
                if successor.ident is awaiting:
                    return mark(successor, me, _AWAITED_THREAD)
                return mark(successor, _thread_tokens.get(successor.loop_ident), _LOOP_THREAD)
            return False

        def reach_waited_for(
            thread: _Token, waits_for: _Entry, mode: int, own: _Request | None, at_head: bool
        ) -> bool:
            if reach(thread, waits_for.owner, waits_for, True):
                return True
            exclusive = mode == _WRITE or waits_for.limit == 1  # one slot: as a write
            if exclusive:  # newest first, as in _core
                if any(reach(thread, reader, waits_for, True)
                       for reader in reversed(waits_for.readers)):
                    return True
            if thread is not me and any(entry is waits_for for entry in upgrades):
                return reach(thread, me, waits_for, True)
            if not at_head:
                for ahead in waits_for.queue:
                    if ahead is own:
                        break
                    conflicting = exclusive or ahead.mode == _WRITE
                    if (conflicting or ahead.lead is not None) and reach(
                            thread, ahead.token, waits_for, conflicting):
                        return True
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
            if own is not None and own.state in (_WAITING, _WOKEN):
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

    # -- waiting (the only place that sleeps, and the only call that may raise midway) ------

    def _wait(self, request: _Request, seconds: float) -> bool:
        """Sleep until ``request`` (queued) is granted or its time runs out. The request
        stays ``token.request`` until the acquiring call has its outcome (see _acquired).

        The compiled core's ``_wait`` step for step: sleep a slice, settle in a section, and
        run the wait check (``lockmgr._owners.WAIT_CHECK``) only if the request still waits:
        a wait that was granted or timed out returns without it."""
        deadline = None if seconds < 0 else request.since + seconds
        log_at = None if self._log_after < 0 else request.since + self._log_after
        logged = False
        wakeup = request.token.wakeup
        while True:
            # In slices, on every thread: on the main thread a slice bounds how late a
            # signal's handler runs; everywhere it bounds how late the waiter sees that its
            # request became grantable without a post (code that ran inside its own wait
            # took the key, or a forked child, where nobody passes the key on).
            now = time.monotonic()
            remaining = _WAIT_SLICE
            if deadline is not None:
                remaining = min(max(0.0, deadline - now), _WAIT_SLICE)
            if log_at is not None and not logged:
                remaining = min(remaining, max(0.0, log_at - now))
            # Signal handlers (main thread) and finalizers run around this sleep and may
            # call the manager, or raise (the acquiring call then abandons the request).
            wakeup.acquire(timeout=remaining)
            outcome = _section(self._check_wait_section, request, deadline)
            if outcome is False:
                break
            if outcome:  # an exception from here on gives the key back (_acquire)
                self._observe_wait(request)
                if logged:
                    self._log_wait_end(request, True)
                _section(self._complete_section, request)
                return True
            check = WAIT_CHECK.call  # lockmgr._owners: raising ends the wait
            if check is not None:
                check()
            if log_at is not None and not logged and time.monotonic() >= log_at:
                logged = True
                self._log_slow_wait(request)
        if logged:
            self._log_wait_end(request, False)
        return False

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
                self._read(entry, token, -node.count)
            elif level:
                self._drop_read(entry, token)

    # -- releasing ---------------------------------------------------------------------------

    def _release_write(self, key: Hashable) -> None:
        token = _existing_token()
        verdict = self._run_on_key(self._release_write_on, key, token)
        if verdict is not None:
            raise self._refusal(verdict, key, token, _WRITE)

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
        token = _existing_token()
        verdict = self._run_on_key(self._release_read_on, key, token)
        if verdict is not None:
            raise self._refusal(verdict, key, token, _READ)

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
            self._read(entry, token, -1)
        else:
            self._drop_read(entry, token)
        if level == 1 or entry.limit:  # a semaphore's slot given back is free for the queue
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
                raise self._refusal(what, items[index][0], token, items[index][1])
            known[index] = what.settle(items[index][0])

    def _refusal(self, verdict: object, key: Hashable, token: object, mode: int) -> BaseException:
        """The error of a release ``token`` may not make (None: a thread that has none)."""
        owner = token.ident if isinstance(token, _Token) else _get_ident()
        return _failure(verdict, key, owner, self._rw_mode(mode))

    def _rw_mode(self, mode: int) -> int | None:
        """The mode a refused release names: an RWLockManager's (None: a LockManager's)."""
        return mode if hasattr(self, "acquire_read") else None

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
                self._read(entry, token, -1)
                if entry.readers[token] == 0:
                    self._drop_read(entry, token)
            self._pass_on(entry)
        return None

    def _release_held_section(self, token: _Token) -> list[Hashable]:
        """Release every level of this manager's keys ``token`` holds, except pinned ones;
        returns the keys it stopped holding (for a thread that ended: the abandoned keys).

        The compiled core's ``release_token`` step for step: reads first, so a write-held
        key is counted with its write; each list newest first (the core's lists are pushed
        at their head); each key passed on as soon as it is let go. The order decides who
        is granted what on the way, and so what the hold-time histogram counts."""
        released = []
        for entry, manager in reversed(list(token.reads.items())):
            if manager is not self._ref:
                continue
            keep_read = self._pinned(token, entry, _READ)
            if keep_read:
                self._read(entry, token, keep_read - entry.readers[token])
                continue
            if entry.owner is not token:
                released.append(entry.key)
            self._drop_read(entry, token)
            self._pass_on(entry)
        for entry, manager in reversed(list(token.held.items())):
            if manager is not self._ref:
                continue
            keep_write = self._pinned(token, entry, _WRITE)
            if keep_write:
                entry.count = keep_write
                continue
            if token not in entry.readers:  # else a pinned read keeps it held
                released.append(entry.key)
            self._disown(entry)
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
        if request.mode == _READ:  # a semaphore's slot is one more, also for a holder
            return _has_slot(entry)
        return not readers or (len(readers) == 1 and request.token in readers)

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
            self._read(entry, token, request.count)
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
        else:  # on top of its read, or reading a key it writes
            self._read(entry, token, 1)

    def _grant_group(self, lead: _Request, passing: _Entry) -> None:
        """_pass_on found ``lead`` grantable at the head of ``passing``."""
        self._grant_nodes(lead, enqueued=True)
        self._acquisitions += len(lead.members())
        self._waiting -= 1
        lead.token.wakeup.release()
        for node in lead.members():  # readers queued behind its read nodes may follow it in
            if node.queued and node.entry is not passing and node.mode == _READ:
                self._pass_on(node.entry)  # never drops the entry: it has a holder now
