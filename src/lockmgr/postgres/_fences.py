"""Fencing tokens: the fence table, and the statements that take a key's next fence (the
``Lease`` that hands them out is ``lockmgr._layered``'s)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from psycopg import errors as pg_errors

from .._args import WRITE
from .._errors import LockError
from .._views import _short
from ._link import _Steps, _run_all_steps

if TYPE_CHECKING:
    from ._link import _Link


# Fencing: one counter per advisory key (which includes the namespace; a hash collision
# makes two keys share a counter, which still only increases), in one table named with its
# schema: every role, search_path and connection finds the same counters. Made at a
# manager's first fenced acquisition if missing. The check comes first because CREATE
# TABLE IF NOT EXISTS needs the CREATE privilege even when the table exists: a role
# without it can use a table an administrator made.
DEFAULT_FENCE_TABLE = "public.lockmgr_fences"
_MADE_MEANWHILE = (pg_errors.UniqueViolation, pg_errors.DuplicateObject, pg_errors.DuplicateTable)

# The single-key calls, prepared on each connection at first use.
_STATEMENTS = {
    f"lockmgr_{function}".encode(): f"SELECT pg_catalog.{function}($1::bigint)".encode()
    for function in ("pg_advisory_lock", "pg_advisory_lock_shared", "pg_try_advisory_lock",
                     "pg_try_advisory_lock_shared", "pg_advisory_unlock",
                     "pg_advisory_unlock_shared")
}


class _FenceTable:
    """The fence table of a manager (``fence_table``, "schema.table"), and the statements
    that use it."""

    __slots__ = ("create_sql", "exists_sql", "name", "statements")

    def __init__(self, qualified: str) -> None:
        if not isinstance(qualified, str):
            raise TypeError(f"fence_table must be a str, not {type(qualified).__name__}")
        parts = qualified.split(".")
        if len(parts) != 2 or not all(parts) or "\0" in qualified:
            raise ValueError(f"fence_table must name a schema and a table, as"
                             f" {DEFAULT_FENCE_TABLE!r}, not {qualified!r}")
        self.name = ".".join('"' + part.replace('"', '""') + '"' for part in parts)
        literal = "'" + self.name.replace("'", "''") + "'"
        self.exists_sql = f"SELECT pg_catalog.to_regclass({literal}) IS NOT NULL"
        self.create_sql = (f"CREATE TABLE IF NOT EXISTS {self.name}"
                           " (key bigint PRIMARY KEY, fence bigint NOT NULL)")
        self.statements = _STATEMENTS | {
            b"lockmgr_fenced_lock": self.next_fences_sql(
                ["$1"], "SELECT pg_catalog.pg_advisory_lock($1::bigint), true AS granted").encode(),
            b"lockmgr_fenced_try_lock": self.next_fences_sql(
                ["$1"], "SELECT pg_catalog.pg_try_advisory_lock($1::bigint) AS granted").encode(),
        }

    def next_fences_sql(self, idents: Sequence[str], got: str = "SELECT true AS granted") -> str:
        """One statement: ``got`` (a query of one row with a boolean ``granted``, run
        first) and, if granted, the next fence of each of ``idents`` (advisory keys, as
        SQL), in rows (key, fence). Committed durably whatever synchronous_commit the
        session has: a server crash must never hand out a fence again."""
        values = ", ".join(f"({ident}::bigint)" for ident in idents)
        return (f"WITH got AS ({got}),"
                " durable AS (SELECT pg_catalog.set_config('synchronous_commit', 'on', true))"
                f" INSERT INTO {self.name} AS f (key, fence)"
                f" SELECT key, 1 FROM got, durable, (VALUES {values}) AS bumped(key) WHERE granted"
                " ON CONFLICT (key) DO UPDATE SET fence = f.fence + 1 RETURNING f.key, f.fence")


class FenceNotDurableError(LockError):
    """A fenced acquisition took its fence, but the server could not confirm that the
    increment is durable as its settings ask: the commit's wait for a synchronous standby
    was cancelled (at a timed call's or a try's deadline, or by another session), and
    PostgreSQL ended it with a warning, the increment committed on the primary alone. A
    failover to that standby could hand the same fence out again, so this one is not:
    the call fails, and releases what it took. Later fences stay above it."""


def _not_durable(items: Sequence[tuple[Hashable, int]], warning: str | None) -> FenceNotDurableError:
    """The error of a fenced call on ``items`` whose commit was not confirmed: the server's
    ``warning``, or none (the call's deadline cancelled its round trip, which succeeded
    all the same: the cancel may have cut the commit's wait short)."""
    keys = ", ".join(_short.repr(key) for key, mode in items if mode == WRITE)
    cause = (f"PostgreSQL warned: {warning}" if warning else
             "the call's deadline cancelled the commit, which succeeded without confirming")
    return FenceNotDurableError(
        f"the fence of {keys} is not known to be durable ({cause}): a synchronous standby"
        " did not confirm it in time, and could hand it out again after a failover."
        " Nothing was handed out or kept held; check the synchronous standby")


def _fence_table_steps(link: _Link, table: _FenceTable, deadline: float | bool) -> _Steps[None]:
    """Make sure the fence table exists (its own transaction: committed before any wait),
    by ``deadline`` (``_Link.run``)."""
    for attempt in range(2):
        exists = yield from _run_all_steps(link, table.exists_sql, deadline)
        if exists[-1].get_value(0, 0) == b"t":
            return
        try:
            yield from _run_all_steps(link, table.create_sql, deadline)
            return
        except _MADE_MEANWHILE:
            if attempt:  # a lasting conflict (a type of that name)
                raise


def _fences_from(results: Sequence[Any], ordered: list[tuple[int, int]], how: str,
                 fencing: bool) -> dict[int, int] | None:
    """What a ``_lock_sql`` message (or a single-key statement: its one result) answered:
    None if a try was refused, else each fenced advisory key's new fence (none without
    fencing)."""
    if fencing and _fenced(ordered):
        # A timed message takes its session locks after the fences: one statement later.
        rows = results[-2] if how == "timed" else results[-1]
        fences = {int(rows.get_value(row, 0)): int(rows.get_value(row, 1))
                  for row in range(rows.ntuples)}
        # A refused try has no row; a granted call, one per fenced key. Only a try can be
        # refused: a wait missing its rows fails in the caller, whose clean-up releases.
        return None if how == "try" and not fences else fences
    if how == "try" and results[-1].get_value(0, 0) != b"t":
        return None
    return {}


def _fenced(ordered: list[tuple[int, int]]) -> list[str]:
    """The advisory keys of ``ordered`` that take a fence: the written ones, once each (two
    keys of one call that collide share a counter, and so one fence)."""
    return [str(ident) for ident in dict.fromkeys(ident for ident, mode in ordered
                                                  if mode == WRITE)]
