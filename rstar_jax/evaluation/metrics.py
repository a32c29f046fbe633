"""Evaluation metrics: avg@k pass@1 with its standard error, and unbiased pass@k.

avg@k is the paper's headline metric (rStar2-Agent §5.1: avg@16): sample k responses per question,
score each 0/1, average within a question, then across questions. Its standard error is that of the
mean of the per-question averages across questions (ddof=1), i.e. it treats the question set as the
sample; the within-question sampling noise is part of each per-question average.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al., 2021): 1 - C(n-c, k) / C(n, k).

    Computed as a running product so it is exact for large n without huge binomials.
    """
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass_at_k: num_correct={num_correct} outside [0, num_samples={num_samples}]")
    if k > num_samples:
        raise ValueError(f"pass_at_k: k={k} exceeds the {num_samples} samples drawn")
    if num_samples - num_correct < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


@dataclasses.dataclass(frozen=True)
class EvalSummary:
    num_questions: int
    samples_per_question: int
    avg_at_k: float  # mean pass@1 over questions and samples
    avg_at_k_stderr: float
    pass_at_k: dict[int, float]
    per_question_mean: dict[str, float]

    def as_dict(self) -> dict:
        return {
            "num_questions": self.num_questions,
            "samples_per_question": self.samples_per_question,
            "avg_at_k": self.avg_at_k,
            "avg_at_k_stderr": self.avg_at_k_stderr,
            **{f"pass_at_{k}": v for k, v in sorted(self.pass_at_k.items())},
        }


def summarize(rewards_by_question: Mapping[str, Sequence[float]], ks: Sequence[int] = (1,)) -> EvalSummary:
    """avg@k, its standard error and pass@k from binary rewards grouped by question.

    Every question must have the same number of samples k (the protocol samples k per question);
    a ragged set means an interrupted run, which must be resumed rather than silently averaged.
    """
    if not rewards_by_question:
        raise ValueError("summarize: no questions to summarise")
    counts = {qid: len(r) for qid, r in rewards_by_question.items()}
    k_values = set(counts.values())
    if len(k_values) != 1:
        worst = sorted(counts.items(), key=lambda kv: kv[1])[:3]
        raise ValueError(f"summarize: questions have different sample counts {sorted(k_values)}; e.g. {worst}")
    (n,) = k_values
    if n == 0:
        raise ValueError("summarize: every question has zero samples")
    per_question = {}
    correct = {}
    for qid, rewards in rewards_by_question.items():
        arr = np.asarray(rewards, np.float64)
        if not np.all((arr == 0.0) | (arr == 1.0)):
            raise ValueError(f"summarize: question {qid!r} has non-binary rewards {sorted(set(arr.tolist()))}")
        per_question[qid] = float(arr.mean())
        correct[qid] = int(arr.sum())
    means = np.asarray(list(per_question.values()))
    stderr = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else 0.0
    pass_k = {}
    for k in ks:
        if k > n:
            raise ValueError(f"summarize: pass@{k} needs at least {k} samples per question, have {n}")
        pass_k[int(k)] = float(np.mean([pass_at_k(n, c, k) for c in correct.values()]))
    return EvalSummary(
        num_questions=len(means),
        samples_per_question=n,
        avg_at_k=float(means.mean()),
        avg_at_k_stderr=stderr,
        pass_at_k=pass_k,
        per_question_mean=per_question,
    )
