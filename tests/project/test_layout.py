"""The package's layout: the import rules between its modules (import-linter's contracts in
pyproject.toml: the engines below everything else, the benchmark over the PostgreSQL backend,
no cycle among the modules of lockmgr or of any of its packages), and modules of a size one
can read."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import TESTS

import lockmgr

PACKAGE = Path(lockmgr.__file__).resolve().parent  # the tree under test (src/ or a wheel)
PYPROJECT = Path(TESTS).parent / "pyproject.toml"
MOST_LINES = 800


def test_import_contracts_hold() -> None:
    """``lint-imports`` keeps every contract, checking the same tree the tests import. On a
    free-threaded build import-linter cannot be installed (grimp, its import graph, is a
    Rust extension with no free-threaded wheel, see scripts/free-threaded-requirements.py):
    there its absence is expected, anywhere else it fails the test."""
    if importlib.util.find_spec("importlinter") is None:
        assert sysconfig.get_config_var("Py_GIL_DISABLED"), "pip install '.[test]'"
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint_imports), "--no-cache", "--no-logo", str(PYPROJECT)], env=env,
                          cwd=PYPROJECT.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and " kept" in done.stdout


@pytest.mark.parametrize("module", [pytest.param("lockmgr._core", marks=pytest.mark.compiled),
                                    "lockmgr._pure"])
def test_an_engine_loads_no_backend_nor_benchmark(module: str) -> None:
    """Importing an engine (the compiled core too, whose imports import-linter cannot read)
    loads nothing of the PostgreSQL backend, the benchmark or otel."""
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['lockmgr', 'postgres'], ['lockmgr', 'bench'], ['lockmgr', 'otel'])))")
    done = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_modules_are_of_a_readable_size() -> None:
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
             for path in PACKAGE.rglob("*.py")}
    # the whole tree is seen, packages included
    assert {"postgres/_engine.py", "bench/_cli.py", "_pure/_operations.py"} <= sizes.keys()
    too_long = {name: lines for name, lines in sizes.items() if lines > MOST_LINES}
    assert not too_long, f"modules over {MOST_LINES} lines: {too_long}"
