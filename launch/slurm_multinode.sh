#!/usr/bin/env bash
# Multi-node rStar2-Agent run as one SLURM heterogeneous job (the paper's 64 GPUs: 4 + 4 nodes x 8):
#   group 0: trainer nodes: one JAX process per node over all 8 local GPUs (jax.distributed)
#   group 1: generator nodes: two SGLang servers per node, TP 4 each (as the release ran them)
#   group 2: sandbox CPU nodes: one sandbox_service per node
#
#   INIT_HF=runs/sft/hf/final sbatch launch/slurm_multinode.sh configs/stage1.py [--config.a.b=v ...]
#
# Logs: $RUN_DIR/logs/<role>-<node>-<task>.log, one file per node and task.
#SBATCH --job-name=rstar2-agent
#SBATCH --nodes=4 --gpus-per-node=8 --exclusive
#SBATCH hetjob
#SBATCH --nodes=4 --gpus-per-node=8 --exclusive
#SBATCH hetjob
#SBATCH --nodes=2 --exclusive
set -euo pipefail
CONFIG=${1:-configs/stage1.py}
shift || true
RUN_DIR=${RUN_DIR:-$PWD/runs/${SLURM_JOB_ID}}
INIT_HF=${INIT_HF:?set INIT_HF to the Hugging Face directory of the starting policy}
SGLANG_PORT=30000        # servers on a node listen on SGLANG_PORT + i
SERVERS_PER_NODE=2
TP=4                     # GPUs per server: 8 / SERVERS_PER_NODE
SANDBOX_PORT=50051
LOGS="$RUN_DIR/logs"
mkdir -p "$LOGS"          # on a filesystem every node sees (checkpoints, HF exports for the servers)

gen_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")
sbx_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_2")

# Generators start from the initial policy; the trainer loads every update into them. Seeded
# sampling (rollout.seeded_sampling, on by default) needs SGLang's deterministic inference: without
# it SGLang ignores sampling_seed and a resumed run does not repeat the interrupted one.
srun --het-group=1 --ntasks-per-node=1 --output="$LOGS/sglang-%N-%t.log" bash -c "
  for i in \$(seq 0 $((SERVERS_PER_NODE - 1))); do
    gpus=\$(seq -s, \$((i * $TP)) \$((i * $TP + $TP - 1)))
    CUDA_VISIBLE_DEVICES=\$gpus HIP_VISIBLE_DEVICES=\$gpus python -m sglang.launch_server \
      --model-path '$INIT_HF' --host 0.0.0.0 --port \$(($SGLANG_PORT + i)) --tp $TP \
      --skip-tokenizer-init --sampling-defaults openai --mem-fraction-static 0.85 --enable-metrics \
      --enable-deterministic-inference --attention-backend triton &
  done
  wait" &

# The sandbox listens on the cluster network without authentication: keep these nodes on a
# private network the job owns.
srun --het-group=2 --ntasks-per-node=1 --output="$LOGS/sandbox-%N-%t.log" bash -c "
  python -m sandbox_service --host 0.0.0.0 --port $SANDBOX_PORT --workers \$(nproc)" &

servers=$(for h in $gen_nodes; do for i in $(seq 0 $((SERVERS_PER_NODE - 1))); do
  printf 'http://%s:%s,' "$h" $((SGLANG_PORT + i)); done; done)
sandboxes=$(for h in $sbx_nodes; do printf '%s:%s,' "$h" "$SANDBOX_PORT"; done)

# One trainer process per node over the node's 8 GPUs. rstar_jax.launch joins jax.distributed when
# SLURM starts more than one task; JAX's SLURM detection would give each process only the GPU of
# its SLURM_LOCALID, so JAX_LOCAL_DEVICE_IDS names all of them. The trainer waits until every
# server answers /health_generate and every sandbox Info (rollout.ready_timeout_s) before its first
# step; a process that fails ends the job (the others stop within JAX_HEARTBEAT_TIMEOUT_S).
export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7 JAX_HEARTBEAT_TIMEOUT_S=${JAX_HEARTBEAT_TIMEOUT_S:-120}
status=0
srun --het-group=0 --ntasks-per-node=1 --kill-on-bad-exit=1 --output="$LOGS/trainer-%N-%t.log" \
  python -m rstar_jax.launch --config="$CONFIG" \
    --config.run_dir="$RUN_DIR" \
    --config.rollout.backend=sglang \
    --config.rollout.servers="${servers%,}" \
    --config.sandbox.launch_local=False \
    --config.sandbox.targets="${sandboxes%,}" \
    "$@" || status=$?
scancel "$SLURM_JOB_ID" 2>/dev/null || true   # generators and sandboxes end with the trainer
exit $status
