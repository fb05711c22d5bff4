"""Prints the ``[test]`` extra as a requirements file that installs on a free-threaded CPython
(3.13t, 3.14t, 3.15t), where seven of its packages cannot be installed as the extra names them:

- ``psycopg[binary]``: psycopg-binary ships no free-threaded wheels (and no sdist), so the
  extra cannot resolve; plain ``psycopg`` (pure Python over the system's libpq, which the
  PostgreSQL tests' Debian server packages bring) runs the same tests.
- ``hypothesis``: its newest releases depend on a Rust extension with no free-threaded
  wheel, and no Rust toolchain can be fetched here; the last pure-Python ones are kept.
- ``mypy``: from 1.19 it depends on librt and ast-serialize (compiled, no free-threaded
  wheels); 1.18 is pure Python and checks the same annotations, so the typing tests run
  on the free-threaded interpreter too instead of being skipped there.
- ``matplotlib``: no free-threaded wheels, and its source build fails there; it only draws
  the bench's pictures, whose tests then check the "needs lockmgr[plot]" answer instead.
- ``psycopg2-binary`` and ``tooz``: psycopg2-binary has no free-threaded wheels, its source
  build needs libpq's headers and a compiler, and the module turns the GIL back on when
  imported; tooz's PostgreSQL driver runs on it. Both are left out, and the test of
  ``lockmgr-bench --scenario distributed`` checks its "needs lockmgr[compare]" answer there.
- ``import-linter``: its import graph (grimp) is a Rust extension with no free-threaded
  wheel, and its source build fetches crates: left out. The layout is the source's, not the
  interpreter's: tests/project/test_layout.py checks it on the GIL builds and, on a free-threaded
  one, that this is where it is missing.

Used by .ci/run, scripts/tsan.sh, scripts/ci-install.sh and scripts/check-wheels.sh.
pyproject.toml's cibuildwheel configuration lists what it prints (check-wheels.sh compares
them): this list for the free-threaded wheels' tests, and with ``--gil-wheels`` the list for
the other wheels' tests: the [test] extra with only NOT_IN_WHEEL_TESTS left out, nothing
replaced or capped. Those have no wheel on every platform (matplotlib has none for cp315 on
musllinux aarch64, nor grimp, import-linter's Rust graph; psycopg2-binary and tooz serve
only the distributed comparison, which needs a PostgreSQL server no wheel runner has), and
none should be built from source on a runner; without them those tests check the "needs
lockmgr[...]" answers, and the wheels' test command deselects the import contracts' test
(the layout is the source's: ci.yml and .ci/run check it). Plain psycopg without the
system's libpq skips the PostgreSQL tests, naming it, as a missing server does.

    python3 scripts/free-threaded-requirements.py > requirements-ft.txt
    python3 scripts/free-threaded-requirements.py --gil-wheels   # the GIL wheels' tests
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib

#: requirement as the extra spells it -> as a free-threaded interpreter can install it
REPLACED = {"psycopg[binary]": "psycopg"}
#: packages left out on free-threaded interpreters (reasons in the docstring)
DROPPED = {"import-linter", "matplotlib", "psycopg2-binary", "tooz"}
#: packages left out of every wheel's tests, free-threaded or not (--gil-wheels; reasons in the
#: docstring)
NOT_IN_WHEEL_TESTS = {"import-linter", "matplotlib", "psycopg2-binary", "tooz"}
#: package -> upper bound added on free-threaded interpreters (reasons in the docstring)
CAPPED = {"hypothesis": "<6.156", "mypy": "<1.19"}


def free_threaded(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+(\[[^\]]*\])?", requirement).group(0)
    specifier = requirement[len(name):]
    name = REPLACED.get(name, name)
    if name in CAPPED:
        specifier = f"{specifier},{CAPPED[name]}" if specifier else CAPPED[name]
    return name + specifier


def requirements(pyproject: Path, gil: bool = False) -> list[str]:
    """The [test] extra: for a free-threaded interpreter (``gil=False``) without DROPPED and
    with REPLACED and CAPPED applied; for the GIL wheels' tests without NOT_IN_WHEEL_TESTS."""
    with pyproject.open("rb") as file:
        extra = tomllib.load(file)["project"]["optional-dependencies"]["test"]
    left_out = NOT_IN_WHEEL_TESTS if gil else DROPPED
    kept = [requirement for requirement in extra
            if re.match(r"[A-Za-z0-9._-]+", requirement).group(0) not in left_out]
    return kept if gil else [free_threaded(requirement) for requirement in kept]


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(requirements(root / "pyproject.toml", gil="--gil-wheels" in sys.argv[1:])))
    sys.exit(0)
