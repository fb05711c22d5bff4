"""What a run prints and draws: the header, the table, the pictures (``lockmgr[plot]``) and
the contention report."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import math
import os
import platform
import random
import sysconfig
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._asyncio import ASYNC_BASELINE, ASYNC_SCENARIOS
from ._host import HOST_BASELINE
from ._singleflight import SINGLEFLIGHT_BASELINE
from ._measure import gil_enabled, progress, run_for
from ._servers import PAIRS_BASELINE
from ._threads import BASELINE

if TYPE_CHECKING:
    from ._measure import Results, Settings


def machine() -> dict[str, Any]:
    import lockmgr

    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "gil_enabled": gil_enabled(),
        "lockmgr_engine": lockmgr.implementation,
        "lockmgr_engine_reason": lockmgr.implementation_reason,
    }


def header(about: dict[str, Any]) -> str:
    """One line on what ran: the figures of a GIL build and of a GIL-off one differ in kind."""
    build = "free-threaded build" if about["free_threaded_build"] else "GIL build"
    return (f"lockmgr-bench: {about['implementation']} {about['python']} ({build}), "
            f"GIL {'on' if about['gil_enabled'] else 'off'}, lockmgr engine "
            f"{about['lockmgr_engine']}, {about['cpu_count']} CPUs, {about['platform']}")


def table(results: Results, impls: list[str], baseline: str = BASELINE,
          scenarios: Iterable[str] | None = None) -> Iterator[str]:
    """A Markdown table: one row per metric (of ``scenarios``, default all), each figure
    with its ratio to ``baseline`` (threading.Lock; asyncio.Lock for the asyncio table)."""
    cells: dict[tuple[str, str], dict[str, Any]] = collections.defaultdict(dict)
    units: dict[tuple[str, str], str] = {}
    wanted = None if scenarios is None else set(scenarios)
    for row in results.rows:
        if wanted is not None and row["scenario"] not in wanted:
            continue
        cells[row["scenario"], row["metric"]][row["impl"]] = row["value"]
        units[row["scenario"], row["metric"]] = row["unit"]
    yield "| scenario | metric | " + " | ".join(impls) + " |"
    yield "|---|---|" + "---|" * len(impls)
    for (scenario, metric), values in cells.items():
        base = values.get(baseline)
        shown = []
        for impl in impls:
            value = values.get(impl)
            if value is None:
                shown.append("—")
                continue
            text = f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
            if base and impl != baseline:
                text += f" ({value / base:.2f}x)"
            shown.append(text)
        yield f"| {scenario} | {metric} ({units[scenario, metric]}) | " + " | ".join(shown) + " |"


# -- pictures (lockmgr[plot]) -------------------------------------------------------------------

#: Units where more is better; in every other unit (ns, us, ms, s, B, times, ids, yes=1) less is.
HIGHER_IS_BETTER = frozenset({"acq/s", "holds/s", "ops/s", "pairs/s", "x", "keys"})


def better(unit: str) -> str:
    return "higher is better" if unit in HIGHER_IS_BETTER else "lower is better"


@dataclass
class Panel:
    """One metric's bars: the implementations that measured it, in the order asked."""

    scenario: str
    metric: str
    unit: str
    values: dict[str, float]
    log: bool  # the values span more than 10x

    @property
    def title(self) -> str:
        return f"{self.scenario}: {self.metric} ({better(self.unit)})"


def panels(results: Results, impls: list[str]) -> list[Panel]:
    """A panel per metric with something to show: all-zero or unmeasured ones are dropped."""
    found = []
    for scenario, metric, unit in dict.fromkeys((row["scenario"], row["metric"], row["unit"])
                                                for row in results.rows):
        measured = {row["impl"]: float(row["value"]) for row in results.rows
                    if row["scenario"] == scenario and row["metric"] == metric}
        values = {impl: measured[impl] for impl in impls if impl in measured}
        positive = [value for value in values.values() if value > 0]
        if not positive:
            continue
        found.append(Panel(scenario, metric, unit, values, max(positive) > 10 * min(positive)))
    return found


def baseline_of(scenario: str) -> str:
    if scenario == "server-pairs":
        return PAIRS_BASELINE
    if scenario == "host":
        return HOST_BASELINE
    if scenario == "singleflight":
        return SINGLEFLIGHT_BASELINE
    return ASYNC_BASELINE if scenario in ASYNC_SCENARIOS else BASELINE


def ratios(found: list[Panel]) -> list[tuple[Panel, dict[str, float]]]:
    """For the summary panel: each metric's values as ratios to its baseline's
    (threading.Lock; asyncio.Lock for the asyncio scenarios, the libpq loop for
    server-pairs), where it measured one. A zero
    (0 overtakes) stays a ratio of 0: the summary draws it at its axis floor."""
    rows = []
    for panel in found:
        baseline = baseline_of(panel.scenario)
        base = panel.values.get(baseline, 0.0)
        if base <= 0:  # nothing to divide by (asyncio.Lock is never overtaken): no row
            continue
        compared = {impl: value / base for impl, value in panel.values.items()
                    if impl != baseline}
        if compared:
            rows.append((panel, compared))
    return rows


LOCKMGR_RED = "#d62728"
#: One colour per implementation, none of them red (lockmgr's), in the order they come.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94",
           "#f7b6d2", "#dbdb8d", "#9edae5")


def colours(impls: list[str]) -> dict[str, str]:
    """A colour per implementation, the same in every panel: lockmgr (the compiled engine,
    the subject) red, the others distinct from each other while the palette lasts."""
    others = itertools.cycle(PALETTE)
    return {impl: LOCKMGR_RED if impl == "lockmgr" else next(others) for impl in impls}


def zero_floor(summary: list[tuple[Panel, dict[str, float]]]) -> float:
    """Where the summary's log axis draws a ratio of 0: a notch left of the smallest
    ratio above 0 (a log axis has no 0)."""
    positive = [ratio for _, values in summary for ratio in values.values() if ratio > 0]
    return min([*positive, 1.0]) / 4


def _mark_zero(axis: Any, floor: float) -> None:
    """The summary's 0: a dotted line at ``floor``, labelled 0 on the axis, which starts
    there (the decades below it, which no ratio has, would read as values between)."""
    axis.axvline(floor, color="black", linewidth=0.8, linestyle=":")
    right = axis.get_xlim()[1]
    decades = range(math.ceil(math.log10(floor * 2)), math.floor(math.log10(right)) + 1)
    axis.set_xticks([floor, *(10.0 ** power for power in decades)],
                    ["0", *(f"$10^{{{power}}}$" for power in decades)])
    axis.set_xlim(floor / 1.3, right)


def draw(results: Results, impls: list[str]) -> Any:
    """The results at a glance (a matplotlib Figure): first every metric as a ratio to
    threading.Lock (asyncio ones to asyncio.Lock, server-pairs to libpq, host to
    lockmgr.host) on one log axis (lockmgr in red, a ratio
    of 0 at the axis floor, marked 0), then one panel per metric, log-scaled where values
    span more than 10x (a 0 there, which has no bar, labelled); each title says whether
    higher or lower is better, and each implementation keeps its colour throughout."""
    importlib.import_module("matplotlib").use("Agg")  # an optional extra: untyped on purpose
    plt = importlib.import_module("matplotlib.pyplot")
    no_labels = importlib.import_module("matplotlib.ticker").NullFormatter
    found = panels(results, impls)
    summary = ratios(found)
    colour = colours(impls)
    columns = 3
    rows = (len(found) + columns - 1) // columns
    summary_height = max(2.5, 0.32 * len(summary) + 1.2) if summary else 0.0
    figure = plt.figure(figsize=(5 * columns, summary_height + 3.0 * rows))
    grid = figure.add_gridspec(rows + (1 if summary else 0), columns,
                               height_ratios=([summary_height] if summary else []) + [3.0] * rows)
    if summary:
        axis = figure.add_subplot(grid[0, :])
        labels = [f"{panel.scenario}: {panel.metric} ({'higher' if panel.unit in HIGHER_IS_BETTER else 'lower'} is better)"
                  for panel, _ in summary]
        floor = zero_floor(summary)
        shown: set[str] = set()
        for row, (_, values) in enumerate(summary):
            for impl, ratio in values.items():
                axis.scatter([ratio if ratio > 0 else floor], [row],
                             s=90 if impl == "lockmgr" else 30, color=colour[impl],
                             zorder=3 if impl == "lockmgr" else 2,
                             label=None if impl in shown else impl)
                shown.add(impl)
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(no_labels())
        if any(ratio == 0 for _, values in summary for ratio in values.values()):
            _mark_zero(axis, floor)
        axis.set_yticks(range(len(labels)), labels, fontsize=7)
        axis.invert_yaxis()
        axis.set_xlabel(f"ratio to {BASELINE} (asyncio scenarios: to {ASYNC_BASELINE}; "
                        f"server-pairs: to {PAIRS_BASELINE}; host: to {HOST_BASELINE}; "
                        f"singleflight: to {SINGLEFLIGHT_BASELINE}); "
                        "log scale", fontsize=8)
        axis.set_title("Every scenario against the standard library's lock: lockmgr in red",
                       fontsize=10)
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        axis.grid(axis="x", which="both", alpha=0.3)
    first_row = 1 if summary else 0
    for index, panel in enumerate(found):
        axis = figure.add_subplot(grid[first_row + index // columns, index % columns])
        names = list(panel.values)
        axis.barh(names, [panel.values[name] for name in names],
                  color=[colour[name] for name in names])
        if panel.log:
            axis.set_xscale("log")
            axis.xaxis.set_minor_formatter(no_labels())
        for row, name in enumerate(names):
            if panel.values[name] == 0:  # no bar to see: say it
                axis.annotate("0", (0, row), xycoords=("axes fraction", "data"),
                              xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        axis.set_title(panel.title, fontsize=8)
        axis.set_xlabel(panel.unit + (" (log scale)" if panel.log else ""), fontsize=7)
        axis.tick_params(labelsize=7)
        axis.invert_yaxis()
    figure.tight_layout()
    return figure


def plot(results: Results, impls: list[str], path: str) -> None:
    """``draw`` the results into the PNG file ``path``."""
    figure = draw(results, impls)
    figure.savefig(path, dpi=110)
    importlib.import_module("matplotlib.pyplot").close(figure)


# -- the contention report (--contention-report) ---------------------------------------------------

REPORT_HOLD_SECONDS = 0.0001  # the work each holder does (off the GIL, as I/O would be)
REPORT_SKEW = 1.1  # Zipf exponent of the many-keys run: a few keys draw most requests


def contention_runs(manager_class: Any, settings: Settings) -> dict[str, Any]:
    """The hot-key and (skewed) many-keys workloads on a fresh manager each, with metrics
    on; returns each run's ``metrics()``."""
    seconds = settings.scaled(1.0, 3.0)
    weights = [1 / (rank + 1) ** REPORT_SKEW for rank in range(settings.keys)]
    measured = {}
    for run, pick in (("hot-key", None), ("many-keys (Zipf)", weights)):
        locks = manager_class()
        plans = [["hot"] if pick is None else
                 [f"key-{k}" for k in random.Random(seed).choices(range(settings.keys), pick, k=4096)]
                 for seed in range(settings.threads)]

        def body(index: int, stop: threading.Event, locks: Any = locks,
                 plans: list[list[str]] = plans) -> None:
            for key in itertools.cycle(plans[index]):
                if stop.is_set():
                    break
                with locks[key]:
                    time.sleep(REPORT_HOLD_SECONDS)

        progress(f"contention report: {run}")
        run_for(seconds, settings.threads, body)
        measured[run] = locks.metrics()
    return measured


def _bucket_label(bound: float) -> str:
    if bound < 1e-3:
        return f"{bound * 1e6:.3g}us"
    return f"{bound * 1e3:.3g}ms" if bound < 1 else f"{bound:.3g}s"


def contention_report(measured: dict[str, Any], path: str) -> None:
    """Wait-time and hold-time histograms of each run, and the skewed run's hot keys."""
    importlib.import_module("matplotlib").use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    figure, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    runs = list(measured)
    first = measured[runs[0]]
    labels = [f"<={_bucket_label(bound)}" for bound in first.wait_time.bounds] + [
        f">{_bucket_label(first.wait_time.bounds[-1])}"]
    used = [index for index in range(len(labels))
            if any(m.wait_time.counts[index] or m.hold_time.counts[index] for m in measured.values())]
    lo, hi = (min(used), max(used)) if used else (0, len(labels) - 1)
    shown = range(lo, hi + 1)
    width = 0.8 / len(runs)
    for axis, which, title in ((axes[0], "wait_time", "Wait before the grant"),
                               (axes[1], "hold_time", "Holds someone waited for")):
        if not any(getattr(measured[run], which).count for run in runs):
            axis.text(0.5, 0.5, "nothing waited", ha="center", va="center")
            axis.set_axis_off()
            continue
        for offset, run in enumerate(runs):
            histogram = getattr(measured[run], which)
            axis.bar([position + offset * width for position in range(len(shown))],
                     [histogram.counts[index] for index in shown], width, label=
                     f"{run}: {histogram.count:,} (p50 {_bucket_label(histogram.quantile(0.5) or 0)}, "
                     f"max {_bucket_label(histogram.max)})")
        axis.set_xticks([position + width * (len(runs) - 1) / 2 for position in range(len(shown))],
                        [labels[index] for index in shown], rotation=60, fontsize=7)
        axis.set_yscale("log")
        axis.set_ylabel("count (log scale)", fontsize=8)
        axis.set_title(f"{title} (lower is better)", fontsize=10)
        axis.legend(fontsize=7)
    hot = measured[runs[-1]].hot_keys
    axis = axes[2]
    if hot:
        axis.barh([repr(entry.key) for entry in hot], [entry.waited for entry in hot],
                  color="#d62728")
        axis.invert_yaxis()
        axis.set_xlabel("seconds waited, all threads (Space-Saving; over-estimate <= error)",
                        fontsize=8)
        axis.tick_params(labelsize=7)
    else:
        axis.text(0.5, 0.5, "nothing waited", ha="center", va="center")
        axis.set_axis_off()
    axis.set_title(f"Hot keys of {runs[-1]}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report_lines(measured: dict[str, Any]) -> Iterator[str]:
    for run, metrics in measured.items():
        waits = metrics.wait_time
        if not waits.count:
            yield f"{run}: {metrics.acquisitions:,} acquisitions, none waited"
            continue
        yield (f"{run}: {metrics.acquisitions:,} acquisitions, {metrics.contended:,} waited "
               f"(p50 {_bucket_label(waits.quantile(0.5) or 0)}, p99 "
               f"{_bucket_label(waits.quantile(0.99) or 0)}, max {_bucket_label(waits.max)}); "
               "hot keys: " + ", ".join(f"{entry.key!r} {entry.waited:.2f}s"
                                        for entry in metrics.hot_keys[:5]))
