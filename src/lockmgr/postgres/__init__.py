"""Across processes and hosts: PostgreSQL advisory locks behind the lockmgr API.

``PgLockManager`` and ``PgRWLockManager`` offer the methods of ``LockManager`` and
``RWLockManager``. Within a process, threads are ordered by the in-process engine
(reentrancy per thread, FIFO, deadlock detection); across processes, by PostgreSQL's lock
manager (its FIFO queue, its deadlock detector, and release of everything a session held
when the session ends — no lease that can expire under a paused holder).

The rules that keep it correct:

- **Keys** (str, bytes, int and tuples of them) map to one 64-bit advisory key by blake2b of
  a canonical encoding keyed with the namespace: the same key is the same lock from every
  process, Python version and host. A hash collision can only make two keys wait for each
  other; it can never let two holders in.
- **Connections**: a thread's session-level locks live on a connection that thread owns
  until it holds nothing (then the connection is idle: the thread keeps it, parked, for its
  next call, unless a thread or task that needs one takes it first; a thread that ends
  leaves it on the manager's idle list; it is checked before it is used again). Each new
  connection pins the settings locks depend on and refuses a standby and a pooler (``_setup_sql``, ``_refusal``). A forked child never uses (nor closes) a connection
  of its parent's: it opens its own, and keys the parent held are not the child's.
- **A lost connection is a lost lock**: the holder gets ``LockLost`` at each release of
  that key (and at an acquire of it), ``lost_keys()`` and the ``on_lost`` callback (once per
  key) tell the application, and the manager no longer claims to hold the key. Keys taken
  later go on a new connection. Connections use TCP keepalives so a dead peer is noticed.
- **One round trip** per first acquire and per last release: each is one message (a
  single-key call is a statement prepared once per connection), fences included. A wait with a timeout takes
  transaction-level locks first, so that a timeout racing the grant (PostgreSQL may report
  the timeout and grant all the same) rolls the grant back, and takes the session locks,
  which then no longer wait, in the same message: no extra round trip, where checking for
  a raced grant after each timeout would cost one per timeout. A wait without a timeout
  takes the session locks directly; after a cancel or Ctrl-C (rare) one more round trip
  releases whatever of the call the server may have granted.
- **Timeouts** end on time via ``lock_timeout``; 0 uses ``pg_try_advisory_*lock*``;
  Ctrl-C cancels the server-side wait; PostgreSQL's deadlock error becomes
  ``DeadlockError``. After any of them, and after a cancelled statement, nothing the call
  took is left held; where that cannot be made sure (the connection is not idle), the
  connection is closed and the keys held on it are lost. A second Ctrl-C that lands before
  that clean-up (or a release's round trip) has started leaves it to the thread's next call
  on the manager, which does it first (``_Session.unsure``).
- ``xact_lock(conn, key)`` takes a transaction-scoped lock in the caller's own transaction,
  so the lock and the caller's writes commit or roll back together.
- **Deadlines**: every round trip has one on the client (``_ANSWER_WITHIN``,
  ``_WAIT_MARGIN``); past it the statement is cancelled, and if the cancel goes
  unanswered too (``_CANCEL_GRACE``) the connection is closed and its keys are lost. So
  does every connect (a timed call's deadline, else ``connect_timeout``, else
  ``_CONNECT_WITHIN`` for each host in turn: ``_link._connect_pgconn``; libpq's
  non-blocking connect for a thread),
  and every deadlock look (``LOOK_FOR``, and its wait's deadline). A connect that fails
  raises ``PgConnectionError`` (psycopg's error as its cause); a DSN libpq cannot parse
  fails when the manager is made.
- **Fencing tokens** (``fencing=True``): the first level of each write acquisition takes
  the key's next fence — its row of the fence table (``_FenceTable``), keyed by advisory key, incremented
  — in the lock's own message, after the lock and only if it was granted; a timed wait
  takes it under its transaction locks, so that a timeout rolls it back too. The increment
  commits with ``synchronous_commit`` on before the fence is handed out: a crash never
  hands one out twice. Session locks outlive a failed statement, so an increment that
  fails after the grant (table dropped, no privilege) leaves the lock to the call's usual
  clean-up. The fence lives in the thread's ``_Session`` while the key is held, and goes
  with the last release, a loss or a fork. Reads take none. A manager's first fenced
  acquisition makes sure the table exists first, in a round trip of its own, so that its
  creation is committed before any wait (in the lock's transaction, it would hold back
  every other session's first use — timed ones too — until the lock was granted). A
  commit whose wait for a synchronous standby was cut short (the server's warning, or a
  deadline's cancel the statement survived) hands no fence out: a promoted standby could
  hand it out again. The call raises ``FenceNotDurableError``; its clean-up releases.
- ``aio``: asyncio tasks as owners, under the same rules (``lockmgr.postgres._aio`` says what the
  event loop adds).

The package, by concern (each module imports only those above it; the two asyncio ones are
imported on first use of ``aio``, so that ``import lockmgr.postgres`` does not load asyncio):

- ``_keys``: keys to advisory keys; ``_server``: what a new connection checks and sets;
  ``_link``: a thread's connection and its round trips with their deadlines; ``_capacity``:
  ``max_connections``, and the queue for a connection beyond it; ``_inspect``: who holds
  what on the server (``snapshot(server=True)``); ``_fences``:
  fencing tokens; ``_sql``: the lock statements; ``_session``: what a thread holds;
- ``_elsewhere``: what the caller holds through the process's other managers; ``_xact``:
  ``xact_lock`` beside the session locks of the same owner;
- ``_engine``: the thread manager (``_PgEngine``); ``_managers``: the public managers;
- ``_aio_link``, ``_tasks``, ``_aio``: asyncio tasks as owners.
"""

from __future__ import annotations

try:
    import psycopg
except ImportError as exc:  # tested in a subprocess without psycopg
    raise ImportError(
        "lockmgr.postgres needs psycopg 3: pip install 'lockmgr[postgres]'"
    ) from exc

from .._errors import LockLost
from .._layered import Lease
from ._fences import DEFAULT_FENCE_TABLE, FenceNotDurableError
from ._inspect import ServerKeyState, ServerSession
from ._keys import advisory_key
from ._managers import PgKeyLock, PgLockManager, PgRWLockManager
from ._server import PgConnectionError, UnsafeServerError

__all__ = ["FenceNotDurableError", "Lease", "LockLost", "PgConnectionError", "PgKeyLock",
           "PgLockManager", "PgRWLockManager", "ServerKeyState", "ServerSession",
           "UnsafeServerError", "advisory_key"]
