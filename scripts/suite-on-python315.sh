#!/usr/bin/env bash
# CI step (issue 25): the whole test suite on CPython 3.15 as Debian sid builds it, in the sid
# chroot of scripts/debian-sid-python.sh (Debian's build: no registry serves 3.15 as source).
# The checkout's files (tracked and untracked, not ignored) are copied into the chroot; there a
# fresh virtual environment gets `pip install -e '.[test]'` (the compiled core built by 3.15),
# the core is asserted to be in use, and the suite runs with four pytest-xdist workers against
# Debian sid's PostgreSQL, pgbouncer and Redis (LOCKMGR_REQUIRE_SERVERS=1: a missing server
# fails, never skips). Needs root.
#
# Usage: scripts/suite-on-python315.sh [--python python3.14] [PYTEST_ARG...]
#   --python   the chroot's interpreter to use (default python3.15; python3.14 is there too)
#   PYTEST_ARG replaces the default selection (the whole suite), e.g. tests/test_core.py
# Each phase prints how long it took. The exit status is pytest's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
checkout=$(cd "$here/.." && pwd)
python=python3.15
if [ "${1:-}" = --python ]; then python=$2; shift 2; fi

phase_started=$SECONDS
took() { printf '=== %s took %ss\n' "$1" "$((SECONDS - phase_started))"; phase_started=$SECONDS; }

printf '=== the Debian sid chroot\n'
root=$("$here/debian-sid-python.sh")
took "the Debian sid chroot"

printf '=== copying the checkout into the chroot\n'
# A folder of this run's own: two runs at once (CI and an engineer) must not share one.
work=/build/lockmgr-$python-$$
rm -rf --one-file-system "${root:?}$work"
trap 'rm -rf --one-file-system "${root:?}$work" "${root:?}$work.venv"' EXIT
mkdir -p "$root$work"
# What git would see: tracked and untracked files, not the ignored ones (venvs, builds, the
# host's compiled .so files), and not a tracked file deleted in the work tree.
git -C "$checkout" ls-files -z --cached --others --exclude-standard \
  | (cd "$checkout" && xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done; :' sh) \
  | tar -C "$checkout" --null -T - -cf - | tar -C "$root$work" -xf -
took "copying the checkout"

# Inside: phases report their own times the same way.
status=0
"$here/in-sid-chroot.sh" env PYTHON="$python" WORK="$work" PIP_DISABLE_PIP_VERSION_CHECK=1 \
  LOCKMGR_REQUIRE_SERVERS=1 bash -euo pipefail -c '
phase_started=$SECONDS
took() { printf "=== %s took %ss\n" "$1" "$((SECONDS - phase_started))"; phase_started=$SECONDS; }
cd "$WORK"
printf "=== %s: a virtual environment, pip install -e .[test]\n" "$PYTHON"
"$PYTHON" -m venv --clear "$WORK.venv"
. "$WORK.venv/bin/activate"
python -VV
python -m pip install -q -e ".[test]"
took "venv and pip install -e .[test]"
python - <<PY
import lockmgr, lockmgr._core, sys
assert lockmgr.implementation == "cython", f"compiled core not in use: {lockmgr.implementation}"
print("compiled core in use on", sys.version.split()[0], "(Debian sid):", lockmgr._core.__file__)
PY
printf "=== the whole suite on %s, 4 workers\n" "$PYTHON"
status=0
python -m pytest -n 4 -p no:cacheprovider -q -ra "${@:-tests}" || status=$?
took "the suite"
exit "$status"
' bash "$@" || status=$?
exit "$status"
