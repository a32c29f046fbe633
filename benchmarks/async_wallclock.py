"""Asynchronous RL's wall-clock beside the synchronous loop's, same machine, same run of this script.

    python benchmarks/async_wallclock.py                          # in-process engine (colocated)
    python benchmarks/async_wallclock.py --servers 1              # one `rstar_jax.serve` beside the trainer
    python benchmarks/async_wallclock.py --servers 1 --sync-mode pause   # pushes abort and re-prefill
    python benchmarks/async_wallclock.py --steps 8 --k 1,2 --out runs/async_wallclock

One SFT warm-up (the tiny recipe's task, shortened), then the same RL steps from it with
`rl.max_staleness` 0 and each K of `--k`, through `python -m rstar_jax.launch` as users run it
(held-out evaluation off, so the wall time is the steps'). Printed per run: the RL wall time (first
step's start to the last step's metrics), seconds per step, the generators' and the trainer's busy
fractions and waits, the mean staleness and the sampler-trainer mismatch. On a GPU
(`gpu_suite.sh --async`) the trainer and its servers share the device: each process takes
`XLA_PYTHON_CLIENT_MEM_FRACTION` of it (set here to 0.3 unless given).

The last line is `async_vs_sync_wall=X.XX` (K = 0's RL wall time over the best K's).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess

import numpy as np

from learning import launch  # the launcher on one device, as users run it (benchmarks/learning.py)

REPO = pathlib.Path(__file__).resolve().parents[1]
TASK = ["--config.data.synthetic.kinds=('last_digit_power',)", "--config.train.eval_every=0",
        "--config.metrics.progress_bar=false"]
# The tests' short warm-up (tests/conftest.py, TINY_RUN_OVERRIDES): well-formed calls, no copy needed.
WARM_UP = ["--config.data.synthetic.sft_stages=((480,(0.0,1.0,0.0)),(160,(0.25,0.5,0.25)))", "--config.sft.batch_size=4",
           "--config.sft.micro_batch_tokens=1024", "--config.sft.advance_exact=0"]


def summary(run_dir: pathlib.Path) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "rollout/reward_mean" in line]
    first = steps[0]
    # The first step's start: its metrics' time less its own duration (rollout + update + push, or
    # the pipelined step's window).
    start = first["time"] - first.get("time/step_s", first["time/rollout_s"] + first.get("time/update_s", 0.0)
                                      + first.get("time/weight_sync_s", 0.0))
    def mean(key: str) -> float:  # NaN where no step has it (K = 0 has no async/ figures)
        values = [line[key] for line in steps if key in line]
        return float(np.mean(values)) if values else float("nan")

    return {"steps": len(steps), "wall_s": steps[-1]["time"] - start, "updates": sum(1 - s["update/skipped"] for s in steps),
            "generator_busy": mean("async/generator_busy"), "trainer_busy": mean("async/trainer_busy"),
            "trainer_wait_s": mean("async/trainer_wait_s"), "staleness": mean("async/staleness_mean"),
            "kl_k3": mean("mismatch/kl_k3"), "reward": mean("rollout/reward_mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--k", default="1", help="comma-separated max_staleness values beside 0")
    parser.add_argument("--servers", type=int, default=0, help="rstar_jax.serve processes (0: the in-process engine)")
    parser.add_argument("--sync-mode", default="in_place", choices=("in_place", "pause", "abort"),
                        help="weight_sync.mode with servers (in_place: running requests go on under the new weights)")
    parser.add_argument("--out", default=str(REPO / "runs" / "async_wallclock"))
    args = parser.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")  # the trainer and its servers share a GPU
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warm = out / "warm"
    if not (warm / "hf" / "sft_warmup" / "config.json").exists():
        seconds = launch([*TASK, *WARM_UP, f"--config.run_dir={warm}", "--config.train.steps=1"], out / "warm.log")
        print(f"SFT warm-up (and one RL step) {seconds:.0f}s", flush=True)
    servers = ([] if not args.servers else
               ["--config.rollout.backend=sglang", f"--config.rollout.local_servers={args.servers}",
                f"--config.weight_sync.mode={args.sync_mode}"])
    results = {}
    for k in [0, *(int(x) for x in args.k.split(","))]:
        run_dir = out / f"k{k}{'_servers' if args.servers else ''}"
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        launch([*TASK, *servers, f"--config.run_dir={run_dir}", f"--config.model.hf_path={warm / 'hf' / 'sft_warmup'}",
                "--config.sft.before_rl=false", f"--config.train.steps={args.steps}", f"--config.rl.max_staleness={k}",
                "--config.data.shuffle_seed=3", "--config.optim.warmup_steps=0"], out / f"{run_dir.name}.log")
        results[k] = s = summary(run_dir)
        print(f"K={k}: RL {s['wall_s']:6.1f}s for {s['steps']} steps ({s['wall_s'] / s['steps']:.1f} s/step, "
              f"{s['updates']} updates)  generators busy {s['generator_busy']:.2f}  trainer busy {s['trainer_busy']:.2f}  "
              f"trainer wait {s['trainer_wait_s']:.1f}s/step  staleness {s['staleness']:.2f}  k3 {s['kl_k3']:.1e}  "
              f"reward {s['reward']:.3f}", flush=True)
    name = f"async_wallclock{'_servers' if args.servers else ''}.json"
    (out / name).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    best = min((v["wall_s"] for k, v in results.items() if k), default=float("nan"))
    print(f"async_vs_sync_wall={results[0]['wall_s'] / best:.2f}")


if __name__ == "__main__":
    main()
