"""`heterps data convert`: Criteo text (raw TSV or header CSV, optionally compressed) to a
dataset directory of Parquet partitions, streamed in chunks so a 45M-row day file never has to
fit in memory.

Example::

    meta = convert(["day_0.gz"], "data/criteo-day0", rows_per_part=1_000_000)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from heterps_ray.data import DEFAULT_EVAL_FRACTION, DEFAULT_ROWS_PER_PART
from heterps_ray.data.criteo import BadRows, read_text
from heterps_ray.data.writer import DatasetWriter, eval_every
from heterps_ray.errors import DataError

log = logging.getLogger(__name__)


def convert(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    rows_per_part: int = DEFAULT_ROWS_PER_PART,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    strict: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert text files (in order, rows numbered across them) to a dataset; returns its meta."""
    paths = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: no such file (expected a Criteo TSV or header CSV file)")
    every = eval_every(eval_fraction)
    bad_rows = BadRows()
    start = time.perf_counter()
    with DatasetWriter(output, rows_per_part=rows_per_part, eval_every=every, overwrite=overwrite) as writer:
        for path in paths:
            for table in read_text(path, strict=strict, bad_rows=bad_rows):
                writer.write(table)
                log.info("%s: %d rows converted", path, writer.rows_written)
        if writer.rows_written == 0:
            raise DataError(f"{', '.join(map(str, paths))}: no valid rows to convert")
        return writer.close(
            {
                "kind": "criteo",
                "source": [str(p.resolve()) for p in paths],
                "created_by": "heterps data convert",
                "eval_fraction": eval_fraction,
                "bad_rows": bad_rows.to_json(),
                "seconds": round(time.perf_counter() - start, 3),
            }
        )
