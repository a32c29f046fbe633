"""`python -m rstar_jax.evaluate`: avg@k report, SIGKILL resume, policy loading, config errors.

The policy is a real tiny Qwen3 (byte tokenizer) whose weights make it a bigram model: attention and
MLP outputs are zeroed, so the next token depends only on the current one, and the embedding and
LM head encode a transition table. It writes `\\boxed{a}<|im_end|>` with `a` drawn from chosen
answers (optionally after a run of spaces), so rewards are known by construction while every
response still goes through the real engine, agentic loop, records and the sandbox's Verify RPC.
"""

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.agent.template import GENERATION_PROMPT
from rstar_jax.agent.tokenizer import ByteTokenizer
from rstar_jax.config import REPO_CONFIGS, ConfigError, load_config_file, validate
from rstar_jax.config import resolve
from rstar_jax.evaluation import EvalError, SampleStore, build_report, load_questions, report_ks
from rstar_jax.model.hf import save_pretrained
from rstar_jax.model.qwen3 import Qwen3
from rstar_jax.engine.local_server import LocalServer
from rstar_jax.train.checkpoint import policy_source
from rstar_jax.app.held_out import run_evaluation
from tests.conftest import xla_flags

TINY = REPO_CONFIGS / "tiny.py"
QUESTIONS = [("What is 3+4?", "7"), ("What is 2+3?", "5"), ("What is 4+5?", "9")]
K = 3
EDGE = 20.0  # logit of a table transition; every other token has logit 0


def answering_model(config, *, answers=("7",), filler_logit: float | None = None) -> Qwen3:
    """A `resolve.model_config(config)` Qwen3 that answers `\\boxed{a}` with `a` uniform over `answers`.

    With filler_logit, the answer is preceded by spaces: after `{` or a space, another space has
    logit EDGE + filler_logit against EDGE for each answer (longer responses, a geometric length).
    """
    tok = ByteTokenizer()
    cfg = resolve.model_config(config)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    byte = lambda ch: tok.encode(ch)[0]  # noqa: E731
    chain = [tok.encode(GENERATION_PROMPT)[-1]] + tok.encode("\\boxed{")
    table = {a: {b: EDGE} for a, b in zip(chain, chain[1:])}
    table[byte("{")] = {byte(a): EDGE for a in answers}
    if filler_logit is not None:
        table[byte("{")][byte(" ")] = EDGE + filler_logit
        table[byte(" ")] = {**{byte(a): EDGE for a in answers}, byte(" "): EDGE + filler_logit}
    for a in answers:
        table[byte(a)] = {byte("}"): EDGE}
    table[byte("}")] = {tok.eos_id: EDGE}
    d = cfg.hidden_size
    embed = np.zeros((cfg.vocab_size, d), np.float32)
    head = np.zeros((d, cfg.vocab_size), np.float32)
    for dim, (src, successors) in enumerate(table.items()):
        embed[src, dim] = 1.0  # one-hot: the final RMSNorm scales it to sqrt(d)
        for dst, logit in successors.items():
            head[dim, dst] = logit / math.sqrt(d)
    model.embed[...] = jnp.asarray(embed)
    model.lm_head[...] = jnp.asarray(head)
    model.o_proj[...] = jnp.zeros_like(model.o_proj[...])
    model.down_proj[...] = jnp.zeros_like(model.down_proj[...])
    return model


def write_questions(path: pathlib.Path, questions=QUESTIONS) -> pathlib.Path:
    path.write_text(json.dumps([{"index": i, "question": q, "answer": a} for i, (q, a) in enumerate(questions)]))
    return path


def eval_overrides(run_dir, questions_file, target, *extra) -> list[str]:
    """The tiny config in eval mode against a running sandbox (Verify RPC scores every response).

    The engine keeps the tiny run's shapes (32 slots, 64 + 448 tokens), so every engine here and
    in the tiny run shares one set of compilations.
    """
    return [f"run_dir={run_dir}", "mode=eval", f"eval.files=('{questions_file}',)", f"eval.k={K}",
            "metrics.progress_bar=false", "sandbox.launch_local=false", f"sandbox.targets=('{target}',)",
            "sandbox.verify_via=sandbox", *extra]


def config_from_flags(path, overrides):
    """The config a command builds from `--config=path --config.<override> ...`: config_flags parses
    the same strings as the command-line runs of these tests."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["test", f"--config={path}", *(f"--config.{o}" for o in overrides)]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", str(path), flag_values=values, sys_argv=argv)
    values(argv)
    return holder.value


def eval_config(*overrides):
    return validate(config_from_flags(TINY, overrides))


@pytest.fixture(scope="module")
def sandbox_target():
    from sandbox_service.launcher import LocalSandbox

    with LocalSandbox(workers=2) as sandbox:
        yield sandbox.target


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """HF policy directories and the question file shared by this module's runs."""
    root = tmp_path_factory.mktemp("eval_inputs")
    config = load_config_file(TINY)
    # Answers 7 or 5 after ~100 spaces on average (p(space) = 0.99 at temperature 0.6): some
    # questions are solved by some samples, and each group takes long enough to kill between groups.
    save_pretrained(answering_model(config, answers=("7", "5"), filler_logit=0.6 * math.log(198.0)),
                    root / "hf_slow")
    return {"root": root, "hf_slow": root / "hf_slow", "questions": write_questions(root / "questions.json")}


# -- CLI runs (one CPU device, as users run it) --------------------------------------------------

# One group in flight at a time, so a kill can land between groups.
SLOW = (f"rollout.max_concurrency={K}",)


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()
    return env


def _cli(module, overrides) -> list[str]:
    return [sys.executable, "-m", module, f"--config={TINY}", *(f"--config.{o}" for o in overrides)]


def _run_cli(module, overrides, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(module, overrides), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(inputs, sandbox_target):
    """An uninterrupted CLI evaluation from the HF directory."""
    run_dir = inputs["root"] / "straight"
    result = _run_cli("rstar_jax.evaluate", eval_overrides(run_dir, inputs["questions"], sandbox_target,
                                                           f"model.hf_path={inputs['hf_slow']}", *SLOW),
                      inputs["root"])
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir, result


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_report_matches_a_hand_computation_from_the_records(straight):
    run_dir, result = straight
    records = _records(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    assert "avg@3" in result.stdout and str(run_dir / "report.json") in result.stdout
    by_key: dict[str, list[dict]] = {}
    for r in records:
        by_key.setdefault(r["key"], []).append(r)
    assert sorted(by_key) == sorted(f"{run_dir.parent / 'questions.json'}#{i}" for i in range(3))
    for key, group in by_key.items():
        assert sorted(r["sample_index"] for r in group) == list(range(K))
        for r in group:  # the reward is what the written answer deserves
            answer = r["model_text"].strip().removeprefix("\\boxed{").split("}")[0].strip()
            assert r["reward"] == float(not r["truncated"] and answer == r["gold_answer"]), r["model_text"]
    # Independent re-derivation: per-question means, their mean and standard error (ddof=1),
    # pass@j = 1 - C(n-c, j) / C(n, j) with math.comb, token and tool statistics.
    correct = np.array([sum(r["reward"] for r in g) for g in by_key.values()])
    means = correct / K
    overall = report["overall"]
    assert 0.0 < overall["avg_at_k"] < 1.0  # mixed outcomes, so the check below is not vacuous
    assert overall["avg_at_k"] == pytest.approx(means.mean())
    assert overall["avg_at_k_stderr"] == pytest.approx(means.std(ddof=1) / math.sqrt(len(means)))
    for j in report_ks(K):
        expected = np.mean([1 - math.comb(K - int(c), j) / math.comb(K, j) for c in correct])
        assert overall[f"pass_at_{j}"] == pytest.approx(expected)
    assert overall["mean_response_length"] == pytest.approx(np.mean([len(r["response_ids"]) for r in records]))
    assert overall["mean_sampled_tokens"] == pytest.approx(np.mean([sum(r["loss_mask"]) for r in records]))
    # No response called the tool: no error rate (null), and the table shows "-".
    assert overall["tool_calls_per_response"] == 0.0 and overall["tool_error_rate"] is None
    assert re.search(r" 0\.00 +- +\d", result.stdout), result.stdout
    assert overall["truncation_rate"] == pytest.approx(np.mean([r["truncated"] for r in records]))
    assert overall["num_questions"] == 3 and overall["num_samples"] == 3 * K
    assert report["files"] == {str(run_dir.parent / "questions.json"): overall}


def test_tool_statistics_and_per_file_sections_of_the_report(tmp_path):
    """Tool-call rate, tool-error rate and per-file splits on constructed records."""
    questions, _ = load_questions([str(write_questions(tmp_path / "a.json", QUESTIONS[:2])),
                                   str(write_questions(tmp_path / "b.json", QUESTIONS[2:]))])

    def rec(reward, calls, errors, length):
        return {"reward": reward, "n_tool_calls": calls, "n_tool_errors": errors, "response_length": length,
                "num_sampled_tokens": length - 1, "truncated": False, "n_turns": 1 + calls, "group_id": 0,
                "n_answer_tags": 1, "n_retractions": 0}

    groups = {questions[0].key: [rec(1.0, 2, 1, 10), rec(0.0, 0, 0, 20)],
              questions[1].key: [rec(0.0, 1, 1, 30), rec(0.0, 1, 0, 40)],
              questions[2].key: [rec(1.0, 0, 0, 50), rec(1.0, 4, 0, 60)]}
    report = build_report(groups, questions, 2)
    a, b, overall = report["files"][questions[0].file], report["files"][questions[2].file], report["overall"]
    assert (a["avg_at_k"], a["pass_at_2"], a["tool_calls_per_response"], a["tool_error_rate"]) == (0.25, 0.5, 1.0, 0.5)
    assert a["avg_at_k_stderr"] == pytest.approx(np.std([0.5, 0.0], ddof=1) / math.sqrt(2))
    assert (b["avg_at_k"], b["avg_at_k_stderr"], b["tool_error_rate"], b["mean_response_length"]) == (1.0, 0.0, 0.0, 55)
    assert overall["avg_at_k"] == pytest.approx(0.5) and overall["tool_error_rate"] == pytest.approx(2 / 8)
    assert overall["mean_sampled_tokens"] == pytest.approx(34.0)
    with pytest.raises(EvalError, match="lack their 2 samples"):
        build_report({k: v for k, v in groups.items() if k != questions[1].key}, questions, 2)


@pytest.mark.slow
def test_killed_run_resumes_and_reports_like_the_uninterrupted_run(straight, inputs, sandbox_target, tmp_path):
    run_dir = tmp_path / "resumed"
    overrides = eval_overrides(run_dir, inputs["questions"], sandbox_target, f"model.hf_path={inputs['hf_slow']}",
                               *SLOW)
    process = subprocess.Popen(_cli("rstar_jax.evaluate", overrides), cwd=tmp_path, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    samples = run_dir / "samples.jsonl"
    deadline = time.monotonic() + 240
    try:
        while not (samples.exists() and samples.read_text().count("\n") >= K):
            if process.poll() is not None:
                raise AssertionError(f"the run ended before its first group: {process.stderr.read()[-3000:]}")
            assert time.monotonic() < deadline, "no group was ever written"
            time.sleep(0.01)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    before = samples.read_text()
    finished = before.count("\n") // K
    assert 1 <= finished < 3, "the kill must land between groups"
    assert not (run_dir / "report.json").exists()

    restart = _run_cli("rstar_jax.evaluate", overrides, tmp_path)
    assert restart.returncode == 0, restart.stderr[-4000:]
    assert f"{finished} of 3 questions already sampled; sampling {3 - finished} x {K}" in restart.stdout
    after = samples.read_text()
    assert after.startswith(before)  # finished groups untouched: neither rewritten nor re-sampled
    keys = [(r["key"], r["sample_index"]) for r in _records(run_dir)]
    assert len(keys) == len(set(keys)) == 3 * K
    straight_dir, _ = straight
    assert json.loads((run_dir / "report.json").read_text()) == json.loads((straight_dir / "report.json").read_text())
    strip = lambda r: {k: v for k, v in r.items() if k != "tool_seconds"}  # noqa: E731  (wall time)
    assert sorted(map(json.dumps, map(strip, _records(run_dir)))) == \
        sorted(map(json.dumps, map(strip, _records(straight_dir))))


@pytest.mark.slow
def test_launcher_eval_mode_reports_a_finished_run_without_sampling(straight, inputs, sandbox_target, tmp_path):
    """`python -m rstar_jax.launch` with mode=eval takes the same code path: a complete run
    directory is reported again from its records, and other settings are refused."""
    run_dir = tmp_path / "copy"
    shutil.copytree(straight[0], run_dir)
    samples = (run_dir / "samples.jsonl").read_bytes()
    overrides = eval_overrides(run_dir, inputs["questions"], sandbox_target, f"model.hf_path={inputs['hf_slow']}",
                               *SLOW)
    result = _run_cli("rstar_jax.launch", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "already sampled" not in result.stdout and "avg@3" in result.stdout
    assert (run_dir / "samples.jsonl").read_bytes() == samples
    assert (run_dir / "report.json").read_text() == (straight[0] / "report.json").read_text()
    refused = _run_cli("rstar_jax.evaluate", [*overrides, "eval.temperature=1.0"], tmp_path)
    assert refused.returncode == 2
    assert "temperature: 0.6 -> 1.0" in refused.stderr and "config.run_dir" in refused.stderr


@pytest.mark.slow
def test_evaluates_an_orbax_run_directory_with_the_checkpoints_model_shape(inputs, sandbox_target, tmp_path):
    from rstar_jax.train.checkpoint import Checkpointer

    train_config = load_config_file(TINY)
    with Checkpointer(tmp_path / "train_run" / "checkpoints", async_save=False) as ckpt:
        ckpt.save(5, model=answering_model(train_config, answers=("7",)), config=train_config)
    # The eval config describes a one-layer model; the checkpoint's stored config (two) decides.
    overrides = eval_overrides(tmp_path / "eval", inputs["questions"], sandbox_target,
                               f"eval.checkpoint_dir={tmp_path / 'train_run'}", "model.overrides.num_layers=1")
    result = _run_cli("rstar_jax.evaluate", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    # Always "\boxed{7}": the first question (gold 7) solved 3 of 3, the others never.
    assert (report["overall"]["avg_at_k"], report["overall"][f"pass_at_{K}"]) == (pytest.approx(1 / 3),) * 2
    settings = json.loads((tmp_path / "eval" / "eval_settings.json").read_text())
    assert settings["policy"] == {"kind": "checkpoint", "path": str((tmp_path / "train_run" / "checkpoints").resolve()),
                                  "step": 5}
    assert {r["model_text"] for r in _records(tmp_path / "eval")} == {"\\boxed{7}<|im_end|>"}

    with pytest.raises(ConfigError, match=r"eval\.checkpoint_step: no step 7 .*available: \[5\]"):
        policy_source(checkpoint_dir=str(tmp_path / "train_run"), checkpoint_step=7)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"config\.eval\.checkpoint_dir: no committed orbax checkpoint"):
        policy_source(checkpoint_dir=str(tmp_path / "empty"))


@pytest.mark.slow
def test_evaluates_on_sglang_compatible_servers_with_the_same_samples(straight, inputs, sandbox_target, tmp_path):
    """eval.generator_urls: the policy served by `rstar_jax.serve` (SGLang's HTTP API), placed by the
    KV scheduler. Seeded per trajectory, the servers draw exactly the in-process engine's samples."""
    with LocalServer(str(inputs["hf_slow"]), slots=32, max_length=832, seed=0, env={"XLA_FLAGS": xla_flags()}) as server:
        config = eval_config(*eval_overrides(tmp_path / "served", inputs["questions"], sandbox_target,
                                             f"eval.generator_urls=('{server.url}',)"))
        report = run_evaluation(config)
    settings = json.loads((tmp_path / "served" / "eval_settings.json").read_text())
    assert settings["policy"] == {"kind": "servers"}
    assert report == json.loads((straight[0] / "report.json").read_text())
    sample = lambda r: (r["key"], r["sample_index"], r["response_ids"], r["reward"])  # noqa: E731
    assert sorted(map(sample, _records(tmp_path / "served"))) == sorted(map(sample, _records(straight[0])))


# -- the sample store and config errors ------------------------------------------------------------

def test_sample_store_drops_torn_and_partial_groups_and_refuses_other_settings(tmp_path):
    settings = {"k": 2, "temperature": 0.6}
    full = [{"key": "f#0", "sample_index": i, "reward": 1.0, "question": "q0", "gold_answer": "1"} for i in range(2)]
    partial = [{"key": "f#1", "sample_index": 0, "reward": 0.0, "question": "q1", "gold_answer": "2"}]
    store = SampleStore(tmp_path, settings)
    assert store.open() == {}
    store.append(full)
    store.append(partial)
    store.close()
    good = (tmp_path / "samples.jsonl").read_text()
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"key": "f#2", "sample_in')  # a write cut short by the kill
    store = SampleStore(tmp_path, settings)
    assert store.open() == {"f#0": full}
    with pytest.raises(EvalError, match="in use by another running evaluation"):
        SampleStore(tmp_path, settings).open()
    store.close()
    assert (tmp_path / "samples.jsonl").read_text() == good.split("\n", 2)[0] + "\n" + good.split("\n", 2)[1] + "\n"
    with pytest.raises(EvalError, match=r"k: 2 -> 3"):
        SampleStore(tmp_path, {"k": 3, "temperature": 0.6}).open()
    store = SampleStore(tmp_path, settings)
    store.open()
    store.append(full[:1])  # a duplicate sample index: the file was concatenated
    store.close()
    with pytest.raises(EvalError, match="duplicate samples"):
        SampleStore(tmp_path, settings).open()


@pytest.mark.slow
def test_bad_eval_configs_name_the_field(inputs, tmp_path):
    base = eval_overrides(tmp_path / "run", inputs["questions"], "127.0.0.1:1", f"model.hf_path={inputs['hf_slow']}")
    cases = {
        "eval.k": ["eval.k=0"],
        "eval.files": [f"eval.files=('{tmp_path / 'missing.json'}',)"],
        "eval.checkpoint_dir": ["model.hf_path=", f"eval.checkpoint_dir={tmp_path / 'no_such_run'}"],
        "eval.top_k": ["eval.top_k=0"],
        "eval.checkpoint_step": ["eval.checkpoint_step=-2"],
        "eval.generator_urls": ["eval.generator_urls=('localhost:30000',)"],
    }
    for field, extra in cases.items():
        with pytest.raises(ConfigError, match=rf"config\.{field.replace('.', '[.]')}"):
            eval_config(*base, *extra)
    with pytest.raises(ConfigError, match="set either model.hf_path .* or eval.checkpoint_dir"):
        eval_config(*base, f"eval.checkpoint_dir={tmp_path}")
    with pytest.raises(ConfigError, match="evaluation needs a policy"):
        eval_config(*base, "model.hf_path=")
    # The command line: exit status 2 and the field in the message, before any model is built.
    result = _run_cli("rstar_jax.evaluate", [*base, "eval.k=0"], tmp_path)
    assert result.returncode == 2 and "config.eval.k: must be a positive integer" in result.stderr
    # A question whose prompt exceeds rollout.max_prompt_length is named with its file and row.
    long_file = write_questions(tmp_path / "long.json", [("x" * 500, "1")])
    config = eval_config(*eval_overrides(tmp_path / "long_run", long_file, "127.0.0.1:1",
                                         f"model.hf_path={inputs['hf_slow']}"))
    with pytest.raises(ValueError, match=rf"{long_file} row 0: the prompt is \d+ tokens, more than "
                                         r"config\.rollout\.max_prompt_length=64"):
        run_evaluation(config)


@pytest.mark.slow
def test_rl_held_out_evaluation_at_step_0_equals_the_evaluate_command(straight, inputs, sandbox_target, tmp_path):
    """train.eval_every: the RL run evaluates the policy it starts from with the evaluate command's
    code and settings, so its step-0 samples are those `python -m rstar_jax.evaluate` drew."""
    run_dir = tmp_path / "rl"
    overrides = [f"run_dir={run_dir}", f"model.hf_path={inputs['hf_slow']}", "sft.before_rl=False", "train.steps=1",
                 "train.eval_every=1", f"data.eval_files=('{inputs['questions']}',)", f"eval.k={K}",
                 "metrics.progress_bar=false", "sandbox.launch_local=false", f"sandbox.targets=('{sandbox_target}',)",
                 "sandbox.verify_via=sandbox", "checkpoint.export_hf_final=False"]
    result = _run_cli("rstar_jax.launch", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = {line["step"]: line for line in lines if "eval/pass@1" in line}
    assert sorted(evaluations) == [0, 1]  # the starting policy and the policy after the last step
    report = json.loads((straight[0] / "report.json").read_text())["overall"]
    assert evaluations[0]["eval/pass@1"] == report["avg_at_k"]
    assert evaluations[0]["eval/num_problems"] == report["num_questions"] == len(QUESTIONS)
    assert evaluations[0]["eval/tool_calls_mean"] == report["tool_calls_per_response"]
    sample = lambda r: (r["key"], r["sample_index"], r["response_ids"], r["reward"])  # noqa: E731
    assert sorted(map(sample, _records(run_dir / "eval" / "step_0"))) == sorted(map(sample, _records(straight[0])))
    assert "eval/pass@1" in result.stdout and "(step 0) ->" in result.stdout  # the run's last line reports both
