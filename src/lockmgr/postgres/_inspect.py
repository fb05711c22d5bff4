"""Who holds what across processes: the ``application_name`` of lockmgr's connections, and
``snapshot(server=True)``, read from ``pg_locks`` and ``pg_stat_activity``
(``ServerKeyState``, ``ServerSession``)."""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from .._observe import KeyState, ModeName
from ._capacity import keep_idle, new_link

if TYPE_CHECKING:
    from ._engine import _PgEngine

_APPLICATION = "lockmgr"


def application_name(namespace: str) -> str:
    """What lockmgr's connections of ``namespace`` call themselves on the server unless the
    user names them (it is libpq's ``fallback_application_name``): "lockmgr" and a tag of
    the namespace, which tells the namespace's sessions apart without showing it."""
    tag = hashlib.blake2b(namespace.encode(), digest_size=6, person=b"lockmgr-app").hexdigest()
    return f"{_APPLICATION} {tag}"


@dataclass(frozen=True)
class ServerSession:
    """A server session holding or waiting for a key (``snapshot(server=True)``), as
    ``pg_locks`` and ``pg_stat_activity`` show it. What PostgreSQL hides from a role
    without ``pg_read_all_stats`` about other roles' sessions is None."""

    pid: int
    """The session's server process (``pg_backend_pid()``, ``pg_terminate_backend``)."""
    host: str | None
    """The client's address (None: a Unix socket)."""
    port: int | None
    """The client's TCP port (with ``host``, finds the client process on its host)."""
    application: str | None
    """Its ``application_name``: "lockmgr" and a tag of the namespace for lockmgr's own
    connections, unless the application named them."""
    mode: ModeName
    """``"read"`` (shared) or ``"write"`` (exclusive)."""
    since: datetime.datetime | None
    """A waiter: when it started waiting (PostgreSQL 14+; before, when its statement
    started). A holder: when its session last started or ended a statement, which for a
    lockmgr session idle since it took the key is when it was granted (it has held the key
    since then at least); None if hidden."""


@dataclass(frozen=True)
class ServerKeyState:
    """One advisory key held or waited on in the manager's database (``snapshot(server=True)``)."""

    key: Hashable | None
    """The key, if this process knows it (its threads' and tasks' keys, recent str keys,
    the ``keys`` asked about); else None: only ``advisory_key`` names it."""
    advisory_key: int
    """The 64-bit advisory key (``advisory_key(key, namespace)``)."""
    holders: tuple[ServerSession, ...]
    """By pid."""
    waiters: tuple[ServerSession, ...]
    """Oldest first (the order PostgreSQL grants them in, for conflicting modes)."""


_MODES: dict[bytes, ModeName] = {b"ShareLock": "read", b"ExclusiveLock": "write"}


def _rows_sql(with_waitstart: bool) -> str:
    """Every advisory lock of a bigint key held or waited for in this database, with its
    session: key halves, granted, mode, pid, client address and port, application, since
    (seconds since 1970)."""
    waiting_since = ("COALESCE(l.waitstart, a.state_change)" if with_waitstart
                     else "a.state_change")
    return ("SELECT l.classid, l.objid, l.granted, l.mode, l.pid, pg_catalog.host(a.client_addr),"
            " a.client_port, a.application_name, extract(epoch FROM CASE WHEN l.granted"
            f" THEN a.state_change ELSE {waiting_since} END)::text"
            " FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.database = (SELECT oid"
            " FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())")


class _Inspecting:
    """``snapshot()`` of the PostgreSQL managers: this process's, or the server's."""

    @overload
    def snapshot(self, server: Literal[False] = False) -> list[KeyState]: ...

    @overload
    def snapshot(self, server: Literal[True],
                 keys: Iterable[Hashable] = ()) -> list[ServerKeyState]: ...

    def snapshot(self, server: bool = False,
                 keys: Iterable[Hashable] = ()) -> list[KeyState] | list[ServerKeyState]:
        """The keys held or waited on by this process's threads and tasks, as
        ``LockManager.snapshot``: the in-process engine's view. Raises nothing.

        ``server=True``: the server's instead, across processes and hosts: every key of
        this manager's namespace held or waited for in its database, its holders and
        waiters with their sessions (``ServerKeyState``), keys in advisory-key order. The
        server knows only advisory keys; a key this process knows (its threads' and tasks'
        keys, recent str keys, and ``keys``) is named, any other is shown with ``key``
        None, and only if a session of this namespace holds or waits for it (by its
        ``application_name``): keys of sessions a user named otherwise show only if known.
        One round trip on a connection of the manager's; raises what connecting raises."""
        manager: _PgEngine[Any] = self  # type: ignore[assignment]
        states: list[KeyState] = manager._engine.snapshot()
        if not server:
            return states
        known = {manager.advisory_key(key): key for key in
                 [*(state.key for state in states), *manager._idents.remembered(), *keys]}
        return _server_states(manager, known)


def _server_states(manager: _PgEngine[Any], known: dict[int, Hashable]) -> list[ServerKeyState]:
    # Never on the calling thread's own connection: the question would move the holder's
    # state_change, which dates what it holds.
    with manager._guard:
        link = manager._pop_idle()
    if link is None or not link.idle():
        if link is not None:
            link.close()
        link = new_link(manager, True)
    try:
        result = link.run(_rows_sql(link.pgconn.server_version >= 140000))
    except BaseException:
        link.close()
        raise
    keep_idle(manager, link, manager._idle)
    ours = application_name(manager._namespace)
    found: dict[int, tuple[list[tuple[int, ServerSession]], list[tuple[float, ServerSession]]]] = {}
    for row in range(result.ntuples):
        value = result.get_value
        ident = _signed((int(value(row, 0)) << 32) | int(value(row, 1)))
        application = _text(value(row, 7))
        if ident not in known and application != ours:
            continue  # another namespace's, or an unknown key of a session named otherwise
        since = value(row, 8)
        seconds = None if since is None else float(since)
        session = ServerSession(
            pid=int(value(row, 4)), host=_text(value(row, 5)),
            port=None if value(row, 6) is None else int(value(row, 6)),
            application=application, mode=_MODES[bytes(value(row, 3))],
            since=None if seconds is None
            else datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc))
        holders, waiters = found.setdefault(ident, ([], []))
        if value(row, 2) == b"t":
            holders.append((session.pid, session))
        else:
            waiters.append((float("inf") if seconds is None else seconds, session))
    return [ServerKeyState(known.get(ident), ident,
                           tuple(session for _, session in sorted(holders, key=_first)),
                           tuple(session for _, session in sorted(waiters, key=_first)))
            for ident, (holders, waiters) in sorted(found.items())]


def _first(pair: tuple[float, ServerSession]) -> float:
    return pair[0]


def _signed(unsigned: int) -> int:
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def _text(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).decode("utf-8", "replace")
