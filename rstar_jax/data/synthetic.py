"""Seeded synthetic tool-use math problems for tiny runs and tests.

Every problem has an integer answer that is tedious in the head and one line of Python away
(digit sums of large powers, prime counts, modular powers, divisor counts, Fibonacci residues,
binomial residues, power sums), a question text, and a reference solution that prints the answer.
`write_problems` writes a dataset file in any format the data pipeline reads, and
`sft_conversation` builds a complete rStar2-style multi-turn conversation that solves a problem:
with one tool call (the reference code, answered with its real output, then the boxed answer),
without the tool, or with a failing call fixed on the second try (`BEHAVIOURS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pathlib
import random
from collections.abc import Callable, Collection, Sequence

from rstar_jax.agent.tool_calls import STATUS_OK, syntax_error_text

DEFAULT_TOOL_NAME = "python_code_with_standard_io"  # spec §2.2


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str
    question: str
    answer: int
    solution: str  # Python source that prints `answer`

    def to_row(self, index: int) -> dict:
        return {"index": index, "kind": self.kind, "question": self.question, "answer": str(self.answer),
                "solution": self.solution}


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for d in range(2, math.isqrt(n) + 1):
        if n % d == 0:
            return False
    return True


def _fib_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a % m


# Each generator: (rng, difficulty 1..3) -> Problem. Sizes grow with difficulty so that even
# difficulty 1 is far beyond comfortable mental arithmetic, while the code stays instant.

def digit_sum_power(rng: random.Random, difficulty: int) -> Problem:
    base = rng.randint(2, 9)
    exponent = rng.randint(15 * difficulty, 60 * difficulty)
    answer = sum(int(ch) for ch in str(base ** exponent))
    code = f"print(sum(int(ch) for ch in str({base} ** {exponent})))"
    return Problem("digit_sum_power", f"What is the sum of the decimal digits of {base}^{exponent}?", answer, code)


def primes_in_range(rng: random.Random, difficulty: int) -> Problem:
    low = rng.randint(10, 500 * difficulty)
    high = low + rng.randint(100, 800 * difficulty)
    answer = sum(1 for n in range(low, high + 1) if _is_prime(n))
    code = (f"def is_prime(n):\n    if n < 2:\n        return False\n    d = 2\n    while d * d <= n:\n"
            f"        if n % d == 0:\n            return False\n        d += 1\n    return True\n\n"
            f"print(sum(1 for n in range({low}, {high + 1}) if is_prime(n)))")
    return Problem("primes_in_range", f"How many prime numbers p satisfy {low} <= p <= {high}?", answer, code)


def modular_power(rng: random.Random, difficulty: int) -> Problem:
    base = rng.randint(3, 99 * difficulty)
    exponent = rng.randint(100, 10 ** (2 + difficulty))
    modulus = rng.randint(101, 10 ** (2 + difficulty))
    answer = pow(base, exponent, modulus)
    code = f"print(pow({base}, {exponent}, {modulus}))"
    return Problem("modular_power", f"What is the remainder when {base}^{exponent} is divided by {modulus}?",
                   answer, code)


def divisor_count(rng: random.Random, difficulty: int) -> Problem:
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23]
    n, answer = 1, 1
    for p in rng.sample(primes, 2 + difficulty):
        exponent = rng.randint(1, 2 + difficulty)
        n, answer = n * p ** exponent, answer * (exponent + 1)
    # Divides the factors out: counting divisors up to sqrt(n) would take up to 10^15 steps at
    # difficulty 3 (n up to 10^31), here and in the sandbox.
    code = (f"n = {n}\ncount = 1\nd = 2\nwhile d * d <= n:\n    e = 0\n    while n % d == 0:\n"
            f"        n //= d\n        e += 1\n    count *= e + 1\n    d += 1\nif n > 1:\n    count *= 2\nprint(count)")
    return Problem("divisor_count", f"How many positive divisors does {n} have?", answer, code)


def fibonacci_mod(rng: random.Random, difficulty: int) -> Problem:
    n = rng.randint(50, 500 * difficulty)
    modulus = rng.randint(97, 10 ** (2 + difficulty))
    answer = _fib_mod(n, modulus)
    code = f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {modulus}\nprint(a)"
    return Problem("fibonacci_mod", f"Let F(0) = 0, F(1) = 1 and F(n) = F(n-1) + F(n-2). "
                                    f"What is F({n}) modulo {modulus}?", answer, code)


def binomial_mod(rng: random.Random, difficulty: int) -> Problem:
    n = rng.randint(30, 200 * difficulty)
    k = rng.randint(5, n // 2)
    modulus = rng.randint(97, 10 ** (2 + difficulty))
    answer = math.comb(n, k) % modulus
    code = f"from math import comb\nprint(comb({n}, {k}) % {modulus})"
    return Problem("binomial_mod", f"In how many ways can {k} items be chosen from {n} distinct items? "
                                   f"Give the count modulo {modulus}.", answer, code)


def power_sum_mod(rng: random.Random, difficulty: int) -> Problem:
    n = rng.randint(50, 400 * difficulty)
    power = rng.randint(3, 4 + 2 * difficulty)
    modulus = rng.randint(97, 10 ** (2 + difficulty))
    answer = sum(pow(i, power, modulus) for i in range(1, n + 1)) % modulus
    code = f"print(sum(i ** {power} for i in range(1, {n + 1})) % {modulus})"
    return Problem("power_sum_mod", f"What is (1^{power} + 2^{power} + ... + {n}^{power}) modulo {modulus}?",
                   answer, code)


def last_digit_power(rng: random.Random, difficulty: int) -> Problem:
    # One-digit answers: a weak policy that guesses gets some right, so its rollout groups are mixed
    # and RL has a signal from the first step (the tiny run's RL warm start).
    base = rng.randint(2, 9 + 90 * (difficulty - 1))
    exponent = rng.randint(100, 10 ** (2 + difficulty))
    code = f"print(pow({base}, {exponent}, 10))"
    return Problem("last_digit_power", f"What is the last digit of {base}^{exponent}?", pow(base, exponent, 10), code)


def product(rng: random.Random, difficulty: int) -> Problem:
    # Beyond a tiny model's mental arithmetic, one line for the tool, written as the call writes it.
    # The tiny runs' warm-ups learn to copy by distance, not by content: a first-layer head reads the
    # character a fixed number of positions back (benchmarks/copy_heads.py). One fixed wording and
    # factors of one width, whose products all have twice as many digits, keep every source at one
    # distance from its copy; a probe with ten wordings, which vary it, formed the copy later.
    low, high = {1: (32, 99), 2: (317, 999), 3: (3163, 9999)}[difficulty]
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Problem("product", f"What is ({a}*{b})?", a * b, f"print({a}*{b})")


GENERATORS: dict[str, Callable[[random.Random, int], Problem]] = {
    "digit_sum_power": digit_sum_power,
    "primes_in_range": primes_in_range,
    "modular_power": modular_power,
    "divisor_count": divisor_count,
    "fibonacci_mod": fibonacci_mod,
    "binomial_mod": binomial_mod,
    "power_sum_mod": power_sum_mod,
    "last_digit_power": last_digit_power,
    "product": product,
}


def generate_problems(n: int, *, seed: int = 0, kinds: Sequence[str] = (), difficulty: int = 1,
                      exclude: Collection[str] = ()) -> list[Problem]:
    """`n` problems cycling through `kinds` (all generators when empty); deterministic in `seed`.
    `exclude`: questions never to produce (held-out ones), redrawn when drawn."""
    if n < 0:
        raise ValueError(f"generate_problems: n must be >= 0, got {n}")
    if difficulty not in (1, 2, 3):
        raise ValueError(f"generate_problems: difficulty must be 1, 2 or 3, got {difficulty}")
    kinds = list(kinds) or list(GENERATORS)
    unknown = [k for k in kinds if k not in GENERATORS]
    if unknown:
        raise ValueError(f"generate_problems: unknown kinds {unknown}; known: {sorted(GENERATORS)}")
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        for _ in range(1000):
            problem = GENERATORS[kind](rng, difficulty)
            if problem.question not in exclude:
                break
        else:
            raise ValueError(f"generate_problems: 1000 draws of {kind} at difficulty {difficulty} were all excluded")
        problems.append(problem)
    return problems


@contextlib.contextmanager
def _written_whole(path: pathlib.Path):
    """Yields a temporary path that replaces `path` once written: readers (another process of the
    job writing the same deterministic file, a resumed run) never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_problems(path: str | pathlib.Path, problems: Sequence[Problem], fmt: str = "auto") -> pathlib.Path:
    """Writes problems as jsonl (one row each), json (a list of {index, question, answer}, like the
    rStar eval files) or parquet (the rStar2 training layout: prompt / reward_model / extra_info)."""
    path = pathlib.Path(path)
    if fmt == "auto":
        fmt = path.suffix.lstrip(".")
    rows = [p.to_row(i) for i, p in enumerate(problems)]
    if fmt not in ("jsonl", "json", "parquet"):
        raise ValueError(f"write_problems: unknown format {fmt!r} for {path} (expected jsonl, json or parquet)")
    with _written_whole(path) as tmp:
        _write_rows(tmp, fmt, rows)
    return path


def _write_rows(path: pathlib.Path, fmt: str, rows: list[dict]) -> None:
    if fmt == "jsonl":
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps([{k: r[k] for k in ("index", "question", "answer")} for r in rows], indent=1))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([{
            "data_source": "rstar_jax_synthetic",
            "agent_name": "rstar2_agent",
            "prompt": [{"role": "user", "content": r["question"]}],
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"split": "train", "index": r["index"], "answer": r["answer"], "question": r["question"]},
        } for r in rows])
        pq.write_table(table, path)


def run_reference(problem: Problem) -> str:
    """Runs the (trusted, generated) reference solution in-process and returns its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(problem.solution, f"<{problem.kind}>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def tool_call_text(code: str, tool_name: str = DEFAULT_TOOL_NAME, stdin: str = "") -> str:
    """A Hermes/Qwen-style tool call as the rStar2 model writes it (spec §2.1)."""
    call = {"name": tool_name, "arguments": {"code": code, "input": stdin}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# How a solved conversation goes. "tool": one correct call, then the answer. "direct": an answer
# without the tool (for problems beyond mental arithmetic, an estimate, usually wrong). "fix": a call that fails (a
# syntax error), then the corrected call and the answer. A warm-up on a mix leaves RL something to
# choose between: the tool or not, and a clean call or one that needs a second try.
BEHAVIOURS = ("direct", "tool", "fix")
# The "fix" behaviour's first, failing call: its closing parenthesis left out ("unclosed", SyntaxError:
# '(' was never closed) or doubled ("unmatched", SyntaxError: unmatched ')'). The second reports no
# "(" of its own: every "(" the fix can copy its numbers after (the question's, the failed call's and
# the traceback's echo of it) is followed by the factors (benchmarks/roc_effect.py).
FIX_BUGS = ("unclosed", "unmatched")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """An execution result as the sandbox reports it (what `format_observation` renders)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0


def _syntax_error(code: str, error_format: str = "traceback") -> str:
    """The stderr for trusted, generated code that does not compile."""
    text = syntax_error_text(code, error_format)
    if text is None:
        raise ValueError(f"expected {code!r} not to compile")
    return text


def sft_conversation(problem: Problem, *, tool_name: str = DEFAULT_TOOL_NAME,
                     format_observation: Callable[[ToolResult], str] | None = None,
                     behaviour: str = "tool", error_format: str = "traceback", fix_bug: str = "unclosed") -> list[dict]:
    """A full solved conversation as chat messages for the template to render.

    The assistant turns omit the leading `<reason>` because the template forces it at the start of
    every assistant turn (spec §2.1); a tool message holds the code's real result, rendered by
    `format_observation` (e.g. the rollout loop's style) when given, else the bare stdout/stderr,
    with a failing call's error in the sandbox's `error_format` ("traceback" or "release"); `fix_bug`
    (`FIX_BUGS`): how the "fix" behaviour's first call fails.
    """
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"sft_conversation: behaviour must be one of {BEHAVIOURS}, got {behaviour!r}")
    if fix_bug not in FIX_BUGS:
        raise ValueError(f"sft_conversation: fix_bug must be one of {FIX_BUGS}, got {fix_bug!r}")
    stdout = run_reference(problem)
    if stdout.strip() != str(problem.answer):
        raise RuntimeError(f"reference solution of a {problem.kind} problem printed {stdout!r}, "
                           f"expected {problem.answer}")
    render = format_observation or (lambda result: result.stdout or result.stderr)
    boxed = "</reason>\n<answer>\\boxed{{{}}}</answer>"
    answer = boxed.format(problem.answer)
    messages = [{"role": "user", "content": problem.question}]
    if behaviour == "direct":  # without the tool, the magnitude at best: the leading digit, then zeros
        return messages + [{"role": "assistant", "content": boxed.format(round(problem.answer, 1 - len(str(problem.answer))))}]
    if behaviour == "fix":
        solution = problem.solution.rstrip()
        broken = solution[:-1] if fix_bug == "unclosed" else solution + ")"
        messages += [{"role": "assistant", "content": tool_call_text(broken, tool_name)},
                     {"role": "tool", "content": render(ToolResult("runtime_error",
                                                                   stderr=_syntax_error(broken, error_format)))}]
    return messages + [
        {"role": "assistant", "content": tool_call_text(problem.solution, tool_name)},
        {"role": "tool", "content": render(ToolResult(STATUS_OK, stdout=stdout))},
        {"role": "assistant", "content": answer},
    ]


def behaviours_for(n: int, mix: Sequence[float], seed: int) -> list[str]:
    """`n` behaviours drawn with weights `mix` over `BEHAVIOURS` (direct, tool, fix)."""
    if len(mix) != len(BEHAVIOURS) or any(w < 0 for w in mix) or not sum(mix) > 0:
        raise ValueError(f"behaviours_for: mix must be {len(BEHAVIOURS)} non-negative weights for {BEHAVIOURS} "
                         f"with a positive sum, got {tuple(mix)}")
    return random.Random(seed).choices(BEHAVIOURS, weights=mix, k=n)


def write_sft_file(path: str | pathlib.Path, problems: Sequence[Problem], *, tool_name: str = DEFAULT_TOOL_NAME,
                   format_observation: Callable[[ToolResult], str] | None = None,
                   behaviours: Sequence[str] | None = None, error_format: str = "traceback",
                   fix_bug: str = "unclosed") -> pathlib.Path:
    """jsonl of {"messages": [...], "answer": "N", "behaviour": ...}: the SFT input format."""
    path = pathlib.Path(path)
    behaviours = behaviours or ["tool"] * len(problems)
    with _written_whole(path) as tmp, open(tmp, "w") as f:
        for p, behaviour in zip(problems, behaviours, strict=True):
            messages = sft_conversation(p, tool_name=tool_name, format_observation=format_observation,
                                        behaviour=behaviour, error_format=error_format, fix_bug=fix_bug)
            f.write(json.dumps({"messages": messages, "answer": str(p.answer), "behaviour": behaviour}) + "\n")
    return path


@dataclasses.dataclass(frozen=True)
class SyntheticFiles:
    train: pathlib.Path  # RL problems (jsonl)
    eval: pathlib.Path  # held-out problems (jsonl)
    sft: tuple[pathlib.Path, ...]  # solved conversations, one file per SFT stage, on problems apart from the rest


def held_out_problems(*, num_eval: int, seed: int, kinds: Sequence[str] = (), difficulty: int = 1) -> list[Problem]:
    """The held-out problems of the synthetic set with this seed (seed + 1, so they do not repeat the
    training problems' draws); training and SFT problems exclude their questions."""
    return generate_problems(num_eval, seed=seed + 1, kinds=tuple(kinds), difficulty=difficulty)


def write_held_out(out_dir: str | pathlib.Path, *, num_eval: int, seed: int, kinds: Sequence[str] = (),
                   difficulty: int = 1) -> pathlib.Path:
    """`<out_dir>/eval.jsonl`: `held_out_problems`."""
    problems = held_out_problems(num_eval=num_eval, seed=seed, kinds=kinds, difficulty=difficulty)
    return write_problems(pathlib.Path(out_dir) / "eval.jsonl", problems)


def prepare_synthetic_data(out_dir: str | pathlib.Path, *, num_train: int, num_eval: int, seed: int = 0,
                           kinds: Sequence[str] = (), difficulty: int = 1, tool_name: str = DEFAULT_TOOL_NAME,
                           format_observation: Callable[[ToolResult], str] | None = None,
                           sft_stages: Sequence[tuple[int, Sequence[float]]] = ((0, (0.0, 1.0, 0.0)),),
                           error_format: str = "traceback", fix_bug: str = "unclosed") -> SyntheticFiles:
    """Writes RL problems, held-out problems and solved SFT conversations into `out_dir` and returns
    their paths. `sft_stages`: (conversations, weights over `BEHAVIOURS`) per SFT stage, 0
    conversations meaning `num_train`; stage i goes to `sft_<i>.jsonl`; failing calls' errors read as
    the sandbox's `error_format` reports them, the "fix" behaviour's failing as `fix_bug` says. Deterministic in the seed, so a
    resumed run rewrites identical files. Held-out and SFT problems use their own seeds (seed+1,
    seed+2); no RL or SFT problem is a held-out one (small kinds, such as `product`'s 4624
    questions, may repeat within the RL or the SFT set)."""
    out = pathlib.Path(out_dir)
    kinds = tuple(kinds)
    counts = [n or num_train for n, _ in sft_stages]
    held_out = held_out_problems(num_eval=num_eval, seed=seed, kinds=kinds, difficulty=difficulty)
    exclude = frozenset(p.question for p in held_out)
    train = generate_problems(num_train, seed=seed, kinds=kinds, difficulty=difficulty, exclude=exclude)
    sft = generate_problems(sum(counts), seed=seed + 2, kinds=kinds, difficulty=difficulty, exclude=exclude)
    files, start = [], 0
    for i, (n, (_, mix)) in enumerate(zip(counts, sft_stages)):
        files.append(write_sft_file(out / f"sft_{i}.jsonl", sft[start:start + n], tool_name=tool_name,
                                    format_observation=format_observation, error_format=error_format,
                                    fix_bug=fix_bug, behaviours=behaviours_for(n, mix, seed + 3 + i)))
        start += n
    return SyntheticFiles(
        train=write_problems(out / "train.jsonl", train),
        eval=write_problems(out / "eval.jsonl", held_out),
        sft=tuple(files),
    )
