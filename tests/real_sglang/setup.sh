#!/usr/bin/env bash
# Builds the environment in which tests/real_sglang runs a REAL SGLang server on a CPU-only machine.
#
#   tests/real_sglang/setup.sh [ENV_DIR]     # default: $RSTAR_SGLANG_ENV, else <repo>/.venv-sglang
#
# About 6 GB and a few minutes (torch's CUDA build and its nvidia-* wheels are most of it). Re-running
# on a complete environment only re-checks it. PYTHON picks the interpreter (default python3.11).
set -euo pipefail

start=$(date +%s)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
env_dir=${1:-${RSTAR_SGLANG_ENV:-$repo/.venv-sglang}}
python=${PYTHON:-python3.11}
stand_in="$here/sgl_kernel_cpu"
stamp="$env_dir/.rstar-sglang-complete"  # server.py's env_is_complete() looks for this file

# torch: SGLang 0.5.23 pins torch==2.14.1. The CUDA build runs fine without a GPU; the "+cpu" build
# breaks SGLang's torchvision import. Versions below are the ones this tier was verified with.
TORCH=(torch==2.14.1 torchvision==0.29.1)
SGLANG=sglang==0.5.23
# SGLang's wheel hard-requires CUDA-only packages (flashinfer, sglang-kernel, deep-ep/gemm, cutlass,
# cuda-python, torch_memory_saver, ...), so it is installed with --no-deps and these are what its
# CPU server imports actually need (found by importing the launcher, HTTP server, scheduler, model
# runner and Qwen3 model until nothing was missing). Pins marked * are SGLang's own pins.
DEPS=(
  transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface_hub==1.33.0  # * tf, tok
  fastapi==0.165.0 uvicorn==0.54.0 uvloop==0.23.0 python-multipart==0.0.34 orjson==3.13.0
  pydantic==2.14.4 pyzmq==27.3.0 msgspec==0.22.0 pybase64==1.5.1 aiohttp==3.14.5 requests==2.34.2
  psutil==7.2.2 setproctitle==1.3.8 prometheus_client==0.26.0 xxhash==4.1.0 zstandard==0.25.0
  einops==0.8.2 packaging==26.4 tqdm==4.70.1 regex==2026.11.19 interegular==0.3.3
  partial-json-parser==0.2.1.1.post7 ipython==9.18.1 dill==0.4.1 jsonschema==4.26.0 gguf==0.19.0
  apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 openai==2.8.0  # *
  xgrammar==0.2.7 soundfile==0.13.1  # *
  sglang-router==0.3.2  # SGLang's Rust load balancer, run in front of generators by test_router.py
)
# A change to any pin makes the stamp stale, so the next run re-installs.
want_stamp="$SGLANG ${TORCH[*]} ${DEPS[*]} stand-in=$stand_in"

if [[ ! -x "$env_dir/bin/python" ]]; then
  echo "== creating $env_dir with $python"
  "$python" -m venv "$env_dir"
fi
pip=("$env_dir/bin/python" -m pip install --no-input --disable-pip-version-check)

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]]; then
  echo "== $env_dir is complete; checking it"
else
  rm -f "$stamp"
  echo "== installing torch, SGLang's CPU-side requirements, then SGLang itself (--no-deps)"
  "${pip[@]}" "${TORCH[@]}" "${DEPS[@]}"
  "${pip[@]}" --no-deps "$SGLANG"
  # The pure-torch sgl_kernel stand-in goes on sys.path through a .pth file: nothing is written
  # into SGLang's own files, and edits to the stand-in in the repo take effect at once.
  site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$stand_in" > "$site/rstar_jax_sgl_kernel_stand_in.pth"
fi

# Smoke check: the modules a CPU server loads import (SGLANG_USE_CPU_ENGINE selects the CPU engine,
# whose imports of sgl_kernel the stand-in must satisfy), and sgl_kernel is the stand-in.
SGLANG_USE_CPU_ENGINE=1 "$env_dir/bin/python" -W ignore - "$stand_in" <<'EOF'
import os, sys
import sglang, torch, sgl_kernel
import sglang.launch_server, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.model_executor.model_runner, sglang.srt.models.qwen3
import sglang.srt.layers.attention.torch_native_backend
import sglang_router.launch_router
assert os.path.dirname(os.path.dirname(sgl_kernel.__file__)) == sys.argv[1], sgl_kernel.__file__
print(f"sglang {sglang.__version__}, torch {torch.__version__}, sgl_kernel stand-in {sgl_kernel.__file__}")
EOF
echo "$want_stamp" > "$stamp"
echo "== ready: $env_dir ($(du -sh "$env_dir" | cut -f1)) in $(( $(date +%s) - start )) s"
