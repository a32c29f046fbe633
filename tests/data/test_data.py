"""Datasets (jsonl/json/parquet, bad rows, resumable grain iterator) and synthetic tool-use problems."""

import json
import pathlib
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.data import (
    GENERATORS,
    DataError,
    PromptIterator,
    behaviours_for,
    generate_problems,
    held_out_problems,
    load_examples,
    read_conversations,
    read_examples,
    sft_conversation,
    write_problems,
    write_sft_file,
)


# -- synthetic problems ---------------------------------------------------------------------------

def _independent_answer(problem):
    """Re-derives the answer from the question text alone, with sympy."""
    import sympy

    nums = [int(x) for x in re.findall(r"\d+", problem.question)]
    if problem.kind == "digit_sum_power":
        return sum(map(int, str(sympy.Integer(nums[0]) ** nums[1])))
    if problem.kind == "primes_in_range":
        return int(sympy.primepi(nums[1]) - sympy.primepi(nums[0] - 1))
    if problem.kind == "modular_power":
        return int(sympy.Mod(sympy.Integer(nums[0]) ** nums[1], nums[2]))
    if problem.kind == "divisor_count":
        return int(sympy.divisor_count(nums[0]))
    if problem.kind == "fibonacci_mod":
        return int(sympy.fibonacci(nums[-2]) % nums[-1])
    if problem.kind == "binomial_mod":
        return int(sympy.binomial(nums[1], nums[0]) % nums[2])
    if problem.kind == "power_sum_mod":
        power, n, m = nums[1], nums[-3], nums[-1]
        return int(sum(sympy.Integer(i) ** power for i in range(1, n + 1)) % m)
    if problem.kind == "last_digit_power":
        return int(sympy.Integer(nums[0]) ** nums[1] % 10)
    if problem.kind == "product":
        return int(sympy.Integer(nums[0]) * nums[1])
    raise AssertionError(problem.kind)


@pytest.mark.slow  # the reference programs run in a subprocess
@pytest.mark.parametrize("difficulty", [1, 3])
def test_synthetic_answers_match_sympy_and_the_reference_code(difficulty):
    problems = generate_problems(2 * len(GENERATORS), seed=11, difficulty=difficulty)
    assert {p.kind for p in problems} == set(GENERATORS)
    for p in problems:
        assert isinstance(p.answer, int) and p.answer >= 0
        assert _independent_answer(p) == p.answer, p
    # The reference solutions run as real programs and print exactly the answer.
    script = "\n".join(f"exec({p.solution!r})" for p in problems)
    printed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert printed.split() == [str(p.answer) for p in problems]


def test_synthetic_is_seeded_and_validated():
    assert generate_problems(20, seed=3) == generate_problems(20, seed=3)
    assert generate_problems(20, seed=3) != generate_problems(20, seed=4)
    assert len({p.question for p in generate_problems(200, seed=0)}) > 190
    only = generate_problems(5, kinds=["modular_power"])
    assert all(p.kind == "modular_power" for p in only)
    with pytest.raises(ValueError, match="unknown kinds"):
        generate_problems(1, kinds=["nope"])
    with pytest.raises(ValueError, match="difficulty"):
        generate_problems(1, difficulty=4)
    # Held-out questions are never drawn for training, even where the kind's space is small (the
    # tiny run's products: 68 x 68 questions, 3400 SFT draws).
    held_out = {p.question for p in held_out_problems(num_eval=128, seed=0, kinds=("product",))}
    sft = generate_problems(3400, seed=2, kinds=("product",), exclude=held_out)
    assert len(held_out) > 120 and not held_out & {p.question for p in sft}
    assert held_out & {p.question for p in generate_problems(3400, seed=2, kinds=("product",))}
    everything = {p.question for p in generate_problems(20000, seed=0, kinds=("product",))}
    with pytest.raises(ValueError, match="1000 draws of product at difficulty 1 were all excluded"):
        generate_problems(1, kinds=("product",), exclude=everything)


def test_sft_conversation_has_a_tool_call_real_output_and_boxed_answer():
    problem = generate_problems(1, seed=5, kinds=["primes_in_range"])[0]
    messages = sft_conversation(problem, tool_name="python", format_observation=lambda r: f"stdout: {r.stdout}")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[0]["content"] == problem.question
    call = re.search(r"<tool_call>\n(.*)\n</tool_call>$", messages[1]["content"], re.S)
    payload = json.loads(call.group(1))
    assert payload == {"name": "python", "arguments": {"code": problem.solution, "input": ""}}
    assert messages[2]["content"] == f"stdout: {problem.answer}\n"
    assert messages[3]["content"].endswith(f"</reason>\n<answer>\\boxed{{{problem.answer}}}</answer>")
    assert "<reason>" not in messages[1]["content"]  # the template forces it


def test_sft_behaviours_answer_directly_or_fix_a_failing_call():
    problem = generate_problems(1, seed=5, kinds=["product"])[0]
    a, b = re.fullmatch(r"What is \((\d\d)\*(\d\d)\)\?", problem.question).groups()  # the call's own "(" anchors the copy
    assert problem.solution == f"print({a}*{b})" and problem.answer == int(a) * int(b)
    direct = sft_conversation(problem, behaviour="direct")
    estimate = round(problem.answer, -3)
    assert [m["role"] for m in direct] == ["user", "assistant"]
    assert direct[1]["content"] == f"</reason>\n<answer>\\boxed{{{estimate}}}</answer>"
    fix = sft_conversation(problem, tool_name="python", behaviour="fix",
                           format_observation=lambda r: f"{r.status}: {r.stdout or r.stderr}")
    assert [m["role"] for m in fix] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    codes = [json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", m["content"], re.S).group(1))["arguments"]["code"]
             for m in (fix[1], fix[3])]
    assert codes == [problem.solution[:-1], problem.solution]
    assert fix[2]["content"].startswith("runtime_error:") and "SyntaxError" in fix[2]["content"]
    assert fix[4]["content"] == f"ok: {problem.answer}\n"
    # "unmatched": the failed call doubles its ")"; its error names no "(" of its own, so every "(" in
    # the context before the fix is followed by the factors.
    fix = sft_conversation(problem, tool_name="python", behaviour="fix", fix_bug="unmatched",
                           format_observation=lambda r: f"{r.status}: {r.stdout or r.stderr}")
    codes = [json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", m["content"], re.S).group(1))["arguments"]["code"]
             for m in (fix[1], fix[3])]
    assert codes == [problem.solution + ")", problem.solution]
    assert "SyntaxError: unmatched ')'" in fix[2]["content"]
    before_fix = "".join(m["content"] for m in fix[:3])
    assert before_fix.count("(") == before_fix.count(f"({a}*{b})") == 3  # question, call, the error's echo of it
    with pytest.raises(ValueError, match="fix_bug must be one of"):
        sft_conversation(problem, behaviour="fix", fix_bug="typo")
    with pytest.raises(ValueError, match="behaviour must be one of"):
        sft_conversation(problem, behaviour="guess")
    drawn = behaviours_for(1000, (0.5, 0.3, 0.2), seed=0)
    assert abs(drawn.count("direct") / 1000 - 0.5) < 0.05 and drawn == behaviours_for(1000, (0.5, 0.3, 0.2), seed=0)


def test_sft_file_round_trip_and_bad_conversations(tmp_path):
    problems = generate_problems(6, seed=1)
    path = write_sft_file(tmp_path / "sft.jsonl", problems)
    conversations, report = read_conversations(path)
    assert len(conversations) == 6 and conversations[2].messages[0].content == problems[2].question
    assert report.rows_kept == 6 and conversations[2].source == f"{path} row 2 (line 3)"
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl row 0 \(line 1\): messages\[0\]: expected \{role"):
        read_conversations(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        read_conversations(tmp_path / "empty.jsonl")


# -- files and rows -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_written_problem_files_read_back_in_every_format(tmp_path, fmt):
    problems = generate_problems(9, seed=2)
    path = write_problems(tmp_path / f"p.{fmt}", problems)
    examples, report = read_examples(path)
    assert [(e.question, e.answer) for e in examples] == [(p.question, str(p.answer)) for p in problems]
    assert [e.row for e in examples] == list(range(9)) and examples[0].source == str(path)
    assert report.rows_read == report.rows_kept == 9 and report.num_skipped == 0


def test_rstar2_parquet_layout_with_explicit_dotted_keys(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": i * 7}} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    examples, _ = read_examples(tmp_path / "train.parquet", question_key="prompt.-1.content",
                                answer_key="reward_model.ground_truth")
    assert [(e.question, e.answer) for e in examples] == [(f"q{i}", str(i * 7)) for i in range(4)]
    auto, _ = read_examples(tmp_path / "train.parquet")
    assert auto == examples


def test_rstar_eval_file_from_shared(shared_dir):
    examples, report = read_examples(shared_dir / "data" / "amc23_test.json")
    assert report.rows_kept == 40 and all(e.answer.lstrip("-").isdigit() for e in examples)


BAD_ROWS = [
    ({"question": "q"}, "missing_answer", r"no answer at key 'answer'"),
    ({"question": "q", "answer": None}, "null_answer", r"answer at 'answer' is null"),
    ({"question": "q", "answer": "  "}, "empty_answer", r"must be a non-empty string or a number, got str"),
    ({"question": "q", "answer": [1, 2]}, "bad_answer_type", r"got list \[1, 2\]"),
    ({"question": "q", "answer": True}, "bad_answer_type", r"got bool True"),
    ({"answer": "1"}, "missing_question", r"no question at key 'question'"),
    ({"question": "", "answer": "1"}, "bad_question", r"must be a non-empty string"),
]


@pytest.mark.parametrize("row,reason,message", BAD_ROWS)
def test_bad_row_is_an_error_naming_file_and_row_or_is_skipped(tmp_path, row, reason, message):
    good = {"question": "What is 2+2?", "answer": 4}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, good, row, good)) + "\n")
    with pytest.raises(DataError, match=rf"d.jsonl row 2 \(line 3\): .*{message}"):
        read_examples(path, question_key="question", answer_key="answer")
    examples, report = read_examples(path, question_key="question", answer_key="answer", on_bad_row="skip")
    assert [e.row for e in examples] == [0, 1, 3] and report.skipped == {reason: 1}
    assert report.rows_read == 4 and report.rows_kept == 3 and "row 2" in report.examples_of_skipped[0]


def test_malformed_and_empty_files(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"question": "a", "answer": 1}\n{not json\n')
    with pytest.raises(DataError, match=r"broken.jsonl row 1 \(line 2\): invalid JSON"):
        read_examples(tmp_path / "broken.jsonl")
    _, report = read_examples(tmp_path / "broken.jsonl", on_bad_row="skip")
    assert report.skipped == {"invalid_json": 1}
    for name, content in (("e.jsonl", "\n\n"), ("e.json", "[]"), ("blank.json", "")):
        (tmp_path / name).write_text(content)
        with pytest.raises(DataError, match=rf"{name}: the file is empty"):
            read_examples(tmp_path / name)
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e.parquet: the file is empty"):
        read_examples(tmp_path / "e.parquet")
    (tmp_path / "obj.json").write_text('{"question": "a"}')
    with pytest.raises(DataError, match="must be a list of objects"):
        read_examples(tmp_path / "obj.json")
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        read_examples(tmp_path / "d.csv")
    (tmp_path / "allbad.jsonl").write_text('{"question": "a"}\n')
    with pytest.raises(DataError, match="none of its 1 rows is usable"):
        read_examples(tmp_path / "allbad.jsonl", on_bad_row="skip")
    with pytest.raises(DataError, match="no such file"):
        read_examples(tmp_path / "missing.jsonl")


# -- the prompt stream ----------------------------------------------------------------------------

def _examples(tmp_path, n=12):
    return load_examples([write_problems(tmp_path / "a.jsonl", generate_problems(n, seed=0))])[0]


def test_epochs_are_seeded_permutations(tmp_path):
    examples = _examples(tmp_path)
    it = PromptIterator(examples, batch_size=4, seed=1)
    epochs = [[e.row for _ in range(3) for e in next(it)] for _ in range(3)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(12))  # reshuffled every epoch
    again = PromptIterator(examples, batch_size=4, seed=1)
    assert [e.row for e in next(again)] == epochs[0][:4]
    other = PromptIterator(examples, batch_size=4, seed=2)
    assert [e.row for _ in range(3) for e in next(other)] != epochs[0]
    finite = PromptIterator(examples, batch_size=5, seed=0, num_epochs=1)
    assert len(list(finite)) == 2  # 12 // 5, remainder dropped


def test_iterator_state_resumes_exactly(tmp_path):
    examples = _examples(tmp_path)
    it = PromptIterator(examples, batch_size=5, seed=3)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    expected = [[e.row for e in next(it)] for _ in range(5)]
    resumed = PromptIterator(examples, batch_size=5, seed=3)
    resumed.set_state(state)
    assert [[e.row for e in next(resumed)] for _ in range(5)] == expected
    with pytest.raises(DataError, match="state belongs to different data: seed was 3, now 4"):
        PromptIterator(examples, batch_size=5, seed=4).set_state(state)
    with pytest.raises(DataError, match="batch_size"):
        PromptIterator(examples[:2], batch_size=5, num_epochs=1)


def test_prompt_iterator_from_the_config(tmp_path):
    from rstar_jax.app import builders

    path = write_problems(tmp_path / "p.parquet", generate_problems(10, seed=0))
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.rollout.max_prompt_length = 256  # every kind of problem (tiny trains on short products only)
    it, report = builders.prompt_iterator(config, (str(path),), builders.tokenizer(config))
    batch = next(it)
    assert len(batch) == config.data.num_prompts_per_step == 4 and report.rows_kept == 10


def test_overlong_prompts_are_dropped_and_counted_or_refused(tmp_path, capsys):
    from rstar_jax.app import builders

    config = load_config_file(REPO_CONFIGS / "tiny.py")  # byte tokenizer: a prompt is its bytes + specials
    tokenizer, template = builders.tokenizer(config), builders.template(config)
    length = builders.prompt_length(tokenizer, template)
    fits = "x" * (config.rollout.max_prompt_length - len(template.prompt_ids(tokenizer, "")))
    rows = [{"question": q, "answer": "1"} for q in ("short", fits, fits + "y", "also short", fits * 2)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [length(r["question"]) for r in rows] == [len(template.prompt_ids(tokenizer, r["question"])) for r in rows]
    assert length(fits) == config.rollout.max_prompt_length  # exactly at the limit is kept
    config.data.num_prompts_per_step = 1
    it, report = builders.prompt_iterator(config, (str(path),), tokenizer)
    assert sorted(e.row for e in it.examples) == [0, 1, 3]
    assert report.skipped == {"overlong_prompt": 2} and report.rows_kept == 3 and report.rows_read == 5
    assert "p.jsonl row 2: the prompt has" in report.examples_of_skipped[0]
    assert "dropped 2 of 5 prompts longer than rollout.max_prompt_length" in capsys.readouterr().out
    config.data.filter_overlong_prompts = False
    with pytest.raises(DataError, match=r"p\.jsonl row 2: the prompt has \d+ tokens, more than rollout\.max_prompt"):
        builders.prompt_iterator(config, (str(path),), tokenizer)


def test_prepare_synthetic_data_from_the_tiny_config(tmp_path):
    from rstar_jax.app import builders

    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict({"run_dir": str(tmp_path / "run"), "data.synthetic.num_train": 12,
                                       "data.synthetic.num_eval": 4})
    config.data.synthetic.sft_stages = ((8, (0.0, 1.0, 0.0)), (6, (0.4, 0.3, 0.3)))
    (train_file,), sft_files = builders.prepare_data(config)
    train, _ = read_examples(train_file)
    (eval_file,) = builders.held_out_files(config)
    held_out, _ = read_examples(eval_file)
    stages = [read_conversations(f)[0] for f in sft_files]
    assert (len(train), len(held_out), [len(s) for s in stages]) == (12, 4, [8, 6])
    assert not {e.question for e in held_out} & {e.question for e in train}
    sft_questions = {c.messages[0].content for s in stages for c in s}
    assert not sft_questions & {e.question for e in held_out}
    assert config.rollout.tool_name in stages[0][0].messages[1].content
    first = pathlib.Path(train_file).read_bytes()
    assert pathlib.Path(builders.prepare_data(config)[0][0]).read_bytes() == first  # deterministic on resume

    # An RL stage without a warm-up gets the same problems and no conversations (none written).
    config.sft.before_rl = False
    config.run_dir = str(tmp_path / "rl_only")
    (rl_train_file,), rl_sft_files = builders.prepare_data(config)
    assert pathlib.Path(rl_train_file).read_bytes() == first and rl_sft_files == ()
    assert not list((tmp_path / "rl_only" / "data").glob("sft_*"))
