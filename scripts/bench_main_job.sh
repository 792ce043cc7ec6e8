#!/usr/bin/env bash
# The README's main job on two versions of the code, alternating old, new, old, new (ROUNDS rounds), on
# one venv: OLD (a git revision, checked out beside the repo with the compiled row store copied in)
# against this working tree. Prints each run's report time line and achieved rate.
#   ../shared/bench/quiet.sh && bash scripts/bench_main_job.sh e177ca6
set -euo pipefail
cd "$(dirname "$0")/.."
old_rev=${1:?usage: bench_main_job.sh OLD_REVISION [ROUNDS]}
rounds=${2:-2}
repo=$(pwd)
old=$(mktemp -d /tmp/hps_old.XXXXXX)
out=$(mktemp -d /tmp/hps_bench.XXXXXX)
trap 'git -C "$repo" worktree remove --force "$old"; rm -rf "$out"' EXIT
git worktree add -q --detach "$old" "$old_rev"
cp heterps_ray/ps/_rows*.so "$old/heterps_ray/ps/"
export TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=1 RAY_USAGE_STATS_ENABLED=0
for round in $(seq "$rounds"); do
  for system in old new; do
    dir=$repo
    [ "$system" = old ] && dir=$old
    log="$out/$system-$round.log"
    start=$(date +%s.%N)
    (cd "$dir" && PYTHONPATH="$dir" "$repo/.venv/bin/heterps" run configs/jobs/quickstart.yaml --overwrite \
      --no-progress --output-dir "$out/$system") >"$log" 2>&1
    wall=$(echo "$(date +%s.%N) - $start" | bc)
    echo "round $round $system: wall ${wall} s, load $(cut -d' ' -f1 /proc/loadavg)"
    grep -E "  time |achieved  |predicted  " "$log"
  done
done
