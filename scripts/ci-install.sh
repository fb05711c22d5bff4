#!/usr/bin/env bash
# CI's install step (.github/workflows/ci.yml) for the `python` on PATH: lockmgr in editable
# mode with what its tests need, then proof of which engine is in use and, on a free-threaded
# interpreter, that importing lockmgr left the GIL off (PYTHON_GIL unset: an extension module
# that did not declare itself free-threading compatible would turn it on).
#
#   bash scripts/ci-install.sh compiled   # the compiled core (and the pure twin beside it)
#   LOCKMGR_NO_EXTENSIONS=1 bash scripts/ci-install.sh pure   # the pure twin alone
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:-compiled}
expected=$([ "$engine" = pure ] && echo python || echo cython)

python -m pip install -q --upgrade pip
if python -c 'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))'; then
  # The [test] extra as a free-threaded interpreter can install it (the script says why).
  python scripts/free-threaded-requirements.py > "${RUNNER_TEMP:-/tmp}/ft-requirements.txt"
  python -m pip install -q -r "${RUNNER_TEMP:-/tmp}/ft-requirements.txt"
  python -m pip install -q -e . --no-deps
  env -u PYTHON_GIL python -c "
import sys, lockmgr
assert lockmgr.implementation == '$expected', lockmgr.implementation
assert not sys._is_gil_enabled(), 'importing lockmgr turned the GIL on'
print('free-threaded, GIL off after import:', lockmgr.implementation, lockmgr.__file__)"
else
  python -m pip install -q -e '.[test]'
  python -c "
import lockmgr
assert lockmgr.implementation == '$expected', lockmgr.implementation
print(lockmgr.implementation, lockmgr.__file__)"
fi
