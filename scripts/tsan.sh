#!/usr/bin/env bash
# ThreadSanitizer run of the stress mix (tests/stress/test_stress.py, with the concurrency, multi-key,
# reader-writer, shard, asyncio and snapshot/metrics tests) on the compiled core, with the GIL off: a free-threaded CPython 3.13 configured --with-thread-sanitizer
# (scripts/free-threaded-python.sh --tsan, cached outside the work tree), the core compiled
# and linked with -fsanitize=thread, and the stress test run under it. Fails on any TSAN
# report (data race, lock-order inversion, ...) with a frame of lockmgr's compiled code in
# its stacks; CPython's own known races are suppressed by its suppressions file, and any
# other report is counted and shown, not failed on (it is CPython's, not ours).
#
#   scripts/tsan.sh                    # or: make tsan
#   TSAN_DIR=/tmp/out scripts/tsan.sh  # keep the reports there (default: a temporary directory)
#
# Output: the pytest run, then each counted report (its first stack); exit 1 if any.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
root=$PWD
out=${TSAN_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/lockmgr-tsan.XXXXXX")}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log() { printf '[tsan] %s\n' "$*" >&2; }

plain_python=$(bash scripts/free-threaded-python.sh)
python=$(bash scripts/free-threaded-python.sh --tsan)
prefix=$(cd "$(dirname "$python")/.." && pwd)
suppressions=$prefix/share/tsan/suppressions_free_threading.txt
[ -f "$suppressions" ] || { log "no suppressions file at $suppressions"; exit 2; }
# Everything run with this interpreter (pip included) needs CPython's suppressions.
export TSAN_OPTIONS="suppressions=$suppressions"

# With UV set (a uv binary, as .ci/run passes), uv installs into the environment: pip itself
# would run under the sanitizer, several times slower (its venv's ensurepip included).
install() {
  if [ -n "${UV:-}" ]; then "$UV" pip install -q --python "$venv_python" "$@"
  else nice -n 10 "$venv_python" -m pip install -q "$@"; fi
}
log "virtual environment and pytest for $python"
if [ -n "${UV:-}" ]; then "$python" -m venv --without-pip "$work/venv"
else "$python" -m venv "$work/venv"; fi
venv_python=$work/venv/bin/python
# psycopg too: the tests' conftest needs it importable (a missing one fails every run, so
# that no run can skip the PostgreSQL tests unnoticed); the tests below use no server.
install pytest pytest-timeout pytest-xdist psycopg

# The core built from a copy of the sources, so that no object file or extension module of
# another build (the work tree's build/ or src/lockmgr/*.so) can be reused or imported. The
# wheel is built by the plain 3.13t (same version, same ABI: Cython runs ten times faster
# there than under the sanitizer) with -fsanitize=thread, and installed into the TSAN one's
# environment.
log "building the compiled core with -fsanitize=thread"
mkdir -p "$work/tree" "$work/wheel"
tar -c --exclude=./build --exclude=./.git --exclude='./.ci-venv*' --exclude='*.so' \
    --exclude=./dist --exclude=./wheelhouse --exclude=./lockmgr_core.c . | tar -x -C "$work/tree"
(cd "$work/tree" && env -u TSAN_OPTIONS CFLAGS="-fsanitize=thread -g -O1 -fno-omit-frame-pointer" \
  LDFLAGS="-fsanitize=thread" nice -n 10 "$plain_python" -m pip wheel -q --no-deps -w "$work/wheel" .)
install --no-deps "$work"/wheel/lockmgr-*-cp313-cp313t-*.whl
core=$("$venv_python" -c 'import lockmgr._core as c; print(c.__file__)')
case $core in "$work"/venv/*) ;; *) log "the core under test is not the sanitized build: $core"; exit 2 ;; esac
nm -D "$core" | grep -q ' U __tsan_' || { log "$core is not instrumented (-fsanitize=thread)"; exit 2; }

# The canary: a data race TSAN must report (two threads memset one ctypes buffer), through the
# same log and the same counting below, so that a clean run means something.
rm -f "$out"/tsan.* "$out"/canary.*
# exitcode=0: reports are counted from the logs; exit statuses are the programs' own.
env -u PYTHON_GIL TSAN_OPTIONS="$TSAN_OPTIONS log_path=$out/canary exitcode=0" "$venv_python" - <<'PY'
import ctypes, threading
buffer = ctypes.create_string_buffer(64)
def scribble():
    for i in range(20000):
        ctypes.memset(buffer, i & 0xFF, 64)
threads = [threading.Thread(target=scribble) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
PY
grep -qs "WARNING: ThreadSanitizer: data race" "$out"/canary.* ||
  { log "the canary race was not reported: TSAN is not watching"; exit 2; }

# The tests, compiled core only (TSAN sees C; the pure twin is Python code that the
# interpreter runs, which CPython's own TSAN runs cover). The GIL stays off: PYTHON_GIL is
# unset (importing the core must keep it off) and the stress test asserts it.
log "the stress mix and the concurrency tests under ThreadSanitizer; reports in $out"
status=0
(cd "$work" && cp -r "$root/tests" "$root/pyproject.toml" . &&
  env -u PYTHON_GIL LOCKMGR_REQUIRE_NO_GIL=1 TSAN_OPTIONS="$TSAN_OPTIONS log_path=$out/tsan exitcode=0 halt_on_error=0 second_deadlock_stack=1" \
    nice -n 10 "$venv_python" -m pytest -q -p no:cacheprovider -n 2 --only-c-extensions \
    tests/stress/test_stress.py tests/stress/test_host_stress.py \
    tests/engine/test_concurrency.py tests/engine/test_many.py \
    tests/engine/test_rwlock.py tests/engine/test_shards.py tests/aio/test_aio.py \
    tests/observe/test_observe.py) || status=$?

"$venv_python" - "$out" "$status" <<'PY'
import glob
import re
import sys

out, status = sys.argv[1], int(sys.argv[2])
#: A report is ours when a frame of one of its stacks is lockmgr's compiled code.
OURS = re.compile(r"lockmgr[/_]|_core\.cpython|__pyx_|lockmgr_core\.(pyx|c)|_core\.pxd|_c/\w+\.(pxi|h)")
reports = []
for path in sorted(glob.glob(f"{out}/tsan.*")):
    text = open(path, encoding="utf-8", errors="replace").read()
    reports += re.findall(r"^WARNING: ThreadSanitizer:.*?^SUMMARY: ThreadSanitizer:.*?$", text,
                          re.S | re.M)
# (CPython's own frames name its source, which the cache keeps under a folder named lockmgr:
# they are left out before asking whether a frame is lockmgr's.)
CPYTHON_SOURCE = re.compile(r"\S*/src/Python-[^\s:]*")
ours = [report for report in reports if OURS.search(CPYTHON_SOURCE.sub("", report))]
for report in ours:
    print(report[:6000], file=sys.stderr)
    print("-" * 80, file=sys.stderr)
kinds = sorted({r.splitlines()[0] for r in reports})
print(f"[tsan] {len(ours)} report(s) involving lockmgr, {len(reports) - len(ours)} elsewhere "
      f"(CPython's own, not suppressed); kinds: {kinds}", file=sys.stderr)
if status != 0:
    print(f"[tsan] the stress test itself failed (exit status {status})", file=sys.stderr)
sys.exit(1 if ours or status != 0 else 0)
PY
