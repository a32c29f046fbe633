"""Integration: 64 concurrent trajectories against a real sandbox server on loopback.

A scripted generator (implementing the Generator protocol) drives the loop; every tool call runs in
the real sandbox, so runtime errors and timeouts come from real executions. Skips until
`sandbox_service` is present in the tree.
"""

import asyncio
import json

import pytest

launcher = pytest.importorskip("sandbox_service.launcher")
client_module = pytest.importorskip("sandbox_service.client")

from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer  # noqa: E402
from rstar_jax.rollout.loop import LoopConfig, run_trajectory  # noqa: E402
from rstar_jax.rollout.orchestrator import Orchestrator  # noqa: E402
from rstar_jax.rollout.tool_env import ToolEnv  # noqa: E402
from rstar_jax.rollout.trajectory import STOP_NO_TOOL_CALL  # noqa: E402
from tests.rollout.test_rollout_loop import ScriptedGenerator, exact_scorer  # noqa: E402

pytestmark = pytest.mark.slow  # a sandbox server subprocess

TOK = ByteTokenizer()


def call(code: str, stdin: str = "") -> str:
    args = {"code": code, "input": stdin}
    return "<tool_call>\n" + json.dumps({"name": "python_code_with_standard_io", "arguments": args}) + "\n</tool_call>"


def script(i: int) -> list[str]:
    """Question i: a stdin-driven computation, then (by i) a runtime error or a timeout, then the answer."""
    turns = [f"Compute. {call('n = int(input()); print(n * n)', str(i))}{IM_END}"]
    if i % 4 == 1:
        turns.append(f"Check. {call('print(1 / 0)')}{IM_END}")
    elif i == 2:  # few timeouts: each holds a sandbox worker for the whole limit
        turns.append(f"Wait. {call('while True: pass')}{IM_END}")
    turns.append(f"</reason><answer>\\boxed{{{i * i}}}</answer>{IM_END}")
    return turns


def test_64_concurrent_trajectories_on_a_real_sandbox():
    questions = {f"Square the number {i}, please.": script(i) for i in range(16)}
    gen = ScriptedGenerator(questions)
    cfg = LoopConfig(max_turns=5, response_budget=4096,
                     tool_env=ToolEnv.preset_defaults("rich", timeout_s=1.0, observation_max_chars=512))

    async def main(target):
        async with client_module.SandboxClient(target) as client:
            async def one(q, gold, gid, idx):
                return await run_trajectory(gen, TOK, client, q, gold, config=cfg, scorer=exact_scorer,
                                            group_id=gid, sample_index=idx)

            orchestrator = Orchestrator(one, max_concurrency=64)
            prompts = [(q, str(i * i)) for i, q in enumerate(questions)]
            return await orchestrator.collect(prompts, samples_per_prompt=4)

    with launcher.LocalSandbox(workers=2) as sandbox:
        trajectories = asyncio.run(main(sandbox.target))
    assert len(trajectories) == 64
    for t in trajectories:
        i = t.group_id
        t.check()
        assert t.finish_reason == STOP_NO_TOOL_CALL and t.reward == 1.0, (i, t.tool_statuses)
        assert sum(t.loss_mask) == sum(len(TOK.encode(x)) for x in script(i))
        text = TOK.decode(t.response_ids)
        assert f"stdout: {i * i}" in text  # the real execution's output was observed
        expected = ["ok"] + (["runtime_error"] if i % 4 == 1 else ["timeout"] if i == 2 else [])
        assert t.tool_statuses == expected
        assert t.n_tool_calls == len(expected) and t.n_tool_errors == len(expected) - 1
        if i % 4 == 1:
            assert "ZeroDivisionError" in text
