"""How much each part of the simulator's cost model matters, on measured runs (no Ray needed).

    .venv/bin/python scripts/costmodel_ablation.py benchmarks/costmodel_validation_runs/*/results.json

Each results.json (from scripts/validate_costmodel.py) sits beside the raw measurements of the profile
taken before its runs (problem.measurements.parquet). The problem is fitted again from them with the
current fit code, then the runs are predicted with the per-call overhead and the fused-stage saving
each set to 0, and both; prints every run's errors and, per variant, the largest and mean |error|.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import validate_costmodel  # noqa: E402

from heterps_ray.config import (  # noqa: E402
    ModelConfig,  # noqa: E402
    load_cluster,
    read_yaml,
)
from heterps_ray.models import build_model  # noqa: E402
from heterps_ray.profiling.fit import LayerInfo, fit_problem, write_problem  # noqa: E402

VARIANTS = {
    "as fitted": {},
    "no call overhead": {"call_overhead_ms": 0.0},
    "no fused saving": {"fused_saving_ms": 0.0},
    "neither": {"call_overhead_ms": 0.0, "fused_saving_ms": 0.0},
}


def main(results: list[Path]) -> None:
    spec = build_model(ModelConfig(**read_yaml(REPO / "configs" / "models" / "ctr_dnn.yaml")))
    cluster = load_cluster(REPO / "configs" / "clusters" / "local.yaml")
    layers = [
        LayerInfo(
            x.name, x.out_bytes_per_sample, x.sparse_rows_per_sample, x.parallel_fraction, x.dense_params
        )
        for x in spec.layers
    ]
    errors: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for path in results:
            rows = yaml.safe_load(path.read_text())["rows"]  # JSON is YAML
            measured = pd.read_parquet(path.parent / "problem.measurements.parquet")
            fitted = fit_problem(measured, cluster=cluster, layers=layers, batch_size=512, samples=100_000_000,
                                 throughput_min=0, name="refit", input_bytes_per_sample=spec.input_bytes_per_sample)  # fmt: skip
            files = write_problem(fitted, Path(tmp) / "fitted.yaml")
            base = yaml.safe_load(files["problem"].read_text())
            for name, change in VARIANTS.items():
                problem = copy.deepcopy(base)
                for resource in problem["resources"]:
                    resource.update(change)
                variant = Path(tmp) / "variant.yaml"
                variant.write_text(yaml.safe_dump(problem))
                errs = [validate_costmodel._predict(variant, row)["simulator_error"] for row in rows]
                errors[name] += errs
                print(f"{path.parent.name:>4} {name:<17} " + " ".join(f"{e:+5.0%}" for e in errs))
    print()
    print("| simulator | largest \\|error\\| | mean \\|error\\| | within 15% |\n|---|---:|---:|---:|")
    for name, errs in errors.items():
        worst, mean = max(map(abs, errs)), sum(map(abs, errs)) / len(errs)
        inside = sum(abs(e) <= 0.15 for e in errs)
        print(f"| {name} | {worst:.0%} | {mean:.1%} | {inside}/{len(errs)} |")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
