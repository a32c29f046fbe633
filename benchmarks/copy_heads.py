"""How does a warmed-up tiny policy copy the factors into its call and the tool's output into its answer?

    python benchmarks/copy_heads.py runs/tiny/hf/sft_warmup          # the default run's warm-up
    python benchmarks/copy_heads.py runs/tiny/hf/sft_warmup --problems 128 --tool-name python

On held-out `product` problems of configs/tiny.py (bare template, byte tokenizer), teacher-forced on
the warm-up's own tool-use conversation, it prints for every layer and head the mean attention that
the positions predicting the call's expression (`print(47*38)`) give to the same characters of the
question, and that the positions predicting the boxed answer give to the tool's output, with the
teacher-forced accuracy of both copies. Then the causal check: the same accuracy when every position
after the question is moved one further away (the `positions` argument; the tokens are unchanged). A
copy that finds its source by content (an induction head: the token it just wrote, earlier in the
context) does not care; a head that reads a fixed distance back copies the neighbouring character.

The attention is recomputed layer by layer from the model's parameters; the script checks that the
recomputation reproduces the model's own logits before it prints anything.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.agent.tool_calls import format_observation
from rstar_jax.data.synthetic import held_out_problems, sft_conversation
from rstar_jax.model.hf import load_pretrained
from rstar_jax.model.qwen3 import rms_norm, rope
from rstar_jax.train.sft import conversation_ids


def conversations(num: int, seed: int, tool_name: str, behaviour: str = "tool", error_format: str = "traceback",
                  observation_chars: int = 64, fix_bug: str = "unclosed"):
    """Token ids of `num` held-out conversations of `behaviour` ("tool", or "fix": a failed call, its
    error as the paper-style observation of `observation_chars` shows it, then the call again) and,
    per conversation, the (source, copy) token positions of each copy (`call`: the question's
    expression into the first call; `answer`: the tool's output into the boxed answer; for "fix",
    `fix`: the expression's last occurrence before the second call, in the error, into that call),
    and the token at which the reply that holds the probed copy starts (the first reply, or for
    "fix" the second)."""
    tokenizer, template = ByteTokenizer(), ChatTemplate.bare(tool_name)
    observation = functools.partial(format_observation, style="paper", max_chars=observation_chars)
    rows = []
    for problem in held_out_problems(num_eval=num, seed=seed, kinds=("product",), difficulty=1):
        messages = sft_conversation(problem, tool_name=tool_name, behaviour=behaviour, error_format=error_format,
                                    fix_bug=fix_bug, format_observation=observation)
        ids, _ = conversation_ids(template, tokenizer, messages, "rstar2")
        pieces = [tokenizer.decode([i]) for i in ids]
        text = "".join(pieces)
        starts = np.cumsum([0] + [len(p) for p in pieces])

        def token_at(char: int) -> int:
            return int(np.searchsorted(starts, char, side="right") - 1)

        def copy(source: int, target: int, length: int) -> list[tuple[int, int]]:
            return [(token_at(source + k), token_at(target + k)) for k in range(length)]

        expression = problem.question[problem.question.index("(") + 1:problem.question.index(")")]
        answer = str(problem.answer)
        calls = [at + len("print(") for at in _occurrences(text, "print(" + expression)]
        output_at = text.rindex("<tool_response>\n") + len("<tool_response>\n")
        boxed_at = text.index("\\boxed{") + len("\\boxed{")
        copies = {"call": copy(text.index(expression), calls[0], len(expression)),
                  "answer": copy(output_at, boxed_at, len(answer))}
        replies = _occurrences(text, "<|im_start|>assistant")
        if behaviour == "fix":
            echo = max(at for at in _occurrences(text, expression) if at < calls[-1])
            copies["fix"] = copy(echo, calls[-1], len(expression))
        rows.append((ids, copies, token_at(replies[1 if behaviour == "fix" else 0])))
    length = max(len(row[0]) for row in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    for i, (ids, *_) in enumerate(rows):
        tokens[i, :len(ids)] = ids
    return tokens, rows


def _occurrences(text: str, part: str) -> list[int]:
    return [at for at in range(len(text)) if text.startswith(part, at)]


def attention_by_layer(model, tokens: jax.Array, positions: jax.Array):
    """Per layer, the attention weights [B, heads, T, T]; and the final logits."""
    c = model.config
    params = {name: getattr(model, name)[...] for name in model.LAYER_PARAMS}
    h = model.embed[...][tokens]
    causal = positions[:, :, None] >= positions[:, None, :]
    weights = []
    for layer in range(c.num_layers):
        p = {name: value[layer] for name, value in params.items()}
        x = rms_norm(h, p["input_norm"], c.rms_norm_eps)
        q = rope(rms_norm(jnp.einsum("btd,dhk->bthk", x, p["q_proj"]), p["q_norm"], c.rms_norm_eps), positions, c.rope_theta)
        k = rope(rms_norm(jnp.einsum("btd,dhk->bthk", x, p["k_proj"]), p["k_norm"], c.rms_norm_eps), positions, c.rope_theta)
        v = jnp.einsum("btd,dhk->bthk", x, p["v_proj"])
        group = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.head_dim)
        w = jax.nn.softmax(jnp.where(causal[:, None], scores, -jnp.inf), axis=-1)
        weights.append(np.asarray(w))
        h = h + jnp.einsum("bqhd,hdo->bqo", jnp.einsum("bhqk,bkhd->bqhd", w, v), p["o_proj"])
        x = rms_norm(h, p["post_attn_norm"], c.rms_norm_eps)
        h = h + jnp.einsum("btf,fd->btd", jax.nn.silu(x @ p["gate_proj"]) * (x @ p["up_proj"]), p["down_proj"])
    logits = jnp.einsum("btd,dv->btv", rms_norm(h, model.final_norm[...], c.rms_norm_eps), model.unembedding())
    return weights, np.asarray(logits)


def copy_accuracy(predicted: np.ndarray, tokens: np.ndarray, rows, name: str) -> float:
    """Share of conversations whose every token of copy `name` is predicted."""
    return float(np.mean([all(predicted[i, dst - 1] == tokens[i, dst] for _, dst in row[1][name])
                          for i, row in enumerate(rows)]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="a Hugging Face export of a warmed-up tiny policy")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the held-out problems' seed (data.synthetic.seed)")
    parser.add_argument("--tool-name", default="python", help="rollout.tool_name of the run")
    parser.add_argument("--behaviour", choices=("tool", "fix"), default="tool",
                        help="fix: a failed call, its error and the call again (benchmarks/roc_effect.py's recovery)")
    parser.add_argument("--error-format", default="traceback", help="sandbox.error_format of the run (fix)")
    parser.add_argument("--observation-chars", type=int, default=64, help="rollout.observation_max_chars of the run")
    parser.add_argument("--fix-bug", default="unclosed", help="data.synthetic.fix_bug of the run (fix)")
    args = parser.parse_args(argv)

    model = load_pretrained(args.hf_dir)
    tokens, rows = conversations(args.problems, args.seed, args.tool_name, args.behaviour, args.error_format,
                                 args.observation_chars, args.fix_bug)
    names = list(rows[0][1])
    x = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    weights, logits = attention_by_layer(model, x, positions)
    reference = np.asarray(model(x, positions))
    if not np.allclose(logits, reference, atol=1e-3, rtol=1e-3):
        print(f"recomputed logits differ from the model's by {np.abs(logits - reference).max():.3g}", file=sys.stderr)
        return 1
    predicted = reference.argmax(-1)

    print(f"{args.hf_dir}: {len(rows)} held-out {args.behaviour} conversations, teacher-forced")
    print("copy accuracy: " + ", ".join(f"{name} {copy_accuracy(predicted, tokens, rows, name):.3f}" for name in names))
    print("attention from the position before each copied token to its source (mean), per head:")
    for layer, w in enumerate(weights):
        for head in range(w.shape[1]):
            means = [np.mean([w[i, head, dst - 1, src] for i, row in enumerate(rows) for src, dst in row[1][name]])
                     for name in names]
            mark = "  <- copies" if max(means) > 0.2 else ""
            print(f"  layer {layer} head {head}: " + "  ".join(f"{name} {m:.2f}" for name, m in zip(names, means)) + mark)

    # The probed reply (the first, or the fix's) and everything after it one position further away:
    # content unchanged.
    reply = np.array([row[2] for row in rows])
    shifted = positions + (positions >= reply[:, None]).astype(jnp.int32)
    moved = np.asarray(model(x, shifted)).argmax(-1)
    where = "the first reply and all after it one position further from the question" if args.behaviour == "tool" else \
        "the second call's reply and all after it one position further from the error"
    print(f"with {where}: " + ", ".join(f"{name} {copy_accuracy(moved, tokens, rows, name):.3f}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
