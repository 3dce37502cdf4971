#!/usr/bin/env bash
# A queue of experiment jobs on one GPU machine, each under its own time limit, every result
# archived after each job.
#
#   bash launch/device_jobs.sh SECONDS 'python -m experiments.attnres' [SECONDS 'command' ...]
#
# For a machine whose results come back as one archive (a cloud VM, a batch-queue node) and
# for any single-GPU box. Environment variables:
# OUT, the folder the archive goes to (default /tmp/device_out); RESULTS, the results root the
# jobs write to (default /tmp/device_results). The script
#
# * installs the wheels found in `.whl/*.whl` (e.g. grain, fla-core), if any, into /tmp/site and
#   stops at once if that fails or `grain` does not import (a job without its dependencies would
#   fail anyway);
# * runs each command ALONE on the GPU (sequentially: experiments sharing one GPU slow each other
#   down — three at once each ran at about half speed) under `timeout SECONDS`, with
#   `--out $RESULTS` appended (unless the command names its own `--out`, e.g.
#   `--out $RESULTS/mqar_L128` to keep two calls of one experiment apart: RESULTS is exported to
#   the jobs), its log in `$RESULTS/logs/`;
# * archives `$RESULTS` as `$OUT/results.tgz` after every job, so a run stopped by its time limit
#   still leaves what finished (partial JSONs included), and prints each job's exit status, wall
#   time and last lines.
#
# SKIP_WHEELS=1 skips the install (a machine that has the packages, e.g. a test run on the CPU).
# Environment set for every job: PYTHONPATH (wheels + repo), PYTHONUNBUFFERED=1,
# XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (see docs/results.md: compile time). Give a job its
# own variables inline: 600 'XLA_PYTHON_CLIENT_MEM_FRACTION=.95 python -m experiments.decode_scaling'.
# Keep the sum of SECONDS (+ ~30 s of start-up) inside any limit the whole run has.
set -u
if [ $# -lt 2 ] || [ $(($# % 2)) -ne 0 ]; then
    echo "usage: bash launch/device_jobs.sh SECONDS 'command' [SECONDS 'command' ...]" >&2
    exit 2
fi
n=0
for arg in "$@"; do  # every job's limit checked before the first job runs
    n=$((n + 1))
    if [ $((n % 2)) -eq 1 ] && ! timeout "$arg" true 2> /dev/null; then
        echo "device_jobs: job $(((n + 1) / 2)): SECONDS must be a duration timeout(1) takes (e.g. 600, 10m), got '$arg'" >&2
        exit 2
    fi
done
OUT=${OUT:-/tmp/device_out}
RESULTS=${RESULTS:-/tmp/device_results}
mkdir -p "$OUT" "$RESULTS/logs"
export RESULTS

if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device_jobs: wheel install failed" >&2; exit 3; }
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_FLAGS=${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false}
python3 -c "import grain, jax; print('device_jobs: jax', jax.__version__, jax.devices())" \
    || { echo "device_jobs: grain/jax do not import (are their wheels in .whl/?)" >&2; exit 3; }
git rev-parse HEAD > "$RESULTS/git_head.txt" 2>/dev/null
git status --porcelain --untracked-files=no > "$RESULTS/git_status.txt" 2>/dev/null

summary="$RESULTS/summary.txt"
: > "$summary"
i=0
while [ $# -gt 0 ]; do
    secs=$1 cmd=$2
    shift 2
    i=$((i + 1))
    log="$RESULTS/logs/job$i.log"
    case " $cmd " in
        *" --out "* | *" --out="*) full=$cmd ;;  # the job chose its own output root
        *) full="$cmd --out $RESULTS" ;;
    esac
    echo "== job $i (limit ${secs}s): $full" | tee -a "$summary"
    t0=$(date +%s)
    timeout "$secs" bash -c "$full" > "$log" 2>&1
    rc=$?
    echo "   rc=$rc wall=$(( $(date +%s) - t0 ))s$([ $rc -eq 124 ] && echo ' (cut by its limit)')" | tee -a "$summary"
    tar czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
done
for f in "$RESULTS"/logs/job*.log; do
    echo "---- $f (last lines)"
    tr '\r' '\n' < "$f" | grep -v '^\s*$' | tail -n 25
done
echo "==== summary"
cat "$summary"
