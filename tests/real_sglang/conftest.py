"""Fixtures for the tests that run a real SGLang 0.5.23 server (CPU engine) in a subprocess.

Opt-in: they skip unless tests/real_sglang/setup.sh has built the environment (at
`$RSTAR_SGLANG_ENV`, else `<repo>/.venv-sglang`). `-m real_sglang` selects only them.
"""

from __future__ import annotations

import contextlib
import pathlib

import pytest

from tests.real_sglang.server import SGLangServer, env_dir, env_problem, sglang_server

_HERE = pathlib.Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    # A conftest's hook sees the whole session's items: mark only this directory's.
    for item in items:
        if _HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.real_sglang)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def sglang_env() -> pathlib.Path:
    """The SGLang environment's directory; skips the test when it is absent or incomplete."""
    problem = env_problem(env_dir())
    if problem:
        pytest.skip(problem)
    return env_dir()


@pytest.fixture(scope="session")
def tiny_qwen3_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A tiny random Qwen3 (vocabulary 320, 2 layers, GQA 4/2, untied head) exported by the project
    itself as a Hugging Face float32 checkpoint, which SGLang's Qwen3ForCausalLM loads. No
    tokenizer: servers run with --skip-tokenizer-init (token ids in and out)."""
    from flax import nnx

    from rstar_jax.model.hf import save_pretrained
    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    return save_pretrained(model, tmp_path_factory.mktemp("tiny_qwen3") / "hf", dtype="float32")


def _factory(stack: contextlib.ExitStack, env: pathlib.Path, log_dir: pathlib.Path):
    count = 0

    def start(model_dir, **options) -> SGLangServer:
        """Starts a server (options: sglang_server's keywords, e.g. context_length=,
        max_total_tokens=, extra_args=) and returns it once /health_generate answers."""
        nonlocal count
        count += 1
        options.setdefault("log_path", log_dir / f"sglang-{count}.log")
        return stack.enter_context(sglang_server(env, model_dir, **options))

    return start


@pytest.fixture
def start_sglang(sglang_env, tmp_path):
    """`start_sglang(model_dir, **options) -> SGLangServer`; every server it started is stopped at the
    test's teardown. Each start costs ~40 s to 2 minutes on 2 cores."""
    with contextlib.ExitStack() as stack:
        yield _factory(stack, sglang_env, tmp_path)


@pytest.fixture(scope="session")
def start_sglang_session(sglang_env, tmp_path_factory):
    """As `start_sglang`, for servers shared by several tests (stopped at the session's end)."""
    with contextlib.ExitStack() as stack:
        yield _factory(stack, sglang_env, tmp_path_factory.mktemp("sglang_logs"))
