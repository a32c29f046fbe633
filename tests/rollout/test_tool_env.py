"""The tool environment presets: the rStar2 release's (code-judge under the release's agent loop) and
the project's own, from the config to the observation the policy reads.

Expected observations are what the release produces for the same stdout / stderr / exit status: its
formatting (`run_tool_calls_on_server_async` in rStar's code_judge_utils.py) and verl's 256-character
middle truncation (rstar2_agent_loop.py `_call_tool`), restated below as `release_observation`; the
expected stderr of the release wrapper is derived from its `code_template_setup` case by case.
"""

import ast
import asyncio
import json

import pytest

from rstar_jax.agent.stats import release_counts
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.agent.tool_calls import ToolCall, ToolCallError, format_observation, parse_tool_calls
from rstar_jax.config import REPO_CONFIGS, load_config_file
from rstar_jax.config import resolve
from rstar_jax.data.synthetic import generate_problems, sft_conversation
from rstar_jax.rollout.loop import run_trajectory
from rstar_jax.rollout.tool_env import ToolEnv
from tests.rollout.test_rollout_loop import Result, ScriptedGenerator, exact_scorer

TOOL = "python_code_with_standard_io"
RELEASE = ToolEnv.preset_defaults("release")
RICH = ToolEnv.preset_defaults("rich")


def release_observation(stdout: str, stderr: str, exit_code: int, reason: str, cost: float) -> str:
    """The release's tool response for one code-judge result (streams already cut at 1000)."""
    lines = ["Tool call success"] if exit_code == 0 else ["Tool call failure", f"reason: {reason}"]
    lines += [f"{name}: {text}" for name, text in (("stdout", stdout), ("stderr", stderr)) if text]
    text = "\n".join(lines + [f"execution time: {cost:.2f}s"])
    if len(text) <= 256:
        return text
    return text[:128] + "...(truncated)..." + text[-128:]


def observed(result) -> str:
    return format_observation(result, style=RELEASE.observation_style, max_chars=RELEASE.observation_max_chars)


def expected(result) -> str:
    return release_observation(result.stdout, result.stderr, result.exit_code,
                               "worker_timeout" if result.status == "timeout" else "", result.duration_s)


def in_tool_response(observation: str) -> str:
    return f"<|im_start|>user\n<tool_response>\n{observation}\n</tool_response>{IM_END}\n"


# -- malformed calls: the release agent loop's handling ---------------------------------------------

def _call(arguments, name=TOOL) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("text, message", [
    (_call(json.dumps({"code": "print(1)"})), "Error when executing tool: 'str' object has no attribute 'get'"),
    (_call(["print(1)"]), "Error when executing tool: 'list' object has no attribute 'get'"),
    (_call(None), "Error when executing tool: 'NoneType' object has no attribute 'get'"),
    (_call({"code": "ls"}, name="shell"), "Error when executing tool: 'shell'"),
    (_call({"code": None}), "Error when executing tool: 'NoneType' object has no attribute 'encode'"),
    (_call({"code": "print(1)", "input": 5}),
     "Error when executing tool: run_tool_calls_on_server_async failed for 1 tool calls after 4 attempts."),
    ('<tool_call>\n{"arguments": {"code": "x"}}\n</tool_call>', "Failed to decode tool call: 'name'"),
    ('<tool_call>\n["a"]\n</tool_call>',
     "Failed to decode tool call: list indices must be integers or slices, not str"),
    # The block is decoded as written (not stripped): the position counts the leading newline.
    ("<tool_call>\n{bad}\n</tool_call>",
     "Failed to decode tool call: Expecting property name enclosed in double quotes: line 2 column 2 (char 2)"),
])
def test_release_parsing_reports_what_the_release_reports_and_the_release_roc_counts_it(text, message):
    [error] = parse_tool_calls(text, tool_names=(TOOL,), parsing="release")
    assert error == ToolCallError(message, truncate=False)
    # Shown whole, as the release shows its parse and call errors (not cut at 256 characters).
    assert format_observation(error, max_chars=16) == message
    # The release's RoC counts "error" in tool responses: its call errors count, its decoding failures
    # ("Failed to decode tool call") do not, in the release as here.
    counted = release_counts(in_tool_response(message))["n_error_responses"]
    assert counted == (1 if message.startswith("Error when executing tool: ") else 0)


def test_release_parsing_runs_what_the_release_runs():
    parse = lambda args: parse_tool_calls(_call(args), tool_names=(TOOL,), parsing="release")  # noqa: E731
    assert parse({"input": "3"}) == [ToolCall(TOOL, "", "3")]  # a missing code runs the empty program
    assert parse({"code": "print(input())", "input": None}) == [ToolCall(TOOL, "print(input())", "")]
    long = "x = 1\n" * 30_000  # no code-length limit of its own
    assert parse({"code": long}) == [ToolCall(TOOL, long, "")]
    # The project's own parsing runs string-encoded arguments.
    rich = parse_tool_calls(_call(json.dumps({"code": "print(1)"})), tool_names=(TOOL,))
    assert rich == [ToolCall(TOOL, "print(1)", "")]


def test_the_loop_sends_the_preset_to_the_sandbox_and_skips_string_arguments():
    """A stage config's loop (the release preset): string-encoded arguments are answered with the
    release's error and never executed; a well-formed call carries the preset's sandbox options."""

    class Recorder:
        def __init__(self):
            self.calls = []

        async def execute(self, code, stdin="", **options):
            self.calls.append((code, options))
            return Result("ok", stdout="42\n")

    config = resolve.loop_config(load_config_file(REPO_CONFIGS / "stage1.py"))
    assert (config.tool_env.tool_call_parsing, config.tool_env.observation_max_chars) == ("release", 256)
    evaluation = resolve.loop_config(load_config_file(REPO_CONFIGS / "eval.py"), "eval")
    assert evaluation.tool_env == config.tool_env and evaluation.tool_env.tool_call_parsing == "release"
    turns = [f"Try. {_call(json.dumps({'code': 'print(6 * 7)'}))}{IM_END}",
             f"Again. {_call({'code': 'print(6 * 7)'})}{IM_END}",
             f"</reason><answer>\\boxed{{42}}</answer>{IM_END}"]
    recorder, tok = Recorder(), ByteTokenizer()
    traj = asyncio.run(run_trajectory(ScriptedGenerator({"Q": turns}), tok, recorder, "Q", "42", config=config,
                                      scorer=exact_scorer))
    assert recorder.calls == [("print(6 * 7)", {"timeout_s": 4.0, "memory_mb": 384, "memory_address_space": True,
                                                "stream_cap_chars": 1000, "error_format": "release",
                                                "cold_imports": True})]
    assert traj.tool_statuses == ["parse_error", "ok"] and traj.reward == 1.0
    text = tok.decode(traj.response_ids)
    assert "<tool_response>\nError when executing tool: 'str' object has no attribute 'get'\n</tool_response>" in text
    assert release_counts(text)["n_error_responses"] == 1


# -- executions in the real sandbox ----------------------------------------------------------------

@pytest.fixture(scope="module")
def sandbox_target():
    from sandbox_service.launcher import LocalSandbox

    with LocalSandbox(workers=1, slots=4, timeout_s=5.0) as sandbox:
        yield sandbox.target


def run(target, programs, env: ToolEnv = RELEASE, **options):
    """Results of `programs` (code strings) run with the preset's per-call options."""
    from sandbox_service.client import SandboxClient

    async def go():
        async with SandboxClient(target, **{**env.sandbox_options(), **options}) as client:
            return await client.execute_many(programs)
    return asyncio.run(go())


@pytest.mark.slow
def test_release_streams_are_cut_at_1000_characters_without_stopping_the_program(sandbox_target):
    finished, endless = run(sandbox_target, ["print('x' * 5000)", "while True: print('y' * 99)"], timeout_s=1.0)
    # An output flood that ends is a success; its stdout is the first 1000 characters.
    assert (finished.status, finished.exit_code, finished.stdout, finished.stdout_truncated) == \
        ("ok", 0, "x" * 1000, True)
    assert observed(finished) == expected(finished)
    assert observed(finished).startswith("Tool call success\nstdout: xxx") and "...(truncated)..." in observed(finished)
    assert len(observed(finished)) == 256 + len("...(truncated)...")
    # An endless one meets the time limit; no note of the sandbox's is added.
    assert (endless.status, endless.stdout, endless.stderr) == ("timeout", ("y" * 99 + "\n") * 10, "")
    assert observed(endless) == expected(endless)
    assert observed(endless).startswith("Tool call failure\nreason: worker_timeout\nstdout: yyy")


SYNTAX_MESSAGE = None
try:
    ast.parse("x = = 1")
except SyntaxError as e:  # this interpreter's wording, which the sandbox's (the same) uses too
    SYNTAX_MESSAGE = str(e)


@pytest.mark.slow
@pytest.mark.parametrize("code, stdout, stderr", [
    # The body's error at its line; what the program printed before is still in stdout's buffer when
    # the wrapper exits, so it is lost.
    ("print('before')\nx = 1\ny = 0\nz = x / y\nprint(z)", "",
     "ZeroDivisionError at line 4: division by zero\n  z = x / y\n"),
    # The innermost frame's line, in a function.
    ("def f():\n    return 1 / 0\n\ny = f()", "",
     "ZeroDivisionError at line 2: division by zero\n      return 1 / 0\n"),
    ("1 / 0", "", "ZeroDivisionError at line 1: division by zero\n  1 / 0\n"),
    # A trailing expression after a body: its line number is shifted by the body's length but looked
    # up in its own single line, so the release reports no line.
    ("x = 1\nx / 0", "", "ZeroDivisionError: division by zero\n"),
    ("x = = 1", "", f"SyntaxError at line 1: {SYNTAX_MESSAGE}\n  x = = 1\n"),
    # A trailing expression sharing its line with a statement is run as a statement: nothing shown.
    ("print('a'); 42", "a\n", ""),
])
def test_release_errors_are_the_wrappers_one_line(sandbox_target, code, stdout, stderr):
    [result] = run(sandbox_target, [code])
    assert (result.stdout, result.stderr) == (stdout, stderr)
    assert result.status == ("runtime_error" if stderr else "ok")
    assert observed(result) == expected(result)
    if stderr:
        assert observed(result).startswith(f"Tool call failure\nreason: \nstderr: {stderr}\nexecution time: ")


@pytest.mark.slow
def test_release_memory_bounds_the_address_space_as_code_judge_does(sandbox_target):
    """256 + 128 MB of address space: an allocation beyond it raises MemoryError in the program,
    reported on the wrapper's one line (code-judge's RLIMIT_AS), instead of a kill."""
    [result] = run(sandbox_target, ["x = bytearray(400 << 20)"])
    assert (result.status, result.stdout, result.stderr) == \
        ("memory_limit", "", "MemoryError at line 1: \n  x = bytearray(400 << 20)\n")
    assert observed(result) == expected(result)


@pytest.mark.slow
def test_release_imports_count_against_the_limit_and_fit_in_384_mb(sandbox_target):
    code = "import sys\nprint('numpy' in sys.modules)\nimport numpy, sympy\nprint(sympy.sqrt(8), numpy.arange(4).sum())"
    [cold] = run(sandbox_target, [code])
    [warm] = run(sandbox_target, [code], env=RICH)
    # Released: a worker that imported nothing of numpy's, so the import runs inside the call's time.
    assert (cold.status, cold.stdout, cold.worker[:4]) == ("ok", "False\n2*sqrt(2) 6\n", "lean")
    assert RELEASE.memory_mb == 384 and cold.duration_s > 0
    assert observed(cold) == expected(cold) == f"Tool call success\nstdout: False\n2*sqrt(2) 6\n\n" \
                                               f"execution time: {cold.duration_s:.2f}s"
    # The project's own: numpy is already imported by the worker.
    assert (warm.status, warm.stdout, warm.worker[:3]) == ("ok", "True\n2*sqrt(2) 6\n", "sci")


@pytest.mark.slow
def test_synthetic_sft_errors_read_as_the_sandbox_reports_them(sandbox_target):
    """A synthetic "fix" conversation's failing call shows the stderr the sandbox gives that code."""
    problem = generate_problems(1, seed=0, kinds=("product",))[0]
    broken = problem.solution.rstrip()[:-1]
    for env in (RELEASE, RICH):
        messages = sft_conversation(problem, behaviour="fix", error_format=env.error_format,
                                    format_observation=lambda r: r.stderr)
        [result] = run(sandbox_target, [broken], env=env)
        assert result.status == "runtime_error"
        if env is RELEASE:
            assert messages[2]["content"] == result.stderr
        else:  # Python's own message; the sandbox's traceback names the file it ran
            assert messages[2]["content"].splitlines()[-1] == result.stderr.splitlines()[-1]
