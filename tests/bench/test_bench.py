"""The benchmark CLI's own logic (its figures are checked by running it, not here)."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import warnings
from pathlib import Path

import pytest

from lockmgr import _pure, bench
from lockmgr.bench import _asyncio, _cli, _measure, _output, _servers, _threads


@pytest.mark.parametrize(("order", "expected"), [
    ([], 0), ([0, 1, 2, 3], 0), ([1, 0], 1), ([3, 2, 1, 0], 3), ([0, 2, 3, 1, 4], 2),
])
def test_max_overtaken_counts_later_tickets_granted_first(order: list[int], expected: int) -> None:
    assert _threads.max_overtaken(order) == expected


@pytest.mark.compiled
def test_quick_run_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "uncontended", "--impl", "lockmgr",
                       "--impl", "threading.Lock", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"python", "platform", "cpu_count"} <= set(report["machine"])
    rows = report["results"]
    assert {row["impl"] for row in rows} == {"lockmgr", "threading.Lock"}
    assert all(set(row) == {"scenario", "impl", "metric", "value", "unit"} for row in rows)
    assert all(row["value"] > 0 for row in rows)
    table = capsys.readouterr().out
    assert "| uncontended | acquire+release (ns) |" in table and "x)" in table


def test_plot_needs_matplotlib_or_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "out.png"
    code = bench.main(["--quick", "--scenario", "uncontended", "--impl", "threading.Lock",
                       "--plot", str(picture)])
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and "pip install 'lockmgr[plot]'" in capsys.readouterr().err
        assert not picture.exists()
    else:
        assert code == 0 and picture.stat().st_size > 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    terminal = _Terminal()
    with _measure.Progress(2, terminal) as shown:
        shown.step("uncontended: lockmgr")
        shown.step("hot-key: lockmgr")
    lines = terminal.getvalue().split("\r\x1b[K")
    assert lines[0] == "" and lines[1].startswith("[lockmgr-bench] 1/2 uncontended: lockmgr (0:0")
    assert lines[2].startswith("[lockmgr-bench] 2/2 hot-key: lockmgr (0:0")
    assert lines[2].endswith(")\n")  # the line is ended when the run is


def test_progress_writes_a_line_per_step_with_its_time_where_not_a_terminal() -> None:
    """A log or a pipe (CI) gets each step as it starts, with the run's time so far, then the
    total: plain lines, no terminal control characters."""
    log = io.StringIO()
    with _measure.Progress(2, log) as shown:
        shown.step("uncontended: lockmgr")
        shown.step("hot-key: lockmgr")
    lines = log.getvalue().splitlines()
    assert [re.sub(r"\(\d+:\d\d\)$", "(TIME)", line) for line in lines[:2]] == [
        "[lockmgr-bench] 1/2 uncontended: lockmgr (TIME)",
        "[lockmgr-bench] 2/2 hot-key: lockmgr (TIME)"]
    assert re.fullmatch(r"\[lockmgr-bench\] 2 steps in \d+:\d\d", lines[2]) and len(lines) == 3
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()


def test_a_run_counts_its_steps_and_refuses_bad_options_before_measuring(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    totals: list[int] = []
    labels: list[str] = []

    class Recorded(_measure.Progress):
        def __init__(self, total: int) -> None:
            super().__init__(total, io.StringIO())
            totals.append(total)

        def step(self, label: str) -> None:
            labels.append(label)
            super().step(label)

    monkeypatch.setattr(_cli, "Progress", Recorded)
    assert bench.main(["--quick", "--scenario", "uncontended", "--scenario", "read-mostly",
                       "--impl", "threading.Lock", "--impl", "rwlock-pure"]) == 0
    assert totals == [3] and labels == ["uncontended: threading.Lock",
                                        "read-mostly: threading.Lock", "read-mostly: rwlock-pure"]
    # server-pairs without a server: refused at once, before the uncontended step runs
    assert bench.main(["--quick", "--scenario", "uncontended", "--scenario", "server-pairs",
                       "--impl", "threading.Lock"]) == 2
    assert totals == [3] and "server-pairs needs --pg-dsn or --redis" in capsys.readouterr().err


def test_bad_options_are_rejected() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--threads", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--scenario", "nope"])


@pytest.mark.compiled
def test_reader_writer_managers_run_only_the_read_mostly_scenario(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "read-mostly", "--scenario", "uncontended",
                       "--impl", "rwlock", "--impl", "rwlock-pure", "--impl", "threading.Lock",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    read_mostly = {row["impl"] for row in rows if row["scenario"] == "read-mostly"}
    uncontended = {row["impl"] for row in rows if row["scenario"] == "uncontended"}
    assert read_mostly == {"rwlock", "rwlock-pure", "threading.Lock"}
    assert uncontended == {"threading.Lock"}
    assert all(row["value"] > 0 for row in rows)


def test_scaling_runs_one_two_and_cores_threads_and_reports_the_gil(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 13: the header and the JSON say whether the GIL was on; ``scaling`` measures
    1, 2 and cores threads on distinct keys (the pure twin here, so that it runs without the
    compiled core too) beside one threading.RLock per thread, with each N-vs-1 ratio."""
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "scaling", "--impl", "lockmgr-pure",
                       "--impl", "threading.RLock", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    about = report["machine"]
    assert isinstance(about["gil_enabled"], bool) and isinstance(about["free_threaded_build"], bool)
    assert about["gil_enabled"] == _measure.gil_enabled()
    counts = _threads.scaling_threads()
    assert counts[:2] == [1, 2]
    metrics = {(row["impl"], row["metric"]): row for row in report["results"]}
    for impl in ("lockmgr-pure", "threading.RLock"):
        for count in counts:
            row = metrics[impl, f"{count}-thread" + ("s" if count > 1 else "")]
            assert row["unit"] == "acq/s" and row["value"] > 0
        for count in counts[1:]:
            ratio = metrics[impl, f"{count}-vs-1"]
            assert ratio["unit"] == "x" and ratio["value"] > 0
    printed = capsys.readouterr().out
    first = printed.splitlines()[0]
    assert first.startswith("lockmgr-bench: ") and f"GIL {'on' if about['gil_enabled'] else 'off'}," in first
    assert "| scaling | 2-vs-1 (x) |" in printed


def test_asyncio_scenarios_print_their_own_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14: the asyncio scenarios run every asyncio implementation side by side and
    print a second table, with ratios to one asyncio.Lock; every per-key lock is exclusive
    and asyncio.Lock is FIFO (0 overtakes)."""
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "asyncio-hot-key", "--scenario", "asyncio-many-keys",
                       "--impl", "asyncio.Lock", "--impl", "dict-of-asyncio-locks",
                       "--impl", "asyncio-keyed-lock", "--json", str(out)]) == 0
    rows = {(row["scenario"], row["impl"], row["metric"]): row["value"]
            for row in json.loads(out.read_text())["results"]}
    impls = ("asyncio.Lock", "dict-of-asyncio-locks", "asyncio-keyed-lock")
    for impl in impls:
        assert rows["asyncio-hot-key", impl, "throughput"] > 0
        assert rows["asyncio-many-keys", impl, "throughput"] > 0
        assert rows["asyncio-many-keys", impl, "not-exclusive"] == 0
    assert rows["asyncio-hot-key", "asyncio.Lock", "max-overtaken"] == 0
    printed = capsys.readouterr().out
    assert "| scenario | metric | asyncio.Lock | dict-of-asyncio-locks | asyncio-keyed-lock |" in printed
    assert "| asyncio-many-keys | throughput (holds/s) | " in printed and "x)" in printed


@pytest.mark.compiled
def test_asyncio_scenarios_measure_lockmgr(tmp_path: Path) -> None:
    """lockmgr's aio view in the asyncio scenarios: exclusive per key, never overtaken in
    strict mode, and nothing left after 200,000 distinct keys (the defaultdict keeps them)."""
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "asyncio-hot-key", "--scenario", "asyncio-many-keys",
                       "--scenario", "asyncio-memory",
                       "--impl", "lockmgr", "--impl", "dict-of-asyncio-locks",
                       "--json", str(out)]) == 0
    rows = {(row["scenario"], row["impl"], row["metric"]): row["value"]
            for row in json.loads(out.read_text())["results"]}
    assert rows["asyncio-hot-key", "lockmgr", "max-overtaken"] == 0
    assert rows["asyncio-many-keys", "lockmgr", "not-exclusive"] == 0
    metric = f"residue-after-{_asyncio.ASYNC_MEMORY_KEYS}-keys"
    assert rows["asyncio-memory", "lockmgr", metric] < 64 * 1024
    assert rows["asyncio-memory", "dict-of-asyncio-locks", metric] > 100 * _asyncio.ASYNC_MEMORY_KEYS


def test_server_pairs_puts_lockmgr_beside_its_libpq_and_psycopg_floors(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``server-pairs`` with ``--pg-dsn`` measures lockmgr beside a bare psycopg loop and a
    bare libpq loop on the same server, then redis-py, with one process and with
    ``--threads``: pairs/s and client CPU per pair each (the workers' CPU time over their
    pairs), printed in a table of their own with ratios to the libpq loop. (The workers are
    stubbed: what they report is what the table shows; running them is test_postgres's.)"""
    asked: list[tuple[str, str, int]] = []
    per_process = {"postgres": (1000, 0.2), "psycopg": (1500, 0.15), "libpq": (2000, 0.05),
                   "redis-py": (800, 0.25)}  # pairs/s, CPU seconds per second

    def stub(backend: str, address: str, count: int, seconds: float) -> tuple[int, float]:
        asked.append((backend, address, count))
        rate, cpu = per_process[backend]
        return round(rate * count * seconds), cpu * count * seconds

    monkeypatch.setattr(_servers, "_pairs_and_cpu", stub)
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "server-pairs", "--pg-dsn", "host=pg",
                       "--redis", "redis://redis", "--threads", "4", "--json", str(out)]) == 0
    assert asked == [(backend, address, count) for count in (1, 4) for backend, address in (
        ("postgres", "host=pg"), ("psycopg", "host=pg"), ("libpq", "host=pg"),
        ("redis-py", "redis://redis"))]
    rows = {(row["impl"], row["metric"]): (row["value"], row["unit"])
            for row in json.loads(out.read_text())["results"]}
    for backend, (rate, cpu) in per_process.items():
        for metric, count in (("1-process", 1), ("4-processes", 4)):
            assert rows[backend, metric] == (pytest.approx(rate * count), "pairs/s")
            assert rows[backend, f"{metric} client CPU per pair"] == (
                pytest.approx(cpu / rate * 1e6), "us")
    assert rows["postgres", "1-process vs redis-py"] == (pytest.approx(1.25), "x")
    printed = capsys.readouterr().out
    assert "| scenario | metric | postgres | psycopg | libpq | redis-py |" in printed
    assert ("| server-pairs | 1-process (pairs/s) | 1,000 (0.50x) | 1,500 (0.75x) | 2,000 |"
            " 800 (0.40x) |") in printed
    assert ("| server-pairs | 4-processes client CPU per pair (us) | 200 (8.00x) | 100 (4.00x)"
            " | 25 | 312 (12.50x) |") in printed


def test_server_pairs_without_postgres_measures_no_floors(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With ``--redis`` alone, redis-py only: the floors are PostgreSQL's."""
    asked: list[str] = []

    def stub(backend: str, address: str, count: int, seconds: float) -> tuple[int, float]:
        asked.append(backend)
        return 100, 0.01

    monkeypatch.setattr(_servers, "_pairs_and_cpu", stub)
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "server-pairs", "--redis", "redis://redis",
                       "--threads", "2", "--json", str(out)]) == 0
    assert asked == ["redis-py", "redis-py"]
    assert {row["impl"] for row in json.loads(out.read_text())["results"]} == {"redis-py"}


def _results(*rows: tuple[str, str, str, float, str]) -> _measure.Results:
    results = _measure.Results()
    for row in rows:
        results.add(*row)
    return results


def test_panels_drop_empty_metrics_and_log_scale_wide_ones() -> None:
    results = _results(
        ("uncontended", "lockmgr", "acquire+release", 80.0, "ns"),
        ("uncontended", "threading.Lock", "acquire+release", 50.0, "ns"),
        ("uncontended", "lockmgr-pure", "acquire+release", 9000.0, "ns"),
        ("fairness", "lockmgr", "max-overtaken", 0.0, "times"),
        ("fairness", "threading.Lock", "max-overtaken", 0.0, "times"),
        ("hot-key", "lockmgr", "throughput", 2e6, "acq/s"),
        ("hot-key", "threading.Lock", "throughput", 1e6, "acq/s"),
        ("asyncio-uncontended", "lockmgr", "with-block", 500.0, "ns"),
        ("asyncio-uncontended", "asyncio.Lock", "with-block", 600.0, "ns"),
    )
    found = _output.panels(results, ["lockmgr", "lockmgr-pure", "threading.Lock", "asyncio.Lock"])
    assert [(panel.scenario, panel.log) for panel in found] == [
        ("uncontended", True), ("hot-key", False), ("asyncio-uncontended", False)]
    assert found[0].title == "uncontended: acquire+release (lower is better)"
    assert found[1].title == "hot-key: throughput (higher is better)"
    assert list(found[0].values) == ["lockmgr", "lockmgr-pure", "threading.Lock"]
    summary = {panel.scenario: ratios for panel, ratios in _output.ratios(found)}
    assert summary["uncontended"] == {"lockmgr": 1.6, "lockmgr-pure": 180.0}
    assert summary["hot-key"] == {"lockmgr": 2.0}
    assert summary["asyncio-uncontended"] == {"lockmgr": 500.0 / 600.0}  # to asyncio.Lock


def test_ratios_and_the_plot_take_zeros_wherever_they_are(tmp_path: Path) -> None:
    """A baseline that measured 0 while others did not (asyncio.Lock is never overtaken,
    lockmgr-unfair sometimes is), zeros beside a wide log-scaled metric, and a metric all
    zero: the summary leaves out what it cannot divide by, and the plot draws them all."""
    results = _results(
        ("asyncio-hot-key", "lockmgr", "max-overtaken", 0.0, "times"),
        ("asyncio-hot-key", "lockmgr-unfair", "max-overtaken", 41.0, "times"),
        ("asyncio-hot-key", "asyncio.Lock", "max-overtaken", 0.0, "times"),
        ("fairness", "lockmgr", "max-overtaken", 3.0, "times"),
        ("fairness", "threading.Lock", "max-overtaken", 0.0, "times"),
        ("uncontended", "lockmgr", "acquire+release", 0.0, "ns"),
        ("uncontended", "lockmgr-pure", "acquire+release", 9000.0, "ns"),
        ("uncontended", "threading.Lock", "acquire+release", 50.0, "ns"),
        ("many-keys", "lockmgr", "not-exclusive", 0.0, "times"),
        ("many-keys", "threading.Lock", "not-exclusive", 0.0, "times"),
    )
    impls = ["lockmgr", "lockmgr-unfair", "lockmgr-pure", "threading.Lock", "asyncio.Lock"]
    found = _output.panels(results, impls)
    assert [panel.scenario for panel in found] == ["asyncio-hot-key", "fairness", "uncontended"]
    summary = {panel.scenario: ratios for panel, ratios in _output.ratios(found)}
    assert summary == {"uncontended": {"lockmgr": 0.0, "lockmgr-pure": 180.0}}
    if importlib.util.find_spec("matplotlib") is None:  # free-threaded builds: no wheel
        return
    picture = tmp_path / "zeros.png"
    _output.plot(results, impls, str(picture))
    assert picture.stat().st_size > 0


def test_each_implementation_has_a_colour_of_its_own_and_lockmgr_is_red() -> None:
    impls = ["threading.Lock", "lockmgr", "lockmgr-unfair", "striped", "lockmgr-pure",
             "rwlock", "threading.RLock", "dict-of-locks", "asyncio.Lock"]
    colours = _output.colours(impls)
    assert colours["lockmgr"] == _output.LOCKMGR_RED
    assert len(set(colours.values())) == len(impls)


_FAIRNESS = (
    ("fairness", "lockmgr", "max-overtaken", 0.0, "times"),
    ("fairness", "threading.Lock", "max-overtaken", 40.0, "times"),
    ("fairness", "lockmgr-pure", "max-overtaken", 2.0, "times"),
    ("hot-key", "lockmgr", "throughput", 2e6, "acq/s"),
    ("hot-key", "threading.Lock", "throughput", 1e6, "acq/s"),
)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (lockmgr[plot]) has no wheel here")
def test_a_ratio_of_zero_is_drawn_at_the_summary_axis_floor_marked_0() -> None:
    """0 overtakes against threading.Lock's 40 is a ratio of 0, which a log axis has no
    place for: it is drawn at the axis floor, left of every other ratio, and marked 0."""
    impls = ["lockmgr", "lockmgr-pure", "threading.Lock"]
    figure = _output.draw(_results(*_FAIRNESS), impls)
    try:
        summary = figure.axes[0]
        points = [(tuple(collection.get_offsets()[0]), collection.get_label())
                  for collection in summary.collections]
        floor = _output.zero_floor(_output.ratios(_output.panels(_results(*_FAIRNESS), impls)))
        assert ((floor, 0.0), "lockmgr") in points  # row 0: fairness
        assert floor < min(x for (x, _), _ in points if x != floor)
        assert summary.get_xlim()[0] < floor
        ticks = dict(zip(summary.get_xticks(), (label.get_text() for label in summary.get_xticklabels())))
        assert ticks[floor] == "0"
    finally:
        importlib.import_module("matplotlib.pyplot").close(figure)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (lockmgr[plot]) has no wheel here")
def test_plot_of_a_saved_run_draws_it_without_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "run.json"
    about = _output.machine()
    saved.write_text(json.dumps({"machine": about, "results": [
        {"scenario": scenario, "impl": impl, "metric": metric, "value": value, "unit": unit}
        for scenario, impl, metric, value, unit in _FAIRNESS]}))
    monkeypatch.setattr(_cli, "_plan", lambda *args: pytest.fail("measured"))
    assert bench.main(["--plot", str(saved), "--impl", "lockmgr", "--impl", "threading.Lock"]) == 0
    assert (tmp_path / "run.png").stat().st_size > 0
    printed = capsys.readouterr()
    assert printed.out.splitlines()[0] == _output.header(about)
    assert "| scenario | metric | lockmgr | threading.Lock |" in printed.out
    assert "| fairness | max-overtaken (times) | 0 (0.00x) | 40 |" in printed.out
    assert f"wrote {tmp_path / 'run.png'}" in printed.err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib (lockmgr[plot]) has no wheel here")
def test_plot_of_a_file_that_is_not_a_saved_run_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "run.json"
    saved.write_text('{"results": []}')
    assert bench.main(["--plot", str(saved)]) == 2
    assert f"--plot {saved}: not a run saved by --json" in capsys.readouterr().err
    assert not (tmp_path / "run.png").exists()


def test_contention_report_draws_or_needs_matplotlib(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "report.png"
    code = bench.main(["--quick", "--threads", "2", "--keys", "50",
                       "--contention-report", str(picture)])
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and "pip install 'lockmgr[plot]'" in capsys.readouterr().err
        assert not picture.exists()
        return
    assert code == 0 and picture.stat().st_size > 0
    out = capsys.readouterr().out
    assert "hot-key: " in out and "many-keys (Zipf): " in out and "hot keys: 'hot'" in out


def test_the_contention_runs_measure_waits() -> None:
    measured = _output.contention_runs(
        _pure.LockManager, _measure.Settings(quick=True, threads=2, keys=20))
    hot = measured["hot-key"]
    assert hot.contended > 0 and hot.wait_time.count == hot.contended
    assert hot.hot_keys[0].key == "hot"
    assert measured["many-keys (Zipf)"].acquisitions > 0


def test_a_contention_report_where_nothing_waited(tmp_path: Path) -> None:
    measured = _output.contention_runs(_pure.LockManager, _measure.Settings(quick=True, threads=1, keys=5))
    assert list(_output.report_lines(measured)) == [
        f"{run}: {metrics.acquisitions:,} acquisitions, none waited"
        for run, metrics in measured.items()]
    picture = tmp_path / "report.png"
    if importlib.util.find_spec("matplotlib") is None:  # free-threaded builds: no wheel
        with pytest.raises(ModuleNotFoundError):
            _output.contention_report(measured, str(picture))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no empty log-scaled panel, no empty legend
        _output.contention_report(measured, str(picture))
    assert picture.stat().st_size > 0


@pytest.mark.parametrize("name", ["lockmgr-pure", "dict-of-futures"])
def test_the_singleflight_scenario_makes_one_call_per_stampede(name: str) -> None:
    """The scenario's figures, on a small stampede: one call however many callers."""
    from lockmgr.bench import _singleflight

    results = _measure.Results()
    _singleflight.singleflight(name, _measure.Settings(quick=True, threads=4, keys=10), results,
                               callers=20)
    values = {row["metric"]: row["value"] for row in results.rows}
    assert set(values) == {"miss", "hit", "calls for 20 callers", "hand-off per caller",
                           "stampede per caller", "task stampede per caller"}
    assert values["calls for 20 callers"] == 1
    assert all(value > 0 for value in values.values())


@pytest.mark.compiled
def test_the_limits_scenario_sets_lockmgr_beside_the_hand_written_versions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--scenario", "limits", "--impl", "lockmgr",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {row["impl"] for row in rows} == {"lockmgr", "hand-written"}
    metrics = {(row["impl"], row["metric"]): row["value"] for row in rows}
    assert len(metrics) == 8 and all(
        value > 0 for (_, metric), value in metrics.items() if "overtakes" not in metric)
    assert metrics["lockmgr", "overtakes of those tasks"] == 0
    table = capsys.readouterr().out
    assert "| limits | pair, limit 1 (reference: LockManager) (ns) |" in table
    assert "| lockmgr | hand-written |" in table
