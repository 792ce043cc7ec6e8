#!/usr/bin/env bash
# The GPU figures of issue 39 in one command, on a GPU machine prepared as the README's GPU section says
# (Ray and the rest from .whl/: `bash ../shared/gpu/prepare.sh` here, then carried): gpu_check.py, then
# bench_gpu.py (the plain loop beside heterps' best plan, alternating, at batch 2048 and 8192). Writes
# into OUTDIR: gpu_check.json/.log, bench_gpu.json/.log, machine.txt, and the profiled run's problem.yaml
# and reports. bench_gpu.py's table says where a batch went (phases, every thread's CPU, ops and waits).
#   source .whl/install.sh && bash benchmarks/gpu_figures.sh "$OUT"
# Keep every run's files: copy OUTDIR to benchmarks/gpu_figures/YYYY-MM-DD-<card>/ and commit them, so that a figure
# in BENCHMARKS.md can be checked against what the machine printed.
set -uo pipefail
out=${1:?usage: gpu_figures.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/machine.txt" 2>&1
echo "cpus $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/machine.txt"
timeout "${CHECK_TIMEOUT_S:-240}" python3 scripts/gpu_check.py --workdir /tmp/gpu_check --out "$out/gpu_check.json" \
  > "$out/gpu_check.log" 2>&1
echo "gpu_check exit $?" | tee -a "$out/machine.txt"
timeout "${BENCH_TIMEOUT_S:-420}" python3 benchmarks/bench_gpu.py --workdir /tmp/bench_gpu --out "$out/bench_gpu.json" "${@:2}" \
  2>&1 | grep -v "Token authentication" > "$out/bench_gpu.log"
echo "bench_gpu exit ${PIPESTATUS[0]}" | tee -a "$out/machine.txt"
run=$(ls -d /tmp/bench_gpu/run-*/round0 2>/dev/null | head -1)
[ -n "$run" ] && cp "$run/problem.yaml" "$out/problem.yaml" 2>/dev/null
[ -n "$run" ] && cp "$run/run_summary.json" "$out/run_summary.json" 2>/dev/null
tail -20 "$out/bench_gpu.log"
exit 0
