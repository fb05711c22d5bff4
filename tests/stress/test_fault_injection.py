"""Issue 11, fault injection: the stress mix while finalizers (``gc.callbacks`` at threshold
1) and signal handlers call the managers from inside lock calls and waits.

The mix runs in its own interpreter (``tests/fault_mix.py``, also what ``make memcheck``
runs under valgrind): a crash, a hang (``faulthandler`` ends it after ``--hang`` seconds,
stacks on stderr) or a broken invariant all fail here. Checked at the end: nothing held,
nothing queued, every stats counter equal to what the callers saw, no two threads inside
one critical section, no lost update, and handlers that probe inside a wait of the main
thread got NestedWaitError (engine v2).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TESTS

MIX = Path(TESTS) / "fault_mix.py"
HANG = 120.0  # the child dumps its stacks and exits after this; generous for a busy 2-core box


def run_mix(impl, *options: str) -> dict:
    command = [sys.executable, str(MIX), impl.__name__, "--hang", str(HANG), *options]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=HANG + 60)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the mix hung: {exc.stderr!r}") from None
    assert done.returncode == 0, (
        f"the mix exited with {done.returncode}\nstdout: {done.stdout[-2000:]}\n"
        f"stderr: {done.stderr[-6000:]}")
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
@pytest.mark.parametrize("fair", [True, False], ids=["fair", "unfair"])
def test_mix_with_finalizers_and_handlers_calling_back(impl, fair) -> None:
    options = ["--ops", "300", "--threads", "5", "--seed", "7"]
    report = run_mix(impl, *options, *([] if fair else ["--unfair"]))
    assert report["failures"] == []
    assert report["violations"] == [], "two threads inside one critical section"
    assert report["lost_updates"] == {} and report["increments"] > 0
    for name, manager in report["managers"].items():
        assert (manager["len"], manager["held"], manager["waiting"]) == (0, 0, 0), name
        for counter in ("acquisitions", "timeouts", "deadlocks"):
            engine, seen = manager[counter]
            assert engine == seen, f"{name}.stats().{counter} is {engine}, callers saw {seen}"
        assert manager["contended_le_acquisitions"], name
        measured, contended = manager["waits_measured"]
        assert measured == contended, f"{name}: {measured} waits measured, {contended} contended"
    faults = report["faults"]
    # The faults really ran, many times, inside lock calls.
    assert faults["signals"] >= 20 and faults["collections"] >= 20, faults
    assert faults["meddle:took"] > 0 and faults["meddle:observed"] > 0
    # Every handler probed a key held elsewhere: inside one of the main thread's waits that
    # is NestedWaitError (engine v2), outside it a short wait that times out.
    assert faults["probe:waited"] + faults["probe:nested"] == faults["signals"], faults
    assert faults["probe:nested"] >= 1, "no handler's wait was refused with NestedWaitError"
