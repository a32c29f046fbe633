"""Does the default run teach on every machine? The README's first command over seeds and CPU arithmetic.

    python benchmarks/default_run_spread.py                      # seeds 0-4 x native, avx2, one_core
    python benchmarks/default_run_spread.py --seeds 0,1 --variants native,sse4_2,loop_emitters --jobs 2

XLA:CPU's results depend on the instruction set it compiles for and on the thread count (the order
of its reductions), so the same seed on another machine is another run, and the tiny warm-up's copy
forms in a phase change that the last bits of the arithmetic move. Each run here is
`python -m rstar_jax.launch --config.seed=N` on one CPU device, as a user runs it, under one
arithmetic variant:

- `native`: XLA's build for this CPU, on every core this process may use;
- `avx2`, `avx`, `sse4_2`: `XLA_FLAGS=--xla_cpu_max_isa=...`, the code an older or another vendor's
  CPU gets (AVX-512 machines otherwise compile with AVX-512);
- `loop_emitters`: `--xla_cpu_use_fusion_emitters=false` (other fused kernels, the test suite's setting);
- `one_core`, `one_core_avx2`: pinned to one core (`taskset -c`), so one thread reduces in another order.

Printed per run: where the warm-up's first stage ended and by which criterion, held-out pass@1 at
step 0 and at the end with its standard error, and the run's wall time; then per variant the range,
and a last line `min_pass@1=X max_wall_s=Y runs=N below_0.85=K over_600s=J`. `--jobs 2` runs
one-core variants two at a time on disjoint cores (every other variant runs alone). Runs already
finished in `--out` are read again, not repeated; `<out>/spread.json` keeps every figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import queue
import re
import sys
import threading

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import learning  # noqa: E402  (the launcher as users run it, shared)

REPO = pathlib.Path(__file__).resolve().parents[1]
# name -> (XLA_FLAGS, cores: None for every core this process may use)
VARIANTS = {
    "native": ("", None),
    "avx2": ("--xla_cpu_max_isa=AVX2", None),
    "avx": ("--xla_cpu_max_isa=AVX", None),
    "sse4_2": ("--xla_cpu_max_isa=SSE4_2", None),
    "loop_emitters": ("--xla_cpu_use_fusion_emitters=false", None),
    "one_core": ("", 1),
    "one_core_avx2": ("--xla_cpu_max_isa=AVX2", 1),
}
DEFAULT_VARIANTS = ("native", "avx2", "one_core")
GOAL_PASS, GOAL_SECONDS = 0.85, 600.0
STAGE_END = re.compile(r"\[sft\] stage 1 (ended at step (\d+) of \d+: (.*)|took all its steps, to (\d+).*)")


def launch(args: list[str], run_dir: pathlib.Path, xla_flags: str, cpus: frozenset[int] | None) -> float:
    """The launcher as a user runs it (`learning.launch`: one CPU device, only `xla_flags` as
    XLA_FLAGS, on `cpus`), its log beside `run_dir`; returns its wall time, also kept in the run."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    seconds = learning.launch([*args, f"--config.run_dir={run_dir}"], run_dir.with_suffix(".log"), cpus,
                              xla_flags=xla_flags)
    (run_dir / "wall_seconds.json").write_text(json.dumps({"seconds": seconds, "cores": sorted(cpus or [])}))
    return seconds


def read_run(run_dir: pathlib.Path) -> dict:
    """A finished run's figures: the warm-up's first stage end, held-out pass@1 first and last."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = sorted((r for r in lines if "eval/pass@1" in r), key=lambda r: r["step"])
    log = run_dir.with_suffix(".log").read_text()
    match = STAGE_END.search(log)
    if match is None:
        stage_end, criterion = None, "?"
    elif match.group(2):
        stage_end = int(match.group(2))
        criterion = "reproduced" if "greedy decoding" in match.group(3) else "loss"
    else:
        stage_end, criterion = int(match.group(4)), "all steps"
    sft_steps = [r["step"] for r in lines if "sft/loss" in r]
    return {"stage_1_end": stage_end, "stage_1_by": criterion, "sft_steps": len(sft_steps),
            "pass@1_first": evals[0]["eval/pass@1"], "pass@1": evals[-1]["eval/pass@1"],
            "pass@1_stderr": evals[-1]["eval/pass@1_stderr"], "rl_steps": evals[-1]["step"],
            "seconds": json.loads((run_dir / "wall_seconds.json").read_text())["seconds"]}


def run(seeds: list[int], variants: list[str], out: pathlib.Path, common: list[str], jobs: int) -> dict:
    available = sorted(os.sched_getaffinity(0))
    tasks = [(variant, seed) for variant in variants for seed in seeds]
    results: dict[tuple[str, int], dict] = {}
    lock = threading.Lock()

    def one(variant: str, seed: int, cpus: frozenset[int] | None) -> None:
        run_dir = out / f"{variant}_seed{seed}"
        if not (run_dir / "wall_seconds.json").is_file():
            launch([*common, f"--config.seed={seed}"], run_dir, VARIANTS[variant][0], cpus)
        figures = read_run(run_dir)
        with lock:
            results[variant, seed] = figures
            print(f"{variant:14s} seed {seed}: stage 1 ended at {figures['stage_1_end']} ({figures['stage_1_by']}), "
                  f"pass@1 {figures['pass@1_first']:.3f} -> {figures['pass@1']:.3f} +- {figures['pass@1_stderr']:.3f}, "
                  f"{figures['seconds']:.0f} s", flush=True)

    # Every-core variants alone, one after the other; one-core variants `jobs` at a time on disjoint cores.
    for variant, seed in [t for t in tasks if VARIANTS[t[0]][1] is None]:
        one(variant, seed, None)
    slots = max(1, min(jobs, len(available)))
    free_cores: queue.SimpleQueue = queue.SimpleQueue()
    for core in available[:slots]:
        free_cores.put(frozenset([core]))

    def pinned(task: tuple[str, int]) -> None:
        cpus = free_cores.get()
        try:
            one(*task, cpus)
        finally:
            free_cores.put(cpus)

    with concurrent.futures.ThreadPoolExecutor(slots) as pool:
        futures = [pool.submit(pinned, t) for t in tasks if VARIANTS[t[0]][1] is not None]
        for future in futures:
            if future.exception() is not None:  # the first failure stops the runs not yet started
                pool.shutdown(cancel_futures=True)
                raise future.exception()
    return {f"{variant}_seed{seed}": results[variant, seed] for variant, seed in tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated config.seed values")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=str(REPO / "runs" / "spread"))
    parser.add_argument("--jobs", type=int, default=1, help="one-core runs at once, each on its own core")
    parser.add_argument("overrides", nargs="*", help="--config... arguments every run takes (after --)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = pathlib.Path(args.out)
    runs = run(seeds, variants, out, list(args.overrides), args.jobs)
    (out / "spread.json").write_text(json.dumps({"seeds": seeds, "variants": variants, "overrides": args.overrides,
                                                 "flags": {v: VARIANTS[v] for v in variants}, "runs": runs}, indent=1))

    print(f"\n| variant | XLA_FLAGS | cores | seed | stage 1 ended (by) | pass@1 step 0 -> end | wall |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        flags, cores = VARIANTS[variant]
        for seed in seeds:
            r = runs[f"{variant}_seed{seed}"]
            print(f"| {variant} | {flags or '-'} | {cores or 'all'} | {seed} | {r['stage_1_end']} ({r['stage_1_by']}) | "
                  f"{r['pass@1_first']:.3f} -> {r['pass@1']:.3f} +- {r['pass@1_stderr']:.3f} | {r['seconds']:.0f} s |")
    print()
    for variant in variants:
        rs = [runs[f"{variant}_seed{seed}"] for seed in seeds]
        print(f"{variant:14s} pass@1 {min(r['pass@1'] for r in rs):.3f} .. {max(r['pass@1'] for r in rs):.3f}, "
              f"wall {min(r['seconds'] for r in rs):.0f} .. {max(r['seconds'] for r in rs):.0f} s")
    every = list(runs.values())
    print(f"min_pass@1={min(r['pass@1'] for r in every):.3f} max_wall_s={max(r['seconds'] for r in every):.0f} "
          f"runs={len(every)} below_{GOAL_PASS}={sum(r['pass@1'] < GOAL_PASS for r in every)} "
          f"over_{GOAL_SECONDS:.0f}s={sum(r['seconds'] > GOAL_SECONDS for r in every)}")


if __name__ == "__main__":
    main()
