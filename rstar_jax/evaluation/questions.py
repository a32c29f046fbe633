"""Evaluation questions: every usable row of the evaluation files, keyed by (file, row)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rstar_jax.data.datasets import DataError, LoadReport, read_examples
from rstar_jax.errors import UserError


class EvalError(UserError):
    """An evaluation that cannot run or resume as asked; the message names the field or file."""


@dataclasses.dataclass(frozen=True)
class Question:
    key: str  # "<file>#<row>": how records find their question on resume
    file: str  # the path as the config gives it
    row: int  # 0-based row in that file (`rstar_jax.data.datasets.Example.row`)
    ordinal: int  # position among all questions of the run: the seeded-sampling group id
    question: str
    answer: str


def load_questions(files: Sequence[str], *, fmt: str = "auto", question_key: str = "auto",
                   answer_key: str = "auto", on_bad_row: str = "error",
                   field: str = "eval.files") -> tuple[list[Question], LoadReport]:
    """Every usable row of `files`, in order, keyed by (file, row)."""
    if not files:
        raise EvalError(f"config.{field}: no files to read")
    seen: set[str] = set()
    questions: list[Question] = []
    report = LoadReport()
    for path in files:
        if str(path) in seen:
            raise EvalError(f"config.{field}: {path} is listed twice")
        seen.add(str(path))
        examples, part = read_examples(path, fmt=fmt, question_key=question_key, answer_key=answer_key,
                                       on_bad_row=on_bad_row)
        report.merge(part)
        for ex in examples:
            questions.append(Question(key=f"{path}#{ex.row}", file=str(path), row=ex.row, ordinal=len(questions),
                                      question=ex.question, answer=ex.answer))
    return questions, report


def check_prompt_lengths(questions: Sequence[Question], tokenizer, template, max_prompt_length: int) -> None:
    """A prompt longer than rollout.max_prompt_length would overflow the engine: name the row."""
    for q in questions:
        n = len(template.prompt_ids(tokenizer, q.question))
        if n > max_prompt_length:
            raise DataError(f"{q.file} row {q.row}: the prompt is {n} tokens, more than "
                            f"config.rollout.max_prompt_length={max_prompt_length}")
