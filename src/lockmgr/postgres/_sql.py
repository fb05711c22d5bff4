"""The statements that take and give back advisory locks, and the ``pg_locks`` queries that
find them."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from .._args import READ, WRITE
from ._fences import _fenced

if TYPE_CHECKING:
    from ._fences import _FenceTable

# pg_locks rows of granted advisory locks (bigint keys use objsubid 1 and split the key into
# classid, the high half, and objid, the low half), then "= key" ends the condition.
_KEY_IS = "((classid::bigint << 32) | objid::bigint) ="
_GRANTED_ADVISORY = ("pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
                     f" AND {_KEY_IS}")
# ... and this session's own, the key still to be named.
_MINE = ("pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
         " AND pid = pg_catalog.pg_backend_pid()")
_MODE_NAMES = {READ: "ShareLock", WRITE: "ExclusiveLock"}
# The virtual transaction id of the session's open transaction ("3/1207"): what names an
# xact_lock's transaction in the pg_locks rows of its locks, which every role can read
# (pg_stat_activity hides the transactions of other roles' sessions). Each of the
# session's rows carries it, its own virtualxid lock's among them.
_OWN_TRANSACTION = ("(SELECT virtualtransaction FROM pg_catalog.pg_locks"
                    " WHERE pid = pg_catalog.pg_backend_pid() LIMIT 1)")

def _kind(mode: int) -> str:
    return "_shared" if mode == READ else ""


_LOCK = {mode: f"lockmgr_pg_advisory_lock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_TRY_LOCK = {mode: f"lockmgr_pg_try_advisory_lock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_FENCED_LOCK = {"wait": b"lockmgr_fenced_lock", "try": b"lockmgr_fenced_try_lock"}
_UNLOCK = {mode: f"lockmgr_pg_advisory_unlock{_kind(mode)}".encode() for mode in (READ, WRITE)}
_MAX_LOCK_TIMEOUT = 2**31 - 1  # lock_timeout's ceiling, in milliseconds (about 24.8 days)


def _unlock_sql(items: Sequence[tuple[Hashable, int]], advisory_key: Callable[[Hashable], int]) -> str:
    """Release ``items`` in one statement: a boolean column each (false: not held)."""
    return "SELECT " + ", ".join(f"pg_catalog.pg_advisory_unlock{_kind(mode)}({advisory_key(key)})"
                                 for key, mode in items)


def _not_released(result: Any, items: list[tuple[Hashable, int]]) -> list[tuple[Hashable, int]]:
    """The ``items`` an unlock's ``result`` says the session no longer held."""
    if len(items) == 1:  # (a single key's release, the usual one)
        return [] if result.get_value(0, 0) == b"t" else list(items)
    released = [result.get_value(0, column) == b"t" for column in range(len(items))]
    return [item for item, done in zip(items, released, strict=True) if not done]


def _drop_sql(items: Sequence[tuple[Hashable, int]], advisory_key: Callable[[Hashable], int]) -> str:
    """Release whichever of ``items`` the session holds (after a failed or cancelled call,
    which may or may not have taken them)."""
    return "; ".join(f"SELECT pg_catalog.pg_advisory_unlock{_kind(mode)}({ident}) FROM {_MINE} AND"
                     f" {_KEY_IS} {ident} AND mode = '{_MODE_NAMES[mode]}'"
                     for ident, mode in ((advisory_key(key), mode) for key, mode in items))


def _lock_sql(ordered: list[tuple[int, int]], how: str, milliseconds: int,
              fences: _FenceTable | None) -> str:
    """The one message taking ``ordered`` ((advisory key, mode) pairs, ascending) ``how``:
    "wait" as long as it takes, "try" once, or "timed" (within ``milliseconds``). With a
    ``fences`` table, the same message gives each written key its next fence
    (``_fences_from`` reads the answer)."""
    fenced = _fenced(ordered) if fences is not None else []
    if not fenced or fences is None:
        fences = None
    if how == "try":
        return _try_lock_sql(ordered, fenced, fences)
    if how == "timed":
        return _timed_lock_sql(ordered, milliseconds, fenced, fences)
    return _wait_lock_sql(ordered, fenced, fences)


def _wait_lock_sql(ordered: list[tuple[int, int]], fenced: list[str],
                   fences: _FenceTable | None) -> str:
    """Wait as long as it takes: session locks, one statement each, in order; then the
    fences (a failure there leaves the locks to the caller's clean-up)."""
    waits = "; ".join(f"SELECT pg_catalog.pg_advisory_lock{_kind(mode)}({ident})"
                      for ident, mode in ordered)
    return f"{waits}; {fences.next_fences_sql(fenced)}" if fences else waits


def _try_lock_sql(ordered: list[tuple[int, int]], fenced: list[str],
                  fences: _FenceTable | None) -> str:
    """Try once: all or nothing (transaction locks first, released at the statement's end);
    the fences only if granted, in the same statement."""
    trial = " AND ".join(f"pg_catalog.pg_try_advisory_xact_lock{_kind(mode)}({ident})"
                         for ident, mode in ordered)
    taking = " AND ".join(f"pg_catalog.pg_try_advisory_lock{_kind(mode)}({ident})"
                          for ident, mode in ordered)
    granted = f"CASE WHEN {trial} THEN {taking} ELSE false END"
    if fences is None:
        return f"SELECT {granted}"
    return fences.next_fences_sql(fenced, f"SELECT {granted} AS granted")


def _timed_lock_sql(ordered: list[tuple[int, int]], milliseconds: int, fenced: list[str],
                    fences: _FenceTable | None) -> str:
    """Wait at most ``milliseconds`` in all, for transaction locks (so a timeout or cancel
    rolls back a grant that raced it), then take the fences, still under the timeout (so
    it rolls them back too), and the session locks (which no longer wait). One implicit
    transaction: statement_timestamp() is when the message arrived."""
    elapsed = ("(extract(epoch FROM pg_catalog.clock_timestamp()"
               " - pg_catalog.statement_timestamp()) * 1000)::bigint")
    left = f"greatest(1, least({_MAX_LOCK_TIMEOUT}, {milliseconds} - {elapsed}))::text"
    time_left = f"SELECT pg_catalog.set_config('lock_timeout', {left}, true)"
    waits = "; ".join(f"{time_left}; SELECT pg_catalog.pg_advisory_xact_lock{_kind(mode)}({ident})"
                      for ident, mode in ordered)
    fencing = f"; {time_left}; {fences.next_fences_sql(fenced)}" if fences else ""
    taking = ", ".join(f"pg_catalog.pg_advisory_lock{_kind(mode)}({ident})"
                       for ident, mode in ordered)
    return f"{waits}{fencing}; SELECT {taking}"


def _milliseconds(seconds: float) -> int:
    return min(_MAX_LOCK_TIMEOUT, max(1, int(seconds * 1000 + 0.999)))
