"""Linux isolation primitives for the worker (zygote) processes: namespaces, mounts, cgroups, seccomp.

Everything here runs inside a worker process that was started with exec (never in the gRPC server).
The worker calls `enter_namespaces` once, becomes PID 1 of a new pid namespace, prepares a read-only
view of the host (`prepare_worker_mounts`), and for every call forks a child that runs
`enter_call` (private scratch tmpfs, cgroups, rlimits, per-slot uid, seccomp) before the user code.

What works is detected at start-up; each missing piece is recorded as a warning and the level is
reported as "full", "partial" or "minimal" (see `IsolationReport`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform
import resource
import signal
import struct
import sys

# clone/unshare flags (linux/sched.h)
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                   | CLONE_NEWNET)

# mount flags (linux/mount.h)
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2
_MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                       "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    """unshare(2); os.unshare exists only on Python >= 3.12."""
    if hasattr(os, "unshare"):
        os.unshare(flags)
    else:
        _check(_libc.unshare(flags), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)


def setns(fd: int, nstype: int) -> None:
    """setns(2); os.setns exists only on Python >= 3.12."""
    _check(_libc.setns(fd, nstype), "setns")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def prctl(option: int, arg2: int = 0) -> None:
    _check(_libc.prctl(option, arg2, 0, 0, 0), f"prctl {option}")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    prctl(PR_SET_PDEATHSIG, sig)


# -- report ------------------------------------------------------------------------------------------

FEATURES = ("pid_namespace", "net_namespace", "mount_namespace", "ipc_uts_namespaces", "user_namespace",
            "readonly_host", "private_scratch", "hidden_proc", "seccomp", "cgroup_memory", "cgroup_pids",
            "cgroup_kill", "per_slot_uid", "rlimits")
# Without these the service cannot contain untrusted code; missing any other one gives "partial".
_ESSENTIAL = ("pid_namespace", "net_namespace", "mount_namespace", "readonly_host", "seccomp", "per_slot_uid")


@dataclasses.dataclass
class IsolationReport:
    features: dict[str, bool] = dataclasses.field(default_factory=lambda: {f: False for f in FEATURES})
    warnings: list[str] = dataclasses.field(default_factory=list)

    def set(self, feature: str, ok: bool, warning: str | None = None) -> None:
        self.features[feature] = ok
        if not ok and warning:
            self.warnings.append(f"{feature}: {warning}")

    @property
    def level(self) -> str:
        if not all(self.features[f] for f in _ESSENTIAL):
            return "minimal"
        optional = [f for f in FEATURES if f not in _ESSENTIAL]
        return "full" if all(self.features[f] for f in optional) else "partial"

    def to_dict(self) -> dict:
        return {"level": self.level, "features": dict(self.features), "warnings": list(self.warnings)}


# -- namespaces --------------------------------------------------------------------------------------

def enter_namespaces(report: IsolationReport) -> bool:
    """Unshares pid/net/mount/ipc/uts namespaces (with a user namespace when not root).

    Returns True when a new pid namespace was created: the caller must then fork, and the child
    becomes PID 1 of it. Must run in a single-threaded process.
    """
    is_root = os.geteuid() == 0
    wanted = [CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS]
    if not is_root:
        wanted = [f | CLONE_NEWUSER for f in wanted]
    uid, gid = os.geteuid(), os.getegid()
    for flags in wanted + [CLONE_NEWNS | (0 if is_root else CLONE_NEWUSER)]:
        try:
            unshare(flags)
        except OSError as e:
            report.warnings.append(f"unshare({flags:#x}) failed: {e}")
            continue
        if flags & CLONE_NEWUSER:
            # Map ourselves to root inside, so that mounts are allowed; no other uid is mapped.
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"0 {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"0 {gid} 1")
            report.set("user_namespace", True)
        report.set("mount_namespace", bool(flags & CLONE_NEWNS), "no private mount namespace")
        report.set("pid_namespace", bool(flags & CLONE_NEWPID), "no pid namespace")
        report.set("net_namespace", bool(flags & CLONE_NEWNET), "no network namespace")
        report.set("ipc_uts_namespaces", bool(flags & CLONE_NEWIPC), "no ipc/uts namespaces")
        return bool(flags & CLONE_NEWPID)
    for f in ("mount_namespace", "pid_namespace", "net_namespace", "ipc_uts_namespaces"):
        report.set(f, False, "unshare is not permitted here")
    return False


def _unescape_mountinfo(path: str) -> str:
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 3 < len(path) and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, per-mount options, fs type) from /proc/self/mountinfo, in mount order."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split()
            rows.append((_unescape_mountinfo(parts[4]), parts[5], right.split()[0]))
    return rows


def _blocking_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` that other users cannot traverse (e.g. /root), if any."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    cur = ""
    for p in parts:
        cur = f"{cur}/{p}"
        try:
            if not os.stat(cur).st_mode & 0o001:
                return cur
        except OSError:
            return None
    return None


def prepare_worker_mounts(report: IsolationReport, *, keep_paths: list[str], new_proc: bool) -> None:
    """Inside a private mount namespace (as root there): mount a private /proc, hide directories
    that block the interpreter (e.g. /root) behind a tmpfs that exposes only `keep_paths`, then remount
    every host mount read-only. Cgroup mounts stay writable for the zygote (root-only files)."""
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError as e:
        report.set("readonly_host", False, f"cannot make mounts private ({e}); host mounts left untouched")
        return
    if new_proc:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
            report.set("hidden_proc", True)
        except OSError as e:
            report.set("hidden_proc", False, f"private /proc not mounted: {e}")
    else:
        report.set("hidden_proc", False, "no pid namespace")
    _expose_through_hidden_ancestors(report, keep_paths)
    failures = []
    for mountpoint, options, fstype in _mounts():
        if mountpoint == "/proc" or mountpoint.startswith(("/proc/", "/sys/fs/cgroup")):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in options.split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(opt, 0)
        try:
            mount(None, mountpoint, None, flags)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EACCES) or mountpoint in ("/", "/tmp", "/dev/shm"):
                failures.append(f"{mountpoint} ({fstype}): {e.strerror}")
    report.set("readonly_host", not failures, f"mounts left writable: {', '.join(failures)}")
    try:
        os.sethostname("sandbox") if hasattr(os, "sethostname") else None
    except OSError:
        pass


def outermost(paths) -> list[str]:
    """The paths (absolute, normalised) none of whose ancestors is among them."""
    paths = sorted({os.path.normpath(p) for p in paths})
    return [p for p in paths if not any(p.startswith(q.rstrip("/") + "/") for q in paths if q != p)]


_STATVFS_TO_MOUNT = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                     (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))


def mount_keeping(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None, *,
                  keep=(), read_only: bool = False) -> list[str]:
    """mount(2) over `target`, then bind back, read-only, each of `keep` that lay under it.

    The calls' private /tmp, /dev/shm and /mnt must not hide the interpreter or its packages: a
    virtual environment (or conda, or a container's site-packages) under any of them would otherwise
    be out of sight of tool code, and every cold `import sympy` would fail. The kept directories are
    opened before `target` is covered and bound back from those handles onto directories created in
    the new mount (owned by the caller, mode 0755). `read_only`: the new mount is remounted read-only
    once they are in place. Returns the kept paths."""
    target = os.path.normpath(target)
    inside = [p for p in outermost(keep) if p.startswith(target + "/")]
    handles = []
    try:
        for path in inside:
            try:
                handles.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
            except OSError:
                continue  # gone, or not a directory: nothing to keep
        mount(source, target, fstype, flags, data)
        for path, fd in handles:
            _make_dirs(path, target)
            os.fchdir(fd)  # bind from the handle: the path itself now names the new mount's directory
            mount(".", path, None, MS_BIND | MS_REC)
            os.chdir("/")
            current = os.statvfs(path).f_flag
            if not current & os.ST_RDONLY:  # already so when the host view was made read-only
                remount = MS_REMOUNT | MS_BIND | MS_RDONLY
                for statvfs_flag, mount_flag in _STATVFS_TO_MOUNT:  # locked flags must be restated
                    if current & statvfs_flag:
                        remount |= mount_flag
                mount(None, path, None, remount)
        if read_only:
            mount(None, target, None, MS_REMOUNT | MS_RDONLY | flags, data)
    finally:
        for _, fd in handles:
            os.close(fd)
    return [path for path, _ in handles]


def _make_dirs(path: str, top: str) -> None:
    """mkdir -p of `path` below `top`, each new directory mode 0755 whatever the umask."""
    rel = os.path.relpath(path, top).split(os.sep)
    current = top
    for part in rel:
        current = os.path.join(current, part)
        try:
            os.mkdir(current)
            os.chmod(current, 0o755)
        except FileExistsError:
            pass


def _expose_through_hidden_ancestors(report: IsolationReport, keep_paths: list[str]) -> None:
    """Interpreters often live under /root (mode 0700), which the per-slot uids cannot traverse.
    Cover each blocking ancestor with an empty tmpfs (mode 0755, which also hides the rest of it)
    that keeps only these paths."""
    paths = outermost(os.path.realpath(p) for p in keep_paths if _blocking_ancestor(p))
    ancestors = outermost(_blocking_ancestor(p) for p in paths)
    try:
        for ancestor in ancestors:
            mount_keeping("sandbox-hide", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755", keep=paths)
    except OSError as e:
        report.warnings.append(f"could not expose {paths} to the sandbox uids: {e}")


# -- cgroups -----------------------------------------------------------------------------------------

CGROUP_V1 = "/sys/fs/cgroup"
CGROUP_V2_CANDIDATES = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _v2_root() -> str | None:
    for root in CGROUP_V2_CANDIDATES:
        if os.path.exists(f"{root}/cgroup.controllers"):
            return root
    return None


class SlotCgroups:
    """The cgroups of one execution slot: v1 or v2 memory and pids limits, and a v2 group for
    `cgroup.kill`. Created by the worker as root; the call's child moves itself in before it drops
    privileges. Paths are `<controller root>/sandbox_service/<instance>/<worker>-<slot>`."""

    def __init__(self, instance: str, name: str):
        self.memory_dir = self.pids_dir = self.kill_dir = None
        self.memory_v2 = self.pids_v2 = False
        self.procs_files: list[str] = []
        self.instance, self.name = instance, name
        self._memory_limit: int | None = None
        self._oom_file: str | None = None
        self._v2_dir: str | None = None
        self._pids_max = 0
        self._forks_blocked = False
        self._oom_seen = 0

    def create(self, report: IsolationReport, *, pids_max: int) -> None:
        rel = f"sandbox_service/{self.instance}/{self.name}"
        self._pids_max = pids_max
        v2 = _v2_root()
        v2_controllers = _read(f"{v2}/cgroup.controllers").split() if v2 else []
        v1_pids = os.path.exists(f"{CGROUP_V1}/pids/cgroup.procs")
        # Joining a cgroup costs a migration per call, so the v2 group is used only when it carries
        # the controllers, or for `cgroup.kill` when no v1 pids group can stop forks during teardown.
        use_v2 = v2 is not None and ("memory" in v2_controllers or "pids" in v2_controllers or not v1_pids)
        if use_v2:
            try:
                os.makedirs(f"{v2}/{rel}", exist_ok=True)
                self.procs_files.append(f"{v2}/{rel}/cgroup.procs")
                if os.path.exists(f"{v2}/{rel}/cgroup.kill"):
                    self.kill_dir = f"{v2}/{rel}"
                self._v2_dir = f"{v2}/{rel}"
            except OSError as e:
                report.warnings.append(f"cgroup v2 group not created: {e}")
        if "memory" in v2_controllers and self._v2_dir and os.path.exists(f"{self._v2_dir}/memory.max"):
            self.memory_dir, self.memory_v2 = self._v2_dir, True
            self._oom_file = f"{self._v2_dir}/memory.events"
        elif os.path.exists(f"{CGROUP_V1}/memory/cgroup.procs"):
            try:
                os.makedirs(f"{CGROUP_V1}/memory/{rel}", exist_ok=True)
                self.memory_dir = f"{CGROUP_V1}/memory/{rel}"
                self.procs_files.append(f"{self.memory_dir}/cgroup.procs")
                self._oom_file = f"{self.memory_dir}/memory.oom_control"
            except OSError as e:
                report.warnings.append(f"cgroup v1 memory group not created: {e}")
        if "pids" in v2_controllers and self._v2_dir and os.path.exists(f"{self._v2_dir}/pids.max"):
            self.pids_dir, self.pids_v2 = self._v2_dir, True
        elif v1_pids:
            try:
                os.makedirs(f"{CGROUP_V1}/pids/{rel}", exist_ok=True)
                self.pids_dir = f"{CGROUP_V1}/pids/{rel}"
                self.procs_files.append(f"{self.pids_dir}/cgroup.procs")
            except OSError as e:
                report.warnings.append(f"cgroup v1 pids group not created: {e}")
        if self.pids_dir:
            _write(f"{self.pids_dir}/pids.max", str(pids_max))
        self._oom_seen = self.oom_kills()

    @property
    def can_kill_all(self) -> bool:
        """True when teardown reaches every process of the call (setsid daemons included)."""
        return bool(self.kill_dir or self.pids_dir)

    def set_memory_limit(self, limit_bytes: int) -> None:
        if self.memory_dir is None or limit_bytes == self._memory_limit:
            return
        if self.memory_v2:
            _write(f"{self.memory_dir}/memory.max", str(limit_bytes))
            if os.path.exists(f"{self.memory_dir}/memory.swap.max"):
                _write(f"{self.memory_dir}/memory.swap.max", "0")
        else:
            # v1 requires memory.limit_in_bytes <= memory.memsw.limit_in_bytes at every step.
            files = [f"{self.memory_dir}/memory.limit_in_bytes"]
            if os.path.exists(f"{self.memory_dir}/memory.memsw.limit_in_bytes"):
                files.append(f"{self.memory_dir}/memory.memsw.limit_in_bytes")
            if limit_bytes > int(_read(files[0])):
                files.reverse()
            for path in files:
                _write(path, str(limit_bytes))
        self._memory_limit = limit_bytes

    def oom_kills(self) -> int:
        if self._oom_file is None:
            return 0
        for line in _read(self._oom_file).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def attach_self(self) -> None:
        """Moves the calling process into every group (run in the call's child, while still root)."""
        pid = str(os.getpid())
        for path in self.procs_files:
            _write(path, pid)

    def new_oom_kill(self) -> bool:
        """Whether the memory controller killed a process since the last check."""
        count = self.oom_kills()
        seen, self._oom_seen = self._oom_seen, count
        return count > seen

    def pids(self) -> list[int]:
        """Processes still in the slot."""
        for directory in (self.pids_dir, self._v2_dir, self.memory_dir):
            if directory:
                try:
                    return [int(x) for x in _read(f"{directory}/cgroup.procs").split()]
                except (OSError, ValueError):
                    continue
        return []

    def kill_all(self) -> None:
        """Kills everything in the slot, `setsid` daemons included: `cgroup.kill` on v2; on v1,
        pids.max = 0 first so that nothing can fork while the listed processes are killed (call
        `allow_forks` once the slot is empty)."""
        if self.kill_dir:
            try:
                _write(f"{self.kill_dir}/cgroup.kill", "1")
                return
            except OSError:
                pass
        if self.pids_dir and not self._forks_blocked:
            _write(f"{self.pids_dir}/pids.max", "0")
            self._forks_blocked = True
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def allow_forks(self) -> None:
        if self._forks_blocked:
            _write(f"{self.pids_dir}/pids.max", str(self._pids_max))
            self._forks_blocked = False

    def delegate(self, uid: int, gid: int) -> None:
        """Hands the slot's groups to `uid` (the zygote's root inside its user namespace), so that it
        can keep setting limits and killing without host root."""
        for directory in {d for d in (self.memory_dir, self.pids_dir, self._v2_dir) if d}:
            os.chown(directory, uid, gid)
            for name in os.listdir(directory):
                path = f"{directory}/{name}"
                if os.path.isfile(path):
                    os.chown(path, uid, gid)

    def remove(self) -> None:
        for directory in {d for d in (self.memory_dir, self.pids_dir, self._v2_dir) if d}:
            try:
                os.rmdir(directory)
            except OSError:
                pass


def remove_stale_instances() -> None:
    """Removes the (empty) groups of servers that died without cleaning up (`<pid>-<hex>` whose
    pid no longer exists)."""
    for root in [f"{CGROUP_V1}/memory", f"{CGROUP_V1}/pids", *CGROUP_V2_CANDIDATES]:
        try:
            entries = os.listdir(f"{root}/sandbox_service")
        except OSError:
            continue
        for entry in entries:
            pid, sep, _ = entry.partition("-")
            if not (sep and pid.isdigit()) or os.path.exists(f"/proc/{pid}"):
                continue
            remove_instance_cgroups(entry)


def remove_instance_cgroups(instance: str) -> None:
    """Removes `sandbox_service/<instance>` under every hierarchy (empty groups only)."""
    roots = [f"{CGROUP_V1}/memory", f"{CGROUP_V1}/pids"] + [r for r in CGROUP_V2_CANDIDATES]
    for root in roots:
        base = f"{root}/sandbox_service/{instance}"
        if not os.path.isdir(base):
            continue
        for entry in os.listdir(base):
            if os.path.isdir(f"{base}/{entry}"):
                try:
                    os.rmdir(f"{base}/{entry}")
                except OSError:
                    pass
        try:
            os.rmdir(base)
        except OSError:
            pass


def write_id_maps(process: int, ns_root: int, identity_ranges: list[tuple[int, int]]) -> None:
    """uid/gid maps of a process's new user namespace: its root is host id `ns_root` (unprivileged),
    and each (first, count) range of slot ids maps to itself. Written by a privileged process outside.
    `process`: a pid, or ("fd", dirfd) of an open /proc/<pid> directory."""
    lines = [f"0 {ns_root} 1"] + [f"{first} {first} {count}" for first, count in identity_ranges]
    text = ("\n".join(lines) + "\n").encode()
    for kind in ("uid_map", "gid_map"):
        if isinstance(process, tuple):
            fd = os.open(kind, os.O_WRONLY, dir_fd=process[1])
        else:
            fd = os.open(f"/proc/{process}/{kind}", os.O_WRONLY)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)


# -- seccomp -----------------------------------------------------------------------------------------

AUDIT_ARCH_X86_64 = 0xC000003E
_X86_64_DENIED = {
    "syslog": 103, "ptrace": 101, "uselib": 134, "vhangup": 153, "pivot_root": 155, "chroot": 161,
    "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168,
    "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "pidfd_getfd": 438, "mount_setattr": 442,
}
_X86_64_SOCKET, _X86_64_CLONE, _X86_64_CLONE3 = 41, 56, 435
_AF_UNIX = 1
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_NS_CLONE_FLAGS = NAMESPACE_FLAGS


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def seccomp_program(*, allow_setns: bool = False) -> bytes | None:
    """A classic-BPF seccomp filter: deny (EPERM) kernel-surface syscalls (mount, unshare, setns,
    ptrace, bpf, keyrings, io_uring, ...), sockets other than AF_UNIX, and clone with namespace
    flags; clone3 answers ENOSYS so that libc falls back to clone, whose flags can be inspected.
    allow_setns: for a filter loaded once in the zygote, whose calls join their slot's prepared
    mount namespace (setns needs capabilities the calls never have). None on architectures without
    a syscall table here."""
    if platform.machine() != "x86_64" or sys.byteorder != "little":
        return None
    ld_w_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    eperm, enosys = _SECCOMP_RET_ERRNO | errno.EPERM, _SECCOMP_RET_ERRNO | errno.ENOSYS
    prog = [
        _insn(ld_w_abs, 0, 0, 4),  # arch
        _insn(jeq, 1, 0, AUDIT_ARCH_X86_64),
        _insn(ret, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        _insn(ld_w_abs, 0, 0, 0),  # syscall number
        _insn(jge, 0, 1, 0x40000000),  # x32 ABI
        _insn(ret, 0, 0, eperm),
    ]
    denied = {name: nr for name, nr in _X86_64_DENIED.items() if not (allow_setns and name == "setns")}
    for nr in sorted(denied.values()):
        prog += [_insn(jeq, 0, 1, nr), _insn(ret, 0, 0, eperm)]
    prog += [_insn(jeq, 0, 1, _X86_64_CLONE3), _insn(ret, 0, 0, enosys)]
    prog += [  # socket(domain, ...): only AF_UNIX
        _insn(jeq, 0, 4, _X86_64_SOCKET),
        _insn(ld_w_abs, 0, 0, 16),
        _insn(jeq, 0, 1, _AF_UNIX),
        _insn(ret, 0, 0, _SECCOMP_RET_ALLOW),
        _insn(ret, 0, 0, eperm),
    ]
    prog += [  # clone(flags, ...): no new namespaces
        _insn(jeq, 0, 4, _X86_64_CLONE),
        _insn(ld_w_abs, 0, 0, 16),
        _insn(jset, 0, 1, _NS_CLONE_FLAGS),
        _insn(ret, 0, 0, eperm),
        _insn(ret, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    prog.append(_insn(ret, 0, 0, _SECCOMP_RET_ALLOW))
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program: bytes) -> None:
    """Sets no_new_privs and installs the filter on the calling thread (inherited by children)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")


def probe_seccomp(program: bytes | None) -> str | None:
    """Loads the filter in a forked child and checks that AF_INET sockets are refused; returns an
    error message, or None when the filter works. (Runs in the worker, never in the gRPC server.)"""
    if program is None:
        return f"no seccomp syscall table for {platform.machine()}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            load_seccomp(program)
            import socket
            try:
                socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                code = 2
            except PermissionError:
                a, b = socket.socketpair()  # AF_UNIX stays allowed (multiprocessing, asyncio)
                a.close(), b.close()
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            os.write(w, repr(e).encode()[:200])
            code = 3
        os._exit(code)
    os.close(w)
    msg = os.read(r, 400).decode(errors="replace")
    os.close(r)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc == 0:
        return None
    return f"seccomp probe failed (rc {rc}) {msg}".strip()


# -- per call ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CallLimits:
    cpu_s: int
    memory_bytes: int
    address_space_bytes: int | None  # None: no RLIMIT_AS (a cgroup limits memory)
    file_size_bytes: int
    open_files: int
    processes: int
    scratch_bytes: int


def mount_call_scratch(limits: CallLimits, *, keep=(), hide_mnt: bool = False) -> None:
    """In a fresh mount namespace: private size-capped tmpfs on /tmp (the call's working directory)
    and /dev/shm (multiprocessing semaphores); both vanish with the call. `keep`: the interpreter's
    directories, which stay visible (read-only) under them; `hide_mnt`: also cover /mnt (where the
    zygote keeps the slots' scratch). /tmp is a sticky, world-writable directory owned by the
    namespace's root, as a host's is: the call cannot move what is kept there."""
    unshare(CLONE_NEWNS)
    size = limits.scratch_bytes
    mount_keeping("sandbox-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=4096,mode=1777",
                  keep=keep)
    mount_keeping("sandbox-shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=1024,mode=1777",
                  keep=keep)
    if hide_mnt:
        mount_keeping("sandbox-hide", "/mnt", "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=0755", keep=keep,
                      read_only=True)


def apply_rlimits(limits: CallLimits, *, per_uid: bool) -> None:
    """Soft = hard so that the code cannot raise them back."""
    def both(kind: int, value: int) -> None:
        resource.setrlimit(kind, (value, value))

    both(resource.RLIMIT_CORE, 0)
    both(resource.RLIMIT_CPU, limits.cpu_s)
    both(resource.RLIMIT_FSIZE, limits.file_size_bytes)
    both(resource.RLIMIT_NOFILE, limits.open_files)
    if per_uid:  # NPROC counts per uid: only meaningful when the slot has its own uid
        both(resource.RLIMIT_NPROC, limits.processes)
    if limits.address_space_bytes is not None:
        both(resource.RLIMIT_AS, limits.address_space_bytes)


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
