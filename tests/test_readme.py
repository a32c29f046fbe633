"""The README's set-up commands are what CI runs: exactly two, both in `.ci/run`, in order."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_two_set_up_commands():
    readme = (REPO / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):]
    setup = setup[:setup.index("\n## ", 1)]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    assert commands[0].endswith("python -m rstar_jax.launch") and "pytest" in commands[1]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == commands
