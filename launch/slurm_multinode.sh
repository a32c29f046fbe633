#!/usr/bin/env bash
# Multi-node rStar2-Agent run as one SLURM heterogeneous job:
#   group 0: trainer nodes (jax.distributed, one process per node, all local GPUs)
#   group 1: SGLang generator nodes (one server per node, TP over the node's GPUs) + sglang-router
#   group 2: sandbox CPU nodes (one sandbox_service per node)
#
#   sbatch launch/slurm_multinode.sh configs/stage1.py
#
#SBATCH --job-name=rstar2-agent
#SBATCH --nodes=4 --gpus-per-node=8 --exclusive
#SBATCH hetjob
#SBATCH --nodes=4 --gpus-per-node=8 --exclusive
#SBATCH hetjob
#SBATCH --nodes=2 --exclusive
set -euo pipefail
CONFIG=${1:-configs/stage1.py}
RUN_DIR=${RUN_DIR:-$PWD/runs/${SLURM_JOB_ID}}
SGLANG_PORT=30000
SANDBOX_PORT=50051
mkdir -p "$RUN_DIR"   # on a filesystem every node sees (checkpoints, HF exports for the servers)

gen_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")
sbx_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_2")

# Generators start from the initial policy; the trainer pushes new weights after every update.
INIT_HF=${INIT_HF:?set INIT_HF to the Hugging Face directory of the starting policy}
srun --het-group=1 --ntasks-per-node=1 bash -c "
  python -m sglang.launch_server --model-path '$INIT_HF' --host 0.0.0.0 --port $SGLANG_PORT \
    --tp \$SLURM_GPUS_ON_NODE --skip-tokenizer-init --sampling-defaults openai \
    --mem-fraction-static 0.85 --enable-metrics" >"$RUN_DIR/sglang.log" 2>&1 &

srun --het-group=2 --ntasks-per-node=1 bash -c "
  python -m sandbox_service --host 0.0.0.0 --port $SANDBOX_PORT --workers \$(nproc)" \
  >"$RUN_DIR/sandbox.log" 2>&1 &

servers=$(for h in $gen_nodes; do printf 'http://%s:%s,' "$h" "$SGLANG_PORT"; done)
sandboxes=$(for h in $sbx_nodes; do printf '%s:%s,' "$h" "$SANDBOX_PORT"; done)

# The host-side KV-aware scheduler talks to every server directly (the router has no KV admission
# control); start sglang-router only for ad-hoc evaluation traffic.
python -m sglang_router.launch_router --worker-urls ${servers//,/ } --policy cache_aware \
  --host 0.0.0.0 --port 30100 >"$RUN_DIR/router.log" 2>&1 &

# One trainer process per node; rstar_jax.launch calls jax.distributed.initialize() when SLURM
# starts more than one task (JAX reads the coordinator and ranks from SLURM's environment).
export JAX_COORDINATOR_PORT=12355
srun --het-group=0 --ntasks-per-node=1 \
  python -m rstar_jax.launch --config="$CONFIG" \
    --config.run_dir="$RUN_DIR" \
    --config.rollout.backend=sglang \
    --config.rollout.servers="${servers%,}" \
    --config.sandbox.launch_local=False \
    --config.sandbox.targets="${sandboxes%,}"
