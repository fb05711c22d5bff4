"""Every behavioural test runs against both engines: the compiled core and the pure twin.

``--no-c-extensions`` runs the pure twin only (for machines without the compiled core);
by default a missing compiled core is an error, never a skip.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import importlib
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from lockmgr import AbandonedLockWarning


def _postgres_plugins() -> list[str]:
    """The PostgreSQL tests' fixtures (their modules opt in to the per-test checks), where
    psycopg can be imported. Plain psycopg (the free-threaded and wheel runners' install)
    cannot without the system's libpq: there the PostgreSQL test modules skip, naming what is
    missing (``pgserver``, which they import first; an error under LOCKMGR_REQUIRE_SERVERS=1),
    and the other tests run. A psycopg not installed at all fails the run: it is part of the
    [test] extra."""
    try:
        import psycopg  # noqa: F401
    except ModuleNotFoundError:
        raise
    except ImportError:  # psycopg's "no pq wrapper available"
        return []
    return ["pg_fixtures"]


# The host backend's fixtures, where it exists (not on Windows, whose host tests are left out).
pytest_plugins = _postgres_plugins() + ([] if sys.platform == "win32" else ["host_fixtures"])
collect_ignore = ["host"] if sys.platform == "win32" else []

IMPLEMENTATIONS = {"cython": "lockmgr._core", "python": "lockmgr._pure"}

#: Upper bound for anything a test waits on; generous for a noisy 2-core machine.
#: The tests' root folder: what a child process puts on sys.path to import conftest, pgserver
#: and the other support modules (pyproject's ``pythonpath`` does that for the tests).
TESTS = os.path.dirname(os.path.abspath(__file__))

PATIENCE = 20.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lockmgr")
    group.addoption(
        "--c-extensions",
        action="store_true",
        default=True,
        dest="c_extensions",
        help="test the compiled core as well as the pure twin (default)",
    )
    group.addoption(
        "--no-c-extensions",
        action="store_false",
        dest="c_extensions",
        help="test the pure-Python twin only",
    )
    group.addoption(
        "--facade-only",
        action="store_true",
        default=False,
        dest="facade_only",
        help="only the tests that use lockmgr's public names rather than an engine given "
             "to them (what LOCKMGR_NO_EXTENSIONS=1 changes: .ci/run runs them so)",
    )
    group.addoption(
        "--only-c-extensions",
        action="store_true",
        default=False,
        dest="c_only",
        help="run the engine tests on the compiled core only (scripts/mutants.py uses it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--no-c-extensions`` deselects (and reports) the tests that need the compiled core;
    ``--facade-only`` those given an engine (``impl``), which the default run covers."""
    if config.getoption("facade_only"):
        given = [item for item in items if "impl" in getattr(item, "fixturenames", ())]
        if given:
            config.hook.pytest_deselected(items=given)
            items[:] = [item for item in items if "impl" not in getattr(item, "fixturenames", ())]
    if config.getoption("c_extensions"):
        return
    deselected = [item for item in items if item.get_closest_marker("compiled")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("compiled")]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        if not metafunc.config.getoption("c_extensions"):
            names = ["python"]
        elif metafunc.config.getoption("c_only"):
            names = ["cython"]
        else:
            names = ["cython", "python"]
        metafunc.parametrize("impl", names, indirect=True)


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The engine module under test: ``lockmgr._core`` or ``lockmgr._pure``."""
    return importlib.import_module(IMPLEMENTATIONS[request.param])


@pytest.fixture(params=[True, False], ids=["fair", "unfair"])
def fair(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def locks(impl: ModuleType):  # type: ignore[no-untyped-def]
    """A strict-FIFO manager of the engine under test."""
    return impl.LockManager()


def xfail_if_the_interpreter_aborted(returncode: int, stderr: str, pure: bool) -> None:
    """A child running only Python code (the pure twin) that died of glibc's futex abort
    on a free-threaded build: CPython 3.13.5t's doing, not lockmgr's. Python code cannot
    make the kernel return a futex error glibc does not expect; seen in CI's signal storms
    with the GIL off, under load, never on GIL builds, not reproduced in isolation. Any
    other failure of the child still fails its test."""
    if (pure and returncode == -6 and not getattr(sys, "_is_gil_enabled", lambda: True)()
            and "The futex facility returned an unexpected error code" in stderr):
        pytest.xfail("CPython 3.13.5t aborted in glibc's futex code (pure Python child)")


def block_records() -> int:
    """How many records of which task is inside an ``async with`` object are alive: the
    pure twin's and the backends' (``_layered_aio.AsyncBlockRecord``), and the compiled core's (its
    ``aio[key]`` view is its own record)."""
    from lockmgr import _pure

    kinds: tuple[type, ...] = (_pure._BlockRecord,)
    layered = sys.modules.get("lockmgr._layered_aio")
    if layered is not None:
        kinds += (layered.AsyncBlockRecord,)
    core = sys.modules.get("lockmgr._core")
    if core is not None:
        kinds += (core._BlockRecord,)
    gc.collect()
    return sum(isinstance(o, kinds) for o in gc.get_objects())


class Delegating:
    """A user's async context manager that delegates to a lockmgr one: the common wrapper
    pattern (its ``__aenter__``/``__aexit__`` run in frames of their own)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> Any:
        return await self.inner.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self.inner.__aexit__(*exc_info)


def wait_until(condition: Callable[[], bool], what: str, patience: float = PATIENCE) -> None:
    """Poll ``condition`` (a real state: a queue length, an owner) until it holds."""
    deadline = time.monotonic() + patience
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.001)


@contextlib.contextmanager
def abandoned_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Records every ``AbandonedLockWarning`` raised while the block runs, by any thread, on
    any kind of build. Start the thread that ends holding keys inside the block, and join it
    there.

    The warning is raised by the ending thread while CPython clears its state, after its
    ``run()`` returned. Where that warning is filtered and shown depends on the build:

    - With a GIL, and on 3.13t, ``catch_warnings`` swaps the process-wide filters and
      ``warnings.showwarning``: every thread sees them while the block is open.
    - From 3.14 on a free-threaded build (``sys.flags.context_aware_warnings``),
      ``catch_warnings`` changes only the calling context's filters. A thread started inside
      the block runs ``run()`` in a copy of that context (``sys.flags.thread_inherit_context``),
      but by the time its state is cleared it has left that copy, so its warning meets the
      process-wide filters (``warnings.filters``, and ``warnings.showwarning`` if replaced),
      which a context-local block never touched: ``pytest.warns`` would see "DID NOT WARN".

    So this lets the warning through in both places — the block's own context (and the
    copies threads started in it run in) and the process-wide filters — and records it
    through ``warnings.showwarning``, which CPython consults from any context. Other warnings
    go on to the previous ``showwarning``.
    """
    caught: list[warnings.WarningMessage] = []
    previous = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
        if issubclass(category, AbandonedLockWarning):
            caught.append(warnings.WarningMessage(message, category, filename, lineno, None, line))
        else:
            previous(message, category, filename, lineno, file, line)  # type: ignore[arg-type]

    context_aware = bool(getattr(sys.flags, "context_aware_warnings", False))
    process_wide = ("always", None, AbandonedLockWarning, None, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("always", AbandonedLockWarning)  # this context's filters
        if context_aware:
            # An empty context has no context-local filters: this edits the process's.
            contextvars.Context().run(warnings.simplefilter, "always", AbandonedLockWarning)
        warnings.showwarning = show
        try:
            yield caught
        finally:
            warnings.showwarning = previous  # catch_warnings restores it only without contexts
            if context_aware:
                with contextlib.suppress(ValueError):
                    warnings.filters.remove(process_wide)  # type: ignore[arg-type]
                warnings._filters_mutated()  # type: ignore[attr-defined]


class Worker:
    """A thread that runs one call at a time on request, so a test can sequence threads."""

    def __init__(self, name: str = "worker") -> None:
        self._calls: list[tuple[Callable[[], object], threading.Event, list[object]]] = []
        self._ready = threading.Condition()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._calls and not self._stopping:
                    self._ready.wait()
                if not self._calls:
                    return
                func, done, box = self._calls.pop(0)
            try:
                box.append(("ok", func()))
            except BaseException as exc:  # handed to the test
                box.append(("error", exc))
            done.set()

    def submit(self, func: Callable[[], object]) -> Call:
        done = threading.Event()
        box: list[object] = []
        with self._ready:
            self._calls.append((func, done, box))
            self._ready.notify()
        return Call(done, box)

    def run(self, func: Callable[[], object]) -> object:
        """Run ``func`` in the worker and return its result (re-raising its exception)."""
        return self.submit(func).result()

    def stop(self, patience: float = PATIENCE, check: bool = True) -> None:
        """Stop the worker once its calls are done; ``check=False`` abandons a stuck one."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self.thread.join(patience)
        assert not check or not self.thread.is_alive(), "worker did not stop"


class Call:
    def __init__(self, done: threading.Event, box: list[object]) -> None:
        self._done = done
        self._box = box

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, patience: float) -> bool:
        """Whether the call finished within ``patience`` seconds."""
        return self._done.wait(patience)

    def result(self, patience: float = PATIENCE) -> object:
        """The call's result (re-raising its exception), waiting at most ``patience`` s."""
        assert self._done.wait(patience), f"call did not finish within {patience:g} s"
        kind, value = self._box[0]  # type: ignore[misc]
        if kind == "error":
            raise value  # type: ignore[misc]
        return value


@pytest.fixture
def workers() -> Iterator[Callable[[str], Worker]]:
    started: list[Worker] = []

    def start(name: str = "worker") -> Worker:
        worker = Worker(name)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def end_holding_keys_of_a_freed_manager(
        make_doomed: Callable[[], Any], take_live: Callable[[], object]
) -> list[warnings.WarningMessage]:
    """A thread takes key "gone" of a manager made by ``make_doomed`` and runs
    ``take_live()``; the manager (referenced by nothing else) is freed while the thread
    lives; then the thread ends. Returns the AbandonedLockWarnings its end raised."""
    doomed = make_doomed()
    took, go = threading.Event(), threading.Event()

    def hold_and_end() -> None:
        doomed.acquire("gone")
        take_live()
        took.set()
        assert go.wait(PATIENCE)

    with abandoned_warnings() as caught:
        thread = threading.Thread(target=hold_and_end)  # started inside: see abandoned_warnings
        thread.start()
        assert took.wait(PATIENCE)
        ref = weakref.ref(doomed)
        del doomed
        gc.collect()
        assert ref() is None
        go.set()
        thread.join(PATIENCE)
    assert not thread.is_alive()
    return caught


async def held_by_another_task(locks: Any, key: object) -> tuple[Any, Any]:
    """A task holding ``key`` of ``locks`` until the returned event is set."""
    asyncio = sys.modules["asyncio"]  # imported by the caller, which runs a loop
    holds, done = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with locks.aio[key]:
            holds.set()
            await done.wait()

    task = asyncio.create_task(holder())
    await holds.wait()
    return task, done
