#!/usr/bin/env bash
# valgrind memcheck of the fault-injection stress mix (tests/fault_mix.py) on the compiled
# core: fails on any invalid access (read/write/free/jump, uninitialised use, bad syscall
# argument) or any "definitely lost" block whose stack mentions lockmgr's compiled code.
# CPython's own noise is not suppressed but filtered: only errors with a lockmgr frame count
# (PYTHONMALLOC=malloc makes every object a malloc block valgrind can see).
#
#   scripts/memcheck.sh                 # or: make memcheck
#   PYTHON=/path/to/python MEMCHECK_OPS=60 scripts/memcheck.sh [extra fault_mix.py options]
#
# The Python must have lockmgr installed with its compiled core (pip install -e '.[test]').
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
ops=${MEMCHECK_OPS:-100}
out=${MEMCHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/lockmgr-memcheck.XXXXXX")}
mkdir -p "$out"

command -v valgrind >/dev/null || { echo "memcheck: valgrind is not installed" >&2; exit 2; }
"$python" -c 'import lockmgr._core' || { echo "memcheck: no compiled core for $python" >&2; exit 2; }
# The interpreter itself, not a launcher script (pyenv's shims are shell scripts valgrind
# would trace instead).
python=$("$python" -c 'import sys; print(sys.executable)')

echo "memcheck: running the fault-injection mix under valgrind (ops=$ops); logs in $out" >&2
PYTHONMALLOC=malloc valgrind --tool=memcheck --trace-children=no \
    --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
    --num-callers=50 --xml=yes --xml-file="$out/memcheck.xml" --log-file="$out/valgrind.log" \
    "$python" "$here/tests/fault_mix.py" lockmgr._core --ops "$ops" --threads 4 \
        --signal-every 0.02 --gc-every 20 --hang 5400 "$@" >"$out/report.json" 2>"$out/stderr.txt"
status=$?
echo "memcheck: the mix exited with $status; its report:" >&2
cat "$out/report.json" >&2

"$python" - "$out/memcheck.xml" "$status" <<'PY'
import sys
import xml.etree.ElementTree as ET

path, status = sys.argv[1], int(sys.argv[2])
#: An error counts when one of its innermost DEPTH frames is lockmgr's compiled code (deeper
#: ones are CPython running Python code that lockmgr called, e.g. importing at module init).
DEPTH = 12


def frames(error):
    stack = error.find("stack")
    return [] if stack is None else stack.findall("frame")[:DEPTH]


def ours(frame):
    fn = frame.findtext("fn") or ""
    obj = frame.findtext("obj") or ""
    source = frame.findtext("file") or ""
    if fn.startswith("__pyx_pymod_exec"):  # the module's import, running Python code
        return False
    return ("/lockmgr/_core" in obj or source.startswith(("_core.", "lockmgr_"))
            or fn.startswith("__pyx_"))


def describe(error):
    what = error.findtext("what") or (error.find("xwhat").findtext("text") if error.find("xwhat") is not None else "")
    lines = [f"{error.findtext('kind')}: {what}"]
    for frame in frames(error):
        where = frame.findtext("file") or frame.findtext("obj") or "?"
        line = frame.findtext("line") or ""
        lines.append(f"    {frame.findtext('fn') or '???'}  ({where}{':' + line if line else ''})")
    return "\n".join(lines)


try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"memcheck: cannot read valgrind's XML ({exc})", file=sys.stderr)
    sys.exit(2)
counted, ignored = [], 0
for error in root.iter("error"):
    kind = error.findtext("kind") or ""
    if kind.startswith("Leak_") and kind != "Leak_DefinitelyLost":
        continue
    if any(ours(frame) for frame in frames(error)):
        counted.append(error)
    else:
        ignored += 1
for error in counted:
    print(describe(error), file=sys.stderr)
print(f"memcheck: {len(counted)} error(s) in lockmgr code "
      f"({ignored} elsewhere, ignored: CPython's own)", file=sys.stderr)
if status != 0:
    print(f"memcheck: the mix itself failed (exit status {status}); see its stderr", file=sys.stderr)
sys.exit(1 if counted or status != 0 else 0)
PY
