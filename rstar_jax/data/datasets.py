"""Problem datasets for RL and evaluation: jsonl, json and parquet into seeded grain pipelines.

Supported layouts (keys are dotted paths; list indices may be negative):
- flat rows `{"question": ..., "answer": ...}` (jsonl, or a JSON list like the rStar eval files
  `{index, question, answer}`);
- the rStar2 parquet layout `prompt=[{"role": "user", "content": q}]`,
  `reward_model={"ground_truth": a}` (keys `prompt.-1.content` and `reward_model.ground_truth`).
With the key "auto" the layout is chosen per file from its first row.

A row without a usable question or answer (missing, null, empty, wrong type) is an error naming
the file and row, or, with `on_bad_row="skip"`, skipped and counted in the `LoadReport`. An empty
file is always an error. Batches of prompts come from a grain pipeline (shuffle with a new seed
each epoch, endless repetition, fixed-size batches) whose iterator state is a small JSON-able dict:
`PromptIterator.get_state()` / `set_state()` resume the exact order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from rstar_jax.agent.conversation import Conversation, ConversationError, parse_conversation
from rstar_jax.errors import UserError

FORMATS = ("json", "jsonl", "parquet")
AUTO_QUESTION_KEYS = ("question", "problem", "prompt.-1.content")
AUTO_ANSWER_KEYS = ("answer", "reward_model.ground_truth")


class DataError(UserError):
    """A dataset file or row that cannot be used; the message names the file and row."""


@dataclasses.dataclass(frozen=True)
class Example:
    question: str
    answer: str  # gold answer as text (integers are written in decimal)
    source: str  # file it came from
    row: int  # 0-based row index in that file


@dataclasses.dataclass
class LoadReport:
    """What loading kept and skipped (nothing is dropped silently)."""

    rows_read: int = 0
    rows_kept: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count
    examples_of_skipped: list[str] = dataclasses.field(default_factory=list)  # the first few, "file row N: why"

    def merge(self, other: "LoadReport") -> None:
        self.rows_read += other.rows_read
        self.rows_kept += other.rows_kept
        for reason, n in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.examples_of_skipped.extend(other.examples_of_skipped[: max(0, 10 - len(self.examples_of_skipped))])

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


def detect_format(path: pathlib.Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        if fmt not in FORMATS:
            raise DataError(f"{path}: unknown format {fmt!r}; expected one of {FORMATS}")
        return fmt
    suffix = path.suffix.lower().lstrip(".")
    if suffix in FORMATS:
        return suffix
    raise DataError(f"{path}: cannot tell the format from the extension {path.suffix!r}; "
                    f"set data.format to one of {FORMATS}")


_MISSING = object()


def lookup(row: Any, dotted: str) -> Any:
    """Value at a dotted path (`reward_model.ground_truth`, `prompt.-1.content`), or _MISSING."""
    node = row
    for part in dotted.split("."):
        if isinstance(node, dict):
            if part not in node:
                return _MISSING
            node = node[part]
        elif isinstance(node, (list, tuple)):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                return _MISSING
        else:
            return _MISSING
    return node


def _read_rows(path: pathlib.Path, fmt: str) -> list[tuple[int, Any, str]]:
    """(row index, row, location text) for every row; a malformed jsonl line becomes an error row."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        return [(i, row, f"row {i}") for i, row in enumerate(rows)]
    text = path.read_text()
    if fmt == "json":
        if not text.strip():
            return []
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a json dataset must be a list of objects, got {type(data).__name__}")
        return [(i, row, f"row {i}") for i, row in enumerate(data)]
    out = []
    index = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            row = _BadJson(str(e))
        out.append((index, row, f"row {index} (line {line_no})"))
        index += 1
    return out


@dataclasses.dataclass
class _BadJson:
    error: str


def _resolve_key(first_row: Any, key: str, candidates: Sequence[str]) -> str:
    if key != "auto":
        return key
    for candidate in candidates:
        if lookup(first_row, candidate) is not _MISSING:
            return candidate
    return candidates[0]  # every row will then report the missing key by name


def _answer_text(value: Any) -> str | None:
    """Gold answer as text, or None when unusable (null, empty, or not a string/number)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value.strip() or None
    return None


def read_examples(path: str | pathlib.Path, *, fmt: str = "auto", question_key: str = "auto",
                  answer_key: str = "auto", on_bad_row: str = "error") -> tuple[list[Example], LoadReport]:
    """Reads one file into Examples; see the module docstring for layouts and bad-row handling."""
    if on_bad_row not in ("error", "skip"):
        raise DataError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows = _read_rows(path, detect_format(path, fmt))
    if not rows:
        raise DataError(f"{path}: the file is empty (no rows)")
    first = next((row for _, row, _ in rows if isinstance(row, dict)), {})
    q_key = _resolve_key(first, question_key, AUTO_QUESTION_KEYS)
    a_key = _resolve_key(first, answer_key, AUTO_ANSWER_KEYS)
    report = LoadReport(rows_read=len(rows))
    examples = []
    for index, row, where in rows:
        problem = None
        if isinstance(row, _BadJson):
            problem = ("invalid_json", f"invalid JSON ({row.error})")
        elif not isinstance(row, dict):
            problem = ("not_an_object", f"expected an object, got {type(row).__name__}")
        else:
            question = lookup(row, q_key)
            answer = lookup(row, a_key)
            if question is _MISSING:
                problem = ("missing_question", f"no question at key {q_key!r}")
            elif not isinstance(question, str) or not question.strip():
                problem = ("bad_question", f"question at {q_key!r} must be a non-empty string, got {question!r}")
            elif answer is _MISSING:
                problem = ("missing_answer", f"no answer at key {a_key!r}")
            elif answer is None:
                problem = ("null_answer", f"answer at {a_key!r} is null")
            elif _answer_text(answer) is None:
                kind = "empty_answer" if isinstance(answer, str) else "bad_answer_type"
                problem = (kind, f"answer at {a_key!r} must be a non-empty string or a number, "
                                 f"got {type(answer).__name__} {answer!r}")
        if problem is None:
            examples.append(Example(question=question, answer=_answer_text(answer), source=str(path), row=index))
            continue
        reason, message = problem
        if on_bad_row == "error":
            raise DataError(f"{path} {where}: {message} (set data.on_bad_row='skip' to skip such rows)")
        report.skipped[reason] = report.skipped.get(reason, 0) + 1
        if len(report.examples_of_skipped) < 10:
            report.examples_of_skipped.append(f"{path} {where}: {message}")
    report.rows_kept = len(examples)
    if not examples:
        raise DataError(f"{path}: none of its {len(rows)} rows is usable ({report.skipped})")
    return examples, report


def load_examples(files: Sequence[str | pathlib.Path], *, fmt: str = "auto", question_key: str = "auto",
                  answer_key: str = "auto", on_bad_row: str = "error") -> tuple[list[Example], LoadReport]:
    """All files concatenated in the given order, with a merged report."""
    if not files:
        raise DataError("no dataset files given")
    examples: list[Example] = []
    report = LoadReport()
    for path in files:
        part, part_report = read_examples(path, fmt=fmt, question_key=question_key, answer_key=answer_key,
                                          on_bad_row=on_bad_row)
        examples.extend(part)
        report.merge(part_report)
    return examples, report


def filter_overlong_prompts(examples: Sequence[Example], prompt_length, max_length: int, report: LoadReport, *,
                            skip: bool = True) -> list[Example]:
    """Examples whose prompt (`prompt_length(question)` tokens, chat template included) fits
    `max_length`. skip: the rest are dropped and counted in `report` as "overlong_prompt" (the
    release's filter_overlong_prompts); otherwise the first is a DataError naming its row."""
    kept = []
    for example in examples:
        n = prompt_length(example.question)
        if n <= max_length:
            kept.append(example)
            continue
        message = f"the prompt has {n} tokens, more than rollout.max_prompt_length={max_length}"
        if not skip:
            raise DataError(f"{example.source} row {example.row}: {message} (set data.filter_overlong_prompts=True "
                            f"to drop such prompts)")
        report.skipped["overlong_prompt"] = report.skipped.get("overlong_prompt", 0) + 1
        if len(report.examples_of_skipped) < 10:
            report.examples_of_skipped.append(f"{example.source} row {example.row}: {message}")
    report.rows_kept -= len(examples) - len(kept)
    if not kept:
        raise DataError(f"every one of the {len(examples)} prompts is longer than rollout.max_prompt_length="
                        f"{max_length} tokens")
    return kept


class _EpochShuffled(Sequence):
    """Random access to the concatenation of epochs, each an independent seeded permutation.

    Element i is example perm_e[i mod n] of epoch e = i // n, with perm_e drawn by NumPy from
    (seed, e). The same stream shape as grain's shuffle-then-repeat, but grain's per-index
    shuffle costs about 3 ms per element on small datasets and 36 us at 42K examples, against
    about 25 us per prompt here (benchmarks/prompt_stream.py).
    """

    def __init__(self, examples: Sequence[Example], *, seed: int, shuffle: bool, num_epochs: int | None):
        self.examples = examples
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self._cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        # Endless streams still need a length for random access; 2**62 elements is endless enough.
        return len(self.examples) * self.num_epochs if self.num_epochs is not None else 2 ** 62

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.pop(min(self._cache))
            n = len(self.examples)
            self._cache[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                                  else np.arange(n))
        return self._cache[epoch]

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < len(self):
            raise IndexError(index)
        epoch, position = divmod(index, len(self.examples))
        return self.examples[int(self.permutation(epoch)[position])]


class PromptIterator:
    """Endless (or `num_epochs`-long) stream of prompt batches with checkpointable state."""

    def __init__(self, examples: Sequence[Example], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None, drop_remainder: bool = True):
        if not examples:
            raise DataError("PromptIterator: no examples")
        if batch_size < 1:
            raise DataError(f"PromptIterator: batch_size must be >= 1, got {batch_size}")
        if drop_remainder and num_epochs is not None and batch_size > len(examples) * num_epochs:
            raise DataError(f"PromptIterator: batch_size {batch_size} exceeds the {len(examples)} examples "
                            f"x {num_epochs} epochs")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        source = _EpochShuffled(self.examples, seed=seed, shuffle=shuffle, num_epochs=num_epochs)
        dataset = grain.MapDataset.source(source).batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
        # Prompts are cheap to produce: no prefetch threads competing with rollouts for the CPU.
        read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._fingerprint = {"num_examples": len(self.examples), "batch_size": batch_size, "seed": seed,
                             "shuffle": shuffle, "first": [self.examples[0].source, self.examples[0].row]}
        self._iterator = iter(dataset.to_iter_dataset(read_options))

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> list[Example]:
        return next(self._iterator)

    def get_state(self) -> dict:
        """JSON-serialisable position (with a fingerprint of the data it belongs to)."""
        return {"iterator": self._iterator.get_state(), **self._fingerprint}

    def set_state(self, state: dict, *, same_files: bool = True) -> None:
        """Continues from `state` (a `get_state()`); a DataError when it belongs to other data. With
        `same_files=False` the files may live elsewhere (a stage continuing another's run on a copy
        of its data): the first example's row is checked but not its path."""
        for key, value in self._fingerprint.items():
            if key == "first" and not same_files:
                value, state = value[1:], {**state, key: list(state.get(key) or [None])[1:]}
            saved = state.get(key)
            if isinstance(value, list) and isinstance(saved, (list, tuple)):
                saved = list(saved)
            if saved != value:
                raise DataError(f"data iterator state belongs to different data: {key} was {state.get(key)!r}, "
                                f"now {value!r}")
        self._iterator.set_state(state["iterator"])


def read_conversations(path: str | pathlib.Path, *, fmt: str = "auto",
                       on_bad_row: str = "error") -> tuple[list[Conversation], LoadReport]:
    """SFT conversations: rows `{"messages": [...], "tools": [...]}` in the messages format of Hugging
    Face chat templates and OpenAI (`rstar_jax.agent.conversation.parse_conversation`), from jsonl,
    json or parquet. A bad row is an error naming the file, row and field, or with
    `on_bad_row="skip"` skipped and counted."""
    path = pathlib.Path(path)
    if on_bad_row not in ("error", "skip"):
        raise DataError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows = _read_rows(path, detect_format(path, fmt))
    if not rows:
        raise DataError(f"{path}: the file is empty (no conversations)")
    report = LoadReport(rows_read=len(rows))
    conversations = []
    for _, row, where in rows:
        try:
            if isinstance(row, _BadJson):
                raise ConversationError(f"invalid JSON ({row.error})")
            conversations.append(parse_conversation(row, f"{path} {where}"))
        except ConversationError as e:
            if on_bad_row == "error":
                raise DataError(f"{path} {where}: {e} (set data.on_bad_row='skip' to skip such rows)") from None
            report.skipped["bad_conversation"] = report.skipped.get("bad_conversation", 0) + 1
            if len(report.examples_of_skipped) < 10:
                report.examples_of_skipped.append(f"{path} {where}: {e}")
    report.rows_kept = len(conversations)
    if not conversations:
        raise DataError(f"{path}: none of its {len(rows)} conversations is usable ({report.skipped})")
    return conversations, report
