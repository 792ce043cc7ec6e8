"""`heterps data ...`: convert Criteo text to a dataset, make synthetic data, describe a dataset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from heterps_ray.data import DEFAULT_EVAL_FRACTION, DEFAULT_ROWS_PER_PART


def register(subparsers: Any) -> None:
    data = subparsers.add_parser(
        "data",
        help="Criteo data: convert text to Parquet, make synthetic data with a known truth",
        description="Datasets are directories of split=train/ and split=eval/ Parquet partitions plus "
        "_meta.json (pandas, pyarrow, DuckDB, Spark and Ray Data read one as a table with a split column).",
    )
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.set_defaults(func=lambda args: _help(data))

    convert = sub.add_parser(
        "convert",
        help="Criteo TSV or header CSV (optionally .gz) -> Parquet dataset, streamed",
        description="Convert Criteo text to a dataset directory, in chunks (a 45M-row day fits in "
        "bounded memory). Every round(1/eval_fraction)-th row goes to eval. Malformed rows are "
        "skipped with a warning and listed in _meta.json (file:line), or stop the run with --strict.",
    )
    convert.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text file(s), read in order")
    convert.add_argument("--output", "-o", type=Path, required=True, help="dataset directory to write")
    convert.add_argument("--rows-per-part", type=_positive_int, default=DEFAULT_ROWS_PER_PART)
    convert.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION, help="in [0, 0.5]")
    convert.add_argument("--strict", action="store_true", help="a malformed row is an error (exit 2)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --output")
    convert.set_defaults(func=_convert)

    synth = sub.add_parser(
        "synth",
        help="synthetic Criteo-like data from a hidden model; prints the achievable AUC",
        description="Draw rows from a hidden model (Zipf key frequencies, per-key logit effects, "
        "smooth dense effects); the AUC of the true probabilities on eval is stored as "
        "_meta.json's achievable_auc and printed. 1M rows take well under a minute.",
    )
    synth.add_argument("--rows", type=_positive_int, required=True)
    synth.add_argument(
        "--shape",
        choices=["default", "criteo-kaggle"],
        default="default",
        help="default: 26 slots of 100-10,000 values; criteo-kaggle: Criteo Kaggle's distinct values per "
        "slot over its 45.8M rows (33.8M in all), heavy Zipf tails",
    )
    synth.add_argument("--output", "-o", type=Path, required=True, help="dataset directory to write")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--eval-fraction", type=float, default=DEFAULT_EVAL_FRACTION, help="in [0, 0.5]")
    synth.add_argument("--rows-per-part", type=_positive_int, default=DEFAULT_ROWS_PER_PART)
    synth.add_argument("--target-auc", type=float, default=0.78, help="expected AUC of the truth")
    synth.add_argument("--base-ctr", type=float, default=0.25, help="mean click rate")
    synth.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --output")
    synth.set_defaults(func=_synth)

    info = sub.add_parser("info", help="row and file counts and metadata of a dataset")
    info.add_argument("path", type=Path, metavar="DIR")
    info.set_defaults(func=_info)


def _convert(args: argparse.Namespace) -> int:
    from heterps_ray.data.convert import convert

    meta = convert(
        args.inputs,
        args.output,
        rows_per_part=args.rows_per_part,
        eval_fraction=args.eval_fraction,
        strict=args.strict,
        overwrite=args.overwrite,
    )
    print(_summary(args.output, meta))
    bad = meta["bad_rows"]
    if bad["count"]:
        print(f"skipped {bad['count']} malformed rows {bad['by_reason']}; first ones:")
        for where in bad["examples"][:10]:
            print(f"  {where}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from heterps_ray.data.synth import SHAPES, SynthSpec, synthesize

    meta = synthesize(
        args.output,
        args.rows,
        seed=args.seed,
        eval_fraction=args.eval_fraction,
        rows_per_part=args.rows_per_part,
        spec=SynthSpec(**SHAPES[args.shape], target_auc=args.target_auc, base_ctr=args.base_ctr),
        overwrite=args.overwrite,
    )
    print(_summary(args.output, meta))
    achievable = meta["achievable_auc"]
    shown = "n/a (no eval split)" if achievable is None else f"{achievable:.4f}"
    print(f"achievable AUC (true probabilities on eval): {shown}; click rate {meta['ctr']:.4f}")
    print(f"distinct keys: {meta['distinct_values_total']:,} over the 26 slots (_meta.json distinct_values)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from heterps_ray.data.dataset import Dataset

    dataset = Dataset(args.path)
    for split in ("train", "eval"):
        print(f"{split}: {dataset.num_rows(split)} rows in {len(dataset.files(split))} files")
    print(json.dumps(dataset.meta, indent=2))
    return 0


def _summary(output: Path, meta: dict[str, Any]) -> str:
    rows, files = meta["rows"], meta["files"]
    return (
        f"wrote {output}: train {rows['train']} rows in {files['train']} files, "
        f"eval {rows['eval']} rows in {files['eval']} files ({meta['seconds']:.1f} s)"
    )


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
