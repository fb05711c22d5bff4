"""``lockmgr-bench --scenario host``: it runs its worker processes and prints its table, and
names what it leaves out (its figures are read by a person, never asserted here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lockmgr import bench
from lockmgr.bench import _host

CROSS_PROCESS = {"one hot key, 4 processes", "hand-off to another process, p50",
                 "hand-off to another process, p99",
                 "killed holder: key taken by a waiter, p50",
                 "barging: a waiting process's wait p99 (worst of 3)",
                 "barging: grants to the re-acquiring process"}
PAIRS = {"acquire+release, uncontended", "acquire+release, 1,000 other keys held"}


@pytest.mark.posix_only  # its workers fork holders and SIGKILL them
def test_host_scenario_measures_each_row_and_prints_its_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The pure twin's rows (so that it runs without the compiled core too): lockmgr.host
    gets every figure, the in-process manager its pairs only, and PostgreSQL without
    ``--pg-dsn`` is named under the table instead of measured."""
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "host", "--impl", "lockmgr.host-pure",
                       "--impl", "lockmgr-pure", "--impl", "postgres",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    metrics = {impl: {row["metric"] for row in rows if row["impl"] == impl}
               for impl in ("lockmgr.host-pure", "lockmgr-pure", "postgres")}
    assert metrics == {"lockmgr.host-pure": PAIRS | CROSS_PROCESS, "lockmgr-pure": PAIRS,
                       "postgres": set()}
    assert all(row["scenario"] == "host" and row["value"] >= 0 for row in rows)
    printed = capsys.readouterr().out
    assert "| scenario | metric | lockmgr.host-pure | lockmgr-pure |" in printed
    assert "| host | one hot key, 4 processes (pairs/s) | " in printed
    assert "- postgres: left out: give --pg-dsn" in printed


def test_host_rows_that_cannot_run_here_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "portalocker" else real_find_spec(name))
    assert _host.host_refusal("portalocker", None) == (
        "portalocker: left out: not installed (pip install 'lockmgr[bench]')")
    assert _host.host_refusal("postgres", None) == (
        "postgres: left out: give --pg-dsn (a local server) to measure PgLockManager")
    assert _host.host_refusal("postgres", "host=pg") is None
    assert _host.host_refusal("lockmgr.host-pure", None) is None


@pytest.mark.parametrize("library", sorted(_host.FILE_LOCKS))
def test_each_file_lock_library_locks_a_file_per_key(library: str, tmp_path: Path) -> None:
    """The workers' way of using each library the scenario compares (from the [bench] extra):
    a lock file per key, in the run's directory."""
    pytest.importorskip(library)
    from lockmgr.bench.host_worker import Backend

    backend = Backend(library, str(tmp_path), "", "space")
    backend.acquire("key")
    assert (tmp_path / "space-key.lock").exists()
    backend.release("key")
