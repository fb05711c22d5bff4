"""The lock and unlock calls' protocol, once for threads and tasks: which statements take or
give back a set of keys on the server, and what each failure means (``_lock_steps``,
``_unlock_steps``). The steps do no I/O: a thread's ``_PgEngine._lock`` and ``_unlock``
drive them with ``_drive``, a task's ``_Tasks.lock`` and ``unlock`` with ``_drive_async``
(see ``_link``: "the protocol's steps").

The usual call is one prepared statement on the caller's connection: ``_lock_at_once`` and
``_unlock_at_once`` give that round trip, which a thread makes without the step driver;
if it fails, the steps run with its exception as their first round trip's (``_drive``'s
``tried``), so that every failure is still answered here, once."""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors

from .._args import WRITE
from .._errors import DeadlockError
from .._keyhash import REMEMBERED_KEYS
from ._fences import _fence_table_steps, _fences_from, _not_durable
from ._link import (
    _ANSWER_WITHIN,
    _Attach,
    _RoundTrip,
    _Drop,
    _Link,
    _Lose,
    _Overdue,
    _TRY_CONNECTS_WITHIN,
    _Steps,
    _Unanswered,
    _answer_by,
    _call_steps,
    _prepared_call,
    _round_trip_deadline,
    _run_all_steps,
)
from ._sql import _FENCED_LOCK, _LOCK, _TRY_LOCK, _UNLOCK, _lock_sql, _not_released, _unlock_sql

if TYPE_CHECKING:
    from ._engine import _PgEngine
    from ._session import _Session

# A round trip made at once: on the link, by the deadline, the prepared statement, its
# parameters (``_at_once``'s arguments).
_AtOnce = tuple[_Link, float | None, bytes, list[bytes]]


def _lock_at_once(manager: _PgEngine[Any], session: _Session, items: list[tuple[Hashable, int]],
                  seconds: float) -> _AtOnce | None:
    """The round trip of ``_lock_steps`` when it is all they would do: one key, no fence,
    a try or a wait (no timeout), on the session's connection, its statement prepared;
    else None. Its caller sets ``session.unsure`` to ``items`` first, as the steps do,
    and ``_locked_at_once`` reads its answer."""
    if len(items) != 1 or seconds > 0 or manager._fencing:
        return None
    link = session.link
    if link is None:
        return None
    key, mode = items[0]
    statement = _LOCK[mode] if seconds < 0 else _TRY_LOCK[mode]
    if statement not in link.prepared:
        return None
    params = manager._params.get(key) if type(key) is str else None
    return (link, None if seconds < 0 else _round_trip_deadline("try", None), statement,
            _params_of(manager, key) if params is None else params)


def _at_once(link: _Link, deadline: float | None, statement: bytes, params: list[bytes]
             ) -> tuple[list[Any] | None, BaseException | None]:
    """Make the round trip ``_lock_at_once`` or ``_unlock_at_once`` gave (the prepared
    ``statement`` with ``params``, by ``deadline``) in the calling thread, as
    ``_prepared_call``'s: its results, or the exception that the steps then answer
    (``_drive``'s ``tried``)."""
    try:
        return link._round_trip(deadline, link.pgconn.send_query_prepared, statement, params), None
    except BaseException as error:
        return None, error


def _locked_at_once(results: list[Any], seconds: float) -> dict[int, int] | None:
    """What ``_lock_steps`` answer for the results of ``_lock_at_once``'s round trip
    (``_fences_from`` without fences: a refused try None, else no fence)."""
    if seconds < 0 or results[-1].get_value(0, 0) == b"t":
        return {}
    return None


def _lock_steps(manager: _PgEngine[Any], session: _Session, items: list[tuple[Hashable, int]],
                seconds: float, started: float | None = None) -> _Steps[dict[int, int] | None]:
    """Take PostgreSQL locks for ``items`` in ascending advisory-key order (so that two
    processes taking overlapping sets never deadlock), all within ``seconds``, and with
    fencing the written keys' next fences: one message, one round trip. None if not
    granted in time, else the fences by advisory key. ``session.unsure`` is ``items`` from
    before the round trip: the caller clears it once it has counted them. ``started``: when
    a try started, if before these steps (its round trip made at once, and failed)."""
    ordered = sorted([(manager.advisory_key(key), mode) for key, mode in items])
    fencing = manager._fencing and any(mode == WRITE for _, mode in ordered)
    deadline = None if seconds <= 0 else time.monotonic() + seconds
    # A timed call's connect ends when its round trips would, a try's _TRY_CONNECTS_WITHIN
    # after its start; a wait's has a bound of its own (``_link._connect_by``).
    connect_by = (None if seconds < 0
                  else (time.monotonic() if started is None else started) + _TRY_CONNECTS_WITHIN
                  if seconds == 0
                  else _round_trip_deadline("timed", deadline))
    retried = False
    while True:
        if session.link is not None:
            link, fresh_link = session.link, False
        else:
            # (a try waits for no free connection; a timed call, until its deadline)
            link, fresh_link = yield _Attach(session, time.monotonic() if seconds == 0 else deadline,
                                             connect_by)
        # Unsure before the server can take them (a lost connection clears it): an
        # interrupt after the grant, then another at the clean-up's first check point
        # (undo_take's entry), would leave them held on the connection, recorded nowhere.
        session.unsure = items
        try:
            left = 0 if deadline is None else int((deadline - time.monotonic()) * 1000 + 0.999)
            trying = seconds == 0 or (deadline is not None and left <= 0)
            how = "try" if trying else "wait" if deadline is None else "timed"
            answer_by = _round_trip_deadline(how, deadline)
            if fencing and not manager._fence_table_made:
                yield from _fence_table_steps(link, manager._fence_table, answer_by or True)
                manager._fence_table_made = True
            link.warned.clear()
            if how != "timed" and len(ordered) == 1:
                ident, mode = ordered[0]
                statement = (_FENCED_LOCK[how] if fencing
                             else _TRY_LOCK[mode] if trying else _LOCK[mode])
                if statement in link.prepared:  # (the usual: _call_steps's round trip only)
                    results = yield _prepared_call(link, statement, ident, answer_by)
                else:
                    results = [(yield from _call_steps(link, statement, ident, answer_by))]
            else:
                results = yield from _run_all_steps(
                    link, _lock_sql(ordered, how, left, manager._fence_table if fencing else None),
                    answer_by)
        except pg_errors.LockNotAvailable:
            # Only timed waits set a lock_timeout, and they wait with transaction locks:
            # the error rolled the wait back, a grant that raced it and fences included.
            if deadline is not None and deadline - time.monotonic() > 0:
                continue  # lock_timeout's ceiling (about 24.8 days) is below threading's
            return None
        except pg_errors.DeadlockDetected as error:
            raise DeadlockError(f"PostgreSQL: {error}", []) from None
        except _Overdue:
            # A step before a wait without a timeout (the prepare, the fence table's
            # check) was cancelled at its deadline: the server is slow (a migration
            # holds the fence table), and the wait waits, steps again included. A timed
            # call times out (the caller drops what it may have taken).
            if seconds >= 0:
                raise
            continue
        except psycopg.OperationalError as error:
            if not link.broken():
                raise  # a cancelled statement: the caller drops what it may have taken
            # The connection died: the keys held on it are lost, and so is this
            # attempt; a connection that had been idle is replaced once. Unanswered
            # by a timed call's deadline: the caller times out.
            yield _Lose(session)
            if fresh_link or retried or (seconds >= 0 and isinstance(error, _Unanswered)):
                raise
            retried = True
            continue
        fences = _fences_from(results, ordered, how, fencing)
        if fences and (link.warned or link.cancelled_late):
            # A fence is handed out only once its increment is durable as the server's
            # settings ask: a warning (a synchronous standby's wait cancelled, the commit
            # local only) or a cancel that did not fail the statement says it may not be.
            # The caller's clean-up releases the keys.
            raise _not_durable(items, link.warned[-1] if link.warned else None)
        return fences


def _unlock_at_once(manager: _PgEngine[Any], session: _Session,
                    items: list[tuple[Hashable, int]]) -> _AtOnce | None:
    """The round trip of ``_unlock_steps`` when it is all they would do: one key, its
    statement prepared on the session's connection; else None. ``_unlocked`` reads its
    answer."""
    link = session.link
    if len(items) != 1 or link is None:
        return None
    key, mode = items[0]
    statement = _UNLOCK[mode]
    if statement not in link.prepared:
        return None
    params = manager._params.get(key) if type(key) is str else None
    return (link, time.monotonic() + _ANSWER_WITHIN, statement,
            _params_of(manager, key) if params is None else params)


def _params_of(manager: _PgEngine[Any], key: Hashable) -> list[bytes]:
    """The parameters of ``key``'s single-key statements (its advisory key, as libpq sends
    it), made once for recent str keys as ``KeyIdents`` keeps their identities (the manager's
    ``_params``, emptied when full). Lists only read by psycopg: shared by every thread."""
    params = [b"%d" % manager._idents.of(key)]
    if type(key) is str:
        if len(manager._params) >= REMEMBERED_KEYS:
            manager._params.clear()
        manager._params[key] = params
    return params


def _unlocked(manager: _PgEngine[Any], session: _Session, items: list[tuple[Hashable, int]],
              result: Any) -> None:
    """The server answered the release of ``items`` with ``result``: none is unsure any
    more, and one it no longer had is lost, though the connection lives."""
    session.unsure = []
    if len(items) == 1 and result.get_value(0, 0) == b"t":
        return  # (the usual: released; ``_not_released`` without a call)
    gone = _not_released(result, items)
    if gone:
        manager._report(session, items=gone)


def _unlock_steps(manager: _PgEngine[Any], session: _Session,
                  items: list[tuple[Hashable, int]]) -> _Steps[None]:
    """Release the PostgreSQL locks of ``items`` (the caller made them ``session.unsure``:
    cleared once the server answered). A lost connection moves every key held on it to
    ``lost``; a failed or interrupted release is handed to the shell's clean-up (``_Drop``),
    which still releases them."""
    link = session.link
    assert link is not None
    try:
        if len(items) == 1:
            key, mode = items[0]
            statement, ident = _UNLOCK[mode], manager.advisory_key(key)
            if statement in link.prepared:  # (the usual: _call_steps's round trip only)
                result = (yield _prepared_call(link, statement, ident, _answer_by()))[-1]
            else:
                result = yield from _call_steps(link, statement, ident, True)
        else:
            results = yield from _run_all_steps(link, _unlock_sql(items, manager.advisory_key),
                                                True)
            result = results[-1]
    except psycopg.OperationalError as error:
        if link.broken():
            yield _Lose(session)
            return
        yield _Drop(session, items)
        if isinstance(error, _Overdue):
            return  # released by the drop (or lost with the connection: LockLost)
        raise
    except GeneratorExit:
        raise  # a task's coroutine closed: its shell closes the connection, no step is left
    except BaseException:
        yield _Drop(session, items)
        raise
    _unlocked(manager, session, items, result)
