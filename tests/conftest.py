"""Test configuration: 8 fake CPU devices and a persistent compilation cache.

Both must be set before jax is imported anywhere, which is why this happens at the top of
conftest.py rather than in a fixture.
"""

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parents[1]

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# CPU by default; a GPU machine runs the gpu-marked tests with JAX_PLATFORMS=cuda,cpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

SHARED_DIR = _REPO.parent / "shared"


def _has_gpu() -> bool:
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _has_gpu():
        skip = pytest.mark.skip(reason="no GPU visible to jax (run with JAX_PLATFORMS=cuda,cpu on a GPU machine)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    """The team's ../shared folder; tests that need it skip cleanly in users' clones."""
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared is not present in this checkout")
    return SHARED_DIR
