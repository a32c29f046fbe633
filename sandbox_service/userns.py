"""The zygote's user namespace, as root: its root is an unprivileged host uid, and the id maps that
the zygote cannot write itself are written by the outer process (the pid namespace's parent).

Protocol over two pipes: the zygote, once unshared, writes b"u"; the outer process (`serve_id_maps`)
writes the maps and answers b"k", or b"f" on failure.
"""

from __future__ import annotations

import logging
import os

from sandbox_service import isolation
from sandbox_service.slots import Slot

log = logging.getLogger("sandbox_service.worker")


def enter_user_namespace(args, report: isolation.IsolationReport, slots: list[Slot],
                         outer: tuple[int, int] | None, *, is_root: bool, scratch_root: str | None,
                         mount_ns: bool, keep: list[str], slots_on_mnt: bool) -> None:
    """As root: move the zygote into a new user namespace whose root is an unprivileged host uid,
    so that neither it nor the calls keep host capabilities (the read-only host view, owned by the
    initial namespace, can no longer be undone). Probed in a throwaway child first. `outer`, the
    (request fd, response fd) to the outer process, is closed in every case."""
    if outer is None or not is_root or args.isolation == "minimal":
        if is_root and args.isolation != "minimal":
            report.set("user_namespace", False, "no outer process to write the id maps")
        _close_outer(outer)
        return
    ns_root, ranges = args.ns_root_uid, [(slots[0].uid, len(slots))]
    try:
        for slot in slots:
            if slot.cgroups:
                slot.cgroups.delegate(ns_root, ns_root)
        if scratch_root:
            os.chown(scratch_root, ns_root, ns_root)
        problem = probe_user_namespace(slots[0], ns_root, ranges, mount_ns=mount_ns, keep=keep,
                                       slots_on_mnt=slots_on_mnt)
    except OSError as e:
        problem = f"delegation failed: {e}"
    if problem:
        report.set("user_namespace", False, problem)
        _close_outer(outer)
        return
    req_w, resp_r = outer
    isolation.unshare(isolation.CLONE_NEWUSER)
    os.write(req_w, b"u")
    answer = os.read(resp_r, 1)
    _close_outer(outer)
    if answer != b"k":  # the probe passed, so this is not expected; a restart retries
        log.error("the outer process could not write the user namespace's id maps")
        os._exit(3)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    report.set("user_namespace", True)


def _close_outer(outer: tuple[int, int] | None) -> None:
    if outer:
        for fd in outer:
            os.close(fd)


def probe_user_namespace(slot: Slot, ns_root: int, ranges: list[tuple[int, int]], *, mount_ns: bool,
                         keep: list[str], slots_on_mnt: bool) -> str | None:
    """Does in a child what the zygote and a call of `slot` will do inside the user namespace; the
    problem, or None."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
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
            if mount_ns:
                isolation.mount_call_scratch(_limits_for_probe(), keep=keep, hide_mnt=slots_on_mnt)
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


def _limits_for_probe() -> isolation.CallLimits:
    return isolation.CallLimits(cpu_s=1, memory_bytes=64 << 20, address_space_bytes=None, file_size_bytes=1 << 20,
                                open_files=64, processes=8, scratch_bytes=1 << 20)


def serve_id_maps(proc_dir: int, req_r: int, resp_w: int, args) -> None:
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
