"""Issue 13: in a subinterpreter ``import lockmgr`` gives the pure-Python twin, explicitly.

The compiled core is one engine per process (C tables holding Python objects), so it serves
the main interpreter only: a subinterpreter gets the twin, ``lockmgr.implementation`` says
``"python"`` there and ``lockmgr.implementation_reason`` says why, and the twin works there
(threads contending for a key, a reader-writer manager). The main interpreter keeps the
compiled core even when a subinterpreter imported lockmgr first (Cython's own rule would give
the core to whichever interpreter came first).

Each scenario runs in a child process (a subinterpreter that crashes must fail the test, not
pytest), with ``faulthandler`` ending a hang; it uses CPython's low-level module
(``_interpreters`` from 3.13, ``_xxsubinterpreters`` before).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import PATIENCE

LOW_LEVEL = next((name for name in ("_interpreters", "_xxsubinterpreters")
                  if importlib.util.find_spec(name) is not None), None)

CHILD = """
import faulthandler, json, sys
faulthandler.enable()
faulthandler.dump_traceback_later({hang}, exit=True)
import {module} as interpreters

SUB = '''
import json, sys, threading
import lockmgr
locks = lockmgr.LockManager()
rw = lockmgr.RWLockManager()
holding, release = threading.Event(), threading.Event()
got = []

def holder():
    locks.acquire("k")
    holding.set()
    release.wait({patience})
    locks.release("k")

thread = threading.Thread(target=holder)
thread.start()
holding.wait({patience})
tried = locks.acquire("k", timeout=0)  # held by the other thread
release.set()
got.append(locks.acquire("k", timeout={patience}))  # waits for it
locks.release("k")
thread.join({patience})
with rw.read("r"):
    readers = rw.readers("r")
with open({out!r}, "w") as out:
    json.dump(dict(implementation=lockmgr.implementation, reason=lockmgr.implementation_reason,
                   engine=type(locks).__module__, tried=tried, got=got, readers=readers,
                   left=[len(locks), len(rw)]), out)
'''

# Threads allowed: 3.13's default config allows them; before, only a legacy (not isolated)
# subinterpreter does, and there Cython would load the core too if lockmgr did not choose.
interp = interpreters.create() if {module!r} == "_interpreters" else interpreters.create(isolated=False)
try:
    failed = interpreters.run_string(interp, SUB)  # 3.13: an exception snapshot, or None
finally:
    interpreters.destroy(interp)
if failed is not None:
    print(json.dumps(dict(failed=str(failed))))
    sys.exit(3)
import lockmgr  # the main interpreter, after the subinterpreter imported lockmgr
with open({out!r}) as out:
    sub = json.load(out)
print(json.dumps(dict(sub=sub, main=[lockmgr.implementation, lockmgr.implementation_reason,
                                     lockmgr.LockManager.__module__])))
"""


@pytest.mark.skipif(LOW_LEVEL is None, reason="this Python has no subinterpreters (PyPy)")
def test_a_subinterpreter_gets_the_pure_twin_and_says_why(impl, tmp_path) -> None:
    pure = impl.__name__ == "lockmgr._pure"
    code = CHILD.format(hang=PATIENCE * 2, patience=PATIENCE, module=LOW_LEVEL,
                        out=str(tmp_path / "sub.json"))
    env = {**os.environ, "LOCKMGR_NO_EXTENSIONS": "1" if pure else ""}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=PATIENCE * 3, env=env)
    except subprocess.TimeoutExpired as exc:  # faulthandler should have ended it first
        raise AssertionError(f"the child hung: {exc.stderr!r}") from None
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    report = json.loads(done.stdout.splitlines()[-1])
    sub = report["sub"]
    # The twin, working, in the subinterpreter, whichever engine the main interpreter uses.
    assert sub["implementation"] == "python" and sub["engine"] == "lockmgr._pure"
    assert (sub["tried"], sub["got"], sub["readers"], sub["left"]) == (False, [True], 1, [0, 0])
    if pure:  # asked for by the environment, in both interpreters
        assert sub["reason"].startswith("LOCKMGR_NO_EXTENSIONS is set")
        assert report["main"][:2] == ["python", sub["reason"]]
    else:
        assert sub["reason"].startswith("this is a subinterpreter: the compiled core is one "
                                        "engine per process"), sub["reason"]
        assert report["main"] == ["cython", "the compiled core lockmgr._core", "lockmgr._core"]


def test_the_reason_is_a_sentence_in_the_main_interpreter() -> None:
    import lockmgr

    assert lockmgr.implementation in ("cython", "python")
    assert isinstance(lockmgr.implementation_reason, str) and lockmgr.implementation_reason
    assert "implementation_reason" in lockmgr.__all__
