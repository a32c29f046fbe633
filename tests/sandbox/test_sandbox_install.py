"""The sandbox where users install it: tool code imports the interpreter's packages wherever the
environment lives, including under the directories every call gets a private copy of (/tmp, /mnt,
/dev/shm), and the server's start-up self-test says what tool code can import."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from rstar_jax.rollout.tool_env import ToolEnv
from sandbox_service.client import SandboxClient
from sandbox_service.launcher import LocalSandbox

pytestmark = pytest.mark.slow

# What the server imports, what tool code imports, and what they need.
SERVER_DISTRIBUTIONS = ("grpcio", "grpcio-tools", "protobuf", "numpy", "sympy", "mpmath", "math-verify")


def _closure(roots) -> list[importlib.metadata.Distribution]:
    """The installed distributions `roots` need (their unconditional requirements, transitively)."""
    found, todo = {}, list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                todo.append(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0))
    return list(found.values())


def _environment_under(parent: str) -> str:
    """A virtual environment in `parent` whose packages are files there (hard links where the file
    system allows, else copies): the layout of a venv created and pip-installed under that path."""
    venv = os.path.join(parent, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    for dist in _closure(SERVER_DISTRIBUTIONS):
        for file in dist.files or []:
            src = os.path.abspath(dist.locate_file(file))
            if not src.startswith(ours + os.sep) or not os.path.isfile(src):
                continue  # scripts in bin/, headers
            dst = os.path.join(site, os.path.relpath(src, ours))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    return os.path.join(venv, "bin", "python")


def _hidden_parents() -> list[str]:
    """/tmp, and /mnt (where cloud machines mount their scratch disks) or else /dev/shm: the first
    two writable here."""
    parents = ["/tmp"] + [p for p in ("/mnt", "/dev/shm") if os.path.isdir(p) and os.access(p, os.W_OK)][:1]
    return parents


# Reads from the environment's files inside the call (a subpackage no worker pre-imports), and
# checks that they are read-only there.
PROBE = """
import os, numpy, sympy
print(numpy.__file__)
print(sympy.factor(sympy.Symbol('x')**2 - 1), int(numpy.arange(4).sum()))
import sympy.physics.mechanics
try:
    open(os.path.join(os.path.dirname(sympy.__file__), 'written-by-tool-code'), 'w')
    print('writable')
except OSError as e:
    print('read-only' if e.errno == 30 else f'refused {e.errno}')
"""


@pytest.mark.parametrize("parent", _hidden_parents())
def test_tool_code_imports_an_environment_that_lives_under_a_private_directory(parent):
    """The call's own /tmp (and /mnt, /dev/shm) must not hide the interpreter's site-packages: on a
    machine whose venv sits there, every release-preset `import sympy` failed with
    ModuleNotFoundError. Both presets, cold imports included, from a server run by that venv."""
    root = tempfile.mkdtemp(prefix="rstar-venv-", dir=parent)
    try:
        python = _environment_under(root)

        async def run() -> dict:
            # One slot per flavour: every call after the tampering one runs in the slot it tampered with.
            async with LocalSandbox(workers=1, slots=1, python=python, max_timeout_s=120) as sandbox:
                results = {}
                for preset in ("release", "rich"):
                    options = {**ToolEnv.preset_defaults(preset).sandbox_options(), "timeout_s": 60.0}
                    async with SandboxClient([sandbox.target], **options) as client:
                        if preset == "release":
                            results["info"] = await client.info()
                            results["tamper"] = await client.execute(TAMPER.format(root=root, parent=parent))
                        results[preset] = [await client.execute(PROBE) for _ in range(2)]
                return results

        results = asyncio.run(run())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for preset in ("release", "rich"):
        for r in results[preset]:
            assert r.status == "ok", (preset, r.status, r.stdout, r.stderr, r.message)
            numpy_file, factored, readonly = r.stdout.splitlines()
            assert numpy_file.startswith(root + "/") and factored == "(x - 1)*(x + 1) 6" and readonly == "read-only"
    assert results["release"][0].worker.startswith("lean") and results["rich"][0].worker.startswith("sci")
    # Tool code can neither move, delete, chmod nor write into the kept environment.
    assert results["tamper"].status == "ok" and results["tamper"].stdout.split() == ["refused"] * 4, results["tamper"]
    info = results["info"]
    assert info.isolation_level != "minimal" and info.interpreter == python and info.self_test_failures() == []
    ours = {m: importlib.import_module(m).__version__ for m in ("numpy", "sympy", "mpmath")}
    assert {(c.module, c.mode, c.version) for c in info.import_checks} == \
        {(m, mode, v) for m, v in ours.items() for mode in ("cold", "preimported")}


TAMPER = """
import os, shutil
for attempt in (lambda: os.rename({root!r}, os.path.join({parent!r}, 'moved')), lambda: shutil.rmtree({root!r}),
                lambda: os.chmod({root!r}, 0o777), lambda: open(os.path.join({root!r}, 'venv', 'new'), 'w')):
    try:
        attempt()
        print('done')
    except OSError:
        print('refused')
"""


def test_the_self_test_names_a_module_tool_code_cannot_import():
    """A --preimport the interpreter lacks: the server still serves, Info's self-test says which module
    failed in which mode, and the client's failures name it and the interpreter. A module the run
    needs that the server never checked is named too."""
    async def run():
        async with LocalSandbox(workers=1, slots=1, preimport=("no_such_package",)) as sandbox:
            async with SandboxClient([sandbox.target]) as client:
                return await client.info()

    info = asyncio.run(run())
    failed = {(c.module, c.mode, c.error) for c in info.import_checks if not c.ok}
    assert failed == {("no_such_package", mode, "ModuleNotFoundError: No module named 'no_such_package'")
                      for mode in ("cold", "preimported")}
    assert info.self_test_failures(required=("numpy", "scipy")) == [
        "tool code cannot import no_such_package (in a fresh interpreter or pre-imported: under either preset): "
        f"ModuleNotFoundError: No module named 'no_such_package'; it is not installed for the sandbox's interpreter "
        f"{sys.executable}",
        "its self-test did not check scipy: start it with --preimport scipy"]
    assert "no_such_package" in " ".join(info.isolation_warnings)  # the sci workers could not pre-import it


def test_a_preimport_that_is_not_a_module_name_is_refused_at_the_command_line():
    result = subprocess.run([sys.executable, "-m", "sandbox_service", "--port", "0", "--preimport", "numpy,not a module"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "preimports: 'not a module' is not a module name" in result.stderr


def test_the_self_test_runs_as_a_call_on_sandbox_fusion_api():
    """SandboxFusion's API has no Info: the same probe runs as an ordinary (cold) call on the target."""
    from sandbox_service.fusion_client import SandboxFusionExecutor

    async def run():
        async with LocalSandbox(workers=1, slots=1, http_port=0) as sandbox:
            async with SandboxFusionExecutor(sandbox.http_url, memory_address_space=True) as executor:
                return await executor.self_test(sandbox.http_url, ("sympy", "no_such_package"))

    sympy_check, missing = asyncio.run(run())
    assert (sympy_check.module, sympy_check.mode, sympy_check.ok) == ("sympy", "cold", True)
    assert sympy_check.version == importlib.import_module("sympy").__version__
    assert (missing.ok, missing.error) == (False, "ModuleNotFoundError: No module named 'no_such_package'")
