"""What a `jax.profiler.trace` directory says about the device: how busy it was, and where its time went.

Reads the Chrome-format trace the profiler writes beside its xplane (`*.trace.json.gz`), keeps the
device's kernels, and prints the busy fraction (kernel time over the span from the first kernel to
the end of the last; the rest is the host launching, waiting or syncing), the kernel time by kind
(matmul, cuDNN attention, XLA fusions, copies) and the longest kernels with their counts. Needs no
TensorBoard or xprof, so it runs on the machine that took the trace and on a laptop.

    python benchmarks/profile_summary.py /tmp/gpu_suite_profile_decode
    python benchmarks/profile_summary.py /tmp/gpu_suite_profile_train --top 25 --json summary.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys

# Substrings of kernel names, first match wins: cuBLAS/cuBLASLt (nvjet, sm90_xmma), XLA's Triton
# matmul fusions (gemm_fusion), cuDNN's fused attention.
KINDS = (
    ("matmul", ("nvjet", "gemm", "cutlass", "cublas", "xmma")),
    ("attention (cuDNN)", ("cudnn", "flash", "fmha")),
    ("copies", ("memcpy", "memset")),
    ("transposes", ("transpose",)),
    ("gathers and scatters", ("gather", "scatter", "dynamic_update_slice", "dynamic-update-slice")),
    ("other XLA fusions", ("fusion", "loop_", "input_", "wrapped")),
)


def kind_of(kernel: str) -> str:
    lowered = kernel.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def device_kernels(trace_dir: str) -> list[dict]:
    traces = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
    if not traces:
        sys.exit(f"profile_summary: no *.trace.json.gz under {trace_dir} (a jax.profiler.trace directory)")
    events = json.load(gzip.open(traces[-1]))["traceEvents"]
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and e["args"]["name"].startswith("/device:")}
    return [e for e in events if e.get("ph") == "X" and e["pid"] in devices and "dur" in e]


def summarize(kernels: list[dict], top: int) -> dict:
    if not kernels:
        return {"kernels": 0}
    total = sum(k["dur"] for k in kernels)
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    by_kind, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for k in kernels:
        by_kind[kind_of(k["name"])] += k["dur"]
        by_name[k["name"]] += k["dur"]
        count[k["name"]] += 1
    return {"kernels": len(kernels), "kernel_ms": total / 1e3, "span_ms": span / 1e3, "busy": total / span,
            "by_kind_ms": {kind: us / 1e3 for kind, us in by_kind.most_common()},
            "top": [{"name": name, "ms": us / 1e3, "count": count[name]} for name, us in by_name.most_common(top)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir")
    parser.add_argument("--top", type=int, default=15, help="how many of the longest kernels to list")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    summary = summarize(device_kernels(args.trace_dir), args.top)
    if not summary["kernels"]:  # a CPU backend's trace: its ops run on host threads
        print(f"profile_summary: the trace under {args.trace_dir} holds no accelerator kernels")
        return
    total = summary["kernel_ms"]
    print(f"device kernels: {summary['kernels']}, {total:.1f} ms over a span of {summary['span_ms']:.1f} ms "
          f"-> device busy {summary['busy']:.0%}")
    for kind, ms in summary["by_kind_ms"].items():
        print(f"  {kind:22s} {ms:9.1f} ms  {ms / total:6.1%}")
    print("longest kernels (total ms, share, launches):")
    for k in summary["top"]:
        print(f"  {k['ms']:9.1f} ms  {k['ms'] / total:6.1%}  x{k['count']:<6d} {k['name'][:100]}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
