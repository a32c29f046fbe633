"""A zygote's slots: their scratch tmpfs, their prepared mount namespaces, and the scratch's cleaning
and reading back between calls.

Set-up (in the zygote, once): `mount_slot_scratch` as root before the user namespace, then
`prepare_slot_namespaces` inside it. Per call: `read_beneath` for the files a call asks back, then
`clean_slot_scratch`, once the slot's processes are gone.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import stat
from typing import TYPE_CHECKING

from sandbox_service import isolation

if TYPE_CHECKING:
    from sandbox_service.calls import Warm


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


def mount_slot_scratch(slots: list[Slot], *, ns_root: int, scratch_mb: int, keep: list[str],
                       warnings: list[str]) -> tuple[bool, bool]:
    """(As root, before the user namespace.) One size-capped tmpfs per slot under a private tmpfs
    on /mnt, holding the slot's tmp/ and shm/; the slot namespaces bind them on /tmp, /dev/shm.
    Returns whether /mnt was mounted over (then calls hide it) and whether every slot got its
    scratch (if not, none keeps one and the failure is in `warnings`)."""
    on_mnt = False
    try:
        isolation.mount_keeping("sandbox-slots", "/mnt", "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                                f"size=1m,mode=0700,uid={ns_root},gid={ns_root}", keep=keep)
        on_mnt = True
        for slot in slots:
            root = f"/mnt/sandbox-slot-{slot.index}"
            os.mkdir(root)
            isolation.mount("sandbox-slot", root, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                            f"size={scratch_mb << 20},nr_inodes=4096,mode=0755,uid={ns_root},gid={ns_root}")
            # /tmp as a host's: sticky and world-writable, owned by root, so that the call can
            # neither move nor fill what is kept in it (a virtual environment under /tmp)
            os.mkdir(f"{root}/tmp")
            os.chmod(f"{root}/tmp", 0o1777)
            os.chown(f"{root}/tmp", ns_root, ns_root)
            os.mkdir(f"{root}/shm")
            os.chmod(f"{root}/shm", 0o1777)
            os.chown(f"{root}/shm", ns_root, ns_root)
            slot.scratch = root
        return on_mnt, True
    except OSError as e:
        warnings.append(f"per-slot scratch not prepared ({e}); a mount namespace per call instead")
        for slot in slots:
            slot.scratch = None
        return on_mnt, False


def prepare_slot_namespaces(slots: list[Slot], keep: list[str], warnings: list[str]) -> dict[str, set[str]] | None:
    """One mount namespace per slot, made once: /tmp and /dev/shm are the slot's tmpfs, /mnt is
    hidden. A call joins it with setns (cheaper than unsharing and mounting per call); the zygote
    empties the slot's scratch after every call. Returns, for "tmp" and "shm", the first names in a
    slot's scratch that the kept paths are mounted on (for `clean_slot_scratch`); None on failure
    (then no slot keeps a scratch, and the failure is in `warnings`)."""
    fds = []
    try:
        for slot in slots:
            fds.append(slot_namespace(slot, keep))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        warnings.append(f"slot mount namespaces not prepared ({e}); a mount namespace per call instead")
        for slot in slots:
            slot.scratch = None  # calls then get their own scratch, which nothing here cleans or reads
        return None
    for slot, fd in zip(slots, fds):
        slot.ns_fd = fd
    kept = {}
    for sub, target in (("tmp", "/tmp"), ("shm", "/dev/shm")):
        kept[sub] = {os.path.relpath(p, target).split(os.sep)[0]
                     for p in isolation.outermost(keep) if p.startswith(target + "/")}
    return kept


def slot_namespace(slot: Slot, keep: list[str]) -> int:
    """The slot's mount namespace, made by a forked helper, as an fd."""
    # The helper sends its namespace as an fd: after the user namespace, /proc (hidepid=2, owned
    # by the host's) no longer shows us our children's entries.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ours.close()
            isolation.unshare(isolation.CLONE_NEWNS)
            isolation.mount_keeping(f"{slot.scratch}/tmp", "/tmp", None, isolation.MS_BIND, keep=keep)
            isolation.mount_keeping(f"{slot.scratch}/shm", "/dev/shm", None, isolation.MS_BIND, keep=keep)
            isolation.mount_keeping("sandbox-hide", "/mnt", "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV,
                                    "size=4k,mode=0755", keep=keep, read_only=True)
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


def clean_slot_scratch(slot: Slot, kept: dict[str, set[str]]) -> None:
    """Empties the slot's tmp/ and shm/ (its processes are gone) before the next call, but for
    the directories the kept interpreter paths are mounted on in the slot's namespace (`kept`;
    removing one there would detach the mount)."""
    for sub, mode in (("tmp", 0o1777), ("shm", 0o1777)):
        path = f"{slot.scratch}/{sub}"
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name in kept[sub]:
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


def read_beneath(root: str, path: str) -> bytes | None:
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


def pids_of_uid(uid: int) -> list[int]:
    """The processes of `uid` that our /proc shows."""
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
