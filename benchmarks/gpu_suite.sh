#!/usr/bin/env bash
# The GPU figures in one command that fits one 10-minute call on a machine with one NVIDIA GPU:
# the gpu-marked tests; the train step for Qwen3-1.7B at 4 x 4096 bf16 beside the PyTorch peer;
# JaxEngine decode for Qwen3-1.7B at batch 64 beside HF generate and the roofline; the compiled
# memory of the chunked log-prob head against the naive head at V=151,936, T=8,192. Every figure is
# printed beside its baseline from the same run; the log and one JSON per benchmark go to $OUT.
#
#   bash benchmarks/gpu_suite.sh --prepare   # here, with PyPI: .whl/ gets what the GPU image lacks
#                                            # (Python 3.12 manylinux wheels) and this project's wheel
#   bash benchmarks/gpu_suite.sh             # on the GPU machine, .whl/ carried beside the tree
#   bash benchmarks/gpu_suite.sh --profile   # also profiler traces of the train step and decode, and
#                                            # their summaries (benchmarks/profile_summary.py); rejoin
#                                            # a trace with `cat profile_decode.tgz.* | tar xz`
#   bash benchmarks/gpu_suite.sh --sweep     # instead: train-step variants (remat, micro-batches, chunk,
#                                            # parameter dtype, attention), ours only, one line each
#   bash benchmarks/gpu_suite.sh --async     # instead: asynchronous RL's wall-clock beside the synchronous
#                                            # loop's on the device (benchmarks/async_wallclock.py: the tiny
#                                            # recipe, in-process engine, then one serve process beside it)
#   bash benchmarks/gpu_suite.sh --decode    # instead: decode alone, this tree and, when .baseline/ holds
#                                            # another (`--prepare --baseline REV` puts `git archive REV`
#                                            # there; carry it beside .whl), that one in the same call
#   bash benchmarks/gpu_suite.sh --decode-xla # instead: decode's attention, the XLA path beside the Pallas
#                                            # paged-attention kernel (benchmarks/decode_attention.py);
#                                            # then decode alone under XLA:GPU flag variants, alternately:
#                                            # dynamic-slice fusion (cuBLAS reads each layer's weights
#                                            # in place of the scan's per-layer copies), Triton GEMMs off
#   bash benchmarks/gpu_suite.sh --layer-layout # instead: the engine's two layer layouts
#                                            # (rollout.engine.layer_layout), alternately: decode for
#                                            # Qwen3-1.7B at batch 64, tokens/s and % of roofline, with the
#                                            # stacked weights' scan and with per-layer weights unrolled;
#                                            # then both layouts' compile seconds and counts, step time,
#                                            # weight-sync cost and the decode program's dynamic slices
#                                            # (benchmarks/engine_layer_layout.py). The lease's call:
#                                            #   run(command="bash benchmarks/gpu_suite.sh --layer-layout",
#                                            #       carry=[".whl"], timeout_s=600)
#                                            # after `bash benchmarks/gpu_suite.sh --prepare` here; check it
#                                            # first with `bash benchmarks/gpu_suite.sh --layer-layout --smoke`
#   bash benchmarks/gpu_suite.sh --decode-attention # instead: the engine's two decode attentions
#                                            # (rollout.engine.decode_attention), alternately: decode for
#                                            # Qwen3-1.7B at batch 64, tokens/s and % of roofline, with the
#                                            # XLA path and with the Pallas paged-attention kernel over the
#                                            # heads-first pool; then the kernel alone against the XLA path
#                                            # for one layer (benchmarks/decode_attention.py); a second
#                                            # decode round where the deadline allows; the last line is
#                                            # engine_pallas_vs_xla=X.XX. Needs no .whl; the lease's call:
#                                            #   run(command="bash benchmarks/gpu_suite.sh --decode-attention",
#                                            #       timeout_s=600)
#   bash benchmarks/gpu_suite.sh --train-variants # instead: the train step (ours only) under the remat
#                                            # policies that keep named activations, each variant whose
#                                            # compiled memory on CPU (benchmarks/train_step_memory.py, its
#                                            # GPU estimate; RESULTS.md 2026-12-02) fits 30 GiB, after the
#                                            # baseline of the same parameter dtype: tokens/s, MFU and peak
#                                            # memory beside the plain-JAX reference's figures. The lease's call:
#                                            #   run(command="bash benchmarks/gpu_suite.sh --train-variants",
#                                            #       carry=[".whl"], timeout_s=600)
#   bash benchmarks/gpu_suite.sh --smoke     # CPU-sized shapes, to check the suite itself anywhere
#
# Each part has its own time limit inside an overall deadline (GPU_SUITE_SECONDS, default 570 s),
# so a part that hangs costs its own slot and the rest still report.
set -uo pipefail
cd "$(dirname "$0")/.."

# What the GPU image lacks (its package list: the device tool's KINDS.md), at the versions Python
# 3.12 resolves for this project; --no-deps, so each one's own needs are named too.
# grpcio-tools compiles the sandbox's proto at import (the image has grpcio 1.84 but not the tools),
# and needs protobuf >= 7.35, newer than the image's.
WHEELS=(grain==0.2.18 array-record==0.8.6 ml-collections==1.1.0 math-verify==0.9.0
        latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 portpicker==1.6.0 tensorboardX==2.6.5
        grpcio-tools==1.84.0 protobuf==7.36.2)

if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    if [[ "${2:-}" == "--baseline" ]]; then
        rm -rf .baseline && mkdir -p .baseline
        git archive "${3:?--baseline takes a revision}" | tar -x -C .baseline
        echo "baseline tree: $(git rev-parse --short "$3") in .baseline/"
    fi
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
    python3 -m pip wheel -q --no-deps -w .whl .
    du -sh .whl && ls .whl
    exit 0
fi

SMOKE=0 PROFILE=0 SWEEP=0 ASYNC=0 DECODE_ONLY=0 DECODE_XLA=0 LAYER_LAYOUT=0 DECODE_ATTENTION=0 TRAIN_VARIANTS=0
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        --profile) PROFILE=1 ;;
        --sweep) SWEEP=1 ;;
        --async) ASYNC=1 ;;
        --decode) DECODE_ONLY=1 ;;
        --decode-xla) DECODE_XLA=1 ;;
        --layer-layout) LAYER_LAYOUT=1 ;;
        --decode-attention) DECODE_ATTENTION=1 ;;
        --train-variants) TRAIN_VARIANTS=1 ;;
        *) echo "gpu_suite.sh: unknown argument $arg (--prepare, --smoke, --profile, --sweep, --async, --decode, --decode-xla, --layer-layout, --decode-attention, --train-variants)" >&2; exit 2 ;;
    esac
done

OUT="${OUT:-$PWD/gpu_suite_out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_suite.log") 2>&1
TEE_PID=$!
# The log is complete before the command returns (and $OUT is collected).
trap 'exec 1>&- 2>&-; wait "$TEE_PID"' EXIT
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_suite_site \
        .whl/*.whl || { echo "gpu_suite: installing .whl/ failed"; exit 1; }
    export PYTHONPATH="/tmp/gpu_suite_site${PYTHONPATH:+:$PYTHONPATH}"
fi

DEADLINE=$(( $(date +%s) + ${GPU_SUITE_SECONDS:-570} ))
FAILED=()
# part NAME SECONDS COMMAND...: runs COMMAND under the smaller of SECONDS and the time left.
part() {
    local name="$1" budget="$2"; shift 2
    local left=$(( DEADLINE - $(date +%s) - 5 ))
    (( left < budget )) && budget=$left
    echo; echo "=== $name (limit ${budget}s) ==="
    if (( budget < 10 )); then echo "skipped: the suite's deadline is reached"; FAILED+=("$name"); return; fi
    local start=$SECONDS
    timeout --kill-after=10 "$budget" "$@"
    local rc=$?
    echo "--- $name: exit $rc after $(( SECONDS - start ))s"
    (( rc != 0 )) && FAILED+=("$name")
}

if (( SMOKE )); then
    TRAIN=(--preset small --batch 4 --length 128 --steps 2)
    DECODE=(--preset tiny --batch 8 --prompt 32 --new 16)
    HEAD=(--vocab 8192 --length 1024 --hidden 256)
    LAYOUTS=(--preset tiny --layers 2,4 --batch 4 --prompt 16 --new 8 --repeats 1)
else
    TRAIN=(--preset qwen3-1.7b --batch 4 --length 4096 --steps 5)
    DECODE=(--preset qwen3-1.7b --batch 64 --prompt 512 --new 256 --dtype bfloat16)
    HEAD=()
    LAYOUTS=(--preset qwen3-1.7b --dtype bfloat16 --batch 64 --prompt 512 --new 32 --repeats 2)
fi
(( PROFILE )) && TRAIN+=(--profile /tmp/gpu_suite_profile_train) && DECODE+=(--profile /tmp/gpu_suite_profile_decode)

if (( ASYNC )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'"
    ASYNC_STEPS=$(( SMOKE ? 2 : 6 ))
    part "async colocated" 300 "$PY" benchmarks/async_wallclock.py --steps "$ASYNC_STEPS" --out /tmp/gpu_suite_async
    part "async servers" 240 "$PY" benchmarks/async_wallclock.py --steps "$ASYNC_STEPS" --servers 1 --out /tmp/gpu_suite_async
    cp /tmp/gpu_suite_async/async_wallclock*.json "$OUT/" 2>/dev/null
    echo; grep -E "^(=== async|K=|async_vs_sync_wall)" "$OUT/gpu_suite.log"
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

if (( DECODE_ONLY )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'"
    # Both trees measured by this tree's benchmark (same admission, compilations counted), each
    # importing its own package (the script puts its tree first on the path); alternately, so that
    # a drifting host (decode is host-bound there) weighs on both alike.
    [[ -d .baseline ]] && cp benchmarks/decode_throughput.py benchmarks/ceilings.py .baseline/benchmarks/
    for round in 1 2; do
        part "decode, this tree ($round)" 150 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf
        if [[ -d .baseline ]]; then
            part "decode, .baseline ($round)" 150 "$PY" .baseline/benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf
        fi
    done
    echo; grep -E "^(=== decode|JaxEngine:|roofline:)" "$OUT/gpu_suite.log"
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

if (( DECODE_XLA )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'"
    # The H100 profile at 72fbfd0: 19% of decode's device time copies each layer's weights out of
    # the scan's stacked parameters (dynamic slices become memcpys) before the Triton GEMMs read them.
    # Dynamic-slice fusion lets library GEMMs (cuBLAS) read the slice in place, so it is tried with
    # and without Triton GEMMs; XLA_FLAGS names each variant in the log.
    # The other 44%: the attention's reductions (0.9 TB/s for K) beside the kernel that reads the
    # pages in place.
    ATTENTION=(--json "$OUT/decode_attention.json")
    (( SMOKE )) && ATTENTION+=(--smoke)
    part "decode attention" 90 "$PY" benchmarks/decode_attention.py "${ATTENTION[@]}"
    VARIANTS=("" "--xla_gpu_enable_dynamic_slice_fusion=true"
              "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false"
              "--xla_gpu_enable_triton_gemm=false")
    for round in 1 2; do
        for flags in "${VARIANTS[@]}"; do
            part "decode, XLA_FLAGS='$flags' ($round)" 100 env XLA_FLAGS="$flags" "$PY" \
                benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf
        done
    done
    echo; grep -E "^(=== decode|JaxEngine:|limit:|xla:|pallas|pallas_vs_xla)" "$OUT/gpu_suite.log"
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

if (( LAYER_LAYOUT )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'; git log -1 --oneline 2>/dev/null || true"
    # The scan over stacked weights copies each layer's 7 weight matrices every decode step (19% of an
    # H100's step at 72fbfd0); the per-layer layout has nothing to slice. Decode first, one run per
    # layout, then the layouts' compile cost and the weight sync's per-layer cut. Limits: the unrolled
    # programs compile longer (2.4-3.2x at 28 layers on CPU), and engine_layer_layout.py compiles each
    # decode program once more for its HLO counts.
    part "decode, layer layout stacked (1)" 100 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
        --layer-layout stacked
    part "decode, layer layout per_layer (1)" 150 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
        --layer-layout per_layer
    part "layer layouts: compile, step, sync" 210 "$PY" benchmarks/engine_layer_layout.py "${LAYOUTS[@]}" \
        --json "$OUT/engine_layer_layout.json"
    # A second round where the deadline leaves room for both (a drifting host weighs on both alike).
    if (( DEADLINE - $(date +%s) > 260 )); then
        part "decode, layer layout stacked (2)" 100 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
            --layer-layout stacked
        part "decode, layer layout per_layer (2)" 150 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
            --layer-layout per_layer
    fi
    echo; grep -E "^(=== decode|=== layer|device:|JaxEngine:|roofline:|engine layer|layers|per_layer_vs_stacked| +[0-9]+ (stacked|per_layer) )" \
        "$OUT/gpu_suite.log"
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

if (( DECODE_ATTENTION )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'; git log -1 --oneline 2>/dev/null || true"
    # The H100 profile at 72fbfd0: 44% of decode's device time in the XLA path's attention reductions
    # (0.9 TB/s for K). decode_attention=pallas reads the pages in place with the Pallas kernel (its
    # Triton compile makes the first program slower to build: a longer limit). The engine's figure
    # first, one run each; then the kernel alone; a second round where the deadline leaves room.
    export OUT  # decode_throughput.py writes its JSON there: the ratio at the end reads them
    ATTENTION=(--json "$OUT/decode_attention.json")
    (( SMOKE )) && ATTENTION+=(--smoke)
    part "decode, decode attention xla (1)" 100 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
        --decode-attention xla
    part "decode, decode attention pallas (1)" 150 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
        --decode-attention pallas
    part "decode attention, one layer" 90 "$PY" benchmarks/decode_attention.py "${ATTENTION[@]}"
    if (( DEADLINE - $(date +%s) > 260 )); then
        part "decode, decode attention xla (2)" 100 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
            --decode-attention xla
        part "decode, decode attention pallas (2)" 150 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}" --no-hf \
            --decode-attention pallas
    fi
    echo; grep -E "^(=== decode|device:|JaxEngine:|roofline:|limit:|xla:|pallas|pallas_vs_xla)" "$OUT/gpu_suite.log"
    # The engine's ratio from the last run of each (decode_throughput.py writes its JSON to $OUT).
    "$PY" - "$OUT" <<'PYEOF'
import glob, json, os, sys
runs = {}
for path in glob.glob(os.path.join(sys.argv[1], "decode_*_B*.json")):
    with open(path) as f:
        result = json.load(f)
    if result["args"].get("layer_layout", "stacked") == "stacked":  # another mode's runs may share $OUT
        runs[result["args"].get("decode_attention", "xla")] = result["tokens_per_s"]
if {"xla", "pallas"} <= set(runs):
    print(f"engine_pallas_vs_xla={runs['pallas'] / runs['xla']:.2f}")
else:
    print(f"engine_pallas_vs_xla: missing runs ({sorted(runs)})")
PYEOF
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

if (( TRAIN_VARIANTS )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'; git log -1 --oneline 2>/dev/null || true"
    echo "plain JAX reference (../shared/bench/README.md; one H100, 2026-11-22; Qwen3-1.7B, 4 x 4096, bf16 weights,"
    echo "  cuDNN attention, per-layer remat, no optimizer named): 35.7K tokens/s, MFU 42.3%, 30 GiB with nothing"
    echo "  saved across the remat boundary; 38.7K tokens/s, MFU 45.9%, 46 GiB with the matmul outputs saved"
    # GPU estimates from the CPU plan (train_step_memory.py): bf16 parameters (and AdamW moments) with
    # remat full 17.9 GiB (measured), save_qkv_attention 23.2, offload_mlp 23.4, save_attention 19.7,
    # offload_named 18.2; fp32 parameters with offload_named 29.9. The baseline first, so that a
    # deadline cuts variants rather than the figure they are read against; remat full with fp32
    # parameters (29.6 GiB measured) last. Second, bf16 parameters with an fp32 master copy in the
    # optimizer state (optim.master_weights; AdamW's moments fp32 too): the GPU estimate is the bf16
    # baseline plus that state (RESULTS.md, the train step's variants).
    for variant in "--param-dtype bfloat16 --remat full" "--param-dtype bfloat16 --master-weights float32 --remat full" \
                   "--param-dtype bfloat16 --remat save_qkv_attention" \
                   "--param-dtype bfloat16 --remat offload_mlp" "--param-dtype bfloat16 --remat save_attention" \
                   "--param-dtype bfloat16 --remat offload_named" "--remat offload_named" "--remat full"; do
        # shellcheck disable=SC2086  # the variant is several words on purpose
        part "train-step $variant" 90 "$PY" benchmarks/train_step.py "${TRAIN[@]}" --no-peer $variant
    done
    echo; grep -E "^(plain JAX|  cuDNN|  saved|=== train-step|ours :)" "$OUT/gpu_suite.log"
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

if (( SWEEP )); then
    part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'"
    # Most telling first (a short lease's deadline cuts the tail): the remat policy and the parameter
    # dtype decide the MFU and 30 GiB goals; the default (remat full) is the suite's own train-step.
    for variant in "--remat dots_no_batch" "--param-dtype bfloat16" "--micro-batches 2" "--chunk 2048" \
                   "--attention xla --micro-batches 4" "--micro-batches 4" "--chunk 512" "--remat full"; do
        # shellcheck disable=SC2086  # the variant is several words on purpose
        part "train-step $variant" 120 "$PY" benchmarks/train_step.py "${TRAIN[@]}" --no-peer $variant
    done
    echo; grep -E "^(=== train-step|ours :)" "$OUT/gpu_suite.log"
    if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
    exit 0
fi

part environment 30 bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi'; $PY -c 'import sys, jax, flax; \
print(sys.version.split()[0], \"jax\", jax.__version__, \"flax\", flax.__version__, jax.devices())'; git log -1 --oneline 2>/dev/null || true"
# The figures first, each beside its own baseline; the checks after them, so that a deadline shorter
# than the sum of the limits (GPU_SUITE_SECONDS) cuts checks rather than figures.
part train-step 240 "$PY" benchmarks/train_step.py "${TRAIN[@]}"
part decode 200 "$PY" benchmarks/decode_throughput.py "${DECODE[@]}"
part logprob-head-memory 90 "$PY" benchmarks/logprob_head_memory.py "${HEAD[@]}"
part ceilings 60 "$PY" benchmarks/ceilings.py
GPU_TESTS=$(grep -rl --include="test_*.py" "pytest.mark.gpu" tests | tr '\n' ' ')
part gpu-tests 120 env JAX_PLATFORMS=cuda,cpu "$PY" -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS

if (( PROFILE )); then
    # Where the device's time went, in the log; the traces packed in parts of 15 MiB, since the device
    # tool returns files at most two folders down and 16 MiB each.
    for kind in train decode; do
        [[ -d /tmp/gpu_suite_profile_$kind ]] || continue
        part "profile-summary $kind" 60 "$PY" benchmarks/profile_summary.py /tmp/gpu_suite_profile_$kind \
            --top 20 --json "$OUT/profile_summary_$kind.json"
        tar czf - -C /tmp/gpu_suite_profile_$kind . | split -b 15M -d - "$OUT/profile_$kind.tgz."
    done
fi
echo
if (( ${#FAILED[@]} )); then echo "gpu_suite: FAILED parts: ${FAILED[*]}"; exit 1; fi
echo "gpu_suite: every part finished"
