"""The README's python blocks run as written (tests/readme_blocks.py: extraction, preludes, checks)."""

import pytest

from tests.readme_blocks import README, RUNNERS, python_blocks, driver

BLOCKS = python_blocks()


def test_every_python_block_has_a_runner():
    assert BLOCKS, f"{README} has no python block"
    missing = [f"README.md:{b.line} (## {b.section})" for b in BLOCKS if b.section not in RUNNERS]
    assert not missing, f"python blocks without a prelude in tests/readme_blocks.py RUNNERS: {missing}"
    stale = sorted(set(RUNNERS) - {b.section for b in BLOCKS})
    assert not stale, f"RUNNERS names sections with no python block: {stale}"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_block_runs(block, tmp_path, monkeypatch):
    if block.section not in RUNNERS:
        pytest.fail(f"README.md:{block.line} (## {block.section}) has no prelude in tests/readme_blocks.py RUNNERS")
    monkeypatch.chdir(tmp_path)  # the blocks read and write relative paths
    exec(compile(driver(block), f"<README.md:{block.line}>", "exec"), {"__name__": "__readme_driver__"})
