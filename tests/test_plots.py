"""The PNG plots: each writes an image of the expected pixel size with something drawn on it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from heterps_ray.costmodel.simulator import simulate
from heterps_ray.experiments import (
    frontier,
    plot_cost_vs_floor,
    plot_frontier,
    plot_pipeline,
    plot_ratio_to_exact,
)
from heterps_ray.experiments.plots import DPI, FIGSIZE, PANEL_SIZE
from heterps_ray.scheduling import get_scheduler
from heterps_ray.scheduling.generator import generate_problem


def _image(path):
    """(height, width) in pixels and the number of distinct colours of a PNG."""
    pixels = imread(path)
    colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    return pixels.shape[:2], len(colours)


@pytest.fixture(scope="module")
def comparison() -> pd.DataFrame:
    """A hand-written comparison: 3 problems x 3 floors x 3 schedulers, with misses and an infeasible floor."""
    rows = []
    for p, scale in (("small", 1.0), ("wide", 40.0), ("deep", 3.0)):
        for floor in (0.2, 0.5, 0.9):
            exact = scale * (1 + floor)
            for scheduler, factor in (("exact", 1.0), ("greedy", 1.1), ("single", 1.6)):
                feasible = not (scheduler == "single" and floor == 0.9) and not (p == "deep" and floor == 0.9)
                cost = exact * factor if feasible else math.inf
                rows.append(
                    {"problem": p, "floor": floor, "scheduler": scheduler, "cost": cost, "feasible": feasible}
                )
    table = pd.DataFrame(rows)
    exact = table[table.scheduler == "exact"].set_index(["problem", "floor"])["cost"]
    table["ratio"] = [
        c / exact[(p, f)] if math.isfinite(exact[(p, f)]) else math.nan
        for p, f, c in zip(table.problem, table.floor, table.cost, strict=True)
    ]
    return table


def test_cost_vs_floor_has_one_panel_per_problem(comparison, tmp_path):
    path = plot_cost_vs_floor(comparison, tmp_path / "cost.png", columns=2)
    (height, width), colours = _image(path)
    assert (width, height) == (round(2 * PANEL_SIZE[0] * DPI), round((2 * PANEL_SIZE[1] + 0.6) * DPI))
    assert colours > 50


def test_ratio_to_exact_aggregates_over_problems(comparison, tmp_path):
    path = plot_ratio_to_exact(comparison, tmp_path / "ratio.png")
    (height, width), colours = _image(path)
    assert (width, height) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
    assert colours > 50


def test_frontier_of_a_generated_problem(tmp_path):
    problem = generate_problem(5, num_layers=(5, 6), num_types=(3, 3))
    path = plot_frontier(frontier(problem, max_points=60), tmp_path / "frontier.png", title=problem.name)
    (height, width), colours = _image(path)
    assert (width, height) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
    assert colours > 50


def test_pipeline_chart_of_a_simulated_plan(tmp_path):
    problem = generate_problem(5, num_layers=(5, 6), num_types=(3, 3))
    plan = get_scheduler("exact").schedule(problem)
    spans = simulate(problem, plan, batches=8, micro_batches=2, mode="async").spans
    path = plot_pipeline(
        spans, tmp_path / "pipeline.png", stage_labels=[s.type for s in plan.stages], max_batches=4
    )
    drawn = spans[spans.batch < 4]
    lanes = len(set(zip(drawn.stage, drawn.replica, strict=True)))  # stage replicas and PS shards
    (height, width), colours = _image(path)
    assert width == round((FIGSIZE[0] + 2) * DPI)
    assert height == round(max(3.0, 0.45 * lanes + 1.8) * DPI)
    assert colours > 50


def test_pipeline_chart_of_a_recorded_timeline_without_micro_batches(tmp_path):
    # a real run's timeline has the same columns; micro_batch is optional
    spans = pd.DataFrame(
        {
            "start_ms": [0.0, 5.0, 12.0, 20.0, 26.0],
            "end_ms": [5.0, 12.0, 20.0, 26.0, 31.0],
            "stage": [0, 1, 1, 0, 0],
            "replica": [0, 0, 0, 0, 0],
            "kind": ["forward", "forward+backward", "forward+backward", "backward", "forward"],
            "batch": [0, 0, 1, 0, 1],
        }
    )
    (height, width), _ = _image(plot_pipeline(spans, tmp_path / "run.png"))
    assert (width, height) == (round((FIGSIZE[0] + 2) * DPI), round(3.0 * DPI))


def test_missing_columns_are_named(tmp_path):
    with pytest.raises(ValueError, match="feasible"):
        plot_cost_vs_floor(
            pd.DataFrame({"problem": ["p"], "floor": [0.2], "scheduler": ["x"], "cost": [1.0]}),
            tmp_path / "x.png",
        )


def test_plot_commands_write_their_pngs(comparison, tmp_path, capsys):
    from heterps_ray.cli import main

    problem = tmp_path / "problem.yaml"
    generate_problem(6, num_layers=(3, 4), num_types=(2, 2)).save(problem)
    assert (
        main(
            [
                "plot",
                "frontier",
                "--problem",
                str(problem),
                "-o",
                str(tmp_path / "f.png"),
                "--table",
                str(tmp_path / "f.parquet"),
            ]
        )
        == 0
    )
    assert "highest reachable throughput" in capsys.readouterr().out
    assert pd.read_parquet(tmp_path / "f.parquet")["exact_feasible"].any()

    plan = tmp_path / "plan.json"
    assert main(["plan", "--problem", str(problem), "--output", str(plan)]) == 0  # a plan meets its floor
    assert (
        main(
            [
                "plot",
                "pipeline",
                "--problem",
                str(problem),
                "--plan",
                str(plan),
                "-o",
                str(tmp_path / "p.png"),
            ]
        )
        == 0
    )
    comparison.to_parquet(tmp_path / "cmp.parquet")
    assert main(["plot", "schedulers", str(tmp_path / "cmp.parquet"), "-o", str(tmp_path / "charts")]) == 0
    for png in ("f.png", "p.png", "charts/cost_vs_floor.png", "charts/ratio_to_exact.png"):
        assert _image(tmp_path / png)[1] > 50
    assert (
        main(["plot", "pipeline", "--timeline", str(tmp_path / "missing.csv"), "-o", str(tmp_path / "x.png")])
        == 2
    )
