#!/usr/bin/env bash
# Set up heterps_ray on a fresh machine (Python 3.11, pip, a C compiler): a virtual environment in
# .venv with the package (editable) and its test tools. torch is pinned (==2.13.0, CPU build here):
# an unpinned torch would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "heterps_ray set up in $(pwd)/.venv"
