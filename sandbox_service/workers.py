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

The slots' set-up and scratch are in `slots`, the user namespace in `userns`, the call's process and
result in `calls`; `Zygote` runs them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import logging
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time

from sandbox_service import isolation, status
# SETUP_FAILED_TAG, Slot, Warm and Call stay importable from here, where they used to be defined.
from sandbox_service.calls import (READ_CHUNK, SETUP_FAILED_TAG, Call, Warm, call_from_header,  # noqa: F401
                                   call_limits, call_result, fetch_files, kill_call_processes, run_call_process)
from sandbox_service.framing import FrameBuffer, encode
from sandbox_service.slots import (Slot, clean_slot_scratch, mount_slot_scratch, pids_of_uid,
                                   prepare_slot_namespaces)
from sandbox_service.userns import enter_user_namespace, serve_id_maps

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
        """(As root, before the user namespace.) The slots' scratch tmpfs under /mnt (`mount_slot_scratch`);
        whether every slot got one."""
        ns_root = self.args.ns_root_uid if self.outer is not None and os.geteuid() == 0 else os.geteuid()
        self.slots_on_mnt, prepared = mount_slot_scratch(self.slots, ns_root=ns_root, scratch_mb=self.args.scratch_mb,
                                                         keep=self.keep, warnings=self.report.warnings)
        return prepared

    def _prepare_slot_namespaces(self) -> None:
        """A mount namespace per slot (`prepare_slot_namespaces`), which the calls then join."""
        kept = prepare_slot_namespaces(self.slots, self.keep, self.report.warnings)
        if kept is not None:
            self.slot_namespaces = True
            self.kept = kept

    def _enter_user_namespace(self, is_root: bool) -> None:
        """As root: into a user namespace whose id maps the outer process writes (`enter_user_namespace`)."""
        outer, self.outer = self.outer, None  # closed there, whatever the outcome
        enter_user_namespace(self.args, self.report, self.slots, outer, is_root=is_root, scratch_root=self.scratch_root,
                             mount_ns=self.mount_ns, keep=self.keep, slots_on_mnt=self.slots_on_mnt)

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
            call = call_from_header(header, blobs)
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
            run_call_process(slot, request_r, {k: v[1] for k, v in pipes.items()}, scratch_dir, mount_ns=self.mount_ns,
                             keep=self.keep, slots_on_mnt=self.slots_on_mnt, scratch_mb=self.args.scratch_mb,
                             per_slot_uid=self.per_slot_uid, seccomp=self.seccomp, seccomp_loaded=self.seccomp_loaded)
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
        limits = call_limits(call, self.args, self.address_space_base)
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
        # characters are whole whatever the encoding; `call_result` then cuts at N characters.
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

    # -- running calls -------------------------------------------------------------------------------
    def _on_stream(self, call: Call, name: str) -> None:
        stream = call.streams[name]
        try:
            data = os.read(stream[0], READ_CHUNK)
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
        kill_call_processes(call, self.per_slot_uid)

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
                # whoever still holds the pipes (detached grandchildren) goes
                kill_call_processes(call, self.per_slot_uid)
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
            call.fetched = fetch_files(call)
        if call.slot.scratch:
            clean_slot_scratch(call.slot, self.kept)
        header, blobs = call_result(call, self.args.output_limit)
        del self.calls[call.id]
        call.slot.busy = False
        if call.scratch_dir:
            shutil.rmtree(call.scratch_dir, ignore_errors=True)
        self._send(header, blobs)
        self._start_pending()
        if not call.slot.busy:  # after the reply: the next call of this slot finds its process ready
            self._warm_ahead(call.slot)

    def _empty_slot(self, call: Call) -> None:
        """Kills and reaps whatever the call left behind; the slot is reused only when empty."""
        slot = call.slot
        for attempt in range(2000):
            left = slot.cgroups.pids() if slot.cgroups else (pids_of_uid(slot.uid) if self.per_slot_uid else [])
            if not left:
                if slot.cgroups:
                    slot.cgroups.allow_forks()
                return
            kill_call_processes(call, self.per_slot_uid)
            self._reap()
            time.sleep(0.001 if attempt < 100 else 0.01)
        log.error("slot %s still has processes %s after the kill", slot.index, left)

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
                kill_call_processes(call, self.per_slot_uid)
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


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


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
            serve_id_maps(proc_dir, req_r, resp_w, args)
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
