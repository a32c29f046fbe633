"""RoC's effect, shown over seeds: fewer tool errors in correct trajectories than plain GRPO leaves.

    python benchmarks/roc_effect.py                   # 5 seeds x 4 variants: over two hours on 2 CPU cores
    python benchmarks/roc_effect.py --variants roc,grpo --out runs/roc_effect

Each seed's warm-up (at most 2050 steps: the default's first stage ends once the copy holds) took
12-13 minutes on two shared cores at 1250 fixed steps, and each RL run 4-5.

rStar2-Agent's Fig. 4: with outcome-only rewards, GRPO reinforces trajectories that reach the right
answer despite failed tool calls, and keeps about 10% tool errors in its positive trajectories, where
GRPO-RoC (keep G of 2G: negatives uniformly, positives with few tool errors first) drives them down.
Fig. 9 ranks RoC > GRPO with the tool > no tool. This script runs that comparison in miniature.

The task is the default run's (`configs/tiny.py`) with the overrides in `TASK`, chosen so that the
claim can show:
- After the warm-up, a substantial share of the policy's correct trajectories should contain a failed
  call and its recovery. The warm-up teaches a broken call (its ")" doubled), the error, and the
  call again. The recovery writes the factors a second time, so the model has to learn to copy them
  at a new offset. Three things made that learnable (benchmarks/RESULTS.md, "RoC's effect in
  miniature"):
  - a middle stage of mostly fixes (1600 conversations, 80% fixes), between the default's two;
  - an error that names no "(" of its own (`data.synthetic.fix_bug=unmatched`);
  - observations long enough to hold the traceback whole (160 characters). A middle cut inserts
    "...(truncated)...", another "(" to copy after.
  The default's fix conversations (480 tokens) already fit its 512. With these observations a fix
  conversation is 546 tokens, so the lengths grow to 640.
- Clean correct trajectories are possible too: the warm-up also teaches the clean call.
- The failure is one the environment reports clearly: the rich sandbox's SyntaxError traceback,
  which the warm-up shows exactly as the sandbox writes it.
- Outcome reward cannot tell the two apart: both end in the right `\\boxed{}`. Only RoC's positive
  selection gives the policy a reason to drop the broken call.

Variants, from the same warm-up per seed, on the same data, steps and prompts per step:
- `roc`: GRPO-RoC, the paper's variant (2G = 8 sampled, G = 4 kept);
- `roc_release`: the rStar2 release's variant (`rl.roc_variant=release`);
- `grpo`: GRPO with the tool, no resampling (G rollouts, all kept);
- `no_tool`: the tool neither offered nor executed.

Printed, and written to `<out>/roc_effect.json` and `<out>/roc_effect.png`: per variant, held-out
pass@1, the positive trajectories' tool-error rate (failed calls per call, the paper's Fig. 4
measure), the share of correct trajectories with a failed call, the negative trajectories'
tool-error rate, tool calls per trajectory and response length, each against the RL step (mean ±
sd over seeds). The RoC − GRPO difference in the positive tool-error rate at each evaluation is
given in standard errors of the per-seed differences (the variants of one seed share a warm-up,
so they are paired). The last line is

    roc_positive_tool_error=X grpo_positive_tool_error=Y diff_se=Z roc_pass@1=A grpo_pass@1=B no_tool_pass@1=C

with the final evaluation's values, means over seeds, and `diff_se` = (GRPO − RoC) / its standard
error: above 2 means RoC ends with fewer tool errors in its correct trajectories by more than two
standard errors. Runs already finished in `--out` are read again, not repeated.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import learning  # noqa: E402  (the launcher calls, the curves and the plot, shared)

REPO = learning.REPO
# The default task with a recovery the model learns (see the docstring): the fix's failed call
# doubles its ")" (no "(" of the error's own), observations long enough to hold its traceback whole (a
# middle cut would insert "...(truncated)..."), lengths that fit a fix conversation (546 tokens),
# and a warm-up stage of mostly fixes between the default's two. The first stage ends as the
# default's does, once the copy holds (sft.advance_loss, which may end the middle stage early too,
# once the fix holds), but at step 1500 at the latest; the rate decays over the last stage's 150
# steps of the 2050 planned. Four layers, as this task was measured with: the default's one-layer
# policy learned no recovery on it (benchmarks/RESULTS.md, "One layer").
TASK: tuple[str, ...] = (
    "--config.model.overrides.num_layers=4",
    "--config.data.synthetic.fix_bug=unmatched", "--config.rollout.observation_max_chars=160",
    "--config.rollout.response_budget=512", "--config.eval.response_budget=512", "--config.rollout.engine.max_length=640",
    "--config.sft.max_length=640", "--config.sft.micro_batch_tokens=1280",
    "--config.data.synthetic.sft_stages=((6000, (0.0, 1.0, 0.0)), (1600, (0.0, 0.2, 0.8)), (600, (0.4, 0.3, 0.3)))",
    "--config.sft.decay_ratio=0.073")
VARIANTS = ("roc", "roc_release", "grpo", "no_tool")
CURVES = ("eval/pass@1", "eval/tool_error_rate_positive", "eval/positive_with_tool_error", "eval/tool_error_rate_negative",
          "eval/tool_calls_mean", "eval/response_length_mean", "rollout/reward_mean", "rollout/tool_error_rate_positive")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.py"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="RL steps (0: the config's train.steps)")
    parser.add_argument("--eval-every", type=int, default=0, help="0: the config's train.eval_every")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="roc and grpo are needed for the last line")
    parser.add_argument("--out", default=str(REPO / "runs" / "roc_effect"))
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    t0 = time.perf_counter()
    results = learning.run(args.config, seeds=range(args.seeds), variants=args.variants.split(","), out=out,
                           steps=args.steps, eval_every=args.eval_every, common=TASK)
    results["wall_s"] = time.perf_counter() - t0
    sys.path.insert(0, str(REPO))
    from rstar_jax.analysis.runs import load_comparison

    rows = ("eval/pass@1", "eval/tool_error_rate_positive", "eval/positive_with_tool_error", "eval/tool_error_rate_negative",
            "eval/tool_calls_mean", "eval/response_length_mean")
    compared = load_comparison(out, names=rows)
    variants = [v for v in args.variants.split(",") if v in compared.seeds]
    print(f"\n{'variant':12s} " + " ".join(f"{name.removeprefix('eval/'):>30s}" for name in rows))
    for variant in variants:
        cells = []
        for name in rows:
            mean, std = compared.mean(variant, name), compared.std(variant, name)
            cells.append(f"{mean[0]:6.3f} -> {mean[-1]:6.3f} ± {std[-1]:5.3f}")
        print(f"{variant:12s} " + " ".join(f"{c:>30s}" for c in cells))
    print("(step 0 -> final, mean over seeds -> mean ± sd over seeds)")

    comparison = {}
    if {"roc", "grpo"} <= set(variants):
        diff, in_se = compared.paired_difference("roc", "grpo", "eval/tool_error_rate_positive")
        print("\nGRPO - RoC, positive tool-error rate, per evaluation (paired over seeds):")
        for step, d, z in zip(compared.steps.tolist(), diff, in_se):
            comparison[str(step)] = {"diff": float(d), "diff_se": float(z)}
            print(f"  step {step:3d}: {d:+.4f} ({z:+.2f} standard errors)")
        roc_err = compared.values["roc"]["eval/tool_error_rate_positive"][:, -1]
        grpo_err = compared.values["grpo"]["eval/tool_error_rate_positive"][:, -1]
        unpaired = math.sqrt(np.nanvar(roc_err, ddof=1) / len(roc_err) + np.nanvar(grpo_err, ddof=1) / len(grpo_err))
        print(f"  final, unpaired: {diff[-1]:+.4f} ({diff[-1] / unpaired if unpaired else float('nan'):+.2f} standard errors)")
        share = compared.mean("roc", "eval/positive_with_tool_error")[0]
        print(f"\nat step 0, {share:.1%} of the warmed-up policy's correct held-out trajectories contain a failed call")
    results["comparison"] = comparison
    (out / "roc_effect.json").write_text(json.dumps(learning._nan_to_none(results), indent=1))
    learning.plot(results["summary"], out / "roc_effect.png", names=CURVES)
    print(f"\n{out / 'roc_effect.json'}\n{out / 'roc_effect.png'}\nwall time {results['wall_s'] / 60:.1f} min")

    def mean_final(variant: str, name: str) -> float:
        return float(compared.mean(variant, name)[-1]) if variant in compared.seeds else float("nan")

    last_se = comparison[str(compared.steps[-1])]["diff_se"] if comparison else float("nan")
    print(f"roc_positive_tool_error={mean_final('roc', 'eval/tool_error_rate_positive'):.4f} "
          f"grpo_positive_tool_error={mean_final('grpo', 'eval/tool_error_rate_positive'):.4f} diff_se={last_se:.2f} "
          f"roc_pass@1={mean_final('roc', 'eval/pass@1'):.3f} grpo_pass@1={mean_final('grpo', 'eval/pass@1'):.3f} "
          f"no_tool_pass@1={mean_final('no_tool', 'eval/pass@1'):.3f}")


if __name__ == "__main__":
    main()
