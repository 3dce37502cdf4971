#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: create it, install this repository on every worker,
# run the same command on all workers (JAX initialises multi-host itself), fetch
# the run's --workdir from worker 0 (also when the run fails), delete the slice.
#
#   launch/tpu_vm.sh create|install|run|fetch|delete|all [-- TRAIN ARGS...]
#   (fetch takes the training arguments too, for their --workdir; default runs/)
#
# Settings (environment):
#   TPU_NAME          slice name                       (default: lineage-$USER)
#   ZONE              e.g. us-east5-a (v5p), us-west4-a (v5e), us-east1-d (v6e)   (required)
#   ACCELERATOR_TYPE  e.g. v5p-32, v5litepod-16, v6e-8  (default: v5litepod-8)
#   RUNTIME_VERSION   TPU VM image                     (default: v2-alpha-tpuv5-lite; v5p: v2-alpha-tpuv5, v6e: v2-alpha-tpuv6e)
#   PROJECT           gcloud project                   (default: gcloud's configured project)
#   SPOT              1 to request spot capacity       (default: 0)
#   REMOTE_DIR        checkout path on the workers     (default: lineage_jax)
#   FETCH_DIR         where fetch copies the workdir   (default: runs_remote/ in this repository)
#
# A slice of one host (v5litepod-8, v6e-8) can train in a --workdir on that host's disk. A slice of several
# hosts (v5p-32: 4) needs a --workdir that every worker shares (a Filestore or gcsfuse mount): each writes its
# share of every checkpoint there, and the run refuses a directory each worker has to itself.
#
# Example: ZONE=us-east5-a ACCELERATOR_TYPE=v5p-32 RUNTIME_VERSION=v2-alpha-tpuv5 \
#   launch/tpu_vm.sh all -- --config tiny_k3 --steps 1000 --workdir /mnt/shared/runs/k3 --mesh fsdp=4,expert=4
set -euo pipefail

TPU_NAME=${TPU_NAME:-lineage-${USER:-user}}
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v5litepod-8}
RUNTIME_VERSION=${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}
REMOTE_DIR=${REMOTE_DIR:-lineage_jax}
SPOT=${SPOT:-0}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FETCH_DIR=${FETCH_DIR:-$REPO_ROOT/runs_remote}

die() { echo "tpu_vm.sh: $*" >&2; exit 2; }
[[ -n "${ZONE:-}" ]] || die "set ZONE (e.g. ZONE=us-east5-a)"
command -v gcloud >/dev/null || die "gcloud is not installed (https://cloud.google.com/sdk)"

gcloud_tpu() {
  local project_args=()
  [[ -n "${PROJECT:-}" ]] && project_args=(--project "$PROJECT")
  gcloud compute tpus tpu-vm "$@" --zone "$ZONE" "${project_args[@]}"
}

create() {
  local extra=()
  [[ "$SPOT" == "1" ]] && extra=(--spot)
  gcloud_tpu create "$TPU_NAME" --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION" "${extra[@]}"
}

install() {
  local archive
  archive=$(mktemp -d)/lineage_jax.tar.gz
  git -C "$REPO_ROOT" archive --format=tar.gz -o "$archive" HEAD
  gcloud_tpu scp "$archive" "$TPU_NAME:lineage_jax.tar.gz" --worker=all
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command \
    "mkdir -p $REMOTE_DIR && tar -xzf lineage_jax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR && python3 -m pip install -q -e '.[tpu]'"
}

run() {
  (( $# > 0 )) || die "run needs training arguments after --, e.g. -- --config tiny_k3 --steps 100 --workdir runs/x"
  local quoted
  quoted=$(printf '%q ' "$@")
  # Same command on every worker; jax.distributed.initialize() auto-detects the TPU slice.
  gcloud_tpu ssh "$TPU_NAME" --worker=all --command "cd $REMOTE_DIR && python3 -m lineage_jax.train $quoted"
}

workdir_of() {  # the --workdir among the training arguments (default: runs)
  local dir=runs prev=""
  for a in "$@"; do
    [[ "$prev" == "--workdir" ]] && dir=$a
    [[ "$a" == --workdir=* ]] && dir=${a#--workdir=}
    prev=$a
  done
  echo "$dir"
}

fetch() {
  local dir src
  dir=$(workdir_of "$@")
  if [[ "$dir" == /* ]]; then src=$dir; else src=$REMOTE_DIR/$dir; fi
  mkdir -p "$FETCH_DIR"
  gcloud_tpu scp --recurse "$TPU_NAME:$src" "$FETCH_DIR/" --worker=0
  echo "fetched $src into $FETCH_DIR"
}

delete() {
  gcloud_tpu delete "$TPU_NAME" --quiet
}

cmd=${1:-}
[[ -n "$cmd" ]] || die "usage: tpu_vm.sh create|install|run|fetch|delete|all [-- TRAIN ARGS...]"
shift
[[ "${1:-}" == "--" ]] && shift
case "$cmd" in
  create) create ;;
  install) install ;;
  run) run "$@" ;;
  fetch) fetch "$@" ;;
  delete) delete ;;
  all)
    create
    trap delete EXIT
    install
    rc=0
    run "$@" || rc=$?
    # what the run wrote comes back before the slice goes, whether the run finished or not
    fetch "$@" || { echo "tpu_vm.sh: fetch failed" >&2; (( rc != 0 )) || rc=1; }
    exit "$rc"
    ;;
  *) die "unknown command '$cmd' (create|install|run|fetch|delete|all)" ;;
esac
