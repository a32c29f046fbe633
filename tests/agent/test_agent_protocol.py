"""The rStar2 protocol: tokenizers, exact prompt strings, tool-call parsing, observations, reward."""

import json
import time

import pytest

from rstar_jax.agent.reward import VerifierPool, extract_answer, is_equivalent, score
from rstar_jax.agent.template import GENERATION_PROMPT, SYSTEM_PROMPT, ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, IM_START, ByteTokenizer, HFTokenizer
from rstar_jax.agent.tool_calls import ToolCall, ToolCallError, format_observation, parse_tool_calls, truncate_middle

TEMPLATE = ChatTemplate()
TOK = ByteTokenizer()


def test_byte_tokenizer_round_trip_and_specials():
    text = f"{IM_START}user\nx = 2 ÷ 3 ∑ 🙂{IM_END}\n"
    ids = TOK.encode(text)
    assert ids[0] == TOK.token_to_id(IM_START) == 257 and TOK.eos_id == 258 == ids[-2]
    assert TOK.decode(ids) == text
    assert TOK.decode(ids, skip_special_tokens=True) == "user\nx = 2 ÷ 3 ∑ 🙂\n"
    assert TOK.vocab_size == 320 and max(ids) < TOK.vocab_size


def test_hf_tokenizer_wrapper(tmp_path):
    from tokenizers import Tokenizer, models

    from tests.agent_helpers import write_chatml_tokenizer

    write_chatml_tokenizer(tmp_path)
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz <>/\n")}
    hf = HFTokenizer(tmp_path)
    ids = hf.encode(f"{IM_START}ab{IM_END}")
    assert ids[0] == hf.token_to_id(IM_START) and ids[-1] == hf.eos_id
    assert hf.decode(ids) == f"{IM_START}ab{IM_END}" and hf.decode(ids, skip_special_tokens=True) == "ab"
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="a")).save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match="no '<\\|im_start\\|>' token"):
        HFTokenizer(tmp_path / "plain.json")


def _spec_block(spec: str, start: str) -> str:
    """The text of the first `> ` quoted line after `start` in the spec, backtick-quoted."""
    i = spec.index(start)
    line = next(l for l in spec[i:].splitlines() if l.startswith("   > `"))
    return line.strip()[3:-1]


def test_prompt_strings_equal_the_spec(shared_dir):
    spec = (shared_dir / "reference" / "rstar2_spec.md").read_text()
    system = _spec_block(spec, "followed by the default system text")
    header = _spec_block(spec, "2. A tools block in Hermes/Qwen style").replace("\\n", "\n")
    footer = _spec_block(spec, "then, for each tool, `\\n` followed by").replace("\\n", "\n")
    prefix = _spec_block(spec, "3. The user turn").replace("\\n", "\n")
    text = TEMPLATE.render_prompt("What is 1+1?")
    tools = "\n" + json.dumps(TEMPLATE.tools[0])
    expected = (f"{IM_START}system\n{system}{header}{tools}{footer}"
                f"{IM_START}user\n{prefix}What is 1+1?{IM_END}\n{IM_START}assistant\n<reason>")
    assert text == expected
    assert '"name": "python_code_with_standard_io"' in text


def test_prompt_and_tool_response_token_level():
    question = "Compute 7^77 mod 1000."
    ids = TEMPLATE.prompt_ids(TOK, question)
    assert TOK.decode(ids) == TEMPLATE.render_prompt(question)
    assert ids[-len(TOK.encode(GENERATION_PROMPT)):] == TOK.encode(GENERATION_PROMPT)
    obs = TEMPLATE.tool_response_ids(TOK, "Tool call success\nstdout: 43")
    assert TOK.decode(obs) == (f"{IM_START}user\n<tool_response>\nTool call success\nstdout: 43\n</tool_response>"
                               f"{IM_END}\n{IM_START}assistant\n<reason>")
    assert obs[0] == TOK.token_to_id(IM_START)  # no newline after the model's <|im_end|>


def test_sft_segments_train_only_assistant_text():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
                {"role": "tool", "content": "out"}, {"role": "assistant", "content": "a2"}]
    segs = TEMPLATE.sft_segments(messages)
    assert [t for t, trained in segs if trained] == [f"a1{IM_END}", f"a2{IM_END}"]
    assert "".join(t for t, _ in segs).endswith(f"<reason>a2{IM_END}")
    with pytest.raises(ValueError, match=r"messages\[1\]: expected \{role: system\|user\|assistant\|tool"):
        TEMPLATE.sft_segments([{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}])


TOOLS = ("python_code_with_standard_io",)


@pytest.mark.parametrize("text,expected", [
    ("no call here <answer>\\boxed{3}</answer>", []),
    ("<tool_call>{\"name\": \"python_code_with_standard_io\", \"arguments\": {\"code\": \"print(1)\"", []),
    ("<tool_call>{bad json}</tool_call>", ToolCallError),
    ('<tool_call>{"arguments": {"code": "x"}}</tool_call>', "missing field 'name'"),
    ('<tool_call>{"name": "python_code_with_standard_io"}</tool_call>', "missing field 'arguments'"),
    ('<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>', "Unknown tool 'shell'"),
    ('<tool_call>{"name": "python_code_with_standard_io", "arguments": {"input": "1"}}</tool_call>',
     "argument 'code'"),
    ('<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": "print(1)", "input": 5}}</tool_call>',
     "argument 'input'"),
    ('<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": "' + "x" * 200 + '"}}</tool_call>',
     "more than the limit"),
])
def test_parser_table(text, expected):
    calls = parse_tool_calls(text, tool_names=TOOLS, max_code_chars=100)
    if expected == []:
        assert calls == []
    elif expected is ToolCallError:
        assert isinstance(calls[0], ToolCallError) and calls[0].message.startswith("Failed to decode tool call")
    else:
        assert isinstance(calls[0], ToolCallError) and expected in calls[0].message


def test_parser_takes_the_first_of_two_calls_and_defaults_input():
    text = ('<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": "print(1)"}}\n</tool_call>'
            '<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": "print(2)"}}</tool_call>')
    assert parse_tool_calls(text, tool_names=TOOLS) == [ToolCall("python_code_with_standard_io", "print(1)", "")]
    assert len(parse_tool_calls(text, tool_names=TOOLS, max_calls=2)) == 2


class _Result:
    def __init__(self, status, stdout="", stderr="", duration_s=0.1234):
        self.status, self.stdout, self.stderr, self.duration_s = status, stdout, stderr, duration_s


def test_observation_styles_and_truncation():
    ok = _Result("ok", stdout="42\n")
    assert format_observation(ok, style="release") == "Tool call success\nstdout: 42\n\nexecution time: 0.12s"
    assert format_observation(ok, style="paper") == "42\n"
    timeout = _Result("timeout")
    assert format_observation(timeout, style="release") == ("Tool call failure\nreason: worker_timeout\n"
                                                            "execution time: 0.12s")
    assert format_observation(timeout, style="paper") == "tool call failed\nreason: timeout"
    err = _Result("runtime_error", stderr="ZeroDivisionError at line 1")
    assert "ZeroDivisionError" in format_observation(err, style="paper")
    assert format_observation(err, style="release") == ("Tool call failure\nreason: \n"
                                                        "stderr: ZeroDivisionError at line 1\nexecution time: 0.12s")
    assert "reason: internal_error" in format_observation(_Result("sandbox_error"), style="release")
    with pytest.raises(ValueError, match="style"):
        format_observation(ok, style="verbose")
    long = "a" * 100 + "b" * 100
    out = truncate_middle(long, 20)
    assert out == "a" * 10 + "...(truncated)..." + "b" * 10
    assert format_observation(_Result("ok", stdout=long), style="paper", max_chars=20) == out


def test_extraction_rules():
    assert extract_answer("<reason>\\boxed{1}</reason><answer>so \\boxed{\\frac{1}{2}}</answer>") == "\\frac{1}{2}"
    assert extract_answer("we get \\boxed{x^{2}} and then \\boxed{7}") == "7"
    assert extract_answer("The answer is 12.") == "12"
    assert extract_answer("nothing here") is None


def test_reward_amc23_gold_in_equivalent_forms(shared_dir):
    rows = json.loads((shared_dir / "data" / "amc23_test.json").read_text())
    assert len(rows) == 40
    for i, row in enumerate(rows):
        gold = str(row["answer"])
        for form in (gold, f"${gold}$", f"{gold}.0"):
            assert score(f"</reason><answer>\\boxed{{{form}}}</answer>", gold) == 1.0, (gold, form)
        other = str(rows[(i + 1) % len(rows)]["answer"])
        if other != gold:
            assert score(f"<answer>\\boxed{{{other}}}</answer>", gold) == 0.0, (gold, other)
    assert is_equivalent("\\frac{1}{2}", "0.5") and is_equivalent("1,000", "1000")


def test_truncated_trajectory_scores_zero():
    assert score("<answer>\\boxed{5}</answer>", "5", truncated=True) == 0.0
    assert score("<answer>\\boxed{5}</answer>", "5") == 1.0


def test_verifier_pool_times_out_without_blocking_others():
    from tests.agent_helpers import slow_score

    with VerifierPool(workers=2, timeout_s=1.0, score_fn=slow_score) as pool:
        import asyncio

        async def run():
            start = time.perf_counter()
            hung, fast = await asyncio.gather(pool.score("hang 5", "5"), pool.score("is 5", "5"))
            return hung, fast, time.perf_counter() - start

        hung, fast, elapsed = asyncio.run(run())
        assert hung == 0.0 and fast == 1.0 and pool.timeouts == 1
        # The killed worker was replaced: the pool still answers.
        assert pool.score_blocking("is 7", "7") == 1.0
        assert elapsed < 30  # bounded by the 1 s deadline, not the 60 s hang


def test_allowed_specials_and_im_end_id():
    literal = ByteTokenizer(allowed_specials=(IM_START,))
    ids = literal.encode(f"{IM_START}a{IM_END}")
    assert ids[0] == 257 and ids[1:] == list(f"a{IM_END}".encode()) and literal.im_end_id == literal.eos_id == 258
    assert ByteTokenizer(allowed_specials=()).encode(IM_START) == list(IM_START.encode())
    with pytest.raises(ValueError, match="allowed_specials"):
        ByteTokenizer(allowed_specials=("<tool_call>",))


def test_sandbox_scorer_and_make_scorer():
    import asyncio

    from rstar_jax.agent.reward import SandboxScorer, make_scorer

    class Verdict:
        def __init__(self, correct):
            self.correct, self.status, self.extracted = correct, "ok", None

    class FakeClient:
        def __init__(self):
            self.calls = []

        async def verify(self, text, gold, timeout_s=None):
            self.calls.append((text, gold, timeout_s))
            return Verdict(gold in text)

    client = FakeClient()
    scorer = make_scorer("sandbox", timeout_s=3.0, sandbox_client=client)
    assert isinstance(scorer, SandboxScorer)
    assert asyncio.run(scorer("\\boxed{7}", "7")) == 1.0 and asyncio.run(scorer("\\boxed{8}", "7")) == 0.0
    assert asyncio.run(scorer("\\boxed{7}", "7", truncated=True)) == 0.0
    assert client.calls == [("\\boxed{7}", "7", 3.0), ("\\boxed{8}", "7", 3.0)]  # truncated: no RPC
    with pytest.raises(ValueError, match="sandbox_client"):
        make_scorer("sandbox")
    with pytest.raises(ValueError, match="mode"):
        make_scorer("remote")


def test_template_styles_without_the_tool_and_without_a_system_turn():
    tok = ByteTokenizer()
    compact, plain = ChatTemplate.from_style("compact", "python"), ChatTemplate.from_style("compact", "python", tools=False)
    assert "python" in compact.system_text() and "tool" not in plain.system_text()
    assert ChatTemplate.from_style("rstar2", tools=False).system_text() == f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n"
    bare = ChatTemplate.from_style("bare", "python")
    assert bare.render_prompt("What is 2?") == f"{IM_START}user\nWhat is 2?{IM_END}\n{GENERATION_PROMPT}"
    assert bare.prompt_ids(tok, "What is 2?") == tok.encode(bare.render_prompt("What is 2?"))
