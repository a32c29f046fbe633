"""Worker (zygote) process: `python -m sandbox_service.workers --fd N ...`, started with exec by the server.

Start-up: pre-import the flavour's modules, enter new pid/net/mount/ipc/uts namespaces, fork once so
that the zygote is PID 1 of the pid namespace (the outer process only waits), mount a private /proc
and a read-only view of the host, create the slots' cgroups and mount namespaces (private /tmp and
/dev/shm per slot), and report the isolation in force.

Per slot, ahead of its call: fork; the child joins the slot's cgroups and mount namespace, takes its
stdout/stderr pipes and a clean environment, then waits for its request on a pipe. A call writes its
request; the child applies the call's rlimits (soft = hard), takes the slot's uid and the seccomp
filter, and runs the harness. The zygote drains stdout/stderr as they arrive (byte caps whose overrun
kills the call, or a call's character cap beyond which output is discarded), tracks the wall deadline
on the process itself (SIGCHLD, not pipe EOF), kills the slot's whole cgroup at the deadline, on
overflow and after the main process exits, reaps orphans (it is PID 1), empties the slot's scratch,
replies, and only then forks the slot's next process.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import gc
import importlib
import json
import logging
import math
import os
import selectors
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time

from sandbox_service import harness, isolation, status
from sandbox_service.status import TRUNCATION_MARKER
from sandbox_service.framing import FrameBuffer, decode_body, encode

log = logging.getLogger("sandbox_service.worker")

LEAN_MODULES = ("math", "cmath", "itertools", "functools", "fractions", "decimal", "collections", "heapq",
                "bisect", "re", "string", "random", "statistics", "operator", "json", "datetime", "copy",
                "typing", "dataclasses", "array", "struct", "textwrap", "time", "numbers")
# scipy and networkx stay importable but are not pre-imported: they would add ~30 MB to the zygote,
# and fork cost grows with its size for every sci call.
SCI_MODULES = LEAN_MODULES + ("numpy", "sympy", "mpmath", "math_verify", "sandbox_service.verify")
FLAVOURS = {"lean": LEAN_MODULES, "sci": SCI_MODULES}

CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
}
GRACE_AFTER_EXIT_S = 0.1  # output still arriving from the main process after it exited
STREAM_CLOSE_AFTER_KILL_S = 1.0  # then stop waiting for EOF from a pipe holder that survived the kill
SETUP_FAILED_TAG = b"S"
_F_SETPIPE_SZ = 1031
_READ_CHUNK = 1 << 16


@dataclasses.dataclass
class Slot:
    index: int
    uid: int
    gid: int
    cgroups: isolation.SlotCgroups | None
    busy: bool = False
    ns_fd: int | None = None  # the slot's prepared mount namespace (private /tmp and /dev/shm)
    scratch: str | None = None  # where the zygote sees that scratch: <scratch>/tmp, <scratch>/shm
    warm: Warm | None = None  # the next call's process, waiting for its request


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


class Zygote:
    def __init__(self, args, report: isolation.IsolationReport, *, mount_ns: bool,
                 outer: tuple[int, int] | None = None, keep: list[str] = ()):
        self.args = args
        self.keep = list(keep)  # the interpreter's directories: visible to every call, wherever they lie
        self.kept: dict[str, set[str]] = {"tmp": set(), "shm": set()}  # their first names in a slot's scratch
        self.slots_on_mnt = False
        self.outer = outer  # (request fd, response fd) to the outer process, which can write our id maps
        self.report = report
        self.mount_ns = mount_ns
        self.ctrl = socket.socket(fileno=args.fd)
        self.ctrl.setblocking(True)
        self.frames = FrameBuffer()
        self.sel = selectors.DefaultSelector()
        self.calls: dict[int, Call] = {}
        self.by_pid: dict[int, Call] = {}
        self.warm_pids: dict[int, Warm] = {}
        self.pending: collections.deque[Call] = collections.deque()
        self.slots: list[Slot] = []
        self.seccomp = None
        self.seccomp_loaded = False
        self.slot_namespaces = False
        self.per_slot_uid = False
        self.scratch_root: str | None = None
        self.address_space_base = 0

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        a, rep = self.args, self.report
        is_root = os.geteuid() == 0 and not rep.features["user_namespace"]
        self.per_slot_uid = is_root and a.isolation != "minimal"
        rep.set("per_slot_uid", self.per_slot_uid,
                "not root: every call runs as the service's own uid" if a.isolation != "minimal" else "disabled")
        for i in range(a.slots):
            uid = a.uid_base + i if self.per_slot_uid else os.geteuid()
            cg = None
            if is_root and a.isolation != "minimal":
                cg = isolation.SlotCgroups(a.instance, f"{a.flavour}{a.index}-{i}")
                try:
                    cg.create(rep, pids_max=a.pids_max)
                except OSError as e:
                    rep.warnings.append(f"cgroups for slot {i}: {e}")
                    cg = None
            self.slots.append(Slot(i, uid, uid, cg))
        cg = self.slots[0].cgroups
        rep.set("cgroup_memory", bool(cg and cg.memory_dir), "memory limited by RLIMIT_AS only")
        rep.set("cgroup_pids", bool(cg and cg.pids_dir), "process count limited by RLIMIT_NPROC only")
        rep.set("cgroup_kill", bool(cg and cg.can_kill_all), "teardown by process group and uid scan")
        rep.set("private_scratch", self.mount_ns, "scratch is a directory on the host's temp filesystem")
        if not self.mount_ns:
            self.scratch_root = tempfile.mkdtemp(prefix=f"sandbox-{a.instance}-{a.flavour}{a.index}-")
            os.chmod(self.scratch_root, 0o711)
        rep.set("rlimits", True)
        self.address_space_base = _vm_size()
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._shutdown(0))
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        self.sel.register(self.ctrl, selectors.EVENT_READ, ("ctrl", None))
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        slot_roots = self._mount_slot_scratch() if self.mount_ns and a.isolation != "minimal" else False
        self._enter_user_namespace(is_root)
        if slot_roots:
            self._prepare_slot_namespaces()
        # The calls' clean environment is set once here and inherited (cheaper than per call).
        os.environ.clear()
        os.environ.update(CHILD_ENV)
        if a.isolation != "minimal":
            # With prepared slot namespaces the filter is attached once, here, and inherited by every
            # call (attaching a filter costs ~1 ms); otherwise each call attaches it after its mounts.
            self.seccomp = isolation.seccomp_program(allow_setns=self.slot_namespaces)
            problem = isolation.probe_seccomp(self.seccomp)
            if problem:
                self.seccomp = None
            elif self.slot_namespaces:
                isolation.load_seccomp(self.seccomp)
                self.seccomp_loaded = True
            rep.set("seccomp", problem is None, problem)
        else:
            rep.set("seccomp", False, "disabled")
        gc.collect()
        gc.freeze()  # keep the pre-imported heap shared with the forked calls (no gc writes to it)

    def _mount_slot_scratch(self) -> bool:
        """(As root, before the user namespace.) One size-capped tmpfs per slot under a private tmpfs
        on /mnt, holding the slot's tmp/ and shm/; the slot namespaces bind them on /tmp, /dev/shm."""
        a = self.args
        ns_root = a.ns_root_uid if self.outer is not None and os.geteuid() == 0 else os.geteuid()
        try:
            isolation.mount_keeping("sandbox-slots", "/mnt", "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                                    f"size=1m,mode=0700,uid={ns_root},gid={ns_root}", keep=self.keep)
            self.slots_on_mnt = True
            for slot in self.slots:
                root = f"/mnt/sandbox-slot-{slot.index}"
                os.mkdir(root)
                isolation.mount("sandbox-slot", root, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                                f"size={a.scratch_mb << 20},nr_inodes=4096,mode=0755,uid={ns_root},gid={ns_root}")
                # /tmp as a host's: sticky and world-writable, owned by root, so that the call can
                # neither move nor fill what is kept in it (a virtual environment under /tmp)
                os.mkdir(f"{root}/tmp")
                os.chmod(f"{root}/tmp", 0o1777)
                os.chown(f"{root}/tmp", ns_root, ns_root)
                os.mkdir(f"{root}/shm")
                os.chmod(f"{root}/shm", 0o1777)
                os.chown(f"{root}/shm", ns_root, ns_root)
                slot.scratch = root
            return True
        except OSError as e:
            self.report.warnings.append(f"per-slot scratch not prepared ({e}); a mount namespace per call instead")
            for slot in self.slots:
                slot.scratch = None
            return False

    def _prepare_slot_namespaces(self) -> None:
        """One mount namespace per slot, made once: /tmp and /dev/shm are the slot's tmpfs, /mnt is
        hidden. A call joins it with setns (cheaper than unsharing and mounting per call); the zygote
        empties the slot's scratch after every call."""
        fds = []
        try:
            for slot in self.slots:
                fds.append(self._slot_namespace(slot))
        except OSError as e:
            for fd in fds:
                os.close(fd)
            self.report.warnings.append(f"slot mount namespaces not prepared ({e}); a mount namespace per call instead")
            for slot in self.slots:
                slot.scratch = None  # calls then get their own scratch, which nothing here cleans or reads
            return
        for slot, fd in zip(self.slots, fds):
            slot.ns_fd = fd
        self.slot_namespaces = True
        for sub, target in (("tmp", "/tmp"), ("shm", "/dev/shm")):
            self.kept[sub] = {os.path.relpath(p, target).split(os.sep)[0]
                              for p in isolation.outermost(self.keep) if p.startswith(target + "/")}

    def _slot_namespace(self, slot: Slot) -> int:
        # The helper sends its namespace as an fd: after the user namespace, /proc (hidepid=2, owned
        # by the host's) no longer shows us our children's entries.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                ours.close()
                isolation.unshare(isolation.CLONE_NEWNS)
                isolation.mount_keeping(f"{slot.scratch}/tmp", "/tmp", None, isolation.MS_BIND, keep=self.keep)
                isolation.mount_keeping(f"{slot.scratch}/shm", "/dev/shm", None, isolation.MS_BIND, keep=self.keep)
                isolation.mount_keeping("sandbox-hide", "/mnt", "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                                        "size=4k,mode=0755", keep=self.keep, read_only=True)
                fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)
                socket.send_fds(theirs, [b"k"], [fd])
            except BaseException as e:  # noqa: BLE001 - reported through the exit code
                os.write(2, f"slot namespace: {e!r}\n".encode())
                code = 1
            os._exit(code)
        theirs.close()
        try:
            _, st = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(st) != 0:
                raise OSError(f"the helper for slot {slot.index} failed")
            msg, fds, _, _ = socket.recv_fds(ours, 1, 1)
            if msg != b"k" or len(fds) != 1:
                raise OSError(f"the helper for slot {slot.index} sent no namespace")
            return fds[0]
        finally:
            ours.close()

    def _clean_slot_scratch(self, slot: Slot) -> None:
        """Empties the slot's tmp/ and shm/ (its processes are gone) before the next call, but for
        the directories the kept interpreter paths are mounted on in the slot's namespace (removing
        one there would detach the mount)."""
        for sub, mode in (("tmp", 0o1777), ("shm", 0o1777)):
            path = f"{slot.scratch}/{sub}"
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.name in self.kept[sub]:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        try:
                            os.unlink(entry.path)
                        except OSError:
                            pass
            if os.stat(path).st_mode & 0o7777 != mode:  # the call may have changed it
                os.chmod(path, mode)

    def _enter_user_namespace(self, is_root: bool) -> None:
        """As root: move the zygote into a new user namespace whose root is an unprivileged host uid,
        so that neither it nor the calls keep host capabilities (the read-only host view, owned by the
        initial namespace, can no longer be undone). Probed in a throwaway child first."""
        if self.outer is None or not is_root or self.args.isolation == "minimal":
            if is_root and self.args.isolation != "minimal":
                self.report.set("user_namespace", False, "no outer process to write the id maps")
            self._close_outer()
            return
        ns_root, ranges = self.args.ns_root_uid, [(self.slots[0].uid, len(self.slots))]
        try:
            for slot in self.slots:
                if slot.cgroups:
                    slot.cgroups.delegate(ns_root, ns_root)
            if self.scratch_root:
                os.chown(self.scratch_root, ns_root, ns_root)
            problem = self._probe_user_namespace(ns_root, ranges)
        except OSError as e:
            problem = f"delegation failed: {e}"
        if problem:
            self.report.set("user_namespace", False, problem)
            self._close_outer()
            return
        req_w, resp_r = self.outer
        isolation.unshare(isolation.CLONE_NEWUSER)
        os.write(req_w, b"u")
        answer = os.read(resp_r, 1)
        self._close_outer()
        if answer != b"k":  # the probe passed, so this is not expected; a restart retries
            log.error("the outer process could not write the user namespace's id maps")
            os._exit(3)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        self.report.set("user_namespace", True)

    def _close_outer(self) -> None:
        if self.outer:
            for fd in self.outer:
                os.close(fd)
            self.outer = None

    def _probe_user_namespace(self, ns_root: int, ranges: list[tuple[int, int]]) -> str | None:
        """Does in a child what the zygote and a call will do inside the user namespace."""
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        slot = self.slots[0]
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                isolation.unshare(isolation.CLONE_NEWUSER)
                os.write(to_parent_w, b"u")
                if os.read(to_child_r, 1) != b"k":
                    os._exit(2)
                os.setresgid(0, 0, 0)
                os.setresuid(0, 0, 0)
                if slot.cgroups:
                    slot.cgroups.set_memory_limit(64 << 20)
                    slot.cgroups.attach_self()
                if self.mount_ns:
                    isolation.mount_call_scratch(self._limits_for_probe(), keep=self.keep, hide_mnt=self.slots_on_mnt)
                isolation.drop_privileges(slot.uid, slot.gid)
            except BaseException as e:  # noqa: BLE001 - reported to the parent through the exit code
                os.write(2, f"user namespace probe: {e!r}\n".encode())
                code = 3
            os._exit(code)
        os.close(to_child_r)
        os.close(to_parent_w)
        error = ""
        if os.read(to_parent_r, 1) == b"u":
            try:
                isolation.write_id_maps(pid, ns_root, ranges)
                os.write(to_child_w, b"k")
            except OSError as e:
                error = str(e)
                os.write(to_child_w, b"f")
        os.close(to_child_w)
        os.close(to_parent_r)
        _, st = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(st)
        if slot.cgroups:
            slot.cgroups._memory_limit = None  # the probe changed it
        return None if rc == 0 else f"user namespace probe failed (rc {rc}) {error}".strip()

    def _scratch_limits(self) -> isolation.CallLimits:
        """For a mount namespace per call (only scratch_bytes is read)."""
        scratch = self.args.scratch_mb << 20
        return isolation.CallLimits(cpu_s=0, memory_bytes=0, address_space_bytes=None, file_size_bytes=scratch,
                                    open_files=0, processes=0, scratch_bytes=scratch)

    def _limits_for_probe(self) -> isolation.CallLimits:
        return isolation.CallLimits(cpu_s=1, memory_bytes=64 << 20, address_space_bytes=None, file_size_bytes=1 << 20,
                                    open_files=64, processes=8, scratch_bytes=1 << 20)

    def _send(self, header: dict, blobs=()) -> None:
        self.ctrl.sendall(encode(header, blobs))

    # -- main loop -----------------------------------------------------------------------------------
    def serve(self) -> None:
        self._send({"type": "ready", "pid": os.getpid(), "flavour": self.args.flavour, "slots": self.args.slots,
                    "isolation": self.report.to_dict()})
        for slot in self.slots:
            self._warm_ahead(slot)
        while True:
            for key, _ in self.sel.select(self._next_timeout()):
                kind, call = key.data
                if kind == "ctrl":
                    self._on_ctrl()
                elif kind == "wake":
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                elif kind == "request":
                    self._write_request(call)
                else:
                    self._on_stream(call, kind)
            self._reap()
            self._check_timers()

    def _next_timeout(self) -> float | None:
        now, nearest = time.monotonic(), None
        for call in self.calls.values():
            if call.pid == 0:
                continue
            if call.exited_at is None:
                if call.killed_for is not None:
                    continue  # SIGKILL sent: SIGCHLD will wake us
                t = call.deadline
            elif call.grace_killed_at is None:
                t = call.exited_at + GRACE_AFTER_EXIT_S
            else:
                t = call.grace_killed_at + STREAM_CLOSE_AFTER_KILL_S
            nearest = t if nearest is None else min(nearest, t)
        return None if nearest is None else max(0.0, nearest - now)

    def _on_ctrl(self) -> None:
        data = self.ctrl.recv(1 << 20)
        if not data:  # the server is gone
            self._shutdown(0)
        for header, blobs in self.frames.feed(data):
            if header.get("type") != "call":
                log.error("unknown frame type %r", header.get("type"))
                continue
            call = Call(id=header["id"], kind=header["kind"], payload=blobs, timeout_s=float(header["timeout_s"]),
                        memory_mb=int(header["memory_mb"]), stream_cap_chars=int(header.get("stream_cap_chars", 0)),
                        error_format=str(header.get("error_format", "")),
                        memory_address_space=bool(header.get("memory_address_space", False)),
                        script=bool(header.get("script", False)), files=list(header.get("files", ())),
                        fetch_files=list(header.get("fetch_files", ())))
            self.calls[call.id] = call
            self.pending.append(call)
        self._start_pending()

    def _start_pending(self) -> None:
        while self.pending:
            slot = next((s for s in self.slots if not s.busy), None)
            if slot is None:
                return
            call = self.pending.popleft()
            try:
                self._start(call, slot)
            except Exception as e:  # noqa: BLE001 - one failed start must not take the worker down
                log.exception("starting call %s failed", call.id)
                self._reply_error(call, f"worker could not start the call: {e}")

    # -- starting a call -----------------------------------------------------------------------------
    def _limits(self, call: Call) -> isolation.CallLimits:
        a = self.args
        memory = call.memory_mb << 20
        has_cgroup = bool(call.slot.cgroups and call.slot.cgroups.memory_dir)
        if call.memory_address_space:  # the process's whole address space, the worker's inherited part included
            backstop = memory
        else:
            backstop = self.address_space_base + (4 * memory if has_cgroup else memory)
        return isolation.CallLimits(
            cpu_s=int(math.ceil(call.timeout_s)) + 1, memory_bytes=memory, address_space_bytes=backstop,
            file_size_bytes=a.scratch_mb << 20, open_files=a.open_files, processes=a.pids_max,
            scratch_bytes=a.scratch_mb << 20)

    def _warm(self, slot: Slot) -> Warm:
        """Forks the slot's next call process ahead of its call: it joins the slot's cgroups and mount
        namespace, takes its pipes and working directory, and waits for its request (then the call's
        rlimits, the slot's uid and seccomp), so that the fork and most of the isolation are off the
        call's path."""
        request_r, request_w = os.pipe()
        pipes = {name: os.pipe() for name in ("stdout", "stderr", "meta")}
        scratch_dir = None
        if not self.mount_ns:
            scratch_dir = tempfile.mkdtemp(dir=self.scratch_root)
            os.chown(scratch_dir, slot.uid, slot.gid)
        pid = os.fork()
        if pid == 0:
            self._child(slot, request_r, {k: v[1] for k, v in pipes.items()}, scratch_dir)
        os.close(request_r)
        for _, w in pipes.values():
            os.close(w)
        os.set_blocking(request_w, False)
        warm = Warm(pid, request_w, {k: v[0] for k, v in pipes.items()}, scratch_dir)
        self.warm_pids[pid] = warm
        return warm

    def _warm_ahead(self, slot: Slot) -> None:
        try:
            slot.warm = self._warm(slot)
        except OSError as e:  # (no memory to fork, ...) the call will fork its own
            log.warning("could not prepare slot %s ahead of its call: %s", slot.index, e)

    def _discard_warm(self, warm: Warm) -> None:
        for fd in (warm.request_w, *warm.pipes.values()):
            os.close(fd)
        if warm.scratch_dir:
            shutil.rmtree(warm.scratch_dir, ignore_errors=True)

    def _start(self, call: Call, slot: Slot) -> None:
        call.slot, slot.busy = slot, True
        limits = self._limits(call)
        if slot.cgroups:
            slot.cgroups.set_memory_limit(limits.memory_bytes)
        warm, slot.warm = slot.warm, None
        if warm is not None and warm.exited:  # died waiting (killed from outside): start another
            self._discard_warm(warm)
            warm = None
        warm = warm or self._warm(slot)
        del self.warm_pids[warm.pid]
        call.pid, call.scratch_dir = warm.pid, warm.scratch_dir
        self.by_pid[warm.pid] = call
        call.start = time.monotonic()
        call.deadline = call.start + call.timeout_s
        header = {"kind": call.kind, "script": call.script, "error_format": call.error_format, "files": call.files,
                  "limits": vars(limits)}
        call.request, call.request_fd = memoryview(encode(header, call.payload)), warm.request_w
        self._write_request(call)
        if call.request_fd != -1:
            self.sel.register(call.request_fd, selectors.EVENT_WRITE, ("request", call))
        # A character cap keeps 4 bytes per character (UTF-8's widest) and 4 more, so that the first N
        # characters are whole whatever the encoding; `_result` then cuts at N characters.
        out_cap = 4 * call.stream_cap_chars + 4 if call.stream_cap_chars else self.args.output_limit
        caps = {"stdout": out_cap, "stderr": out_cap, "meta": 1 << 20}
        for name, r in warm.pipes.items():
            os.set_blocking(r, False)
            call.streams[name] = [r, bytearray(), False, caps[name]]
            self.sel.register(r, selectors.EVENT_READ, (name, call))

    def _write_request(self, call: Call) -> None:
        """Writes what the pipe takes of the call's request; the rest when it is writable again."""
        try:
            while call.request:
                n = os.write(call.request_fd, call.request)
                call.request = call.request[n:]
        except BlockingIOError:
            return
        except OSError:  # the process is gone: its exit is reported as the call's
            call.request = memoryview(b"")
        self._close_request(call)

    def _close_request(self, call: Call) -> None:
        if call.request_fd == -1:
            return
        try:
            self.sel.unregister(call.request_fd)
        except KeyError:
            pass
        os.close(call.request_fd)
        call.request_fd = -1

    def _child(self, slot: Slot, request_fd: int, w: dict, scratch_dir: str | None) -> None:
        """In the forked child: isolate, wait for the request, then run the harness. Never returns."""
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
            elif self.mount_ns:
                isolation.mount_call_scratch(self._scratch_limits(), keep=self.keep, hide_mnt=self.slots_on_mnt)
                os.chdir("/tmp")
            else:
                os.chdir(scratch_dir)
                os.environ["HOME"] = os.environ["TMPDIR"] = scratch_dir
            isolation.set_parent_death_signal(signal.SIGKILL)
            request = bytearray()
            while chunk := os.read(4, _READ_CHUNK):
                request += chunk
            os.close(4)
            header, payload = decode_body(memoryview(request)[4:])
            del request
            isolation.apply_rlimits(isolation.CallLimits(**header["limits"]), per_uid=self.per_slot_uid)
            # Only now the slot's uid: a process waiting for its call is not the slot's to signal.
            if self.per_slot_uid:
                isolation.drop_privileges(slot.uid, slot.gid)
                isolation.set_parent_death_signal(signal.SIGKILL)  # a change of uid cleared it
            if self.seccomp and not self.seccomp_loaded:
                isolation.load_seccomp(self.seccomp)
            stdin = payload[1] if header["kind"] == "exec" else b""
            in_r, in_w = os.pipe()
            if len(stdin) > 65536:
                fcntl.fcntl(in_w, _F_SETPIPE_SZ, len(stdin))
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
            _write_files(header["files"], payload[2:])  # as the call's uid, under its limits
        if header["kind"] == "exec":
            harness.run_program(payload[0].decode("utf-8", errors="replace"), 3, error_format=header["error_format"],
                                script=header["script"])
        else:
            harness.run_verify(payload[0].decode("utf-8", errors="replace"),
                               payload[1].decode("utf-8", errors="replace"), 3)
        os._exit(1)  # unreachable: the harness exits

    # -- running calls -------------------------------------------------------------------------------
    def _on_stream(self, call: Call, name: str) -> None:
        stream = call.streams[name]
        try:
            data = os.read(stream[0], _READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.sel.unregister(stream[0])
            os.close(stream[0])
            stream[0] = -1
            self._maybe_finish(call)
            return
        room = stream[3] - len(stream[1])
        if len(data) > room:
            stream[1] += data[:max(room, 0)]
            stream[2] = True
            if name != "meta" and call.killed_for is None and not call.stream_cap_chars:
                self._kill(call, status.OUTPUT_LIMIT)
        else:
            stream[1] += data

    def _kill(self, call: Call, reason: str | None) -> None:
        if reason and call.killed_for is None:
            call.killed_for = reason
        self._kill_slot(call)

    def _kill_slot(self, call: Call) -> None:
        slot = call.slot
        if slot.cgroups:
            slot.cgroups.kill_all()
        for target in (lambda: os.killpg(call.pid, signal.SIGKILL), lambda: os.kill(call.pid, signal.SIGKILL)):
            try:
                if call.exited_at is None:
                    target()
            except (ProcessLookupError, PermissionError):
                pass
        if not slot.cgroups and self.per_slot_uid:
            for pid in _pids_of_uid(slot.uid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        """Collects exited main processes (with their rusage) and orphans re-parented to us."""
        while True:
            try:
                pid, wstatus, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.warm_pids:
                self.warm_pids.pop(pid).exited = True
                continue
            call = self.by_pid.pop(pid, None)
            if call is not None:
                call.exited_at = time.monotonic()
                call.wait_status = wstatus
                call.cpu_s = rusage.ru_utime + rusage.ru_stime
                self._maybe_finish(call)

    def _check_timers(self) -> None:
        now = time.monotonic()
        for call in list(self.calls.values()):
            if call.pid == 0:
                continue
            if call.exited_at is None and now >= call.deadline and call.killed_for is None:
                self._kill(call, status.TIMEOUT)
            elif call.exited_at is not None and call.grace_killed_at is None \
                    and now >= call.exited_at + GRACE_AFTER_EXIT_S:
                call.grace_killed_at = now
                self._kill_slot(call)  # whoever still holds the pipes (detached grandchildren) goes
            elif call.grace_killed_at is not None and now >= call.grace_killed_at + STREAM_CLOSE_AFTER_KILL_S:
                for stream in call.streams.values():  # a holder we could not kill: stop reading
                    if stream[0] != -1:
                        self.sel.unregister(stream[0])
                        os.close(stream[0])
                        stream[0] = -1
                self._maybe_finish(call)

    def _maybe_finish(self, call: Call) -> None:
        if call.exited_at is None or any(s[0] != -1 for s in call.streams.values()) or call.id not in self.calls:
            return
        self._close_request(call)
        self._empty_slot(call)
        if call.fetch_files:
            call.fetched = self._fetch(call)
        if call.slot.scratch:
            self._clean_slot_scratch(call.slot)
        header, blobs = self._result(call)
        del self.calls[call.id]
        call.slot.busy = False
        if call.scratch_dir:
            shutil.rmtree(call.scratch_dir, ignore_errors=True)
        self._send(header, blobs)
        self._start_pending()
        if not call.slot.busy:  # after the reply: the next call of this slot finds its process ready
            self._warm_ahead(call.slot)

    def _fetch(self, call: Call) -> dict[str, bytes]:
        """The call's files `fetch_files` names, read from its scratch once its processes are gone;
        a path that is missing, not a regular file or reached through a symlink is left out."""
        root = f"{call.slot.scratch}/tmp" if call.slot.scratch else call.scratch_dir
        if root is None:  # a mount namespace per call: its scratch is gone with it
            return {}
        found = {}
        for path in call.fetch_files:
            data = _read_beneath(root, path)
            if data is not None:
                found[path] = data
        return found

    def _empty_slot(self, call: Call) -> None:
        """Kills and reaps whatever the call left behind; the slot is reused only when empty."""
        slot = call.slot
        for attempt in range(2000):
            left = slot.cgroups.pids() if slot.cgroups else (_pids_of_uid(slot.uid) if self.per_slot_uid else [])
            if not left:
                if slot.cgroups:
                    slot.cgroups.allow_forks()
                return
            self._kill_slot(call)
            self._reap()
            time.sleep(0.001 if attempt < 100 else 0.01)
        log.error("slot %s still has processes %s after the kill", slot.index, left)

    def _result(self, call: Call) -> tuple[dict, list[bytes]]:
        out, err, meta = (call.streams[k] for k in ("stdout", "stderr", "meta"))
        stdout, stderr = bytes(out[1]), bytes(err[1])
        if call.stream_cap_chars:  # cut silently, as code-judge does
            stdout, out[2] = _first_chars(stdout, call.stream_cap_chars, out[2])
            stderr, err[2] = _first_chars(stderr, call.stream_cap_chars, err[2])
        else:
            if out[2]:
                stdout += TRUNCATION_MARKER.format(self.args.output_limit).encode()
            if err[2]:
                stderr += TRUNCATION_MARKER.format(self.args.output_limit).encode()
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
            code, note = status.TIMEOUT, f"[killed: wall-clock limit of {call.timeout_s:g} s exceeded]"
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
            header["verify"] = _parse_verify(meta[1]) if code == status.OK else None
        header["files"] = list(call.fetched)
        return header, [stdout, stderr, *call.fetched.values()]

    def _reply_error(self, call: Call, message: str) -> None:
        self.calls.pop(call.id, None)
        if call.slot:
            call.slot.busy = False
        self._send({"type": "result", "id": call.id, "status": status.SANDBOX_ERROR, "exit_code": -1,
                    "duration_s": 0.0, "cpu_s": 0.0, "stdout_truncated": False, "stderr_truncated": False,
                    "message": message}, [b"", b""])

    def _shutdown(self, code: int) -> None:
        for pid in self.warm_pids:
            os.kill(pid, signal.SIGKILL)
        for call in list(self.calls.values()):
            if call.pid:
                self._kill_slot(call)
        for slot in self.slots:
            if slot.cgroups:
                slot.cgroups.kill_all()
        self._reap()
        for slot in self.slots:
            if slot.cgroups:
                for _ in range(200):
                    if not slot.cgroups.pids():
                        break
                    self._reap()
                    time.sleep(0.005)
                slot.cgroups.remove()
        if self.scratch_root:
            shutil.rmtree(self.scratch_root, ignore_errors=True)
        os._exit(code)


def _first_chars(data: bytes, n: int, overflowed: bool) -> tuple[bytes, bool]:
    """The first `n` characters of UTF-8 output (an invalid byte counts as one) and whether any were
    cut off."""
    text = data.decode("utf-8", "surrogateescape")
    return text[:n].encode("utf-8", "surrogateescape"), overflowed or len(text) > n


def _write_files(paths: list[str], contents: list[bytes]) -> None:
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


def _read_beneath(root: str, path: str) -> bytes | None:
    """The regular file `path` (relative) under `root`, following no symlink on the way."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    fds = []
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        fds.append(fd)
        for part in parts[:-1]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            fds.append(fd)
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        fds.append(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _parse_verify(meta: bytes) -> dict | None:
    try:
        value = json.loads(meta)
        return {"correct": bool(value["correct"]), "extracted": value["extracted"]}
    except (ValueError, KeyError, TypeError):
        return None


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _preload(flavour: str, extra: list[str]) -> list[str]:
    missing = []
    for name in (*FLAVOURS[flavour], *extra):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if flavour == "sci":
        _warm_up_sci(missing)
    return missing


def interpreter_paths() -> list[str]:
    """The directories tool code needs to see to run this interpreter and import what it can: its
    prefixes, its executable's directory and the directories on sys.path (PYTHONPATH, site-packages,
    .pth and editable installs) but the first, the server's working directory that `-m` put there;
    each as written and as resolved (a symlinked environment is reached by both)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             os.path.dirname(os.path.realpath(sys.executable))]
    paths += [p for p in sys.path[1:] if p]
    out = set()
    for p in paths:
        if os.path.isdir(p):
            out.update((os.path.abspath(p), os.path.realpath(p)))
    return sorted(out)


def _warm_up_sci(missing: list[str]) -> None:
    """Runs typical tool-call operations once, so that the modules sympy and math-verify import
    lazily, and their caches, are already in the zygote (a call pays ~10 ms instead of ~60-300 ms)."""
    if "sympy" not in missing:
        import sympy

        x, y = sympy.symbols("x y")
        sympy.factor(x**2 - 1), sympy.expand((x + 1)**3), sympy.simplify(sympy.sin(x)**2 + sympy.cos(x)**2)
        sympy.solve([x + y - 3, x - y - 1], [x, y]), sympy.solve(x**2 - 2, x), sympy.integrate(x**2, (x, 0, 1))
        sympy.isprime(97), sympy.factorint(360), sympy.Rational(3, 4) + 1, sympy.sqrt(8), sympy.nsimplify(0.5)
        sympy.latex(x**2), sympy.diff(sympy.sin(x), x), sympy.limit(sympy.sin(x) / x, x, 0)
        sympy.series(sympy.exp(x), x, 0, 3), sympy.binomial(10, 3), sympy.gcd(12, 18)
        sympy.Matrix([[1, 2], [3, 4]]).det()
    if "numpy" not in missing:
        import numpy

        numpy.linalg.solve(numpy.eye(2), numpy.ones(2)), numpy.arange(10).sum(), numpy.random.default_rng(0).random(3)
    if "math_verify" not in missing:
        from sandbox_service.verify import is_equivalent

        is_equivalent("\\frac{1}{2}", "x")  # pulls in math-verify's lazily imported parsers


def _serve_id_maps(proc_dir: int, req_r: int, resp_w: int, args) -> None:
    """Outer process: write the zygote's id maps if it asks (it cannot write its own)."""
    try:
        request = os.read(req_r, 1)
    except OSError:
        request = b""
    if request == b"u":
        try:
            isolation.write_id_maps(("fd", proc_dir), args.ns_root_uid, [(args.uid_base, args.slots)])
            os.write(resp_w, b"k")
        except OSError as e:
            log.error("writing the zygote's id maps failed: %s", e)
            os.write(resp_w, b"f")
    os.close(req_r)
    os.close(resp_w)
    os.close(proc_dir)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="sandbox worker (started by the sandbox server)")
    p.add_argument("--fd", type=int, required=True, help="control socket inherited from the server")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--flavour", choices=sorted(FLAVOURS), default="lean")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--instance", default=f"w{os.getpid()}")
    p.add_argument("--isolation", choices=("auto", "minimal"), default="auto")
    p.add_argument("--uid-base", type=int, default=1_500_000, help="uid of slot 0 (slot i: + i)")
    p.add_argument("--ns-root-uid", type=int, default=1_499_999,
                   help="host uid (and gid) of the worker's root inside its user namespace")
    p.add_argument("--pids-max", type=int, default=64)
    p.add_argument("--open-files", type=int, default=256)
    p.add_argument("--scratch-mb", type=int, default=64)
    p.add_argument("--output-limit", type=int, default=64 << 10)
    p.add_argument("--preimport", action="append", default=[], help="a module to pre-import beside the flavour's")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s worker {args.flavour}{args.index} %(levelname)s %(message)s")
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ[k] = "1"  # before numpy is imported: no BLAS thread pools at fork time
    missing = _preload(args.flavour, args.preimport)
    report = isolation.IsolationReport()
    if missing:
        report.warnings.append(f"modules not available for pre-import: {', '.join(missing)}")
    new_pid_ns = False
    if args.isolation == "auto":
        new_pid_ns = isolation.enter_namespaces(report)
    else:
        report.warnings.append("isolation disabled by --isolation minimal")
    outer = None
    if new_pid_ns:
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        pid = os.fork()  # the child is PID 1 of the new pid namespace
        if pid:
            os.close(args.fd)
            os.close(req_w)
            os.close(resp_r)
            signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
            # Our /proc is about to be replaced by the zygote's (same mount namespace): hold on to
            # the zygote's entry in the current one, then let it go on.
            proc_dir = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
            os.write(resp_w, b"g")
            _serve_id_maps(proc_dir, req_r, resp_w, args)
            while True:
                try:
                    _, st = os.waitpid(pid, 0)
                    break
                except InterruptedError:
                    continue
            os._exit(max(os.waitstatus_to_exitcode(st), 0))
        isolation.set_parent_death_signal(signal.SIGKILL)
        os.close(req_r)
        os.close(resp_w)
        if os.read(resp_r, 1) != b"g":  # the outer process holds our /proc entry
            os._exit(3)
        outer = (req_w, resp_r)
    mount_ns = report.features["mount_namespace"]
    keep = interpreter_paths()
    if mount_ns:
        isolation.prepare_worker_mounts(report, keep_paths=keep, new_proc=new_pid_ns)
    else:
        report.set("readonly_host", False, "no mount namespace")
        report.set("hidden_proc", False, "no mount namespace")
    zygote = Zygote(args, report, mount_ns=mount_ns, outer=outer, keep=keep)
    zygote.setup()
    zygote.serve()


if __name__ == "__main__":
    main()
