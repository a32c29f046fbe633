"""The multi-turn rollout loop and orchestrator with a scripted generator and a fake executor.

The generator is a test double implementing the Generator protocol (a scripted model); the capability
against the real sandbox and engine is exercised by the end-to-end tests.
"""

import asyncio
import contextlib
import dataclasses
import json

import pytest

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.agent.tool_calls import format_observation
from rstar_jax.rollout.loop import LoopConfig, run_trajectory
from rstar_jax.rollout.orchestrator import GC_YOUNG_THRESHOLD, Orchestrator, trajectory_runner
from rstar_jax.rollout.protocol import Capacity, GenerateResult
from rstar_jax.rollout.tool_env import ToolEnv
from rstar_jax.agent.stats import release_counts
from rstar_jax.rollout.trajectory import STOP_ABORTED, STOP_BUDGET, STOP_MAX_TURNS, STOP_NO_TOOL_CALL

SHORT_OBSERVATIONS = ToolEnv.preset_defaults("rich", observation_max_chars=64)

TOK = ByteTokenizer()
TEMPLATE = ChatTemplate()


def call(code: str) -> str:
    body = json.dumps({"name": "python_code_with_standard_io", "arguments": {"code": code}})
    return f"<tool_call>\n{body}\n</tool_call>"


class ScriptedGenerator:
    """Replays scripted assistant turns; log-prob of the k-th emitted token is -(k + 1) / 1000."""

    name = "scripted"

    def __init__(self, turns_for):
        self.turns_for = turns_for  # question -> list of turn texts
        self.calls = 0
        self.emitted = 0
        self.aborted = []
        self.delay_s = 0.001

    async def generate(self, input_ids, sampling, rid=None):
        self.calls += 1
        question_marker = TOK.decode(input_ids)
        question = next(q for q in self.turns_for if q in question_marker)
        turn = question_marker.count("<|im_start|>assistant") - 1
        ids = TOK.encode(self.turns_for[question][turn])
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[:sampling.max_new_tokens], "length"
        await asyncio.sleep(self.delay_s)
        logprobs = [-(self.emitted + k + 1) / 1000 for k in range(len(ids))]
        self.emitted += len(ids)
        return GenerateResult(ids, logprobs, finish, weight_version=3, num_retractions=self.calls % 2)

    async def capacity(self):
        return Capacity(total_tokens=1 << 20)

    async def abort(self, rid):
        self.aborted.append(rid)

    @property
    def version(self):
        return 3


@dataclasses.dataclass
class Result:
    status: str
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.01


class FakeExecutor:
    def __init__(self):
        self.calls = []

    async def execute(self, code, stdin="", **kw):
        self.calls.append(code)
        await asyncio.sleep(0.001)
        return self.result_for(code)

    @staticmethod
    def result_for(code):
        if "sleep" in code:
            return Result("timeout")
        if "1/0" in code:
            return Result("runtime_error", stderr="ZeroDivisionError: division by zero")
        return Result("ok", stdout="42\n")


async def exact_scorer(text, gold, truncated=False):
    return 0.0 if truncated else float(f"\\boxed{{{gold}}}" in text)


def _run(turns, budget=4096, max_turns=5, question="Q1"):
    gen = ScriptedGenerator({question: turns})
    ex = FakeExecutor()
    cfg = LoopConfig(max_turns=max_turns, response_budget=budget, tool_env=SHORT_OBSERVATIONS)
    traj = asyncio.run(run_trajectory(gen, TOK, ex, question, "42", config=cfg, scorer=exact_scorer))
    return traj, gen, ex


def test_two_turn_bookkeeping():
    turns = [f"Let me compute. {call('print(6*7)')}{IM_END}",
             f"It is 42.</reason><answer>\\boxed{{42}}</answer>{IM_END}"]
    traj, gen, ex = _run(turns)
    assert traj.finish_reason == STOP_NO_TOOL_CALL and traj.reward == 1.0 and not traj.truncated
    assert traj.n_turns == 2 and traj.n_tool_calls == 1 and traj.n_tool_errors == 0 and traj.n_answer_tags == 1
    sampled = sum(len(TOK.encode(t)) for t in turns)
    assert sum(traj.loss_mask) == sampled == gen.emitted
    # The response is turn 1, the observation block (mask 0, ending in the forced <reason>), turn 2.
    obs_ids = TEMPLATE.tool_response_ids(TOK, "Tool call success\nstdout: 42\n\nexecution time: 0.01s")
    n1 = len(TOK.encode(turns[0]))
    assert traj.response_ids[n1:n1 + len(obs_ids)] == obs_ids
    assert traj.loss_mask[n1:n1 + len(obs_ids)] == [0] * len(obs_ids)
    assert TOK.decode(traj.response_ids[n1 + len(obs_ids) - 8:n1 + len(obs_ids)]) == "<reason>"
    # Sampler log-probs line up with the sampled tokens, in order.
    lps = [lp for lp, m in zip(traj.sampler_logprobs, traj.loss_mask) if m]
    assert lps == [-(k + 1) / 1000 for k in range(sampled)]
    assert all(v == 3 for v, m in zip(traj.policy_versions, traj.loss_mask) if m)
    assert ex.calls == ["print(6*7)"]
    assert traj.n_retractions == 1  # the generator retracted turn 1 once, turn 2 never


def test_errors_are_counted_by_status_and_parse_errors_observed():
    turns = [call("import time; time.sleep(10)") + IM_END, call("1/0") + IM_END,
             "<tool_call>{not json}</tool_call>" + IM_END, call("print(42)") + IM_END,
             "</reason><answer>\\boxed{42}</answer>" + IM_END]
    traj, _, ex = _run(turns, max_turns=10)
    assert traj.tool_statuses == ["timeout", "runtime_error", "parse_error", "ok"]
    assert traj.n_tool_calls == 4 and traj.n_tool_errors == 3 and traj.reward == 1.0
    assert len(ex.calls) == 3  # the malformed call never reached the executor
    assert "Failed to decode tool call" in TOK.decode(traj.response_ids)


def test_turn_limit_and_budget():
    loop_forever = [call("print(1)") + IM_END] * 10
    traj, _, _ = _run(loop_forever, max_turns=3)
    assert traj.finish_reason == STOP_MAX_TURNS and traj.n_turns == 3 and traj.n_tool_calls == 2
    for budget in (30, 150, 260):
        traj, _, _ = _run(loop_forever, budget=budget, max_turns=10)
        assert len(traj.response_ids) <= budget
        assert traj.finish_reason == STOP_BUDGET and traj.truncated and traj.reward == 0.0
        # Never ends on a user turn: the last token is a sampled one.
        assert traj.loss_mask[-1] == 1


def test_truncated_answer_scores_zero():
    answer = "</reason><answer>\\boxed{42}</answer>" + IM_END
    traj, _, _ = _run([answer], budget=len(TOK.encode(answer)) - 1)
    assert traj.truncated and traj.reward == 0.0
    # Ending with EOS exactly at the budget is a complete answer, not a truncation.
    traj, _, _ = _run([answer], budget=len(TOK.encode(answer)))
    assert not traj.truncated and traj.finish_reason == STOP_NO_TOOL_CALL and traj.reward == 1.0
    # A tool call exactly at the budget cannot get its observation: truncated.
    turn = call("print(1)") + IM_END
    traj, _, ex = _run([turn, answer], budget=len(TOK.encode(turn)))
    assert traj.truncated and traj.finish_reason == STOP_BUDGET and len(traj.response_ids) == len(TOK.encode(turn))
    assert ex.calls == []  # no sandbox call for an observation that could never be appended


def test_orchestrator_64_concurrent_trajectories_and_cancellation():
    questions = {f"Question number {i}?": [call(f"print({i})") + IM_END,
                                           f"</reason><answer>\\boxed{{{42 if i % 2 else 7}}}</answer>" + IM_END]
                 for i in range(16)}
    gen = ScriptedGenerator(questions)
    ex = FakeExecutor()
    cfg = LoopConfig(max_turns=5, response_budget=2048)

    one = trajectory_runner(gen, TOK, ex, config=cfg, scorer=exact_scorer, template=TEMPLATE)
    orch = Orchestrator(one, max_concurrency=64)
    prompts = [(q, "42") for q in questions]
    trajs = asyncio.run(orch.collect(prompts, samples_per_prompt=4))
    assert len(trajs) == 64 and orch.peak_in_flight <= 64 and orch.peak_in_flight > 8
    assert [(t.group_id, t.sample_index) for t in trajs] == [(g, i) for g in range(16) for i in range(4)]
    for t in trajs:
        t.check()
        assert sum(t.loss_mask) == sum(len(TOK.encode(x)) for x in questions[t.question])
        assert t.reward == (1.0 if int(t.question.split()[2][:-1]) % 2 else 0.0)
    assert len(ex.calls) == 64

    async def cancel_early():
        slow = Orchestrator(one, max_concurrency=4)
        async with contextlib.aclosing(slow.groups(prompts, samples_per_prompt=4)) as groups:
            async for group in groups:
                break  # leaving early cancels the rest; aclosing waits for them
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return len(group), others, slow.peak_in_flight, slow.in_flight

    n, leftover, peak, in_flight = asyncio.run(cancel_early())
    assert (n, leftover, peak, in_flight) == (4, [], 4, 0)


def test_trajectories_run_with_the_objects_before_them_frozen_out_of_the_collector():
    """While an orchestrator's trajectories run, the cyclic collector leaves the objects that existed
    before them alone (gc.freeze); afterwards (or with freeze_gc=False) nothing is frozen."""
    import gc

    frozen, thresholds = [], []
    before = gc.get_threshold()

    async def one(question, gold, group_id, sample_index):
        frozen.append(gc.get_freeze_count())
        thresholds.append(gc.get_threshold()[0])
        await asyncio.sleep(0)
        return await trajectory_runner(ScriptedGenerator({"Q": [f"\\boxed{{42}}{IM_END}"]}), TOK, FakeExecutor(),
                                       config=LoopConfig(), scorer=exact_scorer)(question, gold, group_id, sample_index)

    assert gc.get_freeze_count() == 0
    asyncio.run(Orchestrator(one).collect([("Q", "42")], 3))
    assert len(frozen) == 3 and min(frozen) > 0 and gc.get_freeze_count() == 0
    assert set(thresholds) == {max(before[0], GC_YOUNG_THRESHOLD)} and gc.get_threshold() == before

    async def both():  # concurrent orchestrators share one freeze, lifted when the last one ends
        return await asyncio.gather(Orchestrator(one).collect([("Q", "42")], 2), Orchestrator(one).collect([("Q", "42")], 2))

    frozen.clear()
    asyncio.run(both())
    assert len(frozen) == 4 and min(frozen) > 0 and gc.get_freeze_count() == 0
    frozen.clear()
    thresholds.clear()
    asyncio.run(Orchestrator(one, freeze_gc=False).collect([("Q", "42")], 2))
    assert frozen == [0, 0] and thresholds == [before[0]] * 2


def test_paper_counting_beside_release_counting():
    # A runtime error whose stderr says "Error" and a success that prints the word "error": the paper's
    # counting goes by status (1 error), the release's by substring (2 "errors").
    turns = [call("1/0") + IM_END, call("print('error')") + IM_END,
             "</reason><answer>\\boxed{42}</answer>" + IM_END]
    gen = ScriptedGenerator({"Q": turns})

    class Ex(FakeExecutor):
        async def execute(self, code, stdin="", **kw):
            return Result("ok", stdout="error\n") if "print" in code else await super().execute(code, stdin)

    cfg = LoopConfig(max_turns=5, response_budget=4096)
    traj = asyncio.run(run_trajectory(gen, TOK, Ex(), "Q", "42", config=cfg, scorer=exact_scorer))
    assert (traj.n_turns, traj.n_tool_calls, traj.n_tool_errors, traj.n_answer_tags) == (3, 2, 1, 1)
    assert traj.finish_reason == STOP_NO_TOOL_CALL and traj.num_sampled_tokens == gen.emitted
    release = release_counts(TOK.decode(traj.response_ids, skip_special_tokens=False))
    assert release["n_tool_responses"] == 2 and release["n_error_responses"] == 2
    assert release["n_later_turns"] == 2  # the release's regex misses the first turn


class RecordingScheduler:
    """Records the session and each turn's request to the scheduler, and what was recorded back."""

    def __init__(self, generator):
        self.generator = generator
        self.sessions, self.turns, self.records = [], [], []
        self.held = 0

    @contextlib.asynccontextmanager
    async def trajectory(self, trajectory_id, *, group=None):
        self.sessions.append((trajectory_id, group))
        scheduler = self

        class Session:
            @contextlib.asynccontextmanager
            async def turn(self, context_tokens, max_new_tokens):
                scheduler.turns.append((context_tokens, max_new_tokens))
                scheduler.held += 1
                try:
                    yield scheduler.generator
                finally:
                    scheduler.held -= 1

            def record(self, generated_tokens, *, complete=True):
                scheduler.records.append((generated_tokens, complete))

        yield Session()

    def mark_down(self, generator, reason):
        raise AssertionError(f"unexpected mark_down: {reason}")


def test_scheduler_session_asks_turn_by_turn_and_learns_each_turns_length():
    turns = [call("print(1)") + IM_END, "</reason><answer>\\boxed{42}</answer>" + IM_END]
    gen = ScriptedGenerator({"Q": turns})
    sched = RecordingScheduler(gen)
    cfg = LoopConfig(max_turns=5, response_budget=1000)
    traj = asyncio.run(run_trajectory(None, TOK, FakeExecutor(), "Q", "42", config=cfg, scorer=exact_scorer,
                                      scheduler=sched, group_id=7))
    assert len(sched.sessions) == 1 and sched.sessions[0][1] == 7 and sched.held == 0 and gen.calls == 2
    first = [i for i, m in enumerate(traj.loss_mask) if not m][0]  # the first observation token
    prompt = len(traj.prompt_ids)
    assert sched.turns == [(prompt, 1000), (prompt + first + traj.loss_mask[first:].count(0), 1000 - first
                                             - traj.loss_mask[first:].count(0))]
    assert sched.records == [(first, True), (len(traj.response_ids) - sched.turns[1][0] + prompt, True)]
    with pytest.raises(ValueError, match="generator or a scheduler"):
        asyncio.run(run_trajectory(None, TOK, FakeExecutor(), "Q", "42", config=cfg, scorer=exact_scorer))


def test_cancelling_a_trajectory_aborts_its_generation():
    gen = ScriptedGenerator({"Q": ["</reason><answer>1</answer>" + IM_END]})
    gen.delay_s = 10.0

    async def main():
        task = asyncio.ensure_future(run_trajectory(gen, TOK, FakeExecutor(), "Q", "42", config=LoopConfig(),
                                                    scorer=exact_scorer))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(gen.aborted) == 1 and len(gen.aborted[0]) == 16


@pytest.mark.parametrize("field, value", [("max_turns", 0), ("response_budget", 0), ("top_k", 0),
                                          ("temperature", -1.0), ("max_calls_per_turn", 0)])
def test_loop_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"LoopConfig.{field}"):
        LoopConfig(**{field: value})


def test_two_calls_in_one_turn_and_an_aborted_generation():
    answer = "</reason><answer>\\boxed{42}</answer>" + IM_END
    gen = ScriptedGenerator({"Q": [call("1/0") + call("print(42)") + IM_END, answer]})
    cfg = LoopConfig(max_calls_per_turn=2, tool_env=SHORT_OBSERVATIONS)
    traj = asyncio.run(run_trajectory(gen, TOK, FakeExecutor(), "Q", "42", config=cfg, scorer=exact_scorer))
    assert traj.tool_statuses == ["runtime_error", "ok"] and traj.n_tool_errors == 1 and traj.reward == 1.0
    observations = [format_observation(FakeExecutor.result_for("1/0"), max_chars=64),
                    format_observation(FakeExecutor.result_for("print(42)"), max_chars=64)]
    obs_ids = TEMPLATE.tool_response_ids(TOK, observations)
    masked = [i for i, m in zip(traj.response_ids, traj.loss_mask) if not m]
    assert masked == obs_ids and TOK.decode(obs_ids).count("<tool_response>") == 2

    class Aborting(ScriptedGenerator):
        async def generate(self, input_ids, sampling, rid=None):
            result = await super().generate(input_ids, sampling, rid)
            return GenerateResult(result.token_ids, result.logprobs, "abort", result.weight_version)

    traj = asyncio.run(run_trajectory(Aborting({"Q": [answer]}), TOK, FakeExecutor(), "Q", "42",
                                      config=LoopConfig(), scorer=exact_scorer))
    assert traj.finish_reason == STOP_ABORTED and traj.reward == 0.0


def test_without_tools_a_call_is_never_executed():
    """rollout.tools=False (the no-tool ablation): the first turn is the last; its call goes nowhere."""
    turns = [call("print(42)") + IM_END, "</reason><answer>\\boxed{42}</answer>" + IM_END]
    executor = FakeExecutor()
    traj = asyncio.run(run_trajectory(ScriptedGenerator({"Q": turns}), TOK, executor, "Q", "42",
                                      config=LoopConfig(use_tools=False), scorer=exact_scorer))
    assert (traj.n_turns, traj.n_tool_calls, traj.finish_reason, traj.reward) == (1, 0, STOP_MAX_TURNS, 0.0)
    assert executor.calls == []
    answered = asyncio.run(run_trajectory(ScriptedGenerator({"Q": turns[1:]}), TOK, executor, "Q", "42",
                                          config=LoopConfig(use_tools=False), scorer=exact_scorer))
    assert answered.reward == 1.0 and answered.finish_reason == STOP_NO_TOOL_CALL


def test_generation_stops_on_the_models_eos_set(tmp_path):
    from rstar_jax.agent.tokenizer import HFTokenizer
    from rstar_jax.config import REPO_CONFIGS, load_config_file
    from rstar_jax.app import builders
    from tests.agent_helpers import write_chatml_tokenizer

    ids = write_chatml_tokenizer(tmp_path)
    im_end, endoftext = ids["<|im_end|>"], ids["<|endoftext|>"]
    assert HFTokenizer(tmp_path).stop_ids == (im_end, endoftext)  # no generation config: the ChatML pair
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))  # a base model's
    assert HFTokenizer(tmp_path).stop_ids == (im_end, endoftext)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 3, endoftext]}))
    assert HFTokenizer(tmp_path).stop_ids == (im_end, 3, endoftext)
    # A transformers-made tiny model keeps Qwen's default eos 151643, which this vocabulary lacks.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 151643]}))
    assert HFTokenizer(tmp_path).stop_ids == (im_end, endoftext)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 3, endoftext]}))
    assert ByteTokenizer().stop_ids == (258, 256)
    # The model directory's generation config counts when the tokenizer files live elsewhere.
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    write_chatml_tokenizer(tokenizer_dir)
    config = load_config_file(REPO_CONFIGS / "base.py")
    config.model.hf_path, config.tokenizer.path = str(tmp_path), str(tokenizer_dir)
    assert builders.tokenizer(config).stop_ids == (im_end, 3, endoftext)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, "<|im_end|>"]}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be a token id or a list"):
        HFTokenizer(tmp_path)

    class Recording(ScriptedGenerator):
        async def generate(self, input_ids, sampling, rid=None):
            self.stops = sampling.stop_token_ids
            return await super().generate(input_ids, sampling, rid)

    gen = Recording({"Q": [f"\\boxed{{42}}{IM_END}"]})
    asyncio.run(run_trajectory(gen, TOK, FakeExecutor(), "Q", "42", config=LoopConfig(), scorer=exact_scorer))
    assert gen.stops == TOK.stop_ids == (TOK.eos_id, TOK.token_to_id("<|endoftext|>"))
