"""The notebooks run top to bottom with small settings (HETERPS_NB_SMALL=1) and write what they promise.

Each runs in a fresh Jupyter kernel of this interpreter, in a temp dir, and starts its own embedded
Ray inside the kernel (heterps_ray.cluster.connect), independent of the test session's Ray.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
KERNEL = "heterps-test-python"  # a kernelspec of sys.executable, written per test (no global install needed)
CELL_TIMEOUT_S = 600


def _run_notebook(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[nbformat.NotebookNode, Path]:
    """Execute notebooks/<name> with small settings; returns the executed notebook and its output dir."""
    from nbclient import NotebookClient

    kernel_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "heterps_ray tests",
                "language": "python",
            }
        )
    )
    out = tmp_path / "out"
    # The kernel inherits this environment.
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("HETERPS_NB_SMALL", "1")
    monkeypatch.setenv("HETERPS_NB_OUT", str(out))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the notebook's Ray is its own embedded one
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    NotebookClient(
        notebook, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(cwd)}}
    ).execute()  # raises CellExecutionError, with the cell's traceback, on any error
    return notebook, out


def _printed(notebook: nbformat.NotebookNode) -> str:
    """Everything the code cells printed or displayed as text."""
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output["text"])
            elif "text/plain" in output.get("data", {}):
                parts.append(output["data"]["text/plain"])
    return "\n".join(parts)


def test_notebooks_are_stored_with_a_full_run_s_outputs_and_read_the_small_flag_first():
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == [
        "01_quickstart.ipynb",
        "02_scheduler_experiments.ipynb",
        "03_plan_for_your_cluster.ipynb",
        "04_plan_for_a_gpu_cloud.ipynb",
    ]
    for name in names:
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(notebook)
        assert notebook.metadata["kernelspec"]["name"] == "python3", name
        code = [c for c in notebook.cells if c.cell_type == "code"]
        # saved by scripts/run_notebooks.py: every code cell ran, in order, and none failed
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: not a full run"
        assert not any(o.output_type == "error" for c in code for o in c.outputs), f"{name} saved an error"
        assert any(c.outputs for c in code), f"{name} has no outputs"
        assert "HETERPS_NB_SMALL" in code[0].source, f"{name}: the first code cell sets the small settings"
        # a markdown cell before every step says what it does
        assert notebook.cells[0].cell_type == "markdown"


@pytest.mark.slow
def test_quickstart_notebook_profiles_plans_trains_and_plots(tmp_path, monkeypatch):
    notebook, out = _run_notebook("01_quickstart.ipynb", tmp_path, monkeypatch)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 30 and summary["samples"] == 30 * 512
    assert summary["throughput"] == pytest.approx(summary["samples"] / summary["seconds"])
    assert summary["throughput"] >= 500  # the floor the notebook plans for
    # sync training: the model the reference trainer gives on the same 30 batches of the same data
    from heterps_ray.config import load_job
    from heterps_ray.data.dataset import Dataset
    from heterps_ray.models import build_model
    from heterps_ray.runtime.reference import ReferenceTrainer

    job = load_job(REPO / "configs" / "jobs" / "quickstart.yaml", {"data.path": str(out / "data")})
    trainer = ReferenceTrainer(build_model(job.model), job.optimizer, seed=job.seed)
    history = trainer.fit(Dataset(out / "data"), job.batch_size, steps=30, progress=False)
    reference = trainer.evaluate(Dataset(out / "data").load("eval"))
    assert summary["losses"] == pytest.approx(history["loss"], abs=1e-4)
    assert abs(summary["auc"] - reference["auc"]) < 1e-3, (summary["auc"], reference["auc"])
    assert abs(summary["logloss"] - reference["logloss"]) < 1e-3
    for name in ("problem.yaml", "plan.json", "pipeline.png", "frontier.png"):
        assert (out / name).stat().st_size > 0, name
    text = _printed(notebook)
    assert "plan by exact" in text and "plan by rl" in text
    assert "achieved" in text and "AUC" in text


@pytest.mark.slow
def test_scheduler_experiments_notebook_compares_and_sweeps_with_tune(tmp_path, monkeypatch):
    _, out = _run_notebook("02_scheduler_experiments.ipynb", tmp_path, monkeypatch)
    results = pd.read_parquet(out / "comparison.parquet")
    assert {"exact", "single", "greedy", "genetic", "random"} <= set(results["scheduler"])
    exact = results[results["scheduler"] == "exact"]
    assert exact["feasible"].all() and (exact["ratio"] == 1.0).all()
    feasible = results[results["feasible"].astype(bool) & results["ratio"].notna()]
    assert (feasible["ratio"] >= 1.0 - 1e-9).all(), "no scheduler beats the exact optimum"
    sweep = pd.read_parquet(out / "sweep_genetic.parquet")
    assert len(sweep) == 3 and sweep["mean_ratio"].is_monotonic_increasing
    for name in ("cost_vs_floor.png", "ratio_to_exact.png"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.slow
def test_plan_for_your_cluster_notebook_plans_a_cluster_we_do_not_have(tmp_path, monkeypatch):
    notebook, out = _run_notebook("03_plan_for_your_cluster.ipynb", tmp_path, monkeypatch)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["feasible"] and plan["scheduler"] == "exact"
    assert plan["throughput"] >= 300_000  # the floor written in the notebook's problem
    assert set(plan["assignment"]) <= {"cpu", "t4", "a100"}
    for name in ("problem.yaml", "pipeline.png", "frontier.png"):
        assert (out / name).stat().st_size > 0, name
    assert "plan by exact" in _printed(notebook)


@pytest.mark.slow
def test_gpu_cloud_notebook_shows_where_the_layers_and_the_table_go_and_nothing_beats_exact(tmp_path, monkeypatch):
    notebook, out = _run_notebook("04_plan_for_a_gpu_cloud.ipynb", tmp_path, monkeypatch)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["feasible"] and plan["scheduler"] == "exact" and plan["extra"]["proof"]["proven"]
    assert plan["table_place"] in ("gpu", "gpu_cache", "ps")
    compared = pd.read_csv(out / "comparison.csv")
    feasible = compared[compared["feasible"]]
    assert {"exact", "rl", "greedy"} <= set(compared["scheduler"])
    assert (feasible["vs exact"] >= 1.0 - 1e-9).all(), "no scheduler beats the proven optimum"
    by_hand = pd.read_csv(out / "by_hand.csv").dropna(subset=["vs exact"])
    assert len(by_hand) >= 3 and (by_hand["vs exact"] >= 1.0 - 1e-9).all(), "no hand-written plan beats it"
    # the table's size moves the plan's cost, never below the smaller table's; ten billion rows fit no GPU
    sweep = pd.read_csv(out / "table_sweep.csv")
    assert sweep["table rows"].iloc[0] == 10**6 and sweep["table rows"].iloc[-1] == 10**10
    assert sweep["feasible"].all() and sweep["proven"].all()
    assert sweep["cost $"].is_monotonic_increasing
    assert sweep["fits on"].iloc[-1] == "no GPU" and sweep["table"].iloc[-1].startswith("ps on ")
    # wide rows: the table in one GPU's memory while it serves most lookups, on CPU shards past that
    gpu_table = pd.read_csv(out / "gpu_table.csv")
    assert gpu_table["proven"].all() and gpu_table["cost $"].is_monotonic_increasing
    assert gpu_table["table"].iloc[0].startswith("gpu on ") and gpu_table["table"].iloc[-1].startswith("ps on ")
