"""A real PostgreSQL server for the tests: Debian's binaries, a temporary data directory,
127.0.0.1 and a free port, started as the ``postgres`` user when running as root (initdb
refuses root), stopped afterwards; ``restart(dsn)`` restarts it in between, as an
administrator or a failover would. A missing server is an error, never a skip."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator

from lockmgr.bench import sigterm_interrupts


def _bindir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(initdb)
    raise RuntimeError("no PostgreSQL server binaries: install Debian's postgresql (.ci/run does)")


# DSN -> the command line that runs pg_ctl on that server's data directory
_CONTROLS: dict[str, list[str]] = {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def running_server() -> Iterator[str]:
    """Start a throwaway server; yields its DSN. A SIGTERM meanwhile (CI's time limit,
    ``timeout``) still stops it: pg_ctl runs it as a daemon, not a child of this process."""
    with sigterm_interrupts():
        yield from _running_server()


def _running_server() -> Iterator[str]:
    bindir = _bindir()
    root = os.geteuid() == 0
    workdir = tempfile.mkdtemp(prefix="lockmgr-pg-")
    datadir = os.path.join(workdir, "data")
    as_owner: list[str] = ["runuser", "-u", "postgres", "--"] if root else []
    if root:
        shutil.chown(workdir, "postgres")
    port = _free_port()
    try:
        subprocess.run([*as_owner, f"{bindir}/initdb", "-D", datadir, "-U", "postgres",
                        "--auth=trust", "--no-sync"], check=True, capture_output=True,
                       timeout=120)
        control = [*as_owner, f"{bindir}/pg_ctl", "-D", datadir, "-w", "-t", "60",
                   "-l", os.path.join(workdir, "server.log"), "-o",
                   f"-p {port} -k {workdir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c max_connections=200"]
        subprocess.run([*control, "start"], check=True, capture_output=True, timeout=120)
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        _CONTROLS[dsn] = control
        yield dsn
    finally:
        _CONTROLS.pop(f"postgresql://postgres@127.0.0.1:{port}/postgres", None)
        subprocess.run([*as_owner, f"{bindir}/pg_ctl", "-D", datadir, "-m", "immediate",
                        "stop"], capture_output=True, timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)


def restart(dsn: str) -> None:
    """Stop the server (ending every session at once) and start it again on the same port."""
    subprocess.run([*_CONTROLS[dsn], "-m", "immediate", "restart"], check=True,
                   capture_output=True, timeout=120)
