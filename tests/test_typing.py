"""The public API type-checks strictly, and a wrong key type is a type error.

mypy is part of the [test] extra: a missing mypy fails here (never a skip), since CI must
run these."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import importlib.util

import lockmgr

PACKAGE = Path(lockmgr.__file__).resolve().parent  # what users' type checkers read

USE = """
from lockmgr import LockManager, KeyLock
locks: LockManager[int] = LockManager()
ok: bool = locks.acquire(1, timeout=0.5)
view: KeyLock[int] = locks[2]
with locks.hold(3, timeout=None):
    pass
"""


def test_mypy_is_installed() -> None:
    assert importlib.util.find_spec("mypy") is not None, "pip install -e '.[test]' (it has mypy)"


def _mypy(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_package_is_mypy_strict_clean(tmp_path: Path) -> None:
    # A copy of its sources: mypy refuses files that live inside an environment's site-packages.
    shutil.copytree(PACKAGE, tmp_path / "lockmgr", ignore=shutil.ignore_patterns("*.so", "*.pyd"))
    done = _mypy("lockmgr", cwd=tmp_path)
    assert done.returncode == 0, done.stdout


def test_wrong_key_type_is_a_type_error(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(USE)
    assert _mypy(str(good)).returncode == 0, _mypy(str(good)).stdout
    bad = tmp_path / "bad.py"
    bad.write_text(USE + 'locks.acquire("x")\n')
    done = _mypy(str(bad))
    assert done.returncode == 1 and 'incompatible type "str"' in done.stdout, done.stdout
