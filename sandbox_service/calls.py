"""A call: its state in the zygote, the process that runs it, and the result the zygote replies with.

The zygote forks a slot's call process ahead of its call (`run_call_process`): the process isolates
itself as far as it can without knowing the call, then reads its request on fd 4 (one frame: a JSON
header with the kind, the files and the rlimits, plus the payload blobs) until EOF. It writes the
program's output on fds 1 and 2 and the harness's meta data on fd 3; `SETUP_FAILED_TAG` on fd 3 means
its isolation failed. `call_result` turns what the zygote collected into the reply.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import signal
import time

from sandbox_service import harness, isolation, status
from sandbox_service.framing import decode_body
from sandbox_service.slots import Slot, pids_of_uid, read_beneath
from sandbox_service.status import TRUNCATION_MARKER

SETUP_FAILED_TAG = b"S"
F_SETPIPE_SZ = 1031
READ_CHUNK = 1 << 16


@dataclasses.dataclass
class Warm:
    """A slot's call process, forked and isolated ahead of its call."""
    pid: int
    request_w: int
    pipes: dict  # stdout, stderr, meta -> read end
    scratch_dir: str | None
    exited: bool = False


@dataclasses.dataclass
class Call:
    id: int
    kind: str  # "exec" | "verify"
    payload: list[bytes]
    timeout_s: float
    memory_mb: int
    slot: Slot | None = None
    pid: int = 0
    start: float = 0.0
    deadline: float = 0.0
    exited_at: float | None = None
    wait_status: int | None = None
    cpu_s: float = 0.0
    killed_for: str | None = None
    stream_cap_chars: int = 0  # > 0: keep this many characters per stream, discard the rest, never kill
    error_format: str = ""  # the harness's: "" / "traceback" or "release"
    memory_address_space: bool = False  # memory_mb bounds the whole address space (not resident memory)
    script: bool = False  # run as `python file.py` would: no display of a trailing expression
    files: list = dataclasses.field(default_factory=list)  # paths written before the run (contents: payload[2:])
    fetch_files: list = dataclasses.field(default_factory=list)  # paths read back after the run
    fetched: dict = dataclasses.field(default_factory=dict)  # path -> contents
    request: memoryview = memoryview(b"")  # what is still to be written to the process
    request_fd: int = -1
    grace_killed_at: float | None = None
    scratch_dir: str | None = None
    streams: dict = dataclasses.field(default_factory=dict)  # name -> [fd, bytearray, truncated, cap]


def call_from_header(header: dict, blobs: list[bytes]) -> Call:
    """The call a "call" frame from the server asks for."""
    return Call(id=header["id"], kind=header["kind"], payload=blobs, timeout_s=float(header["timeout_s"]),
                memory_mb=int(header["memory_mb"]), stream_cap_chars=int(header.get("stream_cap_chars", 0)),
                error_format=str(header.get("error_format", "")),
                memory_address_space=bool(header.get("memory_address_space", False)),
                script=bool(header.get("script", False)), files=list(header.get("files", ())),
                fetch_files=list(header.get("fetch_files", ())))


def call_limits(call: Call, args, address_space_base: int) -> isolation.CallLimits:
    """The call's limits, from its request and the worker's options (`args`); `address_space_base`
    is the zygote's own address space, which the call's process inherits."""
    memory = call.memory_mb << 20
    has_cgroup = bool(call.slot.cgroups and call.slot.cgroups.memory_dir)
    if call.memory_address_space:  # the process's whole address space, the worker's inherited part included
        backstop = memory
    else:
        backstop = address_space_base + (4 * memory if has_cgroup else memory)
    return isolation.CallLimits(
        cpu_s=int(math.ceil(call.timeout_s)) + 1, memory_bytes=memory, address_space_bytes=backstop,
        file_size_bytes=args.scratch_mb << 20, open_files=args.open_files, processes=args.pids_max,
        scratch_bytes=args.scratch_mb << 20)


def scratch_limits(scratch_mb: int) -> isolation.CallLimits:
    """For a mount namespace per call (only scratch_bytes is read)."""
    scratch = scratch_mb << 20
    return isolation.CallLimits(cpu_s=0, memory_bytes=0, address_space_bytes=None, file_size_bytes=scratch,
                                open_files=0, processes=0, scratch_bytes=scratch)


def run_call_process(slot: Slot, request_fd: int, w: dict, scratch_dir: str | None, *, mount_ns: bool,
                     keep: list[str], slots_on_mnt: bool, scratch_mb: int, per_slot_uid: bool,
                     seccomp: bytes | None, seccomp_loaded: bool) -> None:
    """In the forked child: isolate, wait for the request, then run the harness. Never returns.
    `w`: the write ends of the stdout, stderr and meta pipes; `scratch_dir`: the call's scratch
    directory when there is no mount namespace."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        if slot.cgroups:
            slot.cgroups.attach_self()
        if slot.ns_fd is not None:
            isolation.setns(slot.ns_fd, isolation.CLONE_NEWNS)
        os.dup2(w["stdout"], 1)
        os.dup2(w["stderr"], 2)
        os.dup2(w["meta"], 3)
        os.dup2(request_fd, 4)
        os.closerange(5, 1 << 16)
        if slot.ns_fd is not None:
            os.chdir("/tmp")
        elif mount_ns:
            isolation.mount_call_scratch(scratch_limits(scratch_mb), keep=keep, hide_mnt=slots_on_mnt)
            os.chdir("/tmp")
        else:
            os.chdir(scratch_dir)
            os.environ["HOME"] = os.environ["TMPDIR"] = scratch_dir
        isolation.set_parent_death_signal(signal.SIGKILL)
        request = bytearray()
        while chunk := os.read(4, READ_CHUNK):
            request += chunk
        os.close(4)
        header, payload = decode_body(memoryview(request)[4:])
        del request
        isolation.apply_rlimits(isolation.CallLimits(**header["limits"]), per_uid=per_slot_uid)
        # Only now the slot's uid: a process waiting for its call is not the slot's to signal.
        if per_slot_uid:
            isolation.drop_privileges(slot.uid, slot.gid)
            isolation.set_parent_death_signal(signal.SIGKILL)  # a change of uid cleared it
        if seccomp and not seccomp_loaded:
            isolation.load_seccomp(seccomp)
        stdin = payload[1] if header["kind"] == "exec" else b""
        in_r, in_w = os.pipe()
        if len(stdin) > 65536:
            fcntl.fcntl(in_w, F_SETPIPE_SZ, len(stdin))
        if stdin:
            os.write(in_w, stdin)
        os.close(in_w)
        os.dup2(in_r, 0)
        os.close(in_r)
    except BaseException as e:  # noqa: BLE001 - any setup failure is the service's, not the user's
        try:
            os.write(3, SETUP_FAILED_TAG)
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        finally:
            os._exit(125)
    if header["files"]:
        write_files(header["files"], payload[2:])  # as the call's uid, under its limits
    if header["kind"] == "exec":
        harness.run_program(payload[0].decode("utf-8", errors="replace"), 3, error_format=header["error_format"],
                            script=header["script"])
    else:
        harness.run_verify(payload[0].decode("utf-8", errors="replace"),
                           payload[1].decode("utf-8", errors="replace"), 3)
    os._exit(1)  # unreachable: the harness exits


def write_files(paths: list[str], contents: list[bytes]) -> None:
    """(In the call's process.) Writes the request's files under the working directory; a failure
    (no space, the file-size limit) ends the call as the program's error."""
    try:
        for path, data in zip(paths, contents, strict=True):
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    except (OSError, ValueError) as e:
        os.write(2, f"could not write the request's files: {e}\n".encode(errors="replace"))
        os._exit(1)


def kill_call_processes(call: Call, per_slot_uid: bool) -> None:
    """SIGKILLs the call's slot: its cgroup, else the main process's group and (with per-slot uids) the
    slot uid's processes."""
    slot = call.slot
    if slot.cgroups:
        slot.cgroups.kill_all()
    for target in (lambda: os.killpg(call.pid, signal.SIGKILL), lambda: os.kill(call.pid, signal.SIGKILL)):
        try:
            if call.exited_at is None:
                target()
        except (ProcessLookupError, PermissionError):
            pass
    if not slot.cgroups and per_slot_uid:
        for pid in pids_of_uid(slot.uid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fetch_files(call: Call) -> dict[str, bytes]:
    """The call's files `fetch_files` names, read from its scratch once its processes are gone;
    a path that is missing, not a regular file or reached through a symlink is left out."""
    root = f"{call.slot.scratch}/tmp" if call.slot.scratch else call.scratch_dir
    if root is None:  # a mount namespace per call: its scratch is gone with it
        return {}
    found = {}
    for path in call.fetch_files:
        data = read_beneath(root, path)
        if data is not None:
            found[path] = data
    return found


def call_result(call: Call, output_limit: int) -> tuple[dict, list[bytes]]:
    """The reply for a finished call: its header (status, exit code, times, truncation, message)
    and blobs (stdout, stderr, then the fetched files' contents). `output_limit`: the byte cap a
    truncation marker names."""
    out, err, meta = (call.streams[k] for k in ("stdout", "stderr", "meta"))
    stdout, stderr = bytes(out[1]), bytes(err[1])
    if call.stream_cap_chars:  # cut silently, as code-judge does
        stdout, out[2] = first_chars(stdout, call.stream_cap_chars, out[2])
        stderr, err[2] = first_chars(stderr, call.stream_cap_chars, err[2])
    else:
        if out[2]:
            stdout += TRUNCATION_MARKER.format(output_limit).encode()
        if err[2]:
            stderr += TRUNCATION_MARKER.format(output_limit).encode()
    ws = call.wait_status
    exit_code = os.waitstatus_to_exitcode(ws)
    sig = -exit_code if exit_code < 0 else 0
    oom = bool(call.slot.cgroups and call.slot.cgroups.new_oom_kill())
    message, note = "", ""
    if meta[1].startswith(harness.MEMORY_ERROR_TAG) and call.kind == "exec":
        oom = True
    if meta[1] == SETUP_FAILED_TAG:
        code, message = status.SANDBOX_ERROR, stderr.decode(errors="replace").strip()
    elif call.killed_for == status.TIMEOUT:
        code, note = status.TIMEOUT, status.TIMEOUT_NOTE.format(call.timeout_s)
    elif call.killed_for == status.OUTPUT_LIMIT:
        code = status.OUTPUT_LIMIT
    elif oom:
        code = status.MEMORY_LIMIT
        if sig:
            note = f"[killed: memory limit of {call.memory_mb} MB exceeded]"
    elif sig in (signal.SIGXCPU,) or (sig == signal.SIGKILL and call.cpu_s >= math.ceil(call.timeout_s) + 1):
        code, note = status.TIMEOUT, f"[killed: CPU-time limit of {math.ceil(call.timeout_s) + 1} s exceeded]"
    elif sig:
        code, note = status.KILLED_BY_SIGNAL, f"[killed by signal {signal.Signals(sig).name}]"
    else:
        code = status.OK if exit_code == 0 else status.RUNTIME_ERROR
    if note and call.error_format != "release":  # the release shows the program's own output only
        stderr += f"\n{note}\n".encode()
    header = {"type": "result", "id": call.id, "status": code, "exit_code": exit_code,
              "duration_s": (call.exited_at or time.monotonic()) - call.start, "cpu_s": call.cpu_s,
              "stdout_truncated": out[2], "stderr_truncated": err[2], "message": message}
    if call.kind == "verify":
        header["verify"] = parse_verify(meta[1]) if code == status.OK else None
    header["files"] = list(call.fetched)
    return header, [stdout, stderr, *call.fetched.values()]


def first_chars(data: bytes, n: int, overflowed: bool) -> tuple[bytes, bool]:
    """The first `n` characters of UTF-8 output (an invalid byte counts as one) and whether any were
    cut off."""
    text = data.decode("utf-8", "surrogateescape")
    return text[:n].encode("utf-8", "surrogateescape"), overflowed or len(text) > n


def parse_verify(meta: bytes) -> dict | None:
    try:
        value = json.loads(meta)
        return {"correct": bool(value["correct"]), "extracted": value["extracted"]}
    except (ValueError, KeyError, TypeError):
        return None
