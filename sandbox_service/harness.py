"""What runs inside a call's process after isolation: the user's program with REPL-style display of
a trailing expression, or an answer verification.

Semantics follow the rStar2 release's wrapper: the code is parsed with `ast`; everything but a
trailing bare expression is executed, then that expression is evaluated and its `repr` printed when
it is not None (the paper's response kind 2). `sys.exit` keeps Python's meaning. Errors are reported
in one of two formats:

- "traceback" (the default): a traceback trimmed to the user's code (frames of this harness are
  dropped), exit code 1; stdout is line-buffered, so what was printed before an error or a kill is kept.
- "release": the release wrapper (`code_template_setup` in rStar's code_judge_utils.py) reimplemented:
  the trailing expression is split off by source lines, evaluated, and on failure run once more as a
  statement; an exception is reported as `<Type> at line N: <message>\n  <source line>`, where N is
  the exception's `lineno` if it has one (SyntaxError) or else the line of the innermost traceback
  frame, counted from the start of the failing segment (body or trailing expression; the latter's
  numbers are shifted by the body's length, yet looked up in the expression's own lines), and reported
  as `<Type>: <message>` when N falls outside that segment; then the process exits at once with code 1.
  stdout is block-buffered as a plain `python3` writing to a pipe, so on an error whatever was still
  in its buffer is lost, as in the release.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import io
import json
import linecache
import os
import sys
import threading
import traceback

FILENAME = "<tool>"
RELEASE_FILENAME = "<string>"  # the release compiles the user's code under this name
MEMORY_ERROR_TAG = b"M"
ERROR_FORMATS = ("", "traceback", "release")  # "" is "traceback"


def _fresh_stdio(*, block_stdout: bool = False) -> None:
    # Line-buffered so that whatever was printed before a kill has reached the pipe; or, for the
    # release's semantics, buffered exactly as CPython buffers a stdout that is a pipe.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
    if block_stdout:
        sys.stdout = io.open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    else:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _user_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - an unprintable exit object still exits with 1
        pass
    return 1


def _tag_memory_error(exc: BaseException, meta_fd: int) -> None:
    """Tells the zygote a MemoryError ended the program (its status is then memory_limit)."""
    if isinstance(exc, MemoryError):
        try:
            os.write(meta_fd, MEMORY_ERROR_TAG)
        except OSError:
            pass


def _run(code: str, meta_fd: int, *, display: bool = True) -> int:
    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
    try:
        tree = ast.parse(code, FILENAME, "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return 1
    trailing = None
    if display and tree.body and isinstance(tree.body[-1], ast.Expr):
        trailing = ast.Expression(tree.body.pop().value)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__doc__": None}
    try:
        exec(compile(tree, FILENAME, "exec"), namespace)
        if trailing is not None:
            value = eval(compile(trailing, FILENAME, "eval"), namespace)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        return _exit_code_of(e)
    except BaseException as e:  # noqa: BLE001 - report every user failure, KeyboardInterrupt included
        _tag_memory_error(e, meta_fd)
        try:
            sys.stderr.write(_user_traceback(e))
        except MemoryError:
            sys.stderr.write("MemoryError\n")
        return 1


def release_error(exc: BaseException, code: str, line_offset: int = 0) -> str:
    """The release wrapper's one-line report of `exc`, raised by the segment `code` of the user's
    program whose first line is line `line_offset` + 1 (no trailing newline)."""
    lineno = exc.lineno if hasattr(exc, "lineno") else _innermost_line(exc)
    if isinstance(lineno, int) and lineno != -1:  # the release fails on another type (a None lineno)
        lineno += line_offset
        lines = code.splitlines()
        if 0 <= lineno - 1 < len(lines):
            return f"{type(exc).__name__} at line {lineno}: {exc}\n  {lines[lineno - 1]}"
    return f"{type(exc).__name__}: {exc}"


def _innermost_line(exc: BaseException) -> int:
    tb = exc.__traceback__
    if tb is None:
        return -1
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_lineno if tb.tb_lineno is not None else -1


def _release_split(code: str) -> tuple[str, str | None]:
    """(body, trailing expression) by source lines, as the release splits them: a last statement
    that is an expression takes its whole lines (with anything sharing them) and drops later lines."""
    tree = ast.parse(code)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code, None
    last = tree.body[-1]
    lines = code.splitlines()
    return "\n".join(lines[:last.lineno - 1]), "\n".join(lines[last.lineno - 1:last.end_lineno])


def _release_fail(exc: BaseException, code: str, line_offset: int, meta_fd: int) -> None:
    """Reports `exc` on stderr and exits at once (no flush of stdout, no atexit), as the release does."""
    _tag_memory_error(exc, meta_fd)
    try:
        message = release_error(exc, code, line_offset)
    except Exception:  # noqa: BLE001 - an exception whose str() fails: Python's own report instead
        message = _user_traceback(exc).rstrip("\n")
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def _run_release(code: str, meta_fd: int) -> int:
    namespace = {"__name__": "__main__", "__file__": RELEASE_FILENAME, "__builtins__": builtins}
    try:
        body, trailing = _release_split(code)
    except SyntaxError as e:
        _release_fail(e, code, 0, meta_fd)
    except ValueError as e:  # NUL bytes in the source
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return 1
    if body:
        try:
            exec(compile(body, RELEASE_FILENAME, "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - BaseExceptions (SystemExit, ...) propagate, as in the release
            _release_fail(e, body, 0, meta_fd)
    if trailing:
        try:
            value = eval(compile(trailing, RELEASE_FILENAME, "eval"), namespace)
            if value is not None:
                print(repr(value))
        except Exception:  # noqa: BLE001 - the release then runs the expression again as a statement
            try:
                exec(compile(trailing, RELEASE_FILENAME, "exec"), namespace)
            except Exception as e:  # noqa: BLE001
                _release_fail(e, trailing, len(body.splitlines()) if body else 0, meta_fd)
    return 0


def _finish(rc: int) -> None:
    """Python's own shutdown order: wait for non-daemon threads, run atexit handlers, flush."""
    try:
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    except SystemExit as e:
        rc = _exit_code_of(e)
    except BaseException as e:  # noqa: BLE001
        sys.stderr.write(_user_traceback(e))
        rc = rc or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not change the exit code
            pass
    os._exit(rc)


def run_program(code: str, meta_fd: int, error_format: str = "", *, script: bool = False) -> None:
    """Runs the user's program and exits the process (never returns). error_format: "" or
    "traceback", or "release" (see the module docstring). script: as `python file.py` runs it
    (SandboxFusion's semantics): a trailing expression is not displayed."""
    rc = 1
    try:
        atexit._clear()  # handlers registered by the worker's own imports are not the user's
        release = error_format == "release"
        _fresh_stdio(block_stdout=release)
        if release:
            try:
                rc = _run_release(code, meta_fd)
            except SystemExit as e:
                rc = _exit_code_of(e)
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt and the like: Python's report
                sys.stderr.write(_user_traceback(e))
                rc = 1
        else:
            rc = _run(code, meta_fd, display=not script)
    finally:
        _finish(rc)


def run_verify(response_text: str, gold_answer: str, meta_fd: int) -> None:
    """Extracts and compares; writes {"correct", "extracted"} as JSON to `meta_fd` and exits."""
    rc = 0
    try:
        from sandbox_service.verify import extract_answer, is_equivalent

        extracted = extract_answer(response_text)
        correct = extracted is not None and is_equivalent(extracted, gold_answer)
        os.write(meta_fd, json.dumps({"correct": bool(correct), "extracted": extracted}).encode())
    except BaseException as e:  # noqa: BLE001 - any failure is reported as a runtime error
        os.write(2, f"{type(e).__name__}: {e}\n".encode(errors="replace")[:4000])
        rc = 1
    os._exit(rc)
