"""What runs inside a call's process after isolation: the user's program with REPL-style display of
a trailing expression, or an answer verification.

Semantics follow the rStar2 release's wrapper: the code is parsed with `ast`; everything but a
trailing bare expression is executed, then that expression is evaluated and its `repr` printed when
it is not None (the paper's response kind 2). Errors print a traceback trimmed to the user's code
(frames of this harness are dropped) and exit with code 1; `sys.exit` keeps Python's meaning.
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
MEMORY_ERROR_TAG = b"M"


def _fresh_stdio() -> None:
    # Line-buffered so that whatever was printed before a kill has reached the pipe.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
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


def _run(code: str, meta_fd: int) -> int:
    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
    try:
        tree = ast.parse(code, FILENAME, "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return 1
    trailing = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
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
        if isinstance(e, MemoryError):
            try:
                os.write(meta_fd, MEMORY_ERROR_TAG)
            except OSError:
                pass
        try:
            sys.stderr.write(_user_traceback(e))
        except MemoryError:
            sys.stderr.write("MemoryError\n")
        return 1


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


def run_program(code: str, meta_fd: int) -> None:
    """Runs the user's program and exits the process (never returns)."""
    rc = 1
    try:
        atexit._clear()  # handlers registered by the worker's own imports are not the user's
        _fresh_stdio()
        rc = _run(code, meta_fd)
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
