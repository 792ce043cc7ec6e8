"""Plots of scheduler experiments and plans, as PNG files (matplotlib, no display needed).

Each function takes data (pandas DataFrames, as the experiments and the simulator produce them)
and a path, writes one PNG of a fixed pixel size (``FIGSIZE`` x ``DPI``) and returns the path::

    plot_cost_vs_floor(results, "out/cost_vs_floor.png")
    plot_frontier(frontier_table, "out/frontier.png")
    plot_pipeline(simulate(problem, plan).spans, "out/pipeline.png")
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter
from matplotlib.transforms import blended_transform_factory

DPI = 100  # dots per inch of every PNG
PANEL_SIZE = (5.0, 3.6)  # inches per panel of the cost-vs-floor grid
FIGSIZE = (9.0, 5.0)  # inches, single-panel plots

# Columns the plots read (the experiments write more).
RESULT_COLUMNS = ("problem", "floor", "scheduler", "cost", "feasible")
FRONTIER_COLUMNS = ("throughput_min", "exact_cost", "exact_feasible", "single_cost", "single_feasible")
SPAN_COLUMNS = ("start_ms", "end_ms", "stage", "replica", "kind", "batch")

_KIND_COLOURS = {
    "read": "#64B5CD",
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "forward_backward": "#8172B3",  # the last stage: loss and backward in one call
    "forward+backward": "#8172B3",
    "pull": "#55A868",
    "push": "#937860",
    "dense": "#DA8BC3",  # dense optimizer steps on the PS (kinds dense0, dense1, ...)
}
_OTHER_COLOURS = ("#8C8C8C", "#CCB974", "#C44E52", "#2F4F4F")  # kinds this module does not know
_MARKERS = "osD^v<>Ph*Xp"


def plot_cost_vs_floor(
    results: pd.DataFrame, path: str | Path, *, log_cost: bool = True, columns: int = 2
) -> Path:
    """Cost of each scheduler's plan against the throughput floor, one panel per problem (log scale
    where costs span more than 10x and `log_cost`).

    `results` has a row per (problem, floor, scheduler) with `cost` ($) and `feasible`; `floor` is a
    fraction of the problem's highest reachable throughput. Infeasible plans are drawn as crosses on
    the top edge of their panel.
    """
    _require(results, RESULT_COLUMNS, "results")
    problems = list(dict.fromkeys(results["problem"]))
    columns = max(1, min(columns, len(problems)))
    rows = math.ceil(len(problems) / columns)
    fig = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows + 0.6), dpi=DPI, layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, columns, squeeze=False)).ravel()
    style = _scheduler_styles(results["scheduler"])
    for ax, problem in zip(axes, problems, strict=False):
        part = results[results["problem"] == problem]
        top = blended_transform_factory(ax.transData, ax.transAxes)
        for scheduler, (colour, marker) in style.items():
            rows_s = part[part["scheduler"] == scheduler].sort_values("floor")
            if rows_s.empty:
                continue
            ok = rows_s[rows_s["feasible"].astype(bool) & np.isfinite(rows_s["cost"].astype(float))]
            if scheduler == "exact":  # a wide pale band under the others: who matches the optimum shows
                ax.plot(ok["floor"], ok["cost"], color=colour, linewidth=7, alpha=0.3, solid_capstyle="round")
            ax.plot(ok["floor"], ok["cost"], color=colour, marker=marker, label=scheduler, alpha=0.85)
            bad = rows_s[~rows_s.index.isin(ok.index)]
            ax.scatter(bad["floor"], np.full(len(bad), 0.97), transform=top, color=colour, marker="x", s=40)
        costs = part.loc[part["feasible"].astype(bool), "cost"].astype(float)
        costs = costs[np.isfinite(costs) & (costs > 0)]
        if log_cost and len(costs) and costs.max() / costs.min() > 10:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.margins(y=0.12)  # room for the infeasible crosses on the top edge
        ax.set_title(str(problem), fontsize=10)
        ax.set_xlabel("throughput floor (fraction of the highest reachable)")
        ax.set_ylabel("cost ($)")
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[len(problems) :]:
        ax.set_visible(False)
    handles = [_line_handle(colour, marker, scheduler) for scheduler, (colour, marker) in style.items()] + [
        _line_handle("grey", "x", "infeasible (top edge)", line=False)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=9)
    fig.suptitle("Plan cost against throughput floor")
    return _save(fig, path)


def plot_ratio_to_exact(results: pd.DataFrame, path: str | Path) -> Path:
    """Cost above the exact optimum (%) against the floor, aggregated over problems.

    Lines are the mean over problems where both plans are feasible, bands span min..max; the legend
    counts the (problem, floor) cases a scheduler missed although a feasible plan exists. The axis is
    linear below 1 % and logarithmic above, so near-optimal and far-off schedulers both read.
    """
    _require(results, (*RESULT_COLUMNS, "ratio"), "results")
    exact_ok = results[(results["scheduler"] == "exact") & results["feasible"].astype(bool)]
    solvable = set(zip(exact_ok["problem"], exact_ok["floor"], strict=True))
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = fig.subplots()
    style = _scheduler_styles(results["scheduler"])
    for scheduler, (colour, marker) in style.items():
        if scheduler == "exact":  # the reference: the dotted line at 0 %
            continue
        part = results[results["scheduler"] == scheduler]
        cases = part[[(p, f) in solvable for p, f in zip(part["problem"], part["floor"], strict=True)]]
        missed = int((~cases["feasible"].astype(bool)).sum())
        ok = cases[cases["feasible"].astype(bool) & np.isfinite(cases["ratio"].astype(float))]
        if ok.empty:
            ax.plot([], [], color=colour, marker=marker, label=f"{scheduler} (missed {missed})")
            continue
        excess = ok.assign(excess=100.0 * (ok["ratio"].astype(float) - 1.0))
        stats = excess.groupby("floor")["excess"].agg(["mean", "min", "max"]).sort_index()
        ax.plot(
            stats.index, stats["mean"], color=colour, marker=marker, label=f"{scheduler} (missed {missed})"
        )
        ax.fill_between(stats.index, stats["min"], stats["max"], color=colour, alpha=0.12)
    ax.axhline(0.0, color="black", linewidth=0.8, linestyle=":", label="exact optimum")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=-0.05)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} %"))
    ax.set_xlabel("throughput floor (fraction of the highest reachable)")
    ax.set_ylabel("cost above the exact optimum's")
    problems = results["problem"].nunique()
    ax.set_title(f"Cost above the exact optimum ({problems} problems; mean, band = min..max)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, title="scheduler (infeasible where exact is not)", title_fontsize=8)
    return _save(fig, path)


def plot_frontier(frontier: pd.DataFrame, path: str | Path, *, title: str | None = None) -> Path:
    """The cost/throughput frontier of one problem: the exact optimum's cost and the best single-type
    plan's cost at each floor (step curves), with the floors no plan reaches shaded."""
    _require(frontier, FRONTIER_COLUMNS, "frontier")
    f = frontier.sort_values("throughput_min")
    x = f["throughput_min"].to_numpy(dtype=float)
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = fig.subplots()
    exact_ok = f["exact_feasible"].to_numpy(dtype=bool)
    single_ok = f["single_feasible"].to_numpy(dtype=bool)
    exact = np.where(exact_ok, f["exact_cost"].to_numpy(dtype=float), np.nan)
    single = np.where(single_ok, f["single_cost"].to_numpy(dtype=float), np.nan)
    ax.step(x, exact, where="post", color="#C44E52", linewidth=2, label="exact optimum (any mix of types)")
    single_label = "best single-type plan"
    if "single_type" in f:
        types = [t for t in dict.fromkeys(f.loc[single_ok, "single_type"]) if isinstance(t, str)]
        single_label += f" ({', '.join(types)})" if types else ""
    ax.step(x, single, where="post", color="#4C72B0", linewidth=1.5, linestyle="--", label=single_label)
    lo, hi = (x.min(), x.max()) if len(x) else (0.0, 1.0)
    # floors that a mix of types reaches but no single type does
    only_mix = x[exact_ok & ~single_ok]
    if len(only_mix):
        mix_end = x[~exact_ok].min() if (~exact_ok).any() else hi
        ax.axvspan(
            only_mix.min(),
            mix_end,
            color="#C44E52",
            alpha=0.07,
            label="only a mix of types reaches these floors",
        )
    unreachable = x[~exact_ok]
    if len(unreachable):
        ax.axvspan(
            unreachable.min(), hi, color="grey", alpha=0.2, label="infeasible: no plan reaches this floor"
        )
    if "best_throughput" in f and np.isfinite(f["best_throughput"].astype(float)).any():
        best = float(f["best_throughput"].astype(float).max())
        if lo <= best <= hi:
            ax.axvline(best, color="black", linewidth=0.8, linestyle=":")
            ax.annotate(
                f" highest reachable\n {best:,.0f} samples/s",
                (best, 0.5),
                xycoords=("data", "axes fraction"),
                fontsize=8,
            )
    finite = np.concatenate([exact[np.isfinite(exact)], single[np.isfinite(single)]])
    if len(finite) and finite.min() > 0 and finite.max() / finite.min() > 20:
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel("throughput floor (samples/s)")
    ax.set_ylabel("cost of the whole run ($)")
    ax.set_title(title or "Cost/throughput frontier")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    return _save(fig, path)


def plot_pipeline(
    spans: pd.DataFrame,
    path: str | Path,
    *,
    stage_labels: Mapping[int, str] | Sequence[str] | None = None,
    max_batches: int | None = 6,
    title: str | None = None,
) -> Path:
    """A Gantt chart of a pipeline: one row per stage replica (and PS shard, stage -1), one bar per call.

    `spans` has the simulator's columns (start_ms, end_ms, stage, replica, kind, batch; micro_batch
    optional), whether from :func:`heterps_ray.costmodel.simulator.simulate` or a real run's timeline.
    Only batches below `max_batches` are drawn, so the bars stay readable.
    """
    _require(spans, SPAN_COLUMNS, "spans")
    data = spans if max_batches is None else spans[spans["batch"] < max_batches]
    if data.empty:
        raise ValueError("spans: no calls to draw")
    lanes = sorted(
        {(int(s), int(r)) for s, r in zip(data["stage"], data["replica"], strict=True)},
        key=lambda lane: (lane[0] < 0, lane),
    )
    lane_of = {lane: i for i, lane in enumerate(lanes)}
    fig = Figure(figsize=(FIGSIZE[0] + 2, max(3.0, 0.45 * len(lanes) + 1.8)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    t0 = float(data["start_ms"].min())
    width_ms = float(data["end_ms"].max()) - t0
    batches = sorted(data["batch"].unique())
    shade = {b: 1.0 if i % 2 == 0 else 0.6 for i, b in enumerate(batches)}  # tell adjacent batches apart
    kinds = _ordered_kinds(data["kind"])
    for kind, group in data.groupby("kind", sort=False):
        colour = _kind_colour(str(kind), kinds)
        y = np.array(
            [lane_of[(int(s), int(r))] for s, r in zip(group["stage"], group["replica"], strict=True)]
        )
        ax.barh(
            y,
            group["end_ms"] - group["start_ms"],
            left=group["start_ms"] - t0,
            height=0.7,
            color=[to_rgba(colour, shade[b]) for b in group["batch"]],
            edgecolor="white",
            linewidth=0.6,
        )
        if len(data) <= 300:  # label bars with their batch (and micro-batch) where they are wide enough
            micro = group["micro_batch"] if "micro_batch" in group else None
            for i, (start, end, batch) in enumerate(
                zip(group["start_ms"], group["end_ms"], group["batch"], strict=True)
            ):
                if (end - start) > 0.025 * width_ms:
                    text = str(batch) if micro is None or micro.iloc[i] < 0 else f"{batch}.{micro.iloc[i]}"
                    ax.text(
                        (start + end) / 2 - t0,
                        y[i],
                        text,
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                    )
    ax.set_yticks(range(len(lanes)), [_lane_label(lane, stage_labels) for lane in lanes], fontsize=8)
    ax.invert_yaxis()  # stage 0 on top, the PS at the bottom
    ax.set_xlim(0, width_ms * 1.01)
    ax.set_xlabel("time (ms)")
    legend = list(dict.fromkeys(_legend_name(k) for k in kinds))
    fig.legend(
        handles=[Patch(color=_kind_colour(k, kinds), label=k) for k in legend],
        loc="outside lower center",
        ncols=len(legend),
        fontsize=8,
        frameon=False,
    )
    shown = f"batches 0..{max(batches)}" if batches else ""
    ax.set_title(title or f"Pipeline timeline ({shown}; labels batch.micro-batch)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------


def _require(data: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in data.columns]
    if missing:
        raise ValueError(f"{what}: missing columns {missing} (has {list(data.columns)})")


def _scheduler_styles(names: pd.Series) -> dict[str, tuple[str, str]]:
    """A fixed colour and marker per scheduler, exact first (so it is drawn under the others)."""
    ordered = sorted(set(names), key=lambda n: (n != "exact", n))
    colours = [f"C{i}" for i in range(10)]
    return {n: (colours[i % 10], _MARKERS[i % len(_MARKERS)]) for i, n in enumerate(ordered)}


def _line_handle(colour: str, marker: str, label: str, line: bool = True):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=colour, marker=marker, linestyle="-" if line else "none", label=label)


def _legend_name(kind: str) -> str:
    return "dense" if kind.startswith("dense") else kind


def _ordered_kinds(kinds: pd.Series) -> list[str]:
    """Known kinds in pipeline order, then the others sorted."""
    present = {str(k) for k in kinds}
    known = [k for k in present if _legend_name(k) in _KIND_COLOURS]
    order = list(_KIND_COLOURS)
    return sorted(known, key=lambda k: (order.index(_legend_name(k)), k)) + sorted(present - set(known))


def _kind_colour(kind: str, kinds: list[str]) -> str:
    """A fixed colour per known kind; unknown kinds share a small palette, in sorted order."""
    name = _legend_name(kind)
    if name in _KIND_COLOURS:
        return _KIND_COLOURS[name]
    unknown = [k for k in kinds if _legend_name(k) not in _KIND_COLOURS]
    return _OTHER_COLOURS[unknown.index(kind) % len(_OTHER_COLOURS)] if kind in unknown else _OTHER_COLOURS[0]


def _lane_label(lane: tuple[int, int], stage_labels: Mapping[int, str] | Sequence[str] | None) -> str:
    stage, replica = lane
    if stage < 0:
        return f"PS shard {replica}"
    name = f"stage {stage}"
    if stage_labels is not None:
        try:
            name = f"{name} · {stage_labels[stage]}"
        except (KeyError, IndexError):
            pass
    return f"{name} · r{replica}"


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path
