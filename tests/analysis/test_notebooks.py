"""The analysis notebooks run top to bottom against the tiny run (and against a run whose tool calls
all failed), in a real Jupyter kernel, and produce their figures."""

import ast
import json
import os
import pathlib
import shutil

import nbformat
import pytest

from rstar_jax.analysis import runs
from rstar_jax.rollout.records import read_records, write_records
from rstar_jax.rollout.stats import record_stats
from rstar_jax.train.metrics import read_metrics
from tests.conftest import xla_flags

pytestmark = pytest.mark.slow  # notebooks executed on the default run

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
NAMES = ("training_dynamics", "tool_use", "entropy")


def load(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def parameters_cell(nb) -> nbformat.NotebookNode:
    tagged = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell must be tagged 'parameters'"
    return tagged[0]


def inject(nb, **params) -> None:
    """Replaces the parameters cell with the same assignments, `params` overriding their values."""
    cell = parameters_cell(nb)
    defaults = {node.targets[0].id: ast.get_source_segment(cell.source, node.value)
                for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)}
    unknown = set(params) - set(defaults)
    assert not unknown, f"not parameters of the notebook: {sorted(unknown)}"
    values = {**defaults, **{k: repr(v) for k, v in params.items()}}
    cell.source = "\n".join(f"{name} = {value}" for name, value in values.items())


def execute(name: str, cwd: pathlib.Path = REPO, **params) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = load(name)
    inject(nb, **params)
    env = dict(os.environ)
    # As users run it: one CPU device, and inline figures whatever MPLBACKEND the shell sets.
    env["XLA_FLAGS"] = xla_flags()
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    return nb


def outputs(nb, kind: str) -> list:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if kind in out.get("data", {})]


def text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebooks_are_clean_and_colab_ready(name):
    nb = load(name)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "clear outputs before committing"
    assert "find_spec(\"rstar_jax\")" in code[0].source and "pip" in code[0].source
    assert parameters_cell(nb) is code[1]
    assert "RUN_DIR = \"runs/tiny\"" in code[1].source
    assert any(cell.cell_type == "markdown" for cell in nb.cells)
    assert not any("pandas" in cell.source for cell in code)


def rl_steps(run_dir) -> int:
    return sum("rollout/reward_mean" in line for line in read_metrics(run_dir))


def test_training_dynamics(tiny_run_dir):
    nb = execute("training_dynamics", RUN_DIR=str(tiny_run_dir))
    # reward, length/truncation, groups, update, lr, SFT loss, held-out evaluation (steps 0 and 3)
    assert len(outputs(nb, "image/png")) == 7 and "no held-out evaluations" not in text(nb)
    sft_steps = sum("sft/loss" in line for line in read_metrics(tiny_run_dir))
    assert sft_steps > 0 and f"{sft_steps} SFT steps, {rl_steps(tiny_run_dir)} RL steps" in text(nb)


def test_training_dynamics_with_stages(tiny_run_dir, tmp_path):
    second = tmp_path / "stage_b"
    second.mkdir()
    shutil.copy(tiny_run_dir / "metrics.jsonl", second / "metrics.jsonl")
    nb = execute("training_dynamics", RUN_DIRS=[str(tiny_run_dir), str(second)], SMOOTH=2)
    assert len(outputs(nb, "image/png")) == 7
    n = rl_steps(tiny_run_dir)
    assert text(nb).count(f" {n} RL steps") == 2
    stage = runs.load_run(tiny_run_dir).stage
    assert f"stages start at global RL steps: {stage} ({tiny_run_dir.name}) 1, stage_b {n + 1}" in text(nb)


def test_the_default_run_dir_is_found_from_the_notebooks_folder(tiny_run_dir, tmp_path):
    """Jupyter starts a kernel in the notebook's folder (notebooks/), while the default RUN_DIR,
    runs/tiny, is relative to the repository root."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny").symlink_to(tiny_run_dir)
    (tmp_path / "notebooks").mkdir()
    nb = execute("tool_use", cwd=tmp_path / "notebooks")  # RUN_DIR left at its default
    assert f"agree with metrics.jsonl on {rl_steps(tiny_run_dir)} steps" in text(nb)


def test_tool_use(tiny_run_dir):
    records = [r for path in sorted((tiny_run_dir / "rollouts").glob("step_*.jsonl")) for r in read_records(path)]
    assert any("ok" in r["tool_statuses"] for r in records), "the tiny run should have successful tool calls"
    nb = execute("tool_use", RUN_DIR=str(tiny_run_dir))
    assert len(outputs(nb, "image/png")) == 3  # calls histogram and means, error rates, error kinds
    assert f"{len(records)} trajectories" in text(nb)
    assert f"agree with metrics.jsonl on {rl_steps(tiny_run_dir)} steps" in text(nb)


def test_tool_use_compares_a_benchmarks_variants_over_seeds(tiny_run_dir, tmp_path):
    """COMPARISON_DIR: a benchmark's --out (benchmarks/roc_effect.py), its <variant>_seed<N> runs
    (here the tiny run's metrics under four names) drawn side by side, GRPO - RoC printed."""
    for name in ("roc_seed0", "roc_seed1", "grpo_seed0", "grpo_seed1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text((tiny_run_dir / "metrics.jsonl").read_text())
    nb = execute("tool_use", RUN_DIR=str(tiny_run_dir), COMPARISON_DIR=str(tmp_path))
    assert len(outputs(nb, "image/png")) == 4
    assert "GRPO - RoC, positive tool-error rate: step 0: " in text(nb)


@pytest.fixture()
def failed_tools_run(tiny_run_dir, tmp_path):
    """The tiny run's metrics and rollouts with every tool call turned into a failure (the metrics'
    rollout statistics recomputed from the changed trajectories, as the trainer computes them)."""
    run_dir = tmp_path / "failed_tools"
    (run_dir / "rollouts").mkdir(parents=True)
    by_step = {}
    for path in sorted((tiny_run_dir / "rollouts").glob("step_*.jsonl")):
        records = read_records(path)
        for r in records:
            r["tool_statuses"] = ["runtime_error" if s == "ok" else s for s in r["tool_statuses"]]
            r["n_tool_errors"] = r["n_tool_calls"]
        write_records(run_dir / "rollouts" / path.name, records)
        by_step[records[0]["step"]] = records
    lines = []
    for line in read_metrics(tiny_run_dir):
        if "rollout/reward_mean" in line:
            line.update({f"rollout/{k}": v for k, v in record_stats(by_step[line["step"]]).items()})
        lines.append(line)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def test_tool_use_when_no_tool_call_succeeded(failed_tools_run):
    nb = execute("tool_use", RUN_DIR=str(failed_tools_run))
    assert len(outputs(nb, "image/png")) == 3  # calls histogram and means, error rates, error kinds
    assert f"agree with metrics.jsonl on {rl_steps(failed_tools_run)} steps" in text(nb)
    assert "ok " not in text(nb).split("positive:")[-1]  # no successful call in the status summary


def test_tool_use_stops_when_records_and_metrics_disagree(failed_tools_run):
    from nbclient.exceptions import CellExecutionError

    lines = read_metrics(failed_tools_run)
    for line in lines:
        if "rollout/tool_error_rate" in line:
            line["rollout/tool_error_rate"] = 0.123
    (failed_tools_run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(CellExecutionError, match="tool_error_rate recomputed 1, logged 0.123"):
        execute("tool_use", RUN_DIR=str(failed_tools_run))


def test_entropy(tiny_run_dir):
    nb = execute("entropy", RUN_DIR=str(tiny_run_dir), N_TRAJECTORIES=8, N_SHOW=2, CHUNK_SIZE=256)
    assert len(outputs(nb, "image/png")) == 3  # class counts, top tokens, entropy histogram
    pages = [out["data"]["text/html"] for out in outputs(nb, "text/html")]
    trajectories = [page for page in pages if "rstar-trajectory" in page]
    assert len(trajectories) == 2
    # Every trajectory has sampled tokens, so each page highlights some (top 20% of them).
    assert all(any(f"rstar-{label}" in page for label in ("forking", "reflection", "code")) for page in trajectories)
    records = runs.load_rollouts(tiny_run_dir)
    if any(0 in r["loss_mask"] for r in runs.sample_records(records, 8)):
        assert any("rstar-tool" in page for page in trajectories)  # tool output shown greyed, listed first
    assert f"8 of {len(records)} trajectories" in text(nb)
    assert f"policy {runs.find_hf_export(tiny_run_dir)};" in text(nb)
