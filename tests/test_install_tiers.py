"""Install tiers: `pip install rstar-jax` is the reusable library (rl, model, agent, parallel) on jax,
flax, optax and numpy alone; the commands' packages come with the extras (pyproject.toml).

The quick test runs the library and the README's python blocks in a subprocess whose imports outside
the base install fail; the slow one installs the base into a fresh virtual environment."""

import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.readme_blocks import LOSS_SECTION, driver, python_blocks

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = {"jax", "flax", "optax", "numpy"}
# Bounds on packages the base already brings (jax requires ml_dtypes): they add no package.
CONSTRAINED = {"ml-dtypes"}
# Packages of the extras that must not come with the base (orbax-checkpoint does: flax requires it).
NOT_IN_BASE = ("grain", "transformers", "aiohttp", "grpc", "ml_collections", "tokenizers", "math_verify",
               "pyarrow", "tensorboardX", "torch", "jinja2")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_base_dependencies_are_jax_flax_optax_numpy_and_the_extras_add_the_rest():
    project = _project()
    assert {_canonical(Requirement(r).name) for r in project["dependencies"]} == BASE | CONSTRAINED
    jax_requires = {_canonical(Requirement(r).name) for r in importlib.metadata.requires("jax") or []}
    assert CONSTRAINED <= jax_requires, jax_requires
    extras = project["optional-dependencies"]
    assert {"train", "serve", "sandbox", "distributed-sync", "dev"} <= set(extras)
    dev = {Requirement(r) for r in extras["dev"]}
    assert any(r.name == "rstar-jax" and r.extras == {"train", "serve", "sandbox"} for r in dev), extras["dev"]


def _base_modules() -> list[str]:
    """Top-level modules of BASE and everything it requires (not its extras), as installed here."""
    dists: set[str] = set()
    todo = list(BASE)
    while todo:
        name = _canonical(todo.pop())
        if name in dists:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # a platform-specific requirement this machine does not have
        dists.add(name)
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    modules = {module for module, owners in importlib.metadata.packages_distributions().items()
               if any(_canonical(owner) in dists for owner in owners)}
    return sorted(modules | {"rstar_jax", "sandbox_service"})  # the wheel's own packages


# Runs where modules outside the base install are not found, as in an environment holding only it.
_BASE_ONLY = r'''
import importlib.abc, json, os, sys

ALLOWED = set(json.loads(os.environ["RSTAR_BASE_MODULES"]))
blocked = set()


class BaseInstallOnly(importlib.abc.MetaPathFinder):
    """Wraps a finder so that modules outside the base are not found (find_spec answers None)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in ALLOWED or top in sys.stdlib_module_names or top.startswith("_sysconfigdata"):
            return self.finder.find_spec(fullname, path, target)
        blocked.add(top)
        return None

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [BaseInstallOnly(finder) for finder in sys.meta_path]

import numpy as np
import rstar_jax.agent, rstar_jax.model, rstar_jax.parallel, rstar_jax.rl
from rstar_jax.agent import (ByteTokenizer, ChatTemplate, DEFAULT_TOOL_NAME, HFTokenizer, extract_answer,
                             is_equivalent, parse_tool_calls, python_tool_schema, release_counts)
from rstar_jax.model import Qwen3, Qwen3Config
from rstar_jax.model.hf import load_pretrained, save_pretrained
from rstar_jax.parallel import create_sharded_model, make_mesh, param_shardings
from rstar_jax.rl import (LossConfig, RocConfig, get_policy_loss, grpo_loss, group_advantages, paper_penalty,
                          release_penalty, resample_on_correct, token_logprobs)

model = create_sharded_model(Qwen3Config.tiny(), make_mesh(data=1, fsdp=-1, tensor=1))
assert model(np.zeros((8, 4), np.int32)).shape == (8, 4, Qwen3Config.tiny().vocab_size)
[call] = parse_tool_calls('<tool_call>{"name": "%s", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
                          % DEFAULT_TOOL_NAME, tool_names=[DEFAULT_TOOL_NAME])
assert call.code == "print(6 * 7)", call
assert extract_answer("so the answer is \\boxed{42}") == "42"
try:
    HFTokenizer(".")
except ImportError as e:  # an optional package is named with the extra that brings it
    assert "pip install 'rstar-jax[" in str(e), e
else:
    raise AssertionError("HFTokenizer ran without the tokenizers package")
try:
    is_equivalent("x^2 + 2x", "2x + x^2")  # beyond the cheap checks: math-verify's
except ImportError as e:
    assert "pip install 'rstar-jax[" in str(e), e
else:
    raise AssertionError("is_equivalent ran math-verify without the package")

for source in json.loads(os.environ["RSTAR_README_DRIVERS"]):
    exec(compile(source, "<README driver>", "exec"), {"__name__": "__readme_driver__"})
print("optional imports refused:", sorted(blocked))
'''


def test_library_and_readme_blocks_run_on_the_base_install_alone(tmp_path):
    # CPU: a GPU plugin is outside the base install's modules.
    env = dict(os.environ, JAX_PLATFORMS="cpu", RSTAR_BASE_MODULES=json.dumps(_base_modules()),
               RSTAR_README_DRIVERS=json.dumps([driver(b) for b in python_blocks()]),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    # cwd: a scratch directory, where the README's blocks write their relative paths.
    proc = subprocess.run([sys.executable, "-c", _BASE_ONLY], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert proc.stdout.count("README block ok:") == len(python_blocks()), proc.stdout


def _source_tree(dest: pathlib.Path) -> pathlib.Path:
    """What the wheel is built from, copied: building in the checkout would leave build/ there."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    for package in ("rstar_jax", "sandbox_service"):
        shutil.copytree(REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.mark.slow
def test_fresh_venv_with_the_base_install_runs_the_readme_loss_block(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    source = tmp_path / "src"
    source.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    started = time.monotonic()
    install = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                              str(_source_tree(source))], env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    installed_s = time.monotonic() - started

    [loss_block] = [b for b in python_blocks() if b.section == LOSS_SECTION]
    script = (f"import importlib.util\n"
              f"present = [m for m in {NOT_IN_BASE!r} if importlib.util.find_spec(m)]\n"
              f"assert not present, f'the base install brought {{present}}'\n"
              f"import rstar_jax.agent, rstar_jax.model, rstar_jax.parallel, rstar_jax.rl\n"
              f"assert rstar_jax.rl.__file__.startswith({str(venv)!r}), rstar_jax.rl.__file__\n"
              + driver(loss_block))
    # cwd: not the checkout, so `import rstar_jax` is the installed wheel.
    run = subprocess.run([str(python), "-c", script], cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert "README block ok:" in run.stdout, run.stdout
    print(f"base install: {installed_s:.0f} s; whole test {time.monotonic() - started:.0f} s")
