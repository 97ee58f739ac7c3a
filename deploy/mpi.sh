#!/bin/bash
# zrun in per-node mode under mpirun (Open MPI): one zrun per node, each taking
# its node rank and the number of nodes from OMPI_COMM_WORLD_RANK / _SIZE.
# Not run in CI (no MPI cluster there); tests/pernode.rs runs the same mode on
# loopback.
#   deploy/mpi.sh HOSTFILE JOB.yaml [WORKERS_PER_NODE]
# HOSTFILE is Open MPI's (`node1 slots=1` per line: one zrun per node). The
# first host of the hostfile is node 0, the job's control plane.
set -euo pipefail
hostfile=$1 job=$2 per_node=${3:-2}
nodes=$(grep -cv '^\s*\(#\|$\)' "$hostfile")
master=$(grep -v '^\s*\(#\|$\)' "$hostfile" | head -n1 | awk '{print $1}')
# Every node needs the same token; -x passes it through mpirun's environment,
# never on a command line.
export ZRUN_TOKEN=${ZRUN_TOKEN:-$(openssl rand -hex 32)}
exec mpirun --hostfile "$hostfile" -np "$nodes" --map-by ppr:1:node \
  -x ZRUN_TOKEN -x MASTER_ADDR="$master" -x MASTER_PORT=29500 \
  zrun train "$job" --nnodes "$nodes" --workers-per-node "$per_node" --no-progress
