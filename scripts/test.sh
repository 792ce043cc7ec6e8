#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: lint, type check, the docs site (strict: a broken link
# or a missing page fails it), then pytest on a real local Ray.
# Pass pytest options through, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
.venv/bin/ruff check heterps_ray tests scripts benchmarks
.venv/bin/mypy heterps_ray
.venv/bin/mkdocs build --strict --quiet
.venv/bin/pytest -p no:cacheprovider "$@"
