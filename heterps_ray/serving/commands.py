"""Sub-commands of serving: `heterps export` (the model in serving formats) and `heterps predict`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "export",
        help="the trained model of a run as TorchScript (dense net) + Parquet (embedding rows) + manifest",
        description="Export OUTPUT_DIR/model (written by `heterps train` / `heterps run`) to DIR: "
        "dense.torchscript (load with torch.jit.load), embeddings.parquet (key, vector) and manifest.json "
        "(model, feature hashing, embedding dim, the rule for unseen keys, versions, SHA-256 of the files).",
    )
    export.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="the run's output_dir")
    export.add_argument("--output", "-o", type=Path, required=True, help="export directory to write")
    export.set_defaults(func=_export)

    predict = subparsers.add_parser(
        "predict",
        help="score Parquet rows with a run's trained model, on Ray Data (one probability per row)",
        description="Score a dataset directory (or Parquet files of raw Criteo rows, label optional) with "
        "the model in OUTPUT_DIR/model on Ray Data map_batches over scorer actors; unseen keys get their "
        "initial rows, as in the run's evaluation. Writes split, label, logit, probability per input row, "
        "in input order.",
    )
    predict.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="the run's output_dir")
    predict.add_argument("--data", type=Path, required=True, help="dataset directory or Parquet file(s)")
    predict.add_argument("--output", "-o", type=Path, required=True, metavar="FILE.parquet")
    predict.add_argument(
        "--split", action="append", choices=["train", "eval"], help="only these splits (repeatable)"
    )
    predict.add_argument("--actors", type=int, default=1, help="scorer actors (default 1)")
    predict.add_argument("--batch-rows", type=int, default=4096, help="rows per scoring call")
    predict.add_argument(
        "--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else an embedded Ray)"
    )
    predict.set_defaults(func=_predict)


def _export(args: argparse.Namespace) -> int:
    from heterps_ray.config import writable
    from heterps_ray.serving.export import export_model

    writable(args.output, "--output", directory=True)
    manifest = export_model(args.output_dir, args.output)
    files = ", ".join(["manifest.json", *sorted(manifest["files"])])
    rows, dim = manifest["embeddings"]["rows"], manifest["embedding_dim"]
    print(f"wrote {args.output}: {files} ({manifest['model']['name']}, {rows:,} embedding rows of dim {dim})")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from heterps_ray.config import writable
    from heterps_ray.serving.predict import predict

    writable(args.output, "--output", directory=False)
    result = predict(
        args.output_dir,
        args.data,
        args.output,
        splits=args.split,
        batch_rows=args.batch_rows,
        actors=args.actors,
        address=args.address,
    )
    per_split = ", ".join(f"{s} {n}" for s, n in result["splits"].items())
    print(f"wrote {result['output']}: {result['rows']} rows ({per_split})")
    for split, m in result["metrics"].items():
        print(f"  {split} AUC {m['auc']:.4f}, logloss {m['logloss']:.4f}")
    return 0
