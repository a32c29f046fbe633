"""The closed set of execution statuses shared by the server, the client and their users."""

from __future__ import annotations

OK = "ok"  # exit code 0
RUNTIME_ERROR = "runtime_error"  # non-zero exit (uncaught exception, sys.exit(n), os._exit(n))
TIMEOUT = "timeout"  # wall-clock deadline (or the CPU-time backstop) reached; the process tree was killed
MEMORY_LIMIT = "memory_limit"  # MemoryError or an out-of-memory kill by the call's memory cgroup
OUTPUT_LIMIT = "output_limit"  # stdout or stderr exceeded the byte cap; the process tree was killed
KILLED_BY_SIGNAL = "killed_by_signal"  # the main process died from a signal it did not get from us
REJECTED = "rejected"  # not admitted (queue full) or an invalid request; never executed
SANDBOX_ERROR = "sandbox_error"  # the service failed (worker lost twice, internal error); retryable

ALL = (OK, RUNTIME_ERROR, TIMEOUT, MEMORY_LIMIT, OUTPUT_LIMIT, KILLED_BY_SIGNAL, REJECTED, SANDBOX_ERROR)

# How output limits show, for the server, its workers and the clients alike.
MAX_STREAM_CAP_CHARS = 1 << 20  # a call's character cap per stream (the worker holds up to 4 bytes per character)
TRUNCATION_MARKER = "\n[... output truncated: exceeded {} bytes]\n"  # appended where the byte cap cut a stream
# The note on stderr of a call killed at its wall-clock limit (its seconds), unless the error format is the release's.
TIMEOUT_NOTE = "[killed: wall-clock limit of {:g} s exceeded]"
