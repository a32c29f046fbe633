"""The README's main command, run as users run it (a subprocess), on 8 fake devices."""

import os
import subprocess
import sys

import pytest

from tests.conftest import TINY_SFT_STAGES, TINY_TEST_TASK, xla_flags

pytestmark = pytest.mark.slow  # the launcher in subprocesses


def _launch(*args, cwd, env=None):
    env = {**os.environ, **(env or {})}  # conftest set 8 fake CPU devices and the compilation cache
    return subprocess.run([sys.executable, "-m", "rstar_jax.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_default_run_warms_up_with_sft_then_trains_with_grpo_roc(tiny_run):
    """The README's main command (configs/tiny.py, shortened by TINY_RUN_OVERRIDES): SFT warm-up, RL
    steps against the local sandbox server and the JaxEngine, progress, metrics, rollouts,
    checkpoints and Hugging Face exports in the run directory."""
    import json

    from rstar_jax.rollout.records import iter_rollouts

    run = tiny_run.run_dir
    assert "[rl] done" in tiny_run.stdout
    assert "[sft] " in tiny_run.stderr + tiny_run.stdout and "[rl] 3/3" in tiny_run.stderr + tiny_run.stdout
    assert "sandbox serving on 127.0.0.1" in tiny_run.stderr and "sandbox stopped" in tiny_run.stderr
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in lines if "sft/loss" in r]
    rl = [r for r in lines if "rollout/reward_mean" in r]
    assert len(sft) == sum(n for n, _ in TINY_SFT_STAGES) // 4 and [r["step"] for r in rl] == [1, 2, 3]
    assert sft[-1]["sft/loss"] < 0.5 * sft[0]["sft/loss"]
    for r in rl:
        assert r["roc/groups_total"] == 4 and 0.0 <= r["rollout/tool_error_rate"] <= 1.0
        assert r["rollout/response_length_max"] <= 448 and "time/rollout_s" in r and "lr" in r
    records = list(iter_rollouts(run))
    assert len(records) == 3 * 4 * 8 and {r["step"] for r in records} == {1, 2, 3}
    # The warmed-up policy calls the tool: some trajectories ran code in the sandbox.
    assert sum(r["n_tool_calls"] for r in records) > 0
    for r in records:
        assert len(r["response_ids"]) == len(r["loss_mask"]) == r["response_length"] <= 448
        assert r["n_tool_calls"] == len(r["tool_statuses"])
        # Synchronous RL (rl.max_staleness 0): every sampled token came from the policy its step trained.
        assert {v for v, _ in r["policy_version_runs"] if v >= 0} <= {r["trained_version"]}
        assert not any(key.startswith("async/") for key in lines[-1])
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1] == 3
    for export in ("sft_warmup", "step_3", "final"):
        assert (run / "hf" / export / "model.safetensors").exists(), export
    assert list((run / "tb").glob("events.out.tfevents.*"))
    # Held-out evaluation of the policy RL starts from and of the last step's, reported on the last line.
    evaluations = {r["step"]: r for r in lines if "eval/pass@1" in r}
    assert sorted(evaluations) == [0, 3]
    for step, r in evaluations.items():
        assert r["eval/num_problems"] == 16 and 0.0 <= r["eval/pass@1"] <= 1.0
        # The logged figures are those of the step's stored samples, recomputed here; a rate is
        # logged exactly where it has a denominator (whether the shortened warm-up's policy calls
        # the tool at evaluation depends on the CPU's arithmetic).
        samples = [json.loads(line) for line in (run / "eval" / f"step_{step}" / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 16 * 2
        calls = sum(s["n_tool_calls"] for s in samples)
        positives = [s for s in samples if s["reward"] > 0.5]
        expected = {"eval/tool_calls_mean": calls / len(samples),
                    "eval/response_length_mean": sum(s["response_length"] for s in samples) / len(samples)}
        if calls:
            expected["eval/tool_error_rate"] = sum(s["n_tool_errors"] for s in samples) / calls
        if sum(s["n_tool_calls"] for s in positives):
            expected["eval/tool_error_rate_positive"] = (sum(s["n_tool_errors"] for s in positives)
                                                         / sum(s["n_tool_calls"] for s in positives))
        logged = {key: r[key] for key in ("eval/tool_calls_mean", "eval/response_length_mean", "eval/tool_error_rate",
                                          "eval/tool_error_rate_positive") if key in r}
        assert logged == pytest.approx(expected), step
        assert r["eval/pass@1"] == pytest.approx(len(positives) / len(samples)), step
    last = tiny_run.stdout.strip().splitlines()[-1]
    assert f"eval/pass@1 {evaluations[0]['eval/pass@1']:.3f} (step 0) -> {evaluations[3]['eval/pass@1']:.3f}" in last


def test_rollout_records_say_what_roc_kept(tiny_run_dir):
    """Each stored training trajectory says whether RoC kept it for the update (`roc_kept`), and the
    records alone reproduce RoC's choice: recomputed from their rewards, groups and tool-call counts
    with the run's RoC settings and its per-step draw, the kept sets are the stored ones. Where RoC
    kept fewer positives than it was given, no erroneous positive (a failed call) was kept over a
    clean one (paper variant, epsilon 1e-3: weight 1000 against at most about 2)."""
    import ml_collections
    import numpy as np

    from rstar_jax.config import resolve
    from rstar_jax.rl.roc import paper_penalty, resample_on_correct
    from rstar_jax.rollout.records import iter_rollouts
    from rstar_jax.train.checkpoint import stored_config

    config = ml_collections.ConfigDict(stored_config(tiny_run_dir))
    roc = resolve.roc_config(config)
    records = list(iter_rollouts(tiny_run_dir))
    assert records and all("roc_kept" in r for r in records)
    kept_positives = given_positives = 0
    for step in sorted({r["step"] for r in records}):
        rows = [r for r in records if r["step"] == step]
        column = lambda key: [r[key] for r in rows]  # noqa: E731
        again = resample_on_correct(column("reward"), column("group_id"),
                                    paper_penalty(column("n_tool_calls"), column("n_tool_errors"),
                                                  column("n_answer_tags"), column("n_turns")), roc,
                                    seed=int(np.random.SeedSequence([config.seed, step - 1]).generate_state(1)[0]))
        assert sorted(again.kept_indices.tolist()) == [i for i, r in enumerate(rows) if r["roc_kept"]], step
        for group in {r["group_id"] for r in rows}:
            positives = [r for r in rows if r["group_id"] == group and r["reward"] > 0]
            kept = [r for r in positives if r["roc_kept"]]
            if any(r["roc_kept"] for r in rows if r["group_id"] == group):
                given_positives, kept_positives = given_positives + len(positives), kept_positives + len(kept)
            if any(r["n_tool_errors"] for r in kept):
                assert all(r["roc_kept"] for r in positives if not r["n_tool_errors"]), (step, group)
    assert 0 < kept_positives < given_positives  # the run made RoC choose among positives


def test_invalid_override_is_rejected_before_work(tmp_path):
    """Every mistake at once, one line each naming the field, exit 2, no traceback (more in test_cli.py)."""
    result = _launch("--config.mesh.tensor=0", "--config.model.preset=qwen3-99b", "--config.no_such_field=1",
                     "--config.rl.clip_hihg=0.3", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 4 and lines[2].startswith("error: config.model.preset: unknown model preset 'qwen3-99b'")
    assert lines[:2] + lines[3:] == [
        "error: config.no_such_field: unknown field (not in configs/base.py)",
        "error: config.rl.clip_hihg: unknown field (not in configs/base.py); did you mean rl.clip_high?",
        "error: config.mesh.tensor: must be a positive integer or -1, got 0",
    ]


def test_rl_mode_runs_two_steps_with_the_real_sandbox_and_engine(tmp_path):
    """The tiny config on 8 fake devices (sharded policy and engine): a local sandbox server, the JaxEngine, two GRPO-RoC steps,
    metrics and checkpoints (the SFT warm-up is left out to keep CI short)."""
    import json

    run = tmp_path / "rl"
    result = _launch(f"--config.run_dir={run}", "--config.sft.before_rl=False",
                     "--config.train.steps=2", "--config.rollout.response_budget=32",
                     "--config.data.num_prompts_per_step=2", "--config.checkpoint.every_steps=1",
                     # Held-out evaluation at step 0 and after the last step, on the run's engine.
                     "--config.train.eval_every=2", "--config.data.synthetic.num_eval=3", "--config.eval.k=2",
                     "--config.eval.response_budget=32", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rl] done" in result.stdout
    # The run's first line says what tool code can import (the sandbox's start-up self-test).
    first = result.stdout.splitlines()[0]
    assert first.startswith("[rl] sandbox 127.0.0.1:") and "tool code imports numpy " in first, first
    assert "sympy " in first and "mpmath " in first and "(cold and pre-imported)" in first
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "rollout/reward_mean" in r]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert "rollout/reward_mean" in r and "roc/groups_total" in r and r["roc/groups_total"] == 2
        assert r["rollout/response_length_mean"] <= 32
    evaluations = [r for r in lines if "eval/pass@1" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    for r in evaluations:
        assert r["eval/num_problems"] == 3 and 0.0 <= r["eval/pass@1"] <= 1.0 and r["eval/response_length_mean"] <= 32
        report = json.loads((run / "eval" / f"step_{r['step']}" / "report.json").read_text())
        assert report["overall"]["num_samples"] == 3 * 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]


def test_a_sandbox_whose_tool_code_cannot_import_a_module_is_refused_before_work(tmp_path):
    """sandbox.preimport_modules names a module the sandbox's interpreter lacks: the local sandbox's
    start-up self-test fails, and the run's readiness wait refuses it with what and where, exit 2,
    before data, model or SFT."""
    run = tmp_path / "run"
    result = _launch(f"--config.run_dir={run}", "--config.sandbox.preimport_modules=('numpy', 'no_such_package')",
                     cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: the sandbox at 127.0.0.1:") and errors[0].endswith("failed its start-up self-test:")
    assert errors[1] == ("error: tool code cannot import no_such_package (in a fresh interpreter or pre-imported: "
                         "under either preset): ModuleNotFoundError: No module named 'no_such_package'; it is not "
                         f"installed for the sandbox's interpreter {sys.executable}")
    assert len(errors) == 2 and "[sft]" not in result.stdout and not any(run.iterdir())


def test_rl_on_two_serve_servers_behind_the_kv_scheduler(tmp_path, tiny_run_dir):
    """The sglang backend end to end: the launcher starts two `rstar_jax.serve` processes from the
    policy, places trajectories with the KV scheduler, and after each update broadcasts the weights
    to both over gloo (`weight_sync.method=distributed`, one group, a rank per server); later
    trajectories report the new weight version. (The disk sync, the default, is the same
    `builders.weight_sync` choice, tested against real servers in test_serve.py and
    test_rollout_failover.py.)"""
    import json

    from rstar_jax.rollout.records import iter_rollouts

    run = tmp_path / "servers"
    env_one_device = {"XLA_FLAGS": xla_flags()}
    # From the warm policy this data order gives updates from step 1 (see test_resume.py).
    result = _launch(f"--config.run_dir={run}", f"--config.model.hf_path={tiny_run_dir / 'hf' / 'sft_warmup'}",
                     *TINY_TEST_TASK, "--config.sft.before_rl=False", "--config.train.steps=2", "--config.data.shuffle_seed=3",
                     "--config.rollout.backend=sglang",
                     "--config.rollout.local_servers=2", "--config.weight_sync.method=distributed",
                     "--config.weight_sync.dtype=bfloat16", "--config.metrics.progress_bar=false", cwd=tmp_path,
                     env=env_one_device)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("http://127.0.0.1:") == 2 and "[rl] done" in result.stdout
    assert "[rl] weight sync: torch.distributed gloo broadcast (bfloat16, mode wait) to 2 server(s)" in result.stdout
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    admitted = [lines[-1][f"scheduler/admitted_{i}"] for i in range(2)]
    assert sum(admitted) == 2 * 4 * 8 and min(admitted) > 0
    updated = [m["step"] for m in lines if m["update/skipped"] == 0]
    assert updated and all("time/weight_sync_s" in lines[s - 1] for s in updated)
    split = {"time/weight_sync_export_s", "time/weight_sync_transfer_s", "time/weight_sync_group_s"}
    assert all(split <= set(lines[s - 1]) for s in updated)
    assert (run / "weights_sync" / "model.safetensors").exists()
    # Trajectories of the step after the first update were sampled by the updated weights.
    first = updated[0]
    if first < 2:
        versions = {r["policy_version"] for r in iter_rollouts(run) if r["step"] == first + 1 and r["num_sampled_tokens"]}
        assert versions == {first}  # the version is the 1-based step of the update
    rewards = [r["reward"] for r in iter_rollouts(run)]
    assert len(rewards) == 2 * 4 * 8


def test_the_warm_ups_first_stage_ends_when_its_held_out_conversations_are_reproduced(tmp_path):
    """sft.advance_exact through the launcher: the first stage's last sft.advance_probe conversations
    are held out (its steps count the rest), measured every sft.advance_every steps, and the stage
    ends right after the first sft.advance_consecutive measurements in a row at the threshold (3,
    configs/tiny.py's); the run says which criterion ended it and at which step; the second stage
    then takes its steps."""
    import json

    def conversations(path, n, reply):
        rows = [{"messages": [{"role": "user", "content": f"Reply to number {i}."},
                              {"role": "assistant", "content": reply}]} for i in range(n)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    first, second = conversations(tmp_path / "a.jsonl", 200, "ok"), conversations(tmp_path / "b.jsonl", 16, "done")
    run = tmp_path / "run"
    result = _launch(f"--config.run_dir={run}", "--config.mode=sft", "--config.data.synthetic.enabled=False",
                     f"--config.sft.train_files=('{first}','{second}')", "--config.sft.batch_size=4",
                     "--config.sft.micro_batch_tokens=1024", "--config.sft.advance_exact=1.0",
                     "--config.sft.advance_every=3", "--config.sft.advance_probe=8", "--config.sft.advance_loss=0",
                     "--config.checkpoint.export_hf_final=False", cwd=tmp_path, env={"XLA_FLAGS": xla_flags()})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    measured = [(r["step"], r["sft/held_out_reproduced"]) for r in lines if "sft/held_out_reproduced" in r]
    stage_1 = [r["step"] for r in lines if r.get("sft/stage") == 1]
    end = stage_1[-1]
    shares = [v for _, v in measured]
    assert measured and measured[-1][0] == end and shares[-3:] == [1.0] * 3, measured  # three in a row ended it
    assert not any(shares[i:i + 3] == [1.0] * 3 for i in range(len(shares) - 3)), measured  # and no earlier three
    assert [step for step, _ in measured] == list(range(3, end + 1, 3))
    assert end < (200 - 8) // 4 == 48  # the stage's planned steps: its conversations less the 8 held out
    assert (f"[sft] stage 1 ended at step {end} of 48: 8 of its 8 held-out conversations reproduced by greedy "
            f"decoding (1.000 >= sft.advance_exact 1, 3 measurements in a row)") in result.stdout
    assert [r["step"] for r in lines if r.get("sft/stage") == 2] == [49, 50, 51, 52]
