"""Does RL with the tool teach anything? GRPO-RoC beside GRPO with the tool and beside no tool.

    python benchmarks/learning.py                       # configs/tiny.py, 3 seeds, every variant
    python benchmarks/learning.py --seeds 5 --steps 60 --out runs/learning
    python benchmarks/learning.py --variants roc,roc_tis,bf16,bf16_tis --out runs/correction

Every seed warms up one policy with the default run's SFT (`--config.mode=sft`), then each variant
trains it with RL from the same weights on the same data, for the same steps and prompts per step,
through `python -m rstar_jax.launch` as a user runs it, evaluating the held-out problems (same
questions, same samples drawn per question) at step 0, every `--eval-every` steps and at the end:

- `roc`: GRPO-RoC as configured (2G rollouts per prompt, RoC keeps G);
- `roc_release`: the same with the release's RoC variant (`rl.roc_variant=release`);
- `grpo`: GRPO with the tool and no resampling (G rollouts per prompt, all kept);
- `no_tool`: the tool left out of the prompt and never executed (`rollout.tools=False`);
- `roc_tis`: GRPO-RoC with rollout correction, token-level truncated importance sampling
  (`rl.rollout_is=token`, cap `rl.rollout_is_threshold`) of the in-process engine's small mismatch;
- `bf16`, `bf16_tis`: the mismatch made real: rollouts from a `rstar_jax.serve` server
  (`rollout.local_servers=1`) holding the policy in bfloat16 (`weight_sync.dtype=bfloat16`)
  while the trainer computes in float32, as SGLang beside an fp32 trainer; without and with the
  correction;
- `roc_noisy`, `grpo_noisy`: `roc` and `grpo` in a noisy environment: the local sandbox answers 10%
  of the tool calls (RL and held-out alike) as timeouts without running them
  (`sandbox.inject_timeout_rate`), as a loaded fleet does;
- `async1`, `async2`: asynchronous RL (`rl.max_staleness` 1 and 2) on the in-process engine
  (colocated), with its default token-level rollout correction; `roc` is their K = 0;
- `async1_servers`, `sync_servers`: K = 1 and K = 0 with two `rstar_jax.serve` servers
  (`rollout.local_servers=2`, pushes in `pause` mode; disaggregated, though on this machine's cores).

Printed and written to `<out>/learning.json` (every curve of every seed, and the mean and standard
deviation over seeds) and `<out>/learning.png`: held-out pass@1, the tool-error rate of positive
trajectories (paper Fig. 4), tool calls per trajectory and response length, against the RL step;
and every step's rollouts: reward and positive tool-error rate (for RoC, of all 2G sampled), and the
update's sampler-trainer mismatch (`mismatch/kl_k3`, `drift/logprob_abs_mean`) and, for
asynchronous runs, the trained tokens' mean staleness. Held-out pass@1 is also drawn against the
wall-clock seconds since RL started (evaluations included, as they are in every variant). Runs
already finished in `--out` are read again, not repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = {
    "roc": [],
    "roc_release": ["--config.rl.roc_variant=release"],
    "grpo": ["--config.rollout.rollouts_per_prompt={group}"],
    "no_tool": ["--config.rollout.tools=False"],
    "roc_tis": ["--config.rl.rollout_is=token"],
    "bf16": ["--config.rollout.backend=sglang", "--config.rollout.local_servers=1", "--config.weight_sync.dtype=bfloat16"],
    "bf16_tis": ["--config.rollout.backend=sglang", "--config.rollout.local_servers=1", "--config.weight_sync.dtype=bfloat16",
                 "--config.rl.rollout_is=token"],
    "roc_noisy": ["--config.sandbox.inject_timeout_rate=0.1"],
    "grpo_noisy": ["--config.rollout.rollouts_per_prompt={group}", "--config.sandbox.inject_timeout_rate=0.1"],
    "async1": ["--config.rl.max_staleness=1"],
    "async2": ["--config.rl.max_staleness=2"],
    "async1_servers": ["--config.rl.max_staleness=1", "--config.rollout.backend=sglang", "--config.rollout.local_servers=2",
                       "--config.weight_sync.mode=pause"],
    "sync_servers": ["--config.rollout.backend=sglang", "--config.rollout.local_servers=2", "--config.weight_sync.mode=pause"],
}
DEFAULT_VARIANTS = ("roc", "grpo", "no_tool")
CURVES = ("eval/pass@1", "eval/tool_error_rate_positive", "eval/positive_with_tool_error", "eval/tool_error_rate_negative",
          "eval/tool_calls_mean", "eval/response_length_mean")
# Every step's rollouts (for RoC: all 2G sampled, before it keeps G): what the update learns from.
ROLLOUT_CURVES = ("rollout/reward_mean", "rollout/tool_error_rate_positive", "mismatch/kl_k3",
                  "drift/logprob_abs_mean", "async/staleness_mean")


def launch(args: list[str], log: pathlib.Path, cpus: frozenset[int] | None = None, xla_flags: str = "") -> float:
    """Runs the launcher; returns its wall time. One CPU device, as users run it; `cpus`: the cores
    it (and the sandbox it starts) may run on; `xla_flags`: its only XLA_FLAGS (e.g.
    `--xla_cpu_max_isa=AVX2`: the arithmetic of another CPU, benchmarks/default_run_spread.py)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    t0 = time.perf_counter()
    with open(log, "w") as f:
        process = subprocess.Popen([sys.executable, "-m", "rstar_jax.launch", *args], cwd=REPO, env=env, stdout=f,
                                   stderr=subprocess.STDOUT)
        if cpus:  # before its interpreter has started the threads and the sandbox that would inherit the set
            os.sched_setaffinity(process.pid, cpus)
        returncode = process.wait()
    if returncode:
        raise SystemExit(f"launcher failed ({returncode}), see {log}")
    return time.perf_counter() - t0


def curves(run_dir: pathlib.Path) -> dict[str, list[float]]:
    """The held-out evaluations' curves against `step`, the rollouts' against `rollout_step`
    (NaN where a step had no positive trajectory)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((line for line in lines if "eval/pass@1" in line), key=lambda line: line["step"])
    steps = sorted((line for line in lines if "rollout/reward_mean" in line), key=lambda line: line["step"])
    return {"step": [line["step"] for line in evals], **{name: [line.get(name, float("nan")) for line in evals] for name in CURVES},
            "wall_s": [line["time"] - evals[0]["time"] for line in evals],
            "rollout_step": [line["step"] for line in steps],
            **{name: [line.get(name, float("nan")) for line in steps] for name in ROLLOUT_CURVES}}


def run(config_path: str, *, seeds: Sequence[int], variants: Sequence[str], out: pathlib.Path, steps: int = 0,
        eval_every: int = 0, common: Sequence[str] = (), jobs: int = 1, xla_flags: str = "") -> dict:
    """Every seed's SFT warm-up, then every variant from it; returns every run's curves and, per
    variant, their mean and standard deviation over seeds (`summary`). `common`: overrides every
    launch (SFT and RL) takes. `jobs`: launches at once, each on its own share of this process's
    cores where there are enough to share; a free one takes the earliest seed's next variant whose
    warm-up is done, else the next warm-up. `xla_flags`: every launch's XLA_FLAGS (`launch`)."""
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from rstar_jax.config import load_config_file

    config = load_config_file(config_path)
    steps = steps or config.train.steps
    eval_every = eval_every or config.train.eval_every or steps
    common = [f"--config={config_path}", "--config.metrics.progress_bar=false", *common]
    shown = os.path.relpath(config_path, REPO) if pathlib.Path(config_path).resolve().is_relative_to(REPO) else config_path
    results: dict = {"config": shown, "overrides": common[2:], "steps": steps, "eval_every": eval_every, "jobs": jobs,
                     "xla_flags": xla_flags, "runs": {}}

    def warm_dir(seed: int) -> pathlib.Path:
        return out / f"sft_seed{seed}"

    def warm_up(seed: int, cpus) -> None:
        seconds = launch([*common, "--config.mode=sft", f"--config.seed={seed}", f"--config.run_dir={warm_dir(seed)}",
                          "--config.checkpoint.export_hf_every=0", f"--config.checkpoint.every_steps={10 ** 6}"],
                         out / f"sft_seed{seed}.log", cpus, xla_flags=xla_flags)
        results.setdefault("sft_seconds", {})[str(seed)] = seconds
        print(f"seed {seed}: SFT warm-up {seconds:.0f}s", flush=True)

    def train(seed: int, variant: str, cpus) -> dict:
        run_dir = out / f"{variant}_seed{seed}"
        extra = [a.format(group=config.rl.group_size) for a in VARIANTS[variant]]
        if (run_dir / "hf" / "final" / "config.json").exists():  # finished earlier: report it again
            seconds = float("nan")
        else:
            seconds = launch([*common, *extra, f"--config.seed={seed}", f"--config.run_dir={run_dir}",
                              f"--config.model.hf_path={warm_dir(seed) / 'hf' / 'final'}", "--config.sft.before_rl=False",
                              f"--config.train.steps={steps}", f"--config.train.eval_every={eval_every}"],
                             out / f"{variant}_seed{seed}.log", cpus, xla_flags=xla_flags)
        run = {"seed": seed, "seconds": seconds, **curves(run_dir)}
        print(f"seed {seed} {variant:8s} pass@1 {run['eval/pass@1'][0]:.3f} -> {run['eval/pass@1'][-1]:.3f}"
              f"  positive tool-error rate {run['eval/tool_error_rate_positive'][0]:.3f} -> "
              f"{run['eval/tool_error_rate_positive'][-1]:.3f}  ({seconds:.0f}s)", flush=True)
        return run

    order = {variant: i for i, variant in enumerate(variants)}
    done = {seed for seed in seeds if (warm_dir(seed) / "hf" / "final" / "config.json").exists()}
    ready = sorted(((seed, variant) for seed in done for variant in variants), key=lambda t: (t[0], order[t[1]]))
    to_warm = [seed for seed in seeds if seed not in done]
    warming: set[int] = set()
    finished: dict[tuple[int, str], dict] = {}
    failures: list[BaseException] = []
    changed = threading.Condition()

    def next_task():
        with changed:
            while not failures:
                if ready:
                    return ready.pop(0)
                if to_warm:
                    warming.add(to_warm[0])
                    return to_warm.pop(0), None
                if not warming:
                    return None
                changed.wait()
            return None

    def worker(cpus) -> None:
        while (task := next_task()) is not None:
            seed, variant = task
            try:
                if variant is None:
                    warm_up(seed, cpus)
                else:
                    run = train(seed, variant, cpus)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                with changed:
                    failures.append(e)
                    changed.notify_all()
                return
            with changed:
                if variant is None:
                    warming.discard(seed)
                    ready.extend((seed, v) for v in variants)
                    ready.sort(key=lambda t: (t[0], order[t[1]]))
                else:
                    finished[task] = run
                changed.notify_all()

    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(available) // jobs if jobs > 1 else 0
    threads = [threading.Thread(target=worker, args=(frozenset(available[j * share:(j + 1) * share]) if share else None,))
               for j in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    for variant in variants:
        results["runs"][variant] = [finished[seed, variant] for seed in seeds]
    summary = {}
    for variant, runs in results["runs"].items():
        summary[variant] = {"step": runs[0]["step"], "rollout_step": runs[0]["rollout_step"]}
        for name in ("wall_s", *CURVES, *ROLLOUT_CURVES):
            values = np.asarray([r[name] for r in runs], np.float64)
            with warnings.catch_warnings():  # a step with no positive trajectory in any seed stays NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                summary[variant][name] = {"mean": np.nanmean(values, 0).tolist(), "std": np.nanstd(values, 0).tolist()}
    results["summary"] = summary
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.py"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's train.steps)")
    parser.add_argument("--eval-every", type=int, default=0, help="0: the config's train.eval_every")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=str(REPO / "runs" / "learning"))
    parser.add_argument("--jobs", type=int, default=1, help="launches at once, each pinned to its share of the cores")
    parser.add_argument("--xla-flags", default="", help="every launch's XLA_FLAGS, e.g. --xla_cpu_max_isa=AVX2")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    results = run(args.config, seeds=range(args.seeds), variants=args.variants.split(","), out=out, steps=args.steps,
                  eval_every=args.eval_every, jobs=args.jobs, xla_flags=args.xla_flags)
    summary = results["summary"]
    (out / "learning.json").write_text(json.dumps(_nan_to_none(results), indent=1))
    print(f"\n{'variant':8s} {'seeds':>5s} {'pass@1 step 0':>14s} {'pass@1 final':>16s} {'pos. tool err final':>20s}"
          f" {'mismatch k3 (mean over steps)':>30s} {'RL wall s':>10s} {'staleness':>9s}")
    for variant, s in summary.items():
        p, e = s["eval/pass@1"], s["eval/tool_error_rate_positive"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            k3 = float(np.nanmean(np.asarray(s["mismatch/kl_k3"]["mean"], np.float64)))
            staleness = float(np.nanmean(np.asarray(s["async/staleness_mean"]["mean"], np.float64)))
        print(f"{variant:8s} {len(results['runs'][variant]):5d} {p['mean'][0]:8.3f}±{p['std'][0]:.3f} "
              f"{p['mean'][-1]:10.3f}±{p['std'][-1]:.3f} {e['mean'][-1]:14.3f}±{e['std'][-1]:.3f} {k3:30.2e} "
              f"{s['wall_s']['mean'][-1]:10.0f} {staleness:9.2f}")
    plot(summary, out / "learning.png")
    print(f"\n{out / 'learning.json'}\n{out / 'learning.png'}")


def _nan_to_none(tree):
    """Strict JSON: NaN (no positive trajectory at that step, or a run read again) becomes null."""
    if isinstance(tree, dict):
        return {k: _nan_to_none(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_nan_to_none(v) for v in tree]
    return None if isinstance(tree, float) and np.isnan(tree) else tree


TITLES = {"eval/pass@1": "held-out pass@1", "eval/tool_error_rate_positive": "held-out: tool-error rate, positive",
          "eval/positive_with_tool_error": "held-out: correct with a failed call",
          "eval/tool_error_rate_negative": "held-out: tool-error rate, negative",
          "eval/tool_calls_mean": "held-out: tool calls per trajectory",
          "eval/response_length_mean": "held-out: response length (tokens)",
          "rollout/reward_mean": "rollouts: reward", "rollout/tool_error_rate_positive": "rollouts: tool-error rate, positive",
          "mismatch/kl_k3": "update: KL(sampler || trainer), k3", "drift/logprob_abs_mean": "update: |log-prob drift|",
          "async/staleness_mean": "update: mean staleness (updates behind)"}


def plot(summary: dict, path: pathlib.Path, names: Sequence[str] = CURVES + ROLLOUT_CURVES) -> None:
    """Mean ± sd over seeds of each curve in `names` against the RL step, and held-out pass@1
    against the wall-clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = -(-(len(names) + 1) // 2)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 7))
    for ax, name in zip(axes.T.flat, names):
        for variant, s in summary.items():
            x = np.asarray(s["rollout_step" if name in ROLLOUT_CURVES else "step"])
            mean, std = np.asarray(s[name]["mean"]), np.asarray(s[name]["std"])
            ax.plot(x, mean, marker="o", label=variant)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        ax.set_title(TITLES[name])
        ax.set_xlabel("RL step")
    ax = axes.T.flat[len(names)]
    for variant, s in summary.items():
        ax.plot(s["wall_s"]["mean"], s["eval/pass@1"]["mean"], marker="o", label=variant)
    ax.set_title("held-out pass@1 against wall-clock")
    ax.set_xlabel("seconds since RL started (mean over seeds)")
    for ax in axes.T.flat[len(names) + 1:]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
