"""A real PostgreSQL server for the tests: Debian's binaries, a temporary data directory,
127.0.0.1 and a free port, started as the ``postgres`` user when running as root (initdb
refuses root), stopped afterwards; ``restart(dsn)`` restarts it in between, as an
administrator or a failover would. Beside it, a streaming hot standby of it
(``running_standby``) and Debian's pgbouncer in front of it (``running_pgbouncer``). A missing
server binary is a skip that names what is missing (``pytest -ra`` prints it), or an error
where ``LOCKMGR_REQUIRE_SERVERS=1`` says the servers must be there (``.ci/run``)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from types import ModuleType
from typing import NoReturn

import pytest


def _import_psycopg() -> ModuleType:
    """psycopg, which every module of PostgreSQL tests imports through this one (it imports
    ``pgserver`` before ``psycopg``). Plain psycopg (what the free-threaded interpreters and
    the wheels' tests install: scripts/free-threaded-requirements.py) loads the system's
    libpq, and cannot be imported without one (a wheel runner, a machine without PostgreSQL's
    packages): then such a module is skipped, naming what is missing, or it is an error where
    ``LOCKMGR_REQUIRE_SERVERS=1``. A psycopg not installed at all is an error: it is part of
    the [test] extra."""
    try:
        import psycopg
    except ModuleNotFoundError:
        raise
    except ImportError as error:  # psycopg's "no pq wrapper available"
        message = (f"psycopg cannot load libpq ({str(error).splitlines()[0]}): install "
                   "Debian's libpq5 (its postgresql brings it) or psycopg[binary]")
        if os.environ.get("LOCKMGR_REQUIRE_SERVERS") == "1":
            raise RuntimeError(message + "; LOCKMGR_REQUIRE_SERVERS=1 makes that an error") \
                from error
        pytest.skip(message, allow_module_level=True)
    return psycopg


psycopg = _import_psycopg()
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

from lockmgr._signals import sigterm_interrupts  # noqa: E402


def missing_server(binary: str, package: str) -> NoReturn:
    """Skip the test that needs ``binary``, naming it and the Debian package that has it
    (``scripts/test-servers.sh`` installs them all); fail instead where the servers are
    required."""
    message = (f"no {binary} on this machine: install Debian's {package} "
               "(bash scripts/test-servers.sh does)")
    if os.environ.get("LOCKMGR_REQUIRE_SERVERS") == "1":
        raise RuntimeError(message + "; LOCKMGR_REQUIRE_SERVERS=1 makes that an error")
    pytest.skip(message)


def require_postgres() -> None:
    """For a test that starts a server in a child process of its own."""
    _bindir()


def require_redis_server() -> None:
    """For the tests that start a Redis server (``lockmgr-bench --redis start``)."""
    if shutil.which("redis-server") is None:
        missing_server("redis-server", "redis-server")


def _bindir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda path: int(path.split("/")[4]) if path.split("/")[4].isdigit() else 0)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(initdb)
    missing_server("PostgreSQL server (initdb)", "postgresql")


# DSN -> the command line that runs pg_ctl on that server's data directory
_CONTROLS: dict[str, list[str]] = {}

# A hot standby refuses to start with fewer connections than its primary allows.
_MAX_CONNECTIONS = 200


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _workdir(prefix: str) -> tuple[str, list[str]]:
    """A new temporary directory, and the prefix that runs a command as its owner: as root,
    the ``postgres`` user (initdb and the server refuse root, and a data directory is its
    server's user's)."""
    workdir = tempfile.mkdtemp(prefix=prefix)
    if os.geteuid() != 0:
        return workdir, []
    shutil.chown(workdir, "postgres")
    return workdir, ["runuser", "-u", "postgres", "--"]


def _control(as_owner: list[str], workdir: str, port: int, settings: str = "") -> list[str]:
    """pg_ctl on ``workdir``'s data directory, for a server on 127.0.0.1 and ``port`` with its
    socket and log in ``workdir``."""
    return [*as_owner, f"{_bindir()}/pg_ctl", "-D", os.path.join(workdir, "data"), "-w", "-t",
            "60", "-l", os.path.join(workdir, "server.log"), "-o",
            f"-p {port} -k {workdir} -c listen_addresses=127.0.0.1 -c fsync=off "
            f"-c max_connections={_MAX_CONNECTIONS}{settings}"]


@contextlib.contextmanager
def running_server(settings: str = "") -> Iterator[str]:
    """Start a throwaway server; yields its DSN. A SIGTERM meanwhile (CI's time limit,
    ``timeout``) still stops it: pg_ctl runs it as a daemon, not a child of this process.
    ``settings``: more of the server's command line (" -c max_connections=5"), after (and
    so over) the defaults here."""
    with sigterm_interrupts():
        yield from _running_server(settings)


def _running_server(settings: str = "") -> Iterator[str]:
    """initdb's defaults let a standby follow it: wal_level replica, 10 WAL senders, and
    replication connections from 127.0.0.1 trusted (``--auth=trust``)."""
    workdir, as_owner = _workdir("lockmgr-pg-")
    port = _free_port()
    try:
        subprocess.run([*as_owner, f"{_bindir()}/initdb", "-D", os.path.join(workdir, "data"),
                        "-U", "postgres", "--auth=trust", "--no-sync"], check=True,
                       capture_output=True, timeout=120)
        with _started(_control(as_owner, workdir, port, settings), port) as dsn:
            yield dsn
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def _started(control: list[str], port: int) -> Iterator[str]:
    """Start the server ``control`` runs, yield its DSN, stop it (immediate) afterwards."""
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        subprocess.run([*control, "start"], check=True, capture_output=True, timeout=120)
        _CONTROLS[dsn] = control
        yield dsn
    finally:
        _CONTROLS.pop(dsn, None)
        subprocess.run([*control[:control.index("-w")], "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)


@contextlib.contextmanager
def running_standby(primary_dsn: str) -> Iterator[str]:
    """Start a hot standby of the server at ``primary_dsn``, copied with ``pg_basebackup -R``
    and streaming from it; yields its DSN once it is in recovery and the primary streams to
    it, so that what a test writes on the primary soon shows there (read-only). ``restart``
    takes it too; stopped and removed afterwards, SIGTERM included, as ``running_server``."""
    with sigterm_interrupts():
        yield from _running_standby(primary_dsn)


def _running_standby(primary_dsn: str) -> Iterator[str]:
    """The base backup carries the primary's postgresql.conf, and ``-R`` adds standby.signal
    and a primary_conninfo naming the primary's host, port and user."""
    workdir, as_owner = _workdir("lockmgr-pg-standby-")
    port = _free_port()
    name = f"lockmgr-standby-{port}"  # cluster_name: the standby's application_name upstream
    try:
        subprocess.run([*as_owner, f"{_bindir()}/pg_basebackup", "-d", primary_dsn, "-D",
                        os.path.join(workdir, "data"), "-R", "-X", "stream",
                        "--checkpoint=fast", "--no-sync"], check=True, capture_output=True,
                       timeout=120)
        with _started(_control(as_owner, workdir, port,
                               f" -c hot_standby=on -c cluster_name={name}"), port) as dsn:
            _await_streaming(primary_dsn, dsn, name)
            yield dsn
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _await_streaming(primary_dsn: str, standby_dsn: str, name: str) -> None:
    """Return once the standby is in recovery and the primary streams WAL to it (60 s at
    most): pg_ctl's wait ends when the standby takes connections, which can be before its
    WAL receiver has connected."""
    with psycopg.connect(standby_dsn, autocommit=True, connect_timeout=10) as standby:
        if standby.execute("SELECT pg_is_in_recovery()").fetchone() != (True,):
            raise RuntimeError(f"the standby at {standby_dsn} is not in recovery")
    deadline = time.monotonic() + 60
    with psycopg.connect(primary_dsn, autocommit=True, connect_timeout=10) as primary:
        while primary.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name"
                              " = %s AND state = 'streaming'", (name,)).fetchone() != (1,):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the primary at {primary_dsn} did not stream to the "
                                   f"standby at {standby_dsn} within 60 s")
            time.sleep(0.05)


@contextlib.contextmanager
def running_pgbouncer(primary_dsn: str, pool_mode: str = "transaction") -> Iterator[str]:
    """Start Debian's pgbouncer in front of the server at ``primary_dsn``, on 127.0.0.1 and a
    free port, with ``pool_mode`` ("session", "transaction" or "statement") and at most 2
    server connections per database and user; yields a DSN through it once a connection
    through it works. In transaction mode one client connection's transactions may run in
    different server sessions, which is what a pooler does to session-level locks. Stopped
    afterwards, SIGTERM included, as ``running_server``."""
    binary = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if binary is None:
        missing_server("pgbouncer", "pgbouncer")
    with sigterm_interrupts():
        yield from _running_pgbouncer(binary, primary_dsn, pool_mode)


def _running_pgbouncer(binary: str, primary_dsn: str, pool_mode: str) -> Iterator[str]:
    """A child process rather than a daemon (``-d``): ``server.poll()`` tells a pgbouncer that
    gave up (its reasons are in its log) from one still starting, and ``terminate`` stops it
    at once. As root it changes to the ``postgres`` user itself (``-u``; it refuses to run as
    root): under runuser, a SIGTERM would take 2 s and leave it unreaped."""
    upstream = conninfo_to_dict(primary_dsn)
    workdir = tempfile.mkdtemp(prefix="lockmgr-pgbouncer-")
    as_postgres = ["-u", "postgres"] if os.geteuid() == 0 else []
    port = _free_port()
    log = os.path.join(workdir, "pgbouncer.log")
    users = os.path.join(workdir, "users.txt")
    config = os.path.join(workdir, "pgbouncer.ini")
    server = None
    try:
        with open(users, "w") as file:  # auth_type trust still admits only the users listed
            file.write(f'"{upstream["user"]}" ""\n')
        with open(config, "w") as file:
            file.write(f"[databases]\n{upstream['dbname']} = host={upstream['host']} "
                       f"port={upstream['port']}\n"
                       f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n"
                       f"unix_socket_dir =\nauth_type = trust\nauth_file = {users}\n"
                       f"pool_mode = {pool_mode}\ndefault_pool_size = 2\n"
                       "max_client_conn = 100\n")
        with open(log, "wb") as output:  # it logs to stderr; read if it does not start
            server = subprocess.Popen([binary, *as_postgres, config], stdin=subprocess.DEVNULL,
                                      stdout=output, stderr=subprocess.STDOUT)
        dsn = f"postgresql://{upstream['user']}@127.0.0.1:{port}/{upstream['dbname']}"
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(dsn, connect_timeout=5).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline or server.poll() is not None:
                    with open(log, errors="replace") as file:
                        raise RuntimeError("pgbouncer did not start:\n" + file.read()[-2000:])
                time.sleep(0.05)
        yield dsn
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


def restart(dsn: str) -> None:
    """Stop the server (ending every session at once) and start it again on the same port."""
    subprocess.run([*_CONTROLS[dsn], "-m", "immediate", "restart"], check=True,
                   capture_output=True, timeout=120)
