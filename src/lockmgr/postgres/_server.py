"""What a new connection checks and sets: the settings locks depend on, and the refusal of
a standby or a pooler (``UnsafeServerError``)."""

from __future__ import annotations

import os
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .._errors import LockError

# Run first on every connection, one message: the search_path pinned, then what the
# session is (``_refusal`` reads its row, ``_WHO_IS_THIS_AT``), then every other setting
# correctness depends on, pinned for the session whatever the server's, the role's, the
# database's or the DSN's defaults say:
# - search_path = pg_catalog, pg_temp: a schema ahead of pg_catalog (a role's default, a
#   DSN's options) could shadow a function, operator or type of lockmgr's statements with
#   one that only pretends (a pg_is_in_recovery() saying false on a standby, a
#   pg_advisory_lock() taking nothing). With pg_catalog first nothing comes before it, and
#   pg_temp named last is searched last for tables, never for functions and operators.
#   Every function and catalog table lockmgr names is qualified as well; operators and
#   types rely on the pinned path. Set first: each statement of the message is resolved
#   once the ones before it have run;
# - lock_timeout, statement_timeout: a wait without a timeout waits for ever (timed waits
#   set a transaction-local lock_timeout of their own);
# - idle_session_timeout (14+), idle_in_transaction_session_timeout: a session holding
#   locks sits idle between calls; a server ending it would turn held locks into leases;
# - default_transaction_isolation: a queued fenced wait reads the fence row after its
#   wait, which under repeatable read or serializable would use a snapshot from before
#   the wait and fail; default_transaction_read_only: fences are written;
# - transaction_timeout (17+): a wait is one statement in one transaction;
# - standard_conforming_strings: the fence table's name is quoted in a literal.
# A session-level SET outranks every default, and a later ALTER ROLE or ALTER SYSTEM
# changes only new sessions (which are set up again).
# The third column names the server (its start, in seconds since 1970 whatever the session's
# time zone and date style, and its port): backend pids are its own.
_PINNED_SEARCH_PATH = "search_path = pg_catalog, pg_temp"
_WHO_IS_THIS = ("SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.pg_backend_pid(),"
                " extract(epoch FROM pg_catalog.pg_postmaster_start_time())::text || ' port '"
                " || pg_catalog.current_setting('port')")
_WHO_IS_THIS_AT = 1  # its result's index in the message's
_PINNED = ("lock_timeout = 0", "statement_timeout = 0", "idle_in_transaction_session_timeout = 0",
           "default_transaction_isolation = 'read committed'",
           "default_transaction_read_only = off", "standard_conforming_strings = on")
# A backend waiting for a lock notices its client has gone (a process killed while it
# waits, a connection closed under a wait) only when granted, and keeps every lock of the
# session until then: PostgreSQL 14+ can check the socket while a statement runs, on the
# systems that can tell (Linux, macOS, the BSDs, illumos; elsewhere setting it is an error
# and the server keeps its default).
_CHECKING_CLIENT = "client_connection_check_interval = 1000"
_CHECK_UNSUPPORTED = (pg_errors.InvalidParameterValue, pg_errors.UndefinedObject)


def _setup_sql(server_version: int, check_client: bool = True) -> str:
    """What sets up a new connection (again with ``check_client`` false if it fails with
    ``_CHECK_UNSUPPORTED``)."""
    pinned = list(_PINNED)
    if server_version >= 170000:
        pinned.append("transaction_timeout = 0")
    if server_version >= 140000:
        pinned.append("idle_session_timeout = 0")
        if check_client:
            pinned.append(_CHECKING_CLIENT)
    return "; ".join([f"SET {_PINNED_SEARCH_PATH}", _WHO_IS_THIS,
                      *(f"SET {setting}" for setting in pinned)])


class UnsafeServerError(LockError):
    """The DSN reaches a server on which session locks would not exclude: a standby, or a
    pooler between this process and the server. Raised by the call that connected; the
    connection is closed and nothing is held."""


class PgConnectionError(LockError, ConnectionError):
    """lockmgr could not connect to PostgreSQL: the server refused the connection (out of
    connections, "sorry, too many clients already"; authentication; no such database), could
    not be reached, or did not complete the connection in time (by an untimed call's connect
    bound: ``connect_timeout``, else 10 s). Raised by the call that connected, psycopg's
    error as its ``__cause__``; nothing is held. (A timed call, or a try, whose connection
    is not complete by its deadline times out instead: False, or ``LockTimeout``.)"""


def _conninfo(dsn: object, connect_kwargs: dict[str, Any]) -> str:
    """The connection string of ``dsn`` with ``connect_kwargs``, as libpq parses it: a
    manager's are checked when it is made (TypeError for a ``dsn`` that is not a str,
    ValueError naming what libpq cannot parse, or a bad ``connect_timeout``)."""
    if not isinstance(dsn, str):
        raise TypeError("dsn must be a str (a URL or \"host=... dbname=...\"), not "
                        f"{type(dsn).__name__}")
    try:
        conninfo = make_conninfo(dsn, **connect_kwargs)
        _connect_limit(conninfo)
    except (psycopg.ProgrammingError, ValueError) as error:
        raise ValueError("not a PostgreSQL connection string (dsn and connect_kwargs): "
                         f"{str(error).strip()}") from None
    return conninfo


# How long a connect may take, when neither the call's deadline nor ``connect_timeout``
# bounds it: as long as any round trip that waits for no lock (``_link._ANSWER_WITHIN``).
_CONNECT_WITHIN = 10.0


def _connect_limit(conninfo: str) -> float | None:
    """How long a connect to ``conninfo`` may take: its ``connect_timeout`` (or
    PGCONNECT_TIMEOUT) as libpq reads it (whole seconds, at least 2; 0 or less: no limit,
    None), else ``_CONNECT_WITHIN``."""
    value = conninfo_to_dict(conninfo).get("connect_timeout",
                                           os.environ.get("PGCONNECT_TIMEOUT"))
    if value is None:
        return _CONNECT_WITHIN
    try:
        seconds = int(float(value))
    except ValueError:
        raise ValueError(f"connect_timeout must be a number of seconds, not {value!r}") from None
    return None if seconds <= 0 else float(max(2, seconds))


def _refusal(first_row: Any, client_pid: int) -> UnsafeServerError | None:
    """Why a session (``_WHO_IS_THIS``'s answer, and the backend pid libpq was given at
    connect) cannot hold locks, or None."""
    in_recovery = first_row.get_value(0, 0) == b"t"
    backend_pid = int(first_row.get_value(0, 1))
    if backend_pid != client_pid:
        return UnsafeServerError(
            f"the DSN reaches PostgreSQL through a connection pooler (the server's backend is"
            f" pid {backend_pid}, the connection was told {client_pid}): a pooler may run the"
            " next statement on another server session, which would not hold this session's"
            " locks and might hold another client's. Point the DSN at the server itself")
    if in_recovery:
        return UnsafeServerError(
            "the DSN reaches a standby (pg_is_in_recovery() is true): a standby's advisory"
            " locks are its own, so a process on the primary could hold the same key. Point"
            " the DSN at the primary (with several hosts: target_session_attrs=read-write)")
    return None


_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
               "keepalives_count": 3, "tcp_user_timeout": 10_000}
