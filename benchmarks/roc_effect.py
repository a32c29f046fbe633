"""RoC's effect, shown over seeds: fewer tool errors in correct trajectories than plain GRPO leaves.

    python benchmarks/roc_effect.py                   # 5 seeds x 4 variants, two launches at a time: about an hour on 2 CPU cores
    python benchmarks/roc_effect.py --variants roc,grpo --seeds 3 --out runs/roc_effect

rStar2-Agent's Fig. 4: with outcome-only rewards, GRPO reinforces trajectories that reach the right
answer despite failed tool calls, and keeps about 10% tool errors in its positive trajectories, where
GRPO-RoC (keep G of 2G: negatives uniformly, positives with few tool errors first) drives them down.
Fig. 9 ranks RoC > GRPO with the tool > no tool. This script runs that comparison in miniature.

The task is the default run's (`configs/tiny.py`: one layer, "What is (47*38)?") with the overrides
in `TASK`, chosen so that the claim can show:
- After the warm-up, a substantial share of the policy's correct trajectories contain a failed call
  and its recovery. The warm-up teaches a broken call (its ")" doubled), the error, and the call
  again. The one-layer policy copies by distance: one attention head reads the character a fixed
  number of positions back (benchmarks/copy_heads.py), so a recovery it can learn needs its source
  at one fixed distance. The rStar2 release's one-line errors (`sandbox.error_format=release`,
  "SyntaxError at line 1: unmatched ')' (<unknown>, line 1)" and then the failed line) end with the
  failed call's expression, 106 positions before the second call writes it again, for every
  problem, and the policy learns to copy at that distance too (`copy_heads.py --behaviour fix
  --error-format release --observation-chars 160 --fix-bug unmatched`: on all five warm-ups of
  benchmarks/RESULTS.md the fix's copies are exact, often by the head that copies the question into
  the first call, 88 positions back; moving the second reply one position drops them to 0.00-0.09).
  Python's own traceback (the default's) echoes the line too, but a caret line and the error's name
  follow it: 171 positions; it was not compared.
- Observations hold the error whole (160 characters): a middle cut would insert "...(truncated)...",
  another "(" at another distance. A fix conversation is then 528 tokens, so the lengths grow to 640.
- The warm-up has a middle stage of mostly fixes (4000 conversations, 80% fixes, 492 steps of
  eight) between the default's two. `sft.advance_exact` could end it early, but greedy decoding
  writes one of a prompt's two behaviours, so at most about 80% of its held-out conversations are
  reproduced: it runs all its steps. (With four conversations per step and the loss rule it ran
  all 1000 on every seed; pilots whose stage allowed 2000 steps ended it at step 773 (seed 0) and
  ran all 2000 (seed 1), both copying exactly.)
- Clean correct trajectories are possible too: the warm-up's last stage teaches the clean call, the
  fix and answering without the tool (30%, 30% and 40% of its conversations).
- Outcome reward cannot tell the two apart: both end in the right `\\boxed{}`. Only RoC's positive
  selection gives the policy a reason to drop the broken call.

Variants, from the same warm-up per seed, on the same data, steps and prompts per step:
- `roc`: GRPO-RoC, the paper's variant (2G = 8 sampled, G = 4 kept);
- `roc_release`: the rStar2 release's variant (`rl.roc_variant=release`);
- `grpo`: GRPO with the tool, no resampling (G rollouts, all kept);
- `no_tool`: the tool neither offered nor executed;
- also `roc_noisy`, `grpo_noisy` (`--variants`): `roc` and `grpo` with 10% of the tool calls
  answered as timeouts without running (`sandbox.inject_timeout_rate`), a noisy environment.

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
# The default task with a recovery the one-layer policy learns (see the docstring): the fix's failed
# call doubles its ")", the release's one-line errors end with the failed line, observations hold
# them whole, lengths fit a fix conversation (528 tokens; eight conversations per step in one
# micro-batch of four rows), and a warm-up stage of mostly fixes sits between the default's two; the
# rate decays over the last stage's 75 steps of the 1559 planned.
TASK: tuple[str, ...] = (
    "--config.data.synthetic.fix_bug=unmatched", "--config.sandbox.error_format=release",
    "--config.rollout.observation_max_chars=160",
    "--config.rollout.response_budget=512", "--config.eval.response_budget=512", "--config.rollout.engine.max_length=640",
    "--config.sft.max_length=640", "--config.sft.micro_batch_tokens=2560",
    "--config.data.synthetic.sft_stages=((8000, (0.0, 1.0, 0.0)), (4000, (0.0, 0.2, 0.8)), (600, (0.4, 0.3, 0.3)))",
    "--config.sft.decay_ratio=0.0481")
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
    parser.add_argument("--jobs", type=int, default=2, help="launches at once, each pinned to its share of the cores")
    parser.add_argument("--xla-flags", default="", help="every launch's XLA_FLAGS, e.g. --xla_cpu_max_isa=AVX2 (another "
                                                        "CPU's arithmetic)")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    t0 = time.perf_counter()
    results = learning.run(args.config, seeds=range(args.seeds), variants=args.variants.split(","), out=out,
                           steps=args.steps, eval_every=args.eval_every, common=TASK, jobs=args.jobs,
                           xla_flags=args.xla_flags)
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
