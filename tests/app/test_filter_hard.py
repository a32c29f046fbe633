"""`python -m rstar_jax.filter_hard`: the stage-3 hard set keeps the problems not solved k of k."""

import json
import subprocess
import sys

import pytest

from rstar_jax.config import REPO_CONFIGS, ConfigError, check_filter_hard, load_config_file, validate
from rstar_jax.evaluation import EvalError, split_by_solved, write_rows
from rstar_jax.app.held_out import filter_hard_loop, run_filter_hard
from rstar_jax.model.hf import save_pretrained
from tests.app.test_evaluate import TINY, _env, answering_model, config_from_flags


def test_split_by_solved_drops_only_problems_solved_k_of_k():
    rewards = {"a#0": [1.0, 1.0, 1.0], "a#1": [1.0, 0.0, 1.0], "b#0": [0.0, 0.0, 0.0], "b#1": [1.0, 1.0, 1.0],
               "b#2": [0.0, 1.0, 1.0]}
    kept, dropped = split_by_solved(rewards, 3)
    assert kept == ["a#1", "b#0", "b#2"] and dropped == ["a#0", "b#1"]  # input order
    assert split_by_solved({}, 3) == ([], [])
    with pytest.raises(ValueError, match="a#1 has 2 rewards, expected 3"):
        split_by_solved({"a#0": [1.0] * 3, "a#1": [1.0, 1.0]}, 3)


ROWS = [
    '{"question": "What is 3+4?", "answer": "7", "source": "a"}',
    '{"question": "What is 2+3?", "answer": 5, "extra": [1, 2]}',
    '{"question":"What is 1+6?","answer":"7"}',
    '{"question": "What is 4+5?",   "answer": "9", "note": "caf\\u00e9 \u00e9"}',
]


@pytest.mark.slow
def test_filter_hard_command_writes_the_unsolved_rows_verbatim(tmp_path):
    """A real run: the policy always answers 7 (engine, loop, a local sandbox server it starts
    itself, Verify), so the two gold-7 problems are solved 2 of 2 and dropped."""
    config = load_config_file(TINY)
    save_pretrained(answering_model(config, answers=("7",)), tmp_path / "hf")
    source = tmp_path / "problems.jsonl"
    source.write_text(ROWS[0] + "\n" + ROWS[1] + "\n\n" + ROWS[2] + "\n" + ROWS[3] + "\n", encoding="utf-8")
    output = tmp_path / "stage3" / "hard.jsonl"
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.hf_path={tmp_path / 'hf'}", "filter_hard.k=2",
                 f"filter_hard.input_files=('{source}',)", f"filter_hard.output_file={output}",
                 # As in configs/stage3.py: the stage trains on the file this command writes.
                 "data.synthetic.enabled=false", f"data.train_files=('{output}',)",
                 "rollout.max_turns=2", "sandbox.verify_via=sandbox", "metrics.progress_bar=false",
                 "sft.before_rl=false"]
    result = subprocess.run([sys.executable, "-m", "rstar_jax.filter_hard", f"--config={TINY}",
                             *(f"--config.{o}" for o in overrides)], cwd=tmp_path, env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert output.read_text(encoding="utf-8") == ROWS[1] + "\n" + ROWS[3] + "\n"
    assert f"kept 2 of 4 problems, dropped 2 solved 2/2 -> {output}" in result.stdout
    summary = json.loads((tmp_path / "run" / "filter_hard" / "summary.json").read_text())
    assert (summary["problems"], summary["kept"], summary["dropped_solved_k_of_k"], summary["rows_written"]) == \
        (4, 2, 2, 2)
    samples = tmp_path / "run" / "filter_hard" / "samples.jsonl"
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == 8 and {r["model_text"] for r in records} == {"\\boxed{7}<|im_end|>"}
    assert {r["key"]: r["reward"] for r in records} == {f"{source}#0": 1.0, f"{source}#1": 0.0,
                                                        f"{source}#2": 1.0, f"{source}#3": 0.0}
    # The stage-3 config reads the result as its training set.
    train = config_from_flags(TINY, overrides)
    from rstar_jax.data.datasets import load_examples

    examples, _ = load_examples(train.data.train_files)
    assert [(e.question, e.answer) for e in examples] == [("What is 2+3?", "5"), ("What is 4+5?", "9")]


def test_rows_keep_their_content_in_json_and_parquet(tmp_path):
    rows = [{"index": i, "question": f"q{i}", "answer": str(i), "meta": {"level": i % 3}} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps(rows[:3]))
    (tmp_path / "b.json").write_text(json.dumps(rows[3:]))
    n = write_rows(tmp_path / "out.json", "json", [(tmp_path / "a.json", [0, 2]), (tmp_path / "b.json", [1])])
    assert n == 3 and json.loads((tmp_path / "out.json").read_text()) == [rows[0], rows[2], rows[4]]

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": f"q{i}"}],
                                   "reward_model": {"ground_truth": str(i)}} for i in range(4)])
    pq.write_table(table, tmp_path / "train.parquet")
    assert write_rows(tmp_path / "hard.parquet", "parquet", [(tmp_path / "train.parquet", [1, 3])]) == 2
    assert pq.read_table(tmp_path / "hard.parquet").to_pylist() == [table.to_pylist()[1], table.to_pylist()[3]]


def test_stage3_filters_with_stage2_sampling():
    # spec §5.3: the stage-2 policy, sampled as stage 2 samples (T = 10), not stage 3's T = 15.
    stage2, stage3 = (load_config_file(REPO_CONFIGS / f"stage{i}.py") for i in (2, 3))
    assert stage3.rollout.max_turns == 15 and stage2.rollout.max_turns == 10
    loop = filter_hard_loop(stage3)
    assert (loop.max_turns, loop.temperature, loop.response_budget) == \
        (stage2.rollout.max_turns, stage2.rollout.temperature, stage2.rollout.response_budget)
    stage3.filter_hard.max_turns, stage3.filter_hard.temperature = 4, 0.7  # overridable
    assert (filter_hard_loop(stage3).max_turns, filter_hard_loop(stage3).temperature) == (4, 0.7)
    stage3.filter_hard.max_turns = stage3.filter_hard.temperature = None  # None: the rollout's own
    assert filter_hard_loop(stage3).max_turns == 15


def test_bad_filter_hard_configs_name_the_field(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    source = tmp_path / "all.jsonl"
    source.write_text(ROWS[0] + "\n")
    stage3 = REPO_CONFIGS / "stage3.py"
    ok = {"run_dir": str(tmp_path / "run"), "model.hf_path": str(tmp_path / "hf"),
          "filter_hard.input_files": (str(source),), "filter_hard.output_file": str(tmp_path / "hard.jsonl"),
          "data.train_files": (str(tmp_path / "hard.jsonl"),), "tokenizer.kind": "byte"}

    def stage3_config(overrides):
        config = load_config_file(stage3)
        config.update_from_flattened_dict(overrides)
        return config

    assert check_filter_hard(validate(stage3_config(ok), check_files=False)) == (str(source),)
    cases = {
        # Stage 3 without input_files would filter its own output.
        r"config\.data\.train_files: .* is also filter_hard\.output_file": {"filter_hard.input_files": ()},
        r"config\.filter_hard\.output_file: must end in one of":
            {"filter_hard.output_file": str(tmp_path / "hard.txt")},
        r"config\.filter_hard\.input_files: .*missing\.jsonl does not exist":
            {"filter_hard.input_files": (str(tmp_path / "missing.jsonl"),)},
        r"config\.filter_hard\.checkpoint_dir: set either model\.hf_path":
            {"filter_hard.checkpoint_dir": str(tmp_path)},
        r"config\.filter_hard\.checkpoint_dir: filtering needs a policy": {"model.hf_path": "", "train.init_from": ""},
        r"config\.train\.init_from: .*does not exist": {"model.hf_path": ""},  # stage 3 defaults to stage 2's run
    }
    cases.update({r"config\.filter_hard\.max_turns: must be >= 1": {"filter_hard.max_turns": 0},
                  r"config\.filter_hard\.temperature: must be >= 0": {"filter_hard.temperature": -1.0}})
    for message, extra in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_filter_hard(validate(stage3_config({**ok, **extra}), check_files=False))
    with pytest.raises(ConfigError, match=r"config\.filter_hard\.k: must be a positive integer"):
        validate(stage3_config({**ok, "filter_hard.k": 0}), check_files=False)
    # The hard set keeps the input's format.
    with pytest.raises(EvalError, match=r"filter_hard\.output_file: .*hard\.json is json but input .* is jsonl"):
        run_filter_hard(validate(stage3_config({**ok, "filter_hard.output_file": str(tmp_path / "hard.json")}),
                                 check_files=False))
