#!/usr/bin/env bash
# Train on the GPUs of one node (one process drives all local GPUs), or on several
# nodes (one process per node, joined by jax.distributed).
#
#   launch/multi_gpu.sh [--gpus 0,1,2,3] [--nodes N --node-rank R --coordinator HOST:PORT] -- TRAIN ARGS...
#
# One node, 4 GPUs, expert parallel:
#   launch/multi_gpu.sh --gpus 0,1,2,3 -- --config tiny_k3 --steps 1000 --workdir runs/k3 --mesh expert=4
# Two nodes of 8 GPUs (run on each, with its rank; --mesh is one node's shape, --mesh-dcn the axes that
# cross nodes):
#   launch/multi_gpu.sh --nodes 2 --node-rank 0 --coordinator 10.0.0.1:1234 -- --config ... --mesh expert=8 --mesh-dcn data=2
set -euo pipefail

die() { echo "multi_gpu.sh: $*" >&2; exit 2; }
gpus="" nodes=1 rank=0 coordinator=""
while (( $# > 0 )); do
  case "$1" in
    --gpus) gpus=${2:?--gpus needs a list like 0,1,2,3}; shift 2 ;;
    --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
    --node-rank) rank=${2:?--node-rank needs a number}; shift 2 ;;
    --coordinator) coordinator=${2:?--coordinator needs HOST:PORT}; shift 2 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (see the header of this script)" ;;
  esac
done
(( $# > 0 )) || die "give training arguments after --, e.g. -- --config tiny_kda --steps 100 --workdir runs/x"
[[ "$nodes" =~ ^[0-9]+$ && "$rank" =~ ^[0-9]+$ ]] || die "--nodes and --node-rank must be integers"
nodes=$((10#$nodes)) rank=$((10#$rank))  # decimal, leading zeros and all (bash reads 08 as octal)
(( nodes >= 1 )) || die "--nodes must be at least 1, got $nodes"
(( rank < nodes )) || die "--node-rank $rank must be < --nodes $nodes"

[[ -n "$gpus" ]] && export CUDA_VISIBLE_DEVICES="$gpus"
# NVLink multicast is off by default (NCCL_NVLS_ENABLE=0); set it to 1 on hosts that support it.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
if (( nodes > 1 )); then
  [[ -n "$coordinator" ]] || die "--coordinator HOST:PORT is required with --nodes > 1"
  # Read by lineage_jax.parallel.maybe_initialize_distributed().
  export JAX_COORDINATOR_ADDRESS="$coordinator" JAX_NUM_PROCESSES="$nodes" JAX_PROCESS_ID="$rank"
fi
exec python3 -m lineage_jax.train "$@"
