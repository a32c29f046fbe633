"""Bytes and encode+decode time of one RL step's trajectories crossing processes: the JSON gather
(`allgather_json` of `dataclasses.asdict`, the trainer's former path) against the token arrays
(`pack_trajectories` + `allgather_arrays`' buffer, the trainer's path now).

`RLTrainer.rollout_shared` gathers every trajectory before RoC: prompts × rollouts_per_prompt
(stage 1: 512 × 32 = 16384), each with up to the 8K-token response budget. Synthetic trajectories
of that shape: a prompt of ~300 tokens shared by its group, turns of sampled tokens (float32
log-probs, as the generators return) separated by tool observations (loss mask 0, log-prob 0.0,
version -1), the decoded model text at ~4 characters per sampled token, a question at ~4
characters per prompt token. Holding a whole step's trajectories as Python lists would take over
10 GB, so `--sample-prompts` groups are built and measured and every figure is scaled to the step
(both encodings are a per-trajectory sum plus a constant header; the scaling is printed). Times
are this process's CPU seconds (`time.process_time`: both paths are single-threaded Python, and CPU
time holds steady on a shared, loaded machine), not the collective's transfer.

    python benchmarks/multihost_gather.py [--prompts 512 --rollouts 32 --tokens 8192 --sample-prompts 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import numpy as np

from rstar_jax.parallel.multihost import decode_arrays, encode_arrays
from rstar_jax.rollout.trajectory import Trajectory, pack_trajectories, unpack_trajectories

WORDS = ["Let", "x", "=", "\\frac{a}{b}", "then", "we", "compute", "the", "sum", "∑", "of", "squares", "so",
         "```python\nprint(sum(i**2 for i in range(10)))\n```", "\\boxed{42}", "≤", "because", "π", "\n"]


def _text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def synthetic_group(rng: random.Random, group_id: int, rollouts: int, tokens: int, version: int) -> list[Trajectory]:
    prompt = [rng.randrange(151_000) for _ in range(rng.randint(200, 400))]
    question = _text(rng, 4 * (len(prompt) - 60))  # the template's tokens around the question
    group = []
    for sample in range(rollouts):
        length = rng.randint(int(0.9 * tokens), tokens)  # ~8K: at or near the response budget
        ids, mask, logprobs, versions, statuses = [], [], [], [], []
        while len(ids) < length:
            turn = rng.randint(600, 2500)  # sampled tokens of one turn
            ids += [rng.randrange(151_000) for _ in range(turn)]
            mask += [1] * turn
            logprobs += [float(np.float32(-rng.expovariate(3.0))) for _ in range(turn)]
            versions += [version] * turn
            if len(ids) < length:  # a tool observation
                obs = rng.randint(30, 300)
                ids += [rng.randrange(151_000) for _ in range(obs)]
                mask += [0] * obs
                logprobs += [0.0] * obs
                versions += [-1] * obs
                statuses.append(rng.choice(["ok", "ok", "ok", "error"]))
        ids, mask, logprobs, versions = ids[:length], mask[:length], logprobs[:length], versions[:length]
        group.append(Trajectory(
            prompt_ids=list(prompt), response_ids=ids, loss_mask=mask, sampler_logprobs=logprobs,
            policy_versions=versions, reward=float(rng.random() < 0.5), finish_reason="no_tool_call",
            truncated=False, group_id=group_id, sample_index=sample, question=question, gold_answer="42",
            n_turns=len(statuses) + 1, n_tool_calls=len(statuses), n_tool_errors=statuses.count("error"),
            n_answer_tags=1, tool_statuses=statuses, tool_seconds=rng.random() * 5,
            extra={"model_text": _text(rng, 4 * sum(mask))}))
    return group


def json_encode(trajectories):
    return np.frombuffer(json.dumps([dataclasses.asdict(t) for t in trajectories], separators=(",", ":")).encode(),
                         np.uint8)


def json_decode(buffer):
    return [Trajectory(**record) for record in json.loads(buffer.tobytes())]


def binary_encode(trajectories):
    return encode_arrays(*pack_trajectories(trajectories))


def binary_decode(buffer):
    return unpack_trajectories(*decode_arrays(buffer))


def measure(encode, decode, trajectories):
    t0 = time.process_time()
    buffer = encode(trajectories)
    t1 = time.process_time()
    decoded = decode(buffer)
    t2 = time.process_time()
    assert decoded == trajectories
    return buffer.size, t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--rollouts", type=int, default=32, help="trajectories per prompt gathered (before RoC)")
    parser.add_argument("--tokens", type=int, default=8192, help="response budget (tokens)")
    parser.add_argument("--sample-prompts", type=int, default=2, help="groups built and measured")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sample = [t for g in range(args.sample_prompts) for t in synthetic_group(rng, g, args.rollouts, args.tokens, 7)]
    scale = args.prompts / args.sample_prompts
    tokens = sum(len(t.response_ids) for t in sample)
    text = sum(len(t.extra["model_text"]) for t in sample)
    print(f"sample: {len(sample)} trajectories, {tokens / len(sample):.0f} response tokens and "
          f"{text / len(sample):.0f} model-text chars each; scaled x{scale:g} to {args.prompts} x {args.rollouts} "
          f"= {args.prompts * args.rollouts} trajectories per step")
    results = {}
    paths = {"json": (json_encode, json_decode), "binary": (binary_encode, binary_decode)}
    for name, (encode, decode) in paths.items():
        size, enc, dec = measure(encode, decode, sample)
        results[name] = (size * scale, enc * scale, dec * scale)
        print(f"{name:>6}: {size * scale / 1e9:8.2f} GB/step ({size / tokens:5.2f} B/response token)   "
              f"encode {enc * scale:7.1f} s   decode {dec * scale:7.1f} s   (CPU s per step, one process doing all)")
    (jb, je, jd), (bb, be, bd) = results["json"], results["binary"]
    print(f"ratio json/binary: bytes {jb / bb:.2f}x   encode {je / be:.2f}x   decode {jd / bd:.2f}x   "
          f"encode+decode {(je + jd) / (be + bd):.2f}x")


if __name__ == "__main__":
    main()
