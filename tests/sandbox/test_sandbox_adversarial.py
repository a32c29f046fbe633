"""The adversarial catalogue (reference sandbox.md §6) against a real server on loopback.

Every case must come back with its documented status; afterwards the service still answers, no
process of the calls survives (checked by scanning /proc), and nothing was written outside scratch
(checked on canary paths of the host).
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import textwrap

import pytest

from sandbox_service import status
from sandbox_service.client import SandboxClient
from sandbox_service.launcher import LocalSandbox

pytestmark = pytest.mark.slow  # a sandbox server subprocess

UID_BASE = 1_700_000  # per-slot uids of this file's server: a stray call process is easy to spot
TIMEOUT_S = 2.0


def processes_with_uid_in(lo: int, hi: int) -> list[tuple[int, int, str]]:
    """(pid, uid, command) of every process on the host whose real uid is in [lo, hi)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            if lo <= uid < hi:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append((int(entry), uid, f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, StopIteration, ValueError):
            continue
    return found


def processes_in_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def sandbox():
    sb = LocalSandbox(workers=1, slots=4, timeout_s=TIMEOUT_S, memory_mb=256, output_limit_bytes=65536,
                      uid_base=UID_BASE, pids_max=32, scratch_mb=16)
    sb.start()
    server_pid = sb.proc.pid
    yield sb
    sb.stop()
    # After stop: nothing of the server's process group and no call process is left on the host.
    assert processes_in_group(server_pid) == []
    assert processes_with_uid_in(UID_BASE - 1, UID_BASE + 100) == []  # zygotes (UID_BASE - 1) and calls


@pytest.fixture(scope="module")
def canary():
    """A world-writable directory on the host, outside any scratch; sandboxed code must not reach it."""
    with tempfile.TemporaryDirectory(prefix="sandbox-canary-", dir="/tmp") as d:
        os.chmod(d, 0o777)
        yield d


def run(sandbox, code: str, stdin: str = "", **kw):
    async def go():
        async with SandboxClient(sandbox.target, batch_size=1) as client:
            return await client.execute(code, stdin, **kw)
    return asyncio.run(go())


def run_many(sandbox, codes: list[str]):
    async def go():
        async with SandboxClient(sandbox.target) as client:
            return await client.execute_many(codes)
    return asyncio.run(go())


def alive(sandbox):
    r = run(sandbox, "print(1+1)")
    assert r.status == status.OK and r.stdout == "2\n", r
    assert processes_with_uid_in(UID_BASE, UID_BASE + 100) == []  # nothing of the last call survives


# (code, expected status, check on the result)
CASES = {
    "infinite_loop": ("print('started', flush=True)\nwhile True: pass", status.TIMEOUT,
                      lambda r: r.stdout == "started\n" and "wall-clock limit" in r.stderr),
    "sleep_no_cpu": ("import time\ntime.sleep(30)", status.TIMEOUT, lambda r: r.duration_s < 30),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  status.TIMEOUT, None),
    "memory_bomb": ("x = bytearray(4 << 30)", status.MEMORY_LIMIT, None),
    "memory_creep": ("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))", status.MEMORY_LIMIT, None),
    # 64 MB limit for these two (see CALL_OPTIONS): first-touch page faults are slow in a microVM
    "memory_touch_below_backstop": ("import numpy as np\na = np.ones((128 << 20) // 8)\nprint(a.sum())",
                                    status.MEMORY_LIMIT, None),
    "huge_output": ("while True: print('x' * 1000)", status.OUTPUT_LIMIT,
                    lambda r: r.stdout_truncated and len(r.stdout_bytes) < 70000 and "output truncated" in r.stdout),
    "huge_line_no_newline": ("import sys\n_ = sys.stdout.write('y' * (1 << 20))", status.OUTPUT_LIMIT,
                             lambda r: r.stdout_truncated),
    "read_shadow": ("print(open('/etc/shadow').read())", status.RUNTIME_ERROR, lambda r: "PermissionError" in r.stderr),
    "list_root": ("import os\nprint([n for n in os.listdir('/root') if n != '.pyenv'])", status.OK,
                  lambda r: r.stdout == "[]\n"),
    "environment": ("import os\nprint(sorted(os.environ))", status.OK,
                    lambda r: "PYTEST_CURRENT_TEST" not in r.stdout and "VIRTUAL_ENV" not in r.stdout
                    and "'PATH'" in r.stdout),
    "write_etc": ("open('/etc/sandbox_probe', 'w').write('x')", status.RUNTIME_ERROR,
                  lambda r: "Read-only file system" in r.stderr or "Permission" in r.stderr),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('survived')", status.RUNTIME_ERROR,
                    lambda r: "Error" in r.stderr),
    "kill_everything": ("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
                        "except OSError as e:\n    print(type(e).__name__)",
                        None, None),
    "deep_recursion": ("import sys\nsys.setrecursionlimit(10**9)\ndef f(n): return f(n + 1)\nf(0)", None,
                       lambda r: r.status in (status.RUNTIME_ERROR, status.KILLED_BY_SIGNAL, status.MEMORY_LIMIT)),
    "eight_threads": ("import threading\nout = []\n"
                      "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
                      "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(sorted(out))", status.OK,
                      lambda r: r.stdout == f"{list(range(8))}\n"),
    "thread_bomb": ("import threading, time\nwhile True:\n"
                    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()",
                    status.RUNTIME_ERROR, lambda r: "can't start new thread" in r.stderr or "RuntimeError" in r.stderr),
    "multiprocessing_pool": ("import multiprocessing as mp\nwith mp.Pool(2) as p:\n    print(p.map(abs, [-1, -2, 3]))",
                             status.OK, lambda r: r.stdout == "[1, 2, 3]\n"),
    "subprocess": ("import subprocess\n"
                   "print(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout.strip())",
                   status.OK, lambda r: r.stdout == "hi\n"),
    "stdin_absent": ("input()", status.RUNTIME_ERROR, lambda r: "EOFError" in r.stderr),
    "non_utf8": ("import sys\n_ = sys.stdout.buffer.write(b'\\xff\\xfe ok\\n')", status.OK,
                 lambda r: r.stdout_bytes == b"\xff\xfe ok\n" and r.stdout == "\ufffd\ufffd ok\n"),
    "sys_exit_3": ("import sys\nsys.exit(3)", status.RUNTIME_ERROR, lambda r: r.exit_code == 3),
    "sys_exit_message": ("import sys\nsys.exit('bye')", status.RUNTIME_ERROR,
                         lambda r: r.exit_code == 1 and r.stderr == "bye\n"),
    "os_exit_7": ("import os\nos._exit(7)", status.RUNTIME_ERROR, lambda r: r.exit_code == 7),
    "sys_exit_0": ("import sys\nprint('a')\nsys.exit(0)", status.OK, lambda r: r.stdout == "a\n"),
    "uncaught_exception": ("def g():\n    raise ValueError('boom')\ng()", status.RUNTIME_ERROR,
                           lambda r: r.stderr.startswith("Traceback") and 'File "<tool>", line 3' in r.stderr
                           and "ValueError: boom" in r.stderr and "harness" not in r.stderr
                           and "workers" not in r.stderr),
    "syntax_error": ("def f(:\n  pass", status.RUNTIME_ERROR, lambda r: "SyntaxError" in r.stderr),
    "keyboard_interrupt": ("raise KeyboardInterrupt", status.RUNTIME_ERROR, lambda r: "KeyboardInterrupt" in r.stderr),
    "double_fork_daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                           "        time.sleep(60)\n    os._exit(0)\nprint('main done')", status.OK,
                           lambda r: r.stdout == "main done\n"),
    "ignore_sigterm_and_alarm": ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                 "signal.alarm(0)\nwhile True: pass",
                                 status.TIMEOUT, None),
    "raise_rlimit": ("import resource\ns, h = resource.getrlimit(resource.RLIMIT_CPU)\n"
                     "resource.setrlimit(resource.RLIMIT_CPU, (h + 10, h + 10))",
                     status.RUNTIME_ERROR, lambda r: "ValueError" in r.stderr or "PermissionError" in r.stderr),
    "close_stdio_then_spin": ("import os\nos.close(1)\nos.close(2)\nwhile True: pass", status.TIMEOUT, None),
    "close_stdio_then_sleep": ("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)", status.TIMEOUT, None),
    "big_file": ("open('big', 'wb').write(b'0' * (64 << 20))", status.RUNTIME_ERROR,
                 lambda r: "File too large" in r.stderr or "No space" in r.stderr),
    "fd_exhaustion": ("fs = []\nwhile True:\n    fs.append(open('/dev/null'))", status.RUNTIME_ERROR,
                      lambda r: "Too many open files" in r.stderr),
    "unshare_net": ("import ctypes\nprint(ctypes.CDLL(None, use_errno=True).unshare(0x40000000))", status.OK,
                    lambda r: r.stdout == "-1\n"),
    "segfault": ("import ctypes\nctypes.string_at(0)", status.KILLED_BY_SIGNAL, lambda r: r.exit_code == -11),
    "setuid_root": ("import os\nos.setuid(0)", status.RUNTIME_ERROR, lambda r: "PermissionError" in r.stderr),
    "mount": ("import ctypes\nprint(ctypes.CDLL(None).mount(b'none', b'/tmp', b'tmpfs', 0, None))", status.OK,
              lambda r: r.stdout == "-1\n"),
    "proc_snooping": ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [os.getpid()])",
                      status.OK, lambda r: r.stdout == "True\n"),
    "atexit_output": ("import atexit\natexit.register(lambda: print('bye from atexit'))\nprint('main')", status.OK,
                      lambda r: r.stdout == "main\nbye from atexit\n"),
    "nul_in_code": ("print(1)\x00", status.RUNTIME_ERROR, lambda r: "null" in r.stderr.lower()),
    "repl_display": ("x = 6\nx * 7", status.OK, lambda r: r.stdout == "42\n"),
    "repl_none_not_shown": ("print('p')\nNone", status.OK, lambda r: r.stdout == "p\n"),
}


CALL_OPTIONS = {"memory_touch_below_backstop": {"memory_mb": 64}, "memory_creep": {"memory_mb": 64}}


@pytest.mark.parametrize("name", list(CASES))
def test_catalogue_case(sandbox, name):
    code, expected, check = CASES[name]
    r = run(sandbox, code, **CALL_OPTIONS.get(name, {}))
    if expected is not None:
        assert r.status == expected, (name, r)
    if check is not None:
        assert check(r), (name, r)
    if name == "kill_everything":
        assert r.status in (status.OK, status.KILLED_BY_SIGNAL), r  # it may kill itself, nothing else
    alive(sandbox)


def test_stdin_is_delivered(sandbox):
    r = run(sandbox, "import sys\ndata = sys.stdin.read()\nprint(len(data), data.split()[-1])", "a b\n" * 50000 + "end")
    assert r.status == status.OK and r.stdout == f"{len('a b' * 50000) + 50000 + 3} end\n", r


def test_network_is_unreachable(sandbox):
    """Only a listener this test opens on loopback is targeted; it must see no connection."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1).send(b"x")
                print("connected")
            except OSError as e:
                print(type(e).__name__, e.errno)
        """)
        r = run(sandbox, code)
        assert r.status == status.OK and "connected" not in r.stdout and r.stdout.strip(), r
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_nothing_written_outside_scratch(sandbox, canary):
    target = os.path.join(canary, "escaped")
    code = textwrap.dedent(f"""
        import os
        results = []
        paths = [{target!r}, "/var/tmp/sandbox_escape", "/dev/shm/sandbox_escape",
                 {os.getcwd() + '/sandbox_escape'!r}]
        for path in paths:
            try:
                with open(path, "w") as f:
                    f.write("x")
                results.append("wrote " + path)
            except OSError as e:
                results.append(type(e).__name__)
        open("inside_scratch.txt", "w").write("fine")
        print(results, os.path.exists("inside_scratch.txt"))
    """)
    r = run(sandbox, code)
    assert r.status == status.OK, r
    assert not os.path.exists(target) and not os.path.exists("/var/tmp/sandbox_escape")
    assert not os.path.exists(os.path.join(os.getcwd(), "sandbox_escape"))
    # /dev/shm and /tmp inside the call are private and vanish with it; the next call sees neither
    r2 = run(sandbox, "import os\n"
                      "print(os.path.exists('/dev/shm/sandbox_escape'), os.path.exists('inside_scratch.txt'))")
    assert r2.stdout == "False False\n", r2
    assert not os.path.exists("/dev/shm/sandbox_escape")


def test_concurrent_identical_requests_do_not_mix(sandbox):
    codes = [f"import sys\nprint({i})\nprint({i}, file=sys.stderr)" for i in range(64)]
    results = run_many(sandbox, codes)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(64)]
    assert [r.stderr for r in results] == [f"{i}\n" for i in range(64)]


def test_calls_cannot_signal_each_other(sandbox):
    """A call running beside another (different slot uid) cannot see or kill it."""
    async def go():
        async with SandboxClient(sandbox.target, batch_size=1) as client:
            victim = asyncio.create_task(client.execute("import time\ntime.sleep(1.0)\nprint('victim ok')"))
            await asyncio.sleep(0.3)
            attacker = await client.execute(
                "import os, signal\nn = 0\nfor pid in range(2, 400):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                "        n += 1\n    except OSError:\n        pass\nprint(n)")
            return await victim, attacker
    victim, attacker = asyncio.run(go())
    assert victim.status == status.OK and victim.stdout == "victim ok\n", victim
    assert attacker.status in (status.OK, status.KILLED_BY_SIGNAL), attacker


def test_workers_hold_no_host_root(sandbox):
    """With a user namespace the zygotes run as the unprivileged host uid UID_BASE - 1 (root only
    inside their namespace); the calls run as per-slot uids."""
    async def go():
        async with SandboxClient(sandbox.target) as client:
            code = "import os\nprint(open('/proc/self/uid_map').read())\nos.getuid()"
            return await client.info(), await client.execute(code)
    info, r = asyncio.run(go())
    assert r.status == status.OK, r
    if not info.isolation_features["user_namespace"]:
        pytest.skip(f"no user namespace here: {info.isolation_warnings}")
    first_map_line = r.stdout.splitlines()[0].split()
    assert first_map_line == ["0", str(UID_BASE - 1), "1"]
    assert UID_BASE <= int(r.stdout.splitlines()[-1]) < UID_BASE + 100
    zygotes = processes_with_uid_in(UID_BASE - 1, UID_BASE)
    assert zygotes and all("sandbox_service.workers" in cmd for _, _, cmd in zygotes)


def test_filling_the_scratch_disk_is_contained_and_cleaned(sandbox):
    code = textwrap.dedent("""
        import errno
        n = 0
        try:
            while True:
                with open(f"f{n}", "wb") as f:
                    f.write(b"0" * (1 << 20))
                n += 1
        except OSError as e:
            print(errno.errorcode[e.errno], n > 0)
    """)
    listing = "import os\nprint(sorted(os.listdir('.')), os.listdir('/dev/shm'))\n_ = open('x', 'w').write('ok')"
    # A fresh call's /tmp holds only what keeps the interpreter in sight (an environment under /tmp).
    before = run(sandbox, listing)
    r = run(sandbox, code)
    assert r.status == status.OK and r.stdout == "ENOSPC True\n", r
    after = run(sandbox, listing)
    assert after.status == status.OK and after.stdout == before.stdout and "'x'" not in before.stdout, after


@pytest.mark.parametrize("error_format", ["traceback", "release"])
def test_the_sft_data_writes_a_syntax_error_as_the_sandbox_reports_it(sandbox, error_format):
    """The synthetic warm-up's failed calls (`rstar_jax.data.synthetic`, fix behaviour) show the error
    text this sandbox writes, file name and caret included: a policy warmed up on them meets the
    same observation in RL."""
    from rstar_jax.agent.tool_calls import syntax_error_text

    for code in ("print(47 * 38", "print(47 * 38))"):
        r = run(sandbox, code, error_format=error_format)
        assert r.status == status.RUNTIME_ERROR and r.stderr == syntax_error_text(code, error_format), r
