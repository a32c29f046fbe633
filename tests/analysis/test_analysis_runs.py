"""rstar_jax.analysis.runs on constructed metrics lines and rollout records (values worked out by hand)."""

import json
import math
import pathlib

import numpy as np
import pytest

from rstar_jax.analysis import runs
from rstar_jax.analysis.entropy import LABEL_CODE, LABEL_FORKING, LABEL_REFLECTION, TokenEntropyRecord
from rstar_jax.rollout.stats import record_stats


def traj(step, reward, statuses, group=0, sample=0, **extra):
    return {"step": step, "group_id": group, "sample_index": sample, "reward": reward,
            "n_tool_calls": len(statuses), "n_tool_errors": sum(s != "ok" for s in statuses),
            "tool_statuses": list(statuses), "n_answer_tags": 1, "truncated": False,
            "finish_reason": "no_tool_call", "response_length": 10, "num_sampled_tokens": 8, "n_turns": 1,
            "n_retractions": 0, **extra}


# Step 1: two positives (ok; ok + runtime_error) and two negatives (timeout + parse_error; none).
# Step 2: only negatives, every call failed.
RECORDS = [
    traj(1, 1.0, ["ok"], group=0, sample=0),
    traj(1, 1.0, ["ok", "runtime_error"], group=0, sample=1),
    traj(1, 0.0, ["timeout", "parse_error"], group=1, sample=0),
    traj(1, 0.0, [], group=1, sample=1),
    traj(2, 0.0, ["runtime_error"], group=2, sample=0),
    traj(2, 0.0, ["runtime_error", "runtime_error", "memory_limit"], group=2, sample=1),
]


def write_run(tmp_path, lines, config=None, rollouts=None):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if config is not None:
        (run_dir / "checkpoints" / "1" / "config").mkdir(parents=True)
        (run_dir / "checkpoints" / "1" / "config" / "metadata").write_text(json.dumps(config))
    for step, records in (rollouts or {}).items():
        (run_dir / "rollouts").mkdir(exist_ok=True)
        (run_dir / "rollouts" / f"step_{step:06d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_split_and_frames_tell_sft_from_rl_by_keys():
    lines = [{"step": 1, "time": 0.0, "sft/loss": 2.0}, {"step": 2, "time": 0.0, "sft/loss": 1.5},
             {"step": 1, "time": 0.0, "rollout/reward_mean": 0.25, "update/skipped": 1},
             {"step": 2, "time": 0.0, "rollout/reward_mean": 0.5, "update/loss": -0.1, "update/skipped": 0,
              "roc/list": [1, 2], "note": "text"},
             {"step": 0, "time": 0.0, "eval/pass@1": 0.3}, {"step": 3, "time": 0.0, "note": "text"}]
    parts = runs.split_metrics(lines)
    assert [len(parts[k]) for k in ("sft", "rl", "eval", "other")] == [2, 2, 1, 1]
    rl = runs.metric_frame(parts["rl"])
    assert rl["step"].dtype == np.int64 and rl["step"].tolist() == [1, 2]
    assert rl["rollout/reward_mean"].tolist() == [0.25, 0.5]
    # Step 1 was skipped: no loss logged there.
    assert math.isnan(rl["update/loss"][0]) and rl["update/loss"][1] == -0.1
    assert "roc/list" not in rl and "note" not in rl
    assert np.isnan(runs.column(rl, "never/logged")).all() and len(runs.column(rl, "never/logged")) == 2
    with pytest.raises(ValueError, match="line 1 has no 'step'"):
        runs.split_metrics([{"sft/loss": 1.0}])


def test_frame_sorts_steps_and_warns_on_duplicates():
    lines = [{"step": 2, "x": 2.0}, {"step": 1, "x": 1.0}, {"step": 2, "x": 20.0}]
    with pytest.warns(UserWarning, match=r"more than once.*\[2\]"):
        frame = runs.metric_frame(lines)
    assert frame["step"].tolist() == [1, 2] and frame["x"].tolist() == [1.0, 20.0]


def test_load_run_reads_frames_config_and_stage(tmp_path):
    config = {"stage": "stage2", "tokenizer": {"kind": "byte", "path": ""}, "model": {"hf_path": ""}}
    run_dir = write_run(tmp_path, [{"step": 1, "sft/loss": 3.0}, {"step": 1, "rollout/reward_mean": 0.5}],
                        config=config)
    run = runs.load_run(run_dir)
    assert (run.num_sft_steps, run.num_rl_steps, run.stage, run.name) == (1, 1, "stage2", "run")
    assert run.config == config
    assert runs.tokenizer_for_run(run_dir).vocab_size == 320
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        runs.load_run(tmp_path / "missing")


def test_load_run_without_config_takes_stage_from_rollouts(tmp_path):
    run_dir = write_run(tmp_path, [{"step": 1, "rollout/reward_mean": 0.0}],
                        rollouts={1: [traj(1, 0.0, [], stage="tiny")]})
    assert runs.load_run(run_dir).stage == "tiny"
    with pytest.raises(ValueError, match="no stored config"):
        runs.tokenizer_for_run(run_dir)


def test_concat_rl_offsets_steps_and_marks_boundaries(tmp_path):
    def run(name, steps, stage):
        frame = runs.metric_frame([{"step": s, "rollout/reward_mean": s / 10} for s in steps])
        evaluations = runs.metric_frame([{"step": s, "eval/pass@1": s / 20} for s in (0, steps[-1])])
        return runs.RunData(run_dir=tmp_path / name, name=name, stage=stage, sft={}, rl=frame, eval=evaluations,
                            other=[], config=None)

    a, b = run("a", [1, 2, 3], "stage1"), run("b", [1, 2], "stage2")
    empty = runs.RunData(run_dir=tmp_path, name="sft", stage="sft", sft={}, rl=runs.metric_frame([]),
                         eval=runs.metric_frame([]), other=[], config=None)
    joined, boundaries = runs.concat_rl([a, empty, b])
    assert joined["global_step"].tolist() == [1, 2, 3, 4, 5]
    assert joined["step"].tolist() == [1, 2, 3, 1, 2]
    np.testing.assert_allclose(joined["rollout/reward_mean"], [0.1, 0.2, 0.3, 0.1, 0.2])
    assert boundaries == [(1, "stage1 (a)"), (4, "stage2 (b)")]
    # Held-out evaluations on the same axis: stage b's step 0 is the policy stage a ended with.
    evaluations = runs.concat_eval([a, empty, b])
    assert evaluations["global_step"].tolist() == [0, 3, 3, 5]
    np.testing.assert_allclose(evaluations["eval/pass@1"], [0.0, 0.15, 0.0, 0.1])


def test_tool_use_by_step_by_hand():
    t = runs.tool_use_by_step(RECORDS)
    assert t["step"].tolist() == [1, 2]
    assert t["positive"].tolist() == [2, 0] and t["negative"].tolist() == [2, 2]
    assert t["tool_calls"].tolist() == [5, 4] and t["tool_errors"].tolist() == [3, 4]
    # Step 1: positives 3 calls / 1 error, negatives 2 calls / 2 errors.
    np.testing.assert_allclose(t["tool_error_rate_positive"], [1 / 3, np.nan])
    np.testing.assert_allclose(t["tool_error_rate_negative"], [1.0, 1.0])
    np.testing.assert_allclose(t["tool_error_rate"], [3 / 5, 1.0])
    np.testing.assert_allclose(t["tool_calls_mean_positive"], [1.5, np.nan])
    np.testing.assert_allclose(t["tool_calls_mean_negative"], [1.0, 2.0])
    np.testing.assert_allclose(t["tool_calls_mean"], [5 / 4, 2.0])
    np.testing.assert_allclose(t["pass_rate"], [0.5, 0.0])


def test_tool_use_rejects_inconsistent_records():
    bad = dict(RECORDS[1], n_tool_errors=0)
    with pytest.raises(ValueError, match=r"record 0 \(step 1, group 0, sample 1\): n_tool_errors=0 but 1"):
        runs.tool_use_by_step([bad])
    with pytest.raises(ValueError, match="n_tool_calls=3 but 2 tool_statuses"):
        runs.tool_use_by_step([dict(RECORDS[1], n_tool_calls=3)])
    missing = {k: v for k, v in RECORDS[0].items() if k != "tool_statuses"}
    with pytest.raises(ValueError, match="no 'tool_statuses' field"):
        runs.tool_use_by_step([missing])


def test_cross_check_agrees_with_the_logged_statistics_and_catches_differences():
    lines = []
    for step in (1, 2):
        stats = record_stats([r for r in RECORDS if r["step"] == step])
        lines.append({"step": step, **{f"rollout/{k}": v for k, v in stats.items()}})
    frame = runs.metric_frame(lines)
    by_step = runs.tool_use_by_step(RECORDS)
    check = runs.cross_check_tool_use(by_step, frame)
    assert check.ok, (check.missing, check.mismatched)
    assert "rollout/tool_error_rate_positive" not in lines[1]  # no positive calls in step 2: absent, NaN here
    older = runs.metric_frame([dict(line, **{"rollout/tool_error_rate_positive": line.get(
        "rollout/tool_error_rate_positive", 0.0)}) for line in lines])
    assert runs.cross_check_tool_use(by_step, older).ok  # runs that logged 0.0 there still agree
    frame["rollout/tool_error_rate_negative"][1] = np.nan  # but a value logged on one side only does not
    assert runs.cross_check_tool_use(by_step, frame).mismatched == [
        "step 2: tool_error_rate_negative recomputed 1, logged nan"]
    frame = runs.metric_frame(lines)
    frame["rollout/tool_error_rate_positive"][0] = 0.5
    check = runs.cross_check_tool_use(by_step, frame)
    assert check.mismatched == ["step 1: tool_error_rate_positive recomputed 0.333333, logged 0.5"]
    check = runs.cross_check_tool_use(runs.tool_use_by_step(RECORDS[:4]), runs.metric_frame(lines))
    assert check.missing == ["step 2: logged in metrics.jsonl but has no stored rollouts"] and not check.mismatched


def test_status_counts_and_per_step():
    counts = runs.tool_status_counts(RECORDS)
    order = ["ok", "runtime_error", "timeout", "memory_limit", "parse_error"]
    assert list(counts["positive"]) == order and list(counts["negative"]) == order
    assert counts["positive"] == {"ok": 2, "runtime_error": 1, "timeout": 0, "memory_limit": 0, "parse_error": 0}
    assert counts["negative"] == {"ok": 0, "runtime_error": 3, "timeout": 1, "memory_limit": 1, "parse_error": 1}
    per_step = runs.tool_status_by_step(RECORDS)
    assert per_step["step"].tolist() == [1, 2]
    assert per_step["ok"].tolist() == [2, 0] and per_step["runtime_error"].tolist() == [1, 3]
    assert per_step["parse_error"].tolist() == [1, 0] and per_step["memory_limit"].tolist() == [0, 1]
    assert runs.tool_calls_per_trajectory(RECORDS).tolist() == [1, 2, 2, 0, 1, 3]
    # A run without any tool call: empty status tables, zero-call histogram.
    silent = [traj(1, 0.0, []), traj(1, 1.0, [])]
    assert runs.tool_status_counts(silent) == {"positive": {}, "negative": {}}
    assert list(runs.tool_status_by_step(silent)) == ["step"]
    assert np.isnan(runs.tool_use_by_step(silent)["tool_error_rate"]).all()


def test_load_rollouts_filters_steps(tmp_path):
    run_dir = write_run(tmp_path, [], rollouts={1: RECORDS[:4], 2: RECORDS[4:]})
    assert len(runs.load_rollouts(run_dir)) == 6
    assert [r["step"] for r in runs.load_rollouts(run_dir, [2])] == [2, 2]
    with pytest.raises(ValueError, match=r"no stored rollouts for steps \[7\]"):
        runs.load_rollouts(run_dir, [2, 7])


def test_moving_average_and_padding():
    np.testing.assert_allclose(runs.moving_average([1.0, 3.0, np.nan, 5.0, 7.0], 2), [1.0, 2.0, np.nan, 5.0, 6.0])
    np.testing.assert_allclose(runs.moving_average([1.0, 2.0], 1), [1.0, 2.0])
    with pytest.raises(ValueError, match="window"):
        runs.moving_average([1.0], 0)
    assert runs.padded_length(300, 128) == 384
    assert runs.padded_length(300, 128, limit=320) == 320
    assert runs.padded_length(330, 128, limit=320) == 330
    assert runs.padded_length(7, 1) == 7


def test_sample_records_is_seeded_and_keeps_order():
    items = [{"i": i} for i in range(10)]
    a = runs.sample_records(items, 4, seed=3)
    assert a == runs.sample_records(items, 4, seed=3) and len(a) == 4
    assert [x["i"] for x in a] == sorted(x["i"] for x in a)
    assert runs.sample_records(items, 20) == items


def test_hf_export_selection(tmp_path):
    for name in ("sft_warmup", "step_2", "step_10"):
        (tmp_path / "hf" / name).mkdir(parents=True)
        (tmp_path / "hf" / name / "config.json").write_text("{}")
    assert runs.find_hf_export(tmp_path).name == "step_10"  # numeric, not lexicographic
    assert runs.find_hf_export(tmp_path, 2).name == "step_2"
    assert runs.find_hf_export(tmp_path, "sft_warmup").name == "sft_warmup"
    available = r"available: \['sft_warmup', 'step_10', 'step_2'\]"
    with pytest.raises(FileNotFoundError, match=r"no export 'step_3'; " + available):
        runs.find_hf_export(tmp_path, 3)
    (tmp_path / "hf" / "final").mkdir()
    (tmp_path / "hf" / "final" / "config.json").write_text("{}")
    assert runs.find_hf_export(tmp_path).name == "final"
    with pytest.raises(FileNotFoundError, match="no Hugging Face export"):
        runs.find_hf_export(tmp_path / "nothing")


def _entropy_record(texts, mask, entropy, labels):
    return TokenEntropyRecord(token_ids=list(range(len(texts))), token_texts=texts, loss_mask=mask,
                              entropy=entropy, flagged=[bool(label) for label in labels], labels=labels)


def test_entropy_summaries_by_hand():
    a = _entropy_record(["B", "u", "t", "<", "x"], [1, 1, 1, 0, 1], [2.0, 0.1, 0.2, 0.0, 1.0],
                        [LABEL_FORKING, "", "", "", LABEL_REFLECTION])
    b = _entropy_record(["B", "c"], [1, 1], [1.0, 3.0], [LABEL_FORKING, LABEL_CODE])
    assert runs.label_counts([a, b]) == {LABEL_FORKING: 2, LABEL_REFLECTION: 1, LABEL_CODE: 1}
    every, flagged = runs.sampled_entropies([a, b])
    np.testing.assert_allclose(every, [2.0, 0.1, 0.2, 1.0, 1.0, 3.0])
    np.testing.assert_allclose(flagged, [2.0, 1.0, 1.0, 3.0])
    assert runs.top_tokens([a, b], 2) == [("B", 2, 1.5), ("c", 1, 3.0)]
    assert runs.top_tokens([a, b], 5, label=LABEL_REFLECTION) == [("x", 1, 1.0)]
    html = runs.render_trajectory_html(_entropy_record(["<b>", "&", "z"], [1, 0, 1], [1.0, 0.0, 0.5],
                                                       [LABEL_FORKING, "", ""]), title="t<1>")
    assert 'class="rstar-forking" title="forking, H=1.000"' in html and "&lt;b&gt;" in html
    assert 'class="rstar-tool"' in html and "&amp;" in html and "t&lt;1&gt;" in html
    assert "<b>" not in html


def test_analyse_records_padding_matches_unpadded_eager_entropies():
    import jax
    from flax import nnx

    from rstar_jax.agent.tokenizer import load_tokenizer
    from rstar_jax.analysis.entropy import trajectory_entropies
    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    tokenizer = load_tokenizer("byte")
    rng = np.random.default_rng(0)
    records = []
    for n_prompt, n_response in ((7, 13), (9, 20)):
        response = rng.integers(1, 256, n_response).tolist()
        mask = [1] * 5 + [0] * 3 + [1] * (n_response - 8)
        records.append({"step": 1, "prompt_ids": rng.integers(1, 256, n_prompt).tolist(),
                        "response_ids": response, "loss_mask": mask})
    with jax.default_matmul_precision("highest"):
        analysed = runs.analyse_records(runs.CompiledPolicy(model), tokenizer, records, chunk_size=5, bucket=16)
        for record, result in zip(records, analysed):
            reference = trajectory_entropies(model, record["prompt_ids"], record["response_ids"], chunk_size=5)
            expected = np.where(np.asarray(record["loss_mask"], bool), reference, 0.0)
            np.testing.assert_allclose(result.entropy, expected, atol=1e-5)
            assert result.token_texts[0] == tokenizer.decode([record["response_ids"][0]])
            assert sum(result.flagged) == round(0.2 * sum(record["loss_mask"]))
    with pytest.raises(ValueError, match="4 loss_mask entries for 13 response tokens"):
        runs.analyse_records(runs.CompiledPolicy(model), tokenizer, [dict(records[0], loss_mask=[1] * 4)])


def test_locate_finds_a_relative_run_dir_from_a_folder_below_the_repository(tmp_path, monkeypatch):
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert runs.locate("runs/tiny") == tmp_path / "runs" / "tiny"
    assert runs.locate("runs/other") == pathlib.Path("runs/other")  # not found anywhere: as given
    assert runs.locate(tmp_path / "runs" / "tiny") == tmp_path / "runs" / "tiny"


def test_load_comparison_pairs_variants_by_seed(tmp_path):
    """A benchmark's --out folder: <variant>_seed<N> runs (and the sft_seed<N> warm-ups, skipped)."""
    def run(name, values):  # values: per evaluation step (0, 10), (pass@1, positive tool-error rate)
        (tmp_path / name).mkdir()
        lines = [{"step": step, "eval/pass@1": p, **({} if e is None else {"eval/tool_error_rate_positive": e})}
                 for step, (p, e) in zip((0, 10), values)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    (tmp_path / "sft_seed0").mkdir()
    run("roc_seed0", [(0.2, 0.5), (0.9, 0.1)])
    run("roc_seed1", [(0.3, 0.5), (0.8, 0.0)])
    run("grpo_seed0", [(0.2, 0.5), (0.9, 0.3)])
    run("grpo_seed1", [(0.3, 0.5), (0.7, 0.4)])
    run("grpo_seed2", [(0.1, None), (0.5, 0.9)])  # no RoC run of seed 2 to pair it with
    c = runs.load_comparison(tmp_path)
    assert c.steps.tolist() == [0, 10] and c.seeds == {"grpo": [0, 1, 2], "roc": [0, 1]}
    np.testing.assert_allclose(c.mean("roc", "eval/pass@1"), [0.25, 0.85])
    np.testing.assert_allclose(c.std("grpo", "eval/tool_error_rate_positive"), [0.0, np.std([0.3, 0.4, 0.9])])
    diff, in_se = c.paired_difference("roc", "grpo", "eval/tool_error_rate_positive")
    # Seeds 0 and 1: differences (0, 0) at step 0, (0.2, 0.4) at step 10; sd 0.1414, se 0.1.
    np.testing.assert_allclose(diff, [0.0, 0.3])
    assert math.isnan(in_se[0]) and in_se[1] == pytest.approx(3.0)
    run("grpo_seed3", [(0.1, 0.2)])
    with pytest.raises(ValueError, match="grpo_seed3: evaluated at steps \\[0\\]"):
        runs.load_comparison(tmp_path)
    with pytest.raises(FileNotFoundError, match="no <variant>_seed<N> run directories"):
        runs.load_comparison(tmp_path / "sft_seed0")
