#!/usr/bin/env bash
# One GPU node: a sandbox server on this host's CPUs and the trainer with the in-process JAX engine.
#
#   CONFIG=configs/stage1.py RUN_DIR=runs/stage1 bash launch/single_node_gpu.sh [--config.a.b=v ...]
set -euo pipefail
CONFIG=${CONFIG:-configs/stage1.py}
RUN_DIR=${RUN_DIR:-runs/$(basename "${CONFIG%.py}")}
SANDBOX_PORT=${SANDBOX_PORT:-50051}
SANDBOX_WORKERS=${SANDBOX_WORKERS:-$(( $(nproc) - 4 ))}
mkdir -p "$RUN_DIR"

python -m sandbox_service --host 127.0.0.1 --port "$SANDBOX_PORT" --workers "$SANDBOX_WORKERS" \
  >"$RUN_DIR/sandbox.log" 2>&1 &
SANDBOX_PID=$!
trap 'kill $SANDBOX_PID 2>/dev/null || true' EXIT

export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.92}
python -m rstar_jax.launch --config="$CONFIG" \
  --config.run_dir="$RUN_DIR" \
  --config.sandbox.launch_local=False \
  --config.sandbox.targets="127.0.0.1:$SANDBOX_PORT" \
  "$@"
