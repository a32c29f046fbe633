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
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.data.synthetic import held_out_problems, sft_conversation
from rstar_jax.model.hf import load_pretrained
from rstar_jax.model.qwen3 import rms_norm, rope
from rstar_jax.train.sft import conversation_ids


def conversations(num: int, seed: int, tool_name: str):
    """Token ids of `num` tool-use conversations and, per conversation, the (source, copy) token
    positions of the call's expression and of the answer, and where the first reply starts."""
    tokenizer, template = ByteTokenizer(), ChatTemplate.bare(tool_name)
    rows = []
    for problem in held_out_problems(num_eval=num, seed=seed, kinds=("product",), difficulty=1):
        ids, _ = conversation_ids(template, tokenizer, sft_conversation(problem, tool_name=tool_name, behaviour="tool"),
                                  "rstar2")
        pieces = [tokenizer.decode([i]) for i in ids]
        text = "".join(pieces)
        starts = np.cumsum([0] + [len(p) for p in pieces])

        def token_at(char: int) -> int:
            return int(np.searchsorted(starts, char, side="right") - 1)

        expression = problem.question[problem.question.index("(") + 1:problem.question.index(")")]
        question_at = text.index(expression)
        call_at = text.index("print(" + expression) + len("print(")
        answer = str(problem.answer)
        output_at = text.index("<tool_response>\n") + len("<tool_response>\n")
        boxed_at = text.index("\\boxed{") + len("\\boxed{")
        call = [(token_at(question_at + k), token_at(call_at + k)) for k in range(len(expression))]
        boxed = [(token_at(output_at + k), token_at(boxed_at + k)) for k in range(len(answer))]
        reply = token_at(text.index("<|im_start|>assistant"))
        rows.append((ids, call, boxed, reply))
    length = max(len(row[0]) for row in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    for i, (ids, *_) in enumerate(rows):
        tokens[i, :len(ids)] = ids
    return tokens, rows


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


def copy_accuracy(predicted: np.ndarray, tokens: np.ndarray, rows, which: int) -> float:
    """Share of conversations whose every copied token (call: which=1, answer: which=2) is predicted."""
    return float(np.mean([all(predicted[i, dst - 1] == tokens[i, dst] for _, dst in row[which])
                          for i, row in enumerate(rows)]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="a Hugging Face export of a warmed-up tiny policy")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the held-out problems' seed (data.synthetic.seed)")
    parser.add_argument("--tool-name", default="python", help="rollout.tool_name of the run")
    args = parser.parse_args(argv)

    model = load_pretrained(args.hf_dir)
    tokens, rows = conversations(args.problems, args.seed, args.tool_name)
    x = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    weights, logits = attention_by_layer(model, x, positions)
    reference = np.asarray(model(x, positions))
    if not np.allclose(logits, reference, atol=1e-3, rtol=1e-3):
        print(f"recomputed logits differ from the model's by {np.abs(logits - reference).max():.3g}", file=sys.stderr)
        return 1
    predicted = reference.argmax(-1)

    print(f"{args.hf_dir}: {len(rows)} held-out conversations, teacher-forced")
    print(f"copy accuracy: call {copy_accuracy(predicted, tokens, rows, 1):.3f}, answer {copy_accuracy(predicted, tokens, rows, 2):.3f}")
    print("attention from the position before each copied token to its source (mean), per head:")
    for layer, w in enumerate(weights):
        for head in range(w.shape[1]):
            call, answer = (np.mean([w[i, head, dst - 1, src] for i, row in enumerate(rows) for src, dst in row[which]])
                            for which in (1, 2))
            mark = "  <- copies" if max(call, answer) > 0.2 else ""
            print(f"  layer {layer} head {head}: call {call:.2f}  answer {answer:.2f}{mark}")

    # The first reply and everything after it one position further away: content unchanged.
    reply = np.array([row[3] for row in rows])
    shifted = positions + (positions >= reply[:, None]).astype(jnp.int32)
    moved = np.asarray(model(x, shifted)).argmax(-1)
    print(f"with the first reply and all after it one position further from the question: call "
          f"{copy_accuracy(moved, tokens, rows, 1):.3f}, answer {copy_accuracy(moved, tokens, rows, 2):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
