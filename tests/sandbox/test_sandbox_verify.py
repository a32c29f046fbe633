"""Answer extraction and equivalence: pure functions, and the Verify RPC on a real server."""

from __future__ import annotations

import asyncio
import json

import pytest

from sandbox_service import status
from sandbox_service.client import SandboxClient
from sandbox_service.launcher import LocalSandbox
from sandbox_service.verify import extract_answer, is_equivalent, last_boxed, normalize

pytestmark = pytest.mark.slow  # a sandbox server subprocess


@pytest.mark.parametrize("text, expected", [
    ("<reason>x</reason><answer>so \\boxed{12}</answer>", "12"),
    # the last \boxed inside <answer> wins over boxes elsewhere (tool output, reasoning)
    ("\\boxed{99} <answer>\\boxed{1} then \\boxed{2}</answer> \\boxed{3}", "2"),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
    ("<answer>\\boxed{\\left\\{1, 2\\right\\}}</answer>", "\\left\\{1, 2\\right\\}"),
    ("<answer>\\fbox{7}</answer>", "7"),
    ("no answer block but \\boxed{5} and later \\boxed{6}", "6"),
    ("\\boxed 8 is it", "8"),
    ("Therefore, the final answer is $42$.", "42"),
    ("<answer>17</answer>", None),  # no box: the release scores it 0, and the prompt asks for \boxed{}
    ("\\boxed{3} <answer>\\boxed{unclosed</answer>", "3"),  # an unclosed box is skipped
    ("nothing here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_nested_braces():
    assert last_boxed("\\boxed{a^{b^{c}}} and \\boxed{\\sqrt{\\frac{x}{y}}}") == "\\sqrt{\\frac{x}{y}}"


@pytest.mark.parametrize("pred, gold, same", [
    ("27", "27", True), ("$27$", "27", True), ("27.0", "27", True), ("\\frac{54}{2}", "27", True),
    ("0.75", "\\frac{3}{4}", True), ("3/4", "\\dfrac{3}{4}", True), ("1,625", "1625", True),
    ("\\text{5}", "5", True), ("-1", "-1", True), ("28", "27", False), ("0.76", "\\frac{3}{4}", False),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True), ("x+1", "1+x", True), ("", "1", False),
])
def test_is_equivalent(pred, gold, same):
    assert is_equivalent(pred, gold) is same


def test_normalize():
    assert normalize(" $\\dfrac{1}{2}$. ") == "\\frac{1}{2}"
    assert normalize("\\text{10}\\,") == "10"


def forms(gold: str) -> list[str]:
    """Equivalent ways a response can state `gold` (an integer)."""
    return [
        f"<reason>work</reason><answer>\\boxed{{{gold}}}</answer>",
        f"<answer>The answer is ${gold}$</answer>",
        f"Reasoning... so the answer is {gold}.",
        f"<answer>\\boxed{{{gold}.0}}</answer>",
        f"<answer>\\boxed{{\\frac{{{2 * int(gold)}}}{{2}}}}</answer>",
        f"\\boxed{{0}} was wrong; <answer>\\boxed{{{gold}}}</answer>",
    ]


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(workers=1, slots=4, verify_timeout_s=10.0) as sb:
        yield sb


def test_amc23_gold_answers_verify_through_the_rpc(sandbox, shared_dir):
    problems = json.loads((shared_dir / "data" / "amc23_test.json").read_text())
    golds = [p["answer"] for p in problems]
    assert len(golds) == 40
    cases = []
    for i, gold in enumerate(golds):
        for text in forms(gold):
            cases.append((text, gold, True))
        other = next(g for g in golds[i + 1:] + golds[:i] if g != gold)
        cases.append((f"<answer>\\boxed{{{other}}}</answer>", gold, False))
        cases.append((f"<answer>\\boxed{{{gold}}}</answer>", other, False))

    async def go():
        async with SandboxClient(sandbox.target) as client:
            return await asyncio.gather(*(client.verify(text, gold) for text, gold, _ in cases))

    results = asyncio.run(go())
    wrong = [(c, r) for c, r in zip(cases, results) if r.status != status.OK or r.correct is not c[2]]
    assert not wrong, wrong[:5]
    # The local pure functions agree with the service on every case.
    assert all((is_equivalent(extract_answer(t), g) if extract_answer(t) else False) is exp for t, g, exp in cases[:24])


def test_pathological_expression_times_out_cleanly(sandbox):
    async def go():
        async with SandboxClient(sandbox.target) as client:
            slow = await client.verify("<answer>\\boxed{2^{2^{2^{2^{2^{2}}}}}}</answer>", "3", timeout_s=1.0)
            after = await client.verify("<answer>\\boxed{4}</answer>", "4")
            return slow, after

    slow, after = asyncio.run(go())
    assert slow.status in (status.TIMEOUT, status.MEMORY_LIMIT) and slow.correct is False, slow
    assert after.status == status.OK and after.correct, after  # the pool is unaffected


def test_missing_answer_is_not_correct(sandbox):
    async def go():
        async with SandboxClient(sandbox.target) as client:
            return await client.verify("I could not solve it.", "5")

    r = asyncio.run(go())
    assert r.status == status.OK and r.correct is False and r.extracted is None
