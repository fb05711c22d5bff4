"""Every code example of the README and the docs runs, on both engines.

Each fenced ```python block of README.md and docs/*.md is one test, named by its file and
line, executed as a module of its own; a ```pycon block (an interpreter transcript) runs its
``>>>``/``...`` lines the same way (its output lines vary: thread idents, times, so they are
not compared). The public names the block imports (``lockmgr.LockManager``, ...) are the
engine under test's, as ``lockmgr.postgres``'s in-process engine is.

An HTML comment on the line before a block says what else it needs, in the docs' source:

- ``<!-- example: needs postgres (dsn) -->``: it runs with ``dsn``, the URL of a PostgreSQL
  server this module starts (``tests/pgserver.py``, as the PostgreSQL tests do); after it,
  its managers are closed and no advisory lock may be left on that server;
- ``<!-- example: needs host (directory) -->``: it runs with ``directory``, the path of a
  lock directory of its own (not made yet) for ``lockmgr.host``; skipped on Windows, where
  ``lockmgr.host`` is not available; after it, its managers are closed;
- ``<!-- example: not runnable: REASON -->``: it is only compiled (so it stays Python), and
  the reason is there for a reader of the source to see.

Any other ``example:`` comment fails its test, and so does a file with no example at all
(a renamed fence would otherwise drop its examples silently).
"""

from __future__ import annotations

import gc
import importlib
import pathlib
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
from conftest import TESTS

import lockmgr

ROOT = pathlib.Path(TESTS).parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<what>.*?)\s*-->\s*$")
NEEDS_POSTGRES = "needs postgres (dsn)"
NEEDS_HOST = "needs host (directory)"
NOT_RUNNABLE = re.compile(r"not runnable: (?P<reason>\S.*)")


@dataclass
class Example:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    lang: str
    source: str
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples_in(path: pathlib.Path) -> list[Example]:
    """The ```python and ```pycon blocks of ``path``, with the example: marker before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(opening["indent"])
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{{indent}}}```\s*$", lines[end]):
            end += 1
        if opening["lang"] in ("python", "pycon"):
            before = i - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            marked = MARKER.match(lines[before]) if before >= 0 else None
            body = textwrap.dedent("\n".join(line[indent:] if line[:indent].isspace() else line
                                             for line in lines[i + 1:end]))
            found.append(Example(path, i + 1, opening["lang"], body + "\n",
                                 marked["what"] if marked else None))
        i = end + 1
    return found


def _transcript_source(text: str) -> str:
    """The statements of a pycon transcript: its ``>>>`` and ``...`` lines."""
    return "".join(line[4:] + "\n" for line in text.splitlines()
                   if line.startswith((">>> ", "... ")) or line in (">>>", "..."))


EXAMPLES = [example for path in FILES for example in examples_in(path)]


def test_every_file_has_its_examples_found() -> None:
    """The pages with code still have it, as fences this module reads."""
    with_examples = {example.path.name for example in EXAMPLES}
    expected = {"README.md", "getting-started.md", "asyncio.md", "readers-writers.md",
                "semaphores.md", "many-keys.md", "postgres.md", "contention.md", "recipes.md",
                "host.md", "singleflight.md"}
    assert expected <= with_examples, expected - with_examples


@pytest.fixture(scope="module")
def pg_dsn() -> Iterator[str]:
    """A throwaway PostgreSQL server for the examples that need one (started on first use)."""
    import pgserver

    with pgserver.running_server() as dsn:
        yield dsn


@pytest.fixture
def public_engine(impl: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The public names, and lockmgr.postgres's and lockmgr.host's in-process engine, are
    ``impl``'s."""
    for name in ("LockManager", "RWLockManager", "SemaphoreManager", "KeyLock", "AsyncKeyLock"):
        monkeypatch.setattr(lockmgr, name, getattr(impl, name))
    # (a Singleflight made now takes its engine from lockmgr.RWLockManager: impl's)
    if sys.platform != "win32":  # (lockmgr.host is not there: its examples are skipped)
        host_managers = importlib.import_module("lockmgr.host._managers")
        monkeypatch.setattr(host_managers, "LockManager", impl.LockManager)
        monkeypatch.setattr(host_managers, "RWLockManager", impl.RWLockManager)
    try:
        managers = importlib.import_module("lockmgr.postgres._managers")
    except ImportError:
        # psycopg cannot load libpq (plain psycopg on a wheel runner): only the examples
        # that need PostgreSQL use lockmgr.postgres, and pg_dsn skips those, naming what is
        # missing (an error where LOCKMGR_REQUIRE_SERVERS=1); the others run.
        return impl
    monkeypatch.setattr(managers, "LockManager", impl.LockManager)
    monkeypatch.setattr(managers, "RWLockManager", impl.RWLockManager)
    return impl


def _advisory_locks(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.name for example in EXAMPLES])
def test_example_runs(example: Example, public_engine: ModuleType,
                      request: pytest.FixtureRequest) -> None:
    source = _transcript_source(example.source) if example.lang == "pycon" else example.source
    assert source.strip(), f"{example.name}: an empty example"
    code = compile(source, example.name, "exec")
    namespace: dict[str, Any] = {"__name__": f"example_{example.line}"}
    if example.marker is not None:
        refused = NOT_RUNNABLE.fullmatch(example.marker)
        if refused:  # compiled above: it is still Python; the reason is in the docs source
            assert refused["reason"].strip()
            return
        assert example.marker in (NEEDS_POSTGRES, NEEDS_HOST), (
            f"{example.name}: unknown marker {example.marker!r}; "
            f"use {NEEDS_POSTGRES!r}, {NEEDS_HOST!r} or 'not runnable: REASON'")
        if example.marker == NEEDS_HOST:
            if sys.platform == "win32":
                pytest.skip("lockmgr.host needs POSIX record locks: not available on Windows")
            namespace["directory"] = str(request.getfixturevalue("tmp_path") / "locks")
        else:
            namespace["dsn"] = dsn = request.getfixturevalue("pg_dsn")
    try:
        exec(code, namespace)
        managers = [value for value in namespace.values()
                    if isinstance(value, (lockmgr.LockManager, lockmgr.RWLockManager))]
        for manager in managers:  # the public names were the engine's under test
            assert type(manager).__module__ == public_engine.__name__, manager
        for flight in (value for value in namespace.values()
                       if isinstance(value, lockmgr.Singleflight)):
            assert type(flight._table.locks).__module__ == public_engine.__name__, flight
    finally:
        for value in namespace.values():
            close = getattr(value, "close", None)
            if type(value).__module__.startswith(("lockmgr.postgres", "lockmgr.host",
                                                  "psycopg")) and callable(close):
                close()
        namespace.clear()
        gc.collect()
    if example.marker == NEEDS_POSTGRES:
        assert _advisory_locks(dsn) == 0, f"{example.name} left locks held on the server"
