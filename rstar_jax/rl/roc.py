"""Resample-on-Correct (RoC): keep G of 2G rollouts per prompt (host side, numpy).

rStar2-Agent oversamples 2G rollouts per question, drops groups whose rewards are all equal (they
carry no GRPO signal; not refilled), and keeps G: negatives uniformly, positives favouring low tool
error and format penalties. Two variants (see rstar2 spec §1.3–1.4):

- ``paper``: negatives sampled uniformly, ⌊n_neg·G/n⌋ of them (⌊n_neg/2⌋ at n = 2G), or at least
  `min_negatives` where the group has them; positives sampled without replacement with weight
  1 / (p_total + ε); p_err counts failed calls by execution status.
- ``release``: banker's-rounded proportional counts with a minimum of 2 per class, the lowest-penalty
  positives first (stable), the first negatives in rollout order; p_err and p_format computed from
  counts the release reads off the decoded text (`rstar_jax.agent.stats.release_counts`).

Paper variant, two choices the paper leaves open:
- ε sets how random the positive draw is. p_total is a sum of halves and fractions, so a zero-penalty
  positive (no failed call, one answer) weighs 1/ε against about 1/(p + ε) ≈ 2 for one without tool
  calls (p = 0.5): at ε = 1e-3 the zero-penalty positives are nearly always drawn first, close to the
  release's deterministic lowest-penalty-first; ε ≈ 0.1 keeps the draw visibly random.
- A group with one negative keeps ⌊1/2⌋ = 0 of it at n = 2G: its kept rollouts are all positive, with
  equal rewards and advantage 0. Kept (`zero_advantage="keep"`, the paper read literally) its tokens
  still count in the token-mean denominator, scaling the other groups' gradient down by their share
  of the batch's tokens; `"drop"` removes such groups after selection (counted in
  `roc/dropped_zero_advantage`), and `min_negatives=1` keeps the negative instead.

Penalties are computed separately (`paper_penalty`, `release_penalty`) from per-rollout counts, so
the selection is one function for both variants and this module never parses text.
"""

from __future__ import annotations

import dataclasses

import numpy as np


VARIANTS = ("paper", "release")
ZERO_ADVANTAGE = ("keep", "drop")


@dataclasses.dataclass(frozen=True)
class RocConfig:
    """How `resample_on_correct` keeps G of a group's rollouts (the draw's seed is per call).

    Attributes:
      group_size: G, the rollouts kept per group; the caller samples more (rStar2-Agent: 2G = 32
        sampled, 16 kept). Groups of at most G are kept whole (the release variant drops those
        smaller than G).
      variant: "paper" (negatives drawn uniformly, positives drawn with weight 1 / (penalty + ε))
        or "release" (the rStar2 release's deterministic counts and order); the module docstring
        says how they differ.
      epsilon: paper variant: ε in the positives' weight 1 / (p_total + ε); ε = 1e-3 nearly always
        draws the zero-penalty positives first, ε ≈ 0.1 keeps the draw visibly random.
      min_per_class: release variant: at least this many negatives and positives where the group
        has them (the release's 2).
      min_negatives: paper variant: keep at least this many negatives where the group has them
        (0: the paper's ⌊n_neg·G/n⌋, which keeps no negative of a group with one).
      zero_advantage: a kept group whose kept rewards are all equal (advantage 0): "keep" (its
        tokens still count in the token-mean denominator) or "drop" (counted in
        `roc/dropped_zero_advantage`).
    """

    group_size: int = 16  # G kept per prompt (rStar2-Agent §4.3: 32 sampled -> 16 kept)
    variant: str = "paper"
    epsilon: float = 1e-3
    min_per_class: int = 2
    min_negatives: int = 0
    zero_advantage: str = "keep"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"RocConfig.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.group_size < 1:
            raise ValueError(f"RocConfig.group_size must be >= 1, got {self.group_size}")
        if self.epsilon <= 0:
            raise ValueError(f"RocConfig.epsilon must be > 0, got {self.epsilon}")
        if self.min_per_class < 0:
            raise ValueError(f"RocConfig.min_per_class must be >= 0, got {self.min_per_class}")
        if not 0 <= self.min_negatives <= self.group_size:
            raise ValueError(f"RocConfig.min_negatives must be in [0, group_size={self.group_size}], "
                             f"got {self.min_negatives}")
        if self.zero_advantage not in ZERO_ADVANTAGE:
            raise ValueError(f"RocConfig.zero_advantage must be one of {ZERO_ADVANTAGE}, got {self.zero_advantage!r}")

# -- penalties ------------------------------------------------------------------------------------

def paper_penalty(n_tool_calls, n_tool_errors, n_answer_tags, n_turns) -> np.ndarray:
    """p_total = p_err + p_format as the paper defines them (Eq. 4–5).

    p_err = 0.5 without tool calls, else failed calls / calls (execution error, timeout or a
    malformed call); p_format = 1 without an answer, else min(1, (answer tags − 1) / turns).
    """
    calls = np.asarray(n_tool_calls, np.float64)
    errors = np.asarray(n_tool_errors, np.float64)
    answers = np.asarray(n_answer_tags, np.float64)
    turns = np.maximum(np.asarray(n_turns, np.float64), 1.0)
    if np.any(errors > calls):
        raise ValueError("paper_penalty: a rollout has more tool errors than tool calls")
    p_err = np.where(calls > 0, errors / np.maximum(calls, 1.0), 0.5)
    p_format = np.where(answers > 0, np.minimum(1.0, (answers - 1.0) / turns), 1.0)
    return p_err + p_format


def release_penalty(n_tool_responses, n_error_responses, n_answer_open, n_answer_close, n_answer_pairs,
                    n_later_turns) -> np.ndarray:
    """The release's penalty (rStar roc.py) from its text counts, which
    `rstar_jax.agent.stats.release_counts` reads from a decoded response."""
    blocks = np.asarray(n_tool_responses, np.float64)
    p_err = np.where(blocks > 0, np.asarray(n_error_responses, np.float64) / np.maximum(blocks, 1.0), 0.5)
    opens = np.asarray(n_answer_open)
    closes = np.asarray(n_answer_close)
    pairs = np.asarray(n_answer_pairs, np.float64)
    turns = np.asarray(n_later_turns, np.float64)
    bad_tags = (opens == 0) | (closes == 0) | (opens != pairs) | (closes != pairs)
    p_format = np.where(bad_tags | (turns == 0), 1.0, np.minimum((pairs - 1.0) / np.maximum(turns, 1.0), 1.0))
    return p_err + p_format


# -- selection ------------------------------------------------------------------------------------

@dataclasses.dataclass
class RocResult:
    kept_indices: np.ndarray  # into the input rollouts, grouped, ascending within each group
    groups_total: int
    groups_kept: int
    dropped_all_correct: int
    dropped_all_wrong: int
    dropped_too_small: int
    kept_positive_penalty_mean: float  # nan when no positive was kept
    discarded_positive_penalty_mean: float  # nan when none was discarded
    # Kept groups whose kept rewards are all equal (advantage 0): dropped or kept per `zero_advantage`.
    zero_advantage_groups: int = 0
    dropped_zero_advantage: int = 0

    def stats(self) -> dict:
        """Step metrics; the penalty means appear only when defined (no NaN in logs)."""
        stats = {
            "roc/groups_total": self.groups_total,
            "roc/groups_kept": self.groups_kept,
            "roc/dropped_all_correct": self.dropped_all_correct,
            "roc/dropped_all_wrong": self.dropped_all_wrong,
            "roc/dropped_too_small": self.dropped_too_small,
            "roc/zero_advantage_groups": self.zero_advantage_groups,
            "roc/dropped_zero_advantage": self.dropped_zero_advantage,
            "roc/rollouts_kept": int(len(self.kept_indices)),
        }
        for name, value in (("roc/kept_positive_penalty", self.kept_positive_penalty_mean),
                            ("roc/discarded_positive_penalty", self.discarded_positive_penalty_mean)):
            if not np.isnan(value):
                stats[name] = value
        return stats


def _release_counts(n: int, n_neg: int, n_pos: int, g: int, minimum: int) -> tuple[int, int]:
    neg_k = round(n_neg * g / n)  # Python's round: half to even, as the release
    pos_k = round(n_pos * g / n)
    if neg_k <= min(minimum, n_neg):
        neg_k = min(minimum, n_neg)
        pos_k = g - neg_k
    if pos_k <= min(minimum, n_pos):
        pos_k = min(minimum, n_pos)
        neg_k = g - pos_k
    return min(neg_k, n_neg), min(pos_k, n_pos)


def resample_on_correct(rewards, group_ids, penalties, config: RocConfig = RocConfig(), *, seed) -> RocResult:
    """Drops all-equal groups and keeps `config.group_size` rollouts of each remaining group.

    Args:
      rewards: [N] rewards (> 0 is a positive).
      group_ids: [N] prompt/group id of each rollout; rollout order within a group is index order.
      penalties: [N] p_total per rollout (`paper_penalty` or `release_penalty`).
      config: the selection (`RocConfig`).
      seed: the paper variant's random draw, anything `np.random.default_rng` takes (an int, a
        sequence of ints such as (run seed, step), a SeedSequence or a Generator). Required, so
        that each call draws as its caller intends: pass a new one per step (a fixed seed draws
        the same positions every step) and the same one to repeat a draw. The release variant
        does not draw and ignores it.

    Returns:
      `RocResult`: the kept indices (grouped, ascending within each group) and what was dropped;
      `RocResult.stats()` gives them as `roc/*` metrics.
    """
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    penalties = np.asarray(penalties, np.float64)
    if not (rewards.shape == group_ids.shape == penalties.shape) or rewards.ndim != 1:
        raise ValueError(
            f"resample_on_correct: rewards {rewards.shape}, group_ids {group_ids.shape} and penalties "
            f"{penalties.shape} must be equal 1-D shapes"
        )
    if np.any(~np.isfinite(penalties)) or np.any(penalties < 0):
        raise ValueError("resample_on_correct: penalties must be finite and >= 0")
    g = config.group_size
    rng = np.random.default_rng(seed)
    _, first = np.unique(group_ids, return_index=True)
    kept: list[np.ndarray] = []
    counts = dict(all_correct=0, all_wrong=0, too_small=0, kept=0, zero_advantage=0, dropped_zero_advantage=0)
    kept_pos_pen: list[float] = []
    dropped_pos_pen: list[float] = []
    for gid in group_ids[np.sort(first)]:
        idx = np.flatnonzero(group_ids == gid)
        r = rewards[idx]
        if np.all(r == r[0]):
            counts["all_correct" if r[0] > 0 else "all_wrong"] += 1
            continue
        n = len(idx)
        pos = idx[r > 0]
        neg = idx[r <= 0]
        if n <= g:
            if config.variant == "release" and n < g:
                counts["too_small"] += 1  # the release drops groups smaller than G
                continue
            choice_pos, choice_neg = pos, neg
        elif config.variant == "release":
            neg_k, pos_k = _release_counts(n, len(neg), len(pos), g, config.min_per_class)
            order = np.argsort(penalties[pos], kind="stable")
            choice_pos = pos[order[:pos_k]]
            choice_neg = neg[:neg_k]
        else:
            neg_k = min(len(neg), max((len(neg) * g) // n, config.min_negatives))
            pos_k = min(len(pos), g - neg_k)
            neg_k = g - pos_k  # when positives are too few, the rest are negatives
            choice_neg = rng.choice(neg, size=neg_k, replace=False) if neg_k else neg[:0]
            if pos_k:
                weights = 1.0 / (penalties[pos] + config.epsilon)
                choice_pos = rng.choice(pos, size=pos_k, replace=False, p=weights / weights.sum())
            else:
                choice_pos = pos[:0]
        chosen = np.sort(np.concatenate([choice_pos, choice_neg]))
        if np.all(rewards[chosen] == rewards[chosen[0]]):
            counts["zero_advantage"] += 1
            if config.zero_advantage == "drop":
                counts["dropped_zero_advantage"] += 1
                continue
        kept.append(chosen)
        counts["kept"] += 1
        kept_pos_pen.extend(penalties[choice_pos].tolist())
        dropped_pos_pen.extend(penalties[np.setdiff1d(pos, choice_pos)].tolist())
    return RocResult(
        kept_indices=np.concatenate(kept) if kept else np.zeros(0, np.int64),
        groups_total=len(first),
        groups_kept=counts["kept"],
        dropped_all_correct=counts["all_correct"],
        dropped_all_wrong=counts["all_wrong"],
        dropped_too_small=counts["too_small"],
        kept_positive_penalty_mean=float(np.mean(kept_pos_pen)) if kept_pos_pen else float("nan"),
        discarded_positive_penalty_mean=float(np.mean(dropped_pos_pen)) if dropped_pos_pen else float("nan"),
        zero_advantage_groups=counts["zero_advantage"],
        dropped_zero_advantage=counts["dropped_zero_advantage"],
    )
