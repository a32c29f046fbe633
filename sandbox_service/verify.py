"""Final-answer extraction and math equivalence (pure functions, no gRPC).

`extract_answer` follows the rStar2 rule (spec §1.6): the last `\\boxed{...}` (or `\\fbox{...}`) inside
the last `<answer>...</answer>` block; fallbacks: the last `\\boxed{}` anywhere, then an "answer is X"
phrase. An answer block without a box (`<answer>7</answer>`) gives no answer: the prompt tells the
model its answer is read from `\\boxed{}`, and the release's grader scores such a response 0.
Braces are matched, so nested groups such as `\\boxed{\\frac{1}{2}}` come out whole.

`is_equivalent` compares after string/number normalisation, then with math-verify, the gold answer
wrapped as `\\boxed{gold}` as in the release. math-verify's own signal-based timeouts are disabled
(they only work on a main thread): callers must bound the time, e.g. through the service's Verify RPC,
which runs this in a worker process killed at the deadline.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_SPACE = re.compile(r"\\boxed +([^\s{}$]+)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+?)\s*(?=</answer>|\n|$)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` (balanced braces), or `\\boxed x`."""
    best_pos, best = -1, None
    for m in _BOXED_START.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                i += 2
                continue
            depth += (c == "{") - (c == "}")
            i += 1
        if depth == 0:
            best_pos, best = m.start(), text[m.end():i - 1]
    for m in _BOXED_SPACE.finditer(text):
        if m.start() > best_pos:
            best_pos, best = m.start(), m.group(1)
    return None if best is None else best.strip()


def _strip_math_delimiters(s: str) -> str:
    prev = None
    while prev != s:
        prev = s
        s = s.strip().rstrip(".。").strip().strip("$").strip()
    return s


def extract_answer(text: str) -> str | None:
    """The response's final answer, or None when it gives none."""
    blocks = _ANSWER_BLOCK.findall(text)
    if blocks:
        boxed = last_boxed(blocks[-1])
        if boxed is not None:
            return boxed
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for scope in ([blocks[-1]] if blocks else []) + [text]:
        phrases = _ANSWER_IS.findall(scope)
        if phrases:
            answer = _strip_math_delimiters(phrases[-1])
            if answer:
                return answer
    return None


_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_SIMPLE_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([-+]?\d+)\}\{([-+]?\d+)\}$")
_SLASH_FRAC = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")


def normalize(answer: str) -> str:
    """Canonical text form: no math delimiters, spacing macros, text wrappers, thousands separators
    or trailing period; `\\dfrac`/`\\tfrac` as `\\frac`."""
    s = _strip_math_delimiters(answer)
    s = re.sub(r"^\\\(|\\\)$", "", s).strip()
    s = re.sub(r"^\\\[|\\\]$", "", s).strip()
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    for macro in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\left", "\\right", "\\displaystyle"):
        s = s.replace(macro, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _as_fraction(s: str) -> Fraction | None:
    """An exact rational for plain numbers and simple fractions, else None."""
    try:
        if _NUMBER.fullmatch(s):
            return Fraction(s)
        m = _SIMPLE_FRAC.match(s)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) == "-" else value
        m = _SLASH_FRAC.match(s)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


class _DisabledTimeoutNotice(logging.Filter):
    """math-verify warns on every call that its timeouts are off; here that is deliberate."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DisabledTimeoutNotice())


def is_equivalent(pred: str, gold: str) -> bool:
    """True when `pred` and `gold` denote the same answer (normalised text, exact rationals, or
    math-verify's symbolic/numeric comparison). Has no timeout of its own."""
    p, g = normalize(pred), normalize(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    pf, gf = _as_fraction(p), _as_fraction(g)
    if pf is not None and gf is not None:
        return pf == gf
    try:  # heavy import: only when the cheap checks are undecided
        from math_verify import parse, verify
    except ImportError as e:  # an optional extra: the base install is the library without it
        raise ImportError(f"checking this answer needs the `math-verify` package ({e}): "
                          "pip install 'rstar-jax[train]' (or [sandbox])") from e

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
