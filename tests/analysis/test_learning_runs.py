"""benchmarks/learning.py's scheduling (roc_effect.py runs through it): every seed's variants start
from its own finished warm-up, every (seed, variant) runs once, results come back in seed order,
and launches that run at once are pinned to disjoint cores."""

import json
import os
import pathlib
import threading
import time

import pytest
from tests.benchmark_scripts import benchmark_script

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py")


@pytest.fixture
def learning():
    with benchmark_script("learning") as module:
        yield module


def fake_launcher(events: list, lock: threading.Lock):
    """Stands in for `python -m rstar_jax.launch`: writes what a finished run leaves behind."""
    def launch(args, log, cpus=None, xla_flags=""):
        assert xla_flags == "", "benchmarks/learning.py passes no XLA_FLAGS unless asked"
        flags = dict(a.removeprefix("--config.").split("=", 1) for a in args if a.startswith("--config.") and "=" in a)
        run_dir = pathlib.Path(flags["run_dir"])
        with lock:
            events.append(("start", run_dir.name, flags.get("model.hf_path"), cpus, time.monotonic()))
        time.sleep(0.05)
        if flags.get("mode") != "sft":
            assert (pathlib.Path(flags["model.hf_path"]) / "config.json").exists(), "a variant started before its warm-up"
            run_dir.mkdir(parents=True, exist_ok=True)
            seed = int(flags["seed"])
            (run_dir / "metrics.jsonl").write_text("".join(
                json.dumps({"step": step, "time": float(step), "eval/pass@1": seed / 10 + step / 100}) + "\n"
                for step in (0, 10)))
        (run_dir / "hf" / "final").mkdir(parents=True)
        (run_dir / "hf" / "final" / "config.json").write_text("{}")
        with lock:
            events.append(("end", run_dir.name, None, cpus, time.monotonic()))
        return 0.05
    return launch


@pytest.mark.parametrize("jobs", [1, 2])
def test_every_variant_runs_once_after_its_warm_up(learning, tmp_path, monkeypatch, jobs):
    events, lock = [], threading.Lock()
    monkeypatch.setattr(learning, "launch", fake_launcher(events, lock))
    if jobs == 2:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    (tmp_path / "sft_seed1" / "hf" / "final").mkdir(parents=True)  # seed 1 warmed up earlier: not repeated
    (tmp_path / "sft_seed1" / "hf" / "final" / "config.json").write_text("{}")
    results = learning.run(TINY, seeds=range(3), variants=["roc", "grpo"],
                           out=tmp_path, jobs=jobs)
    started = [name for kind, name, *_ in events if kind == "start"]
    assert sorted(started) == sorted(["sft_seed0", "sft_seed2"] + [f"{v}_seed{s}" for s in range(3) for v in ("roc", "grpo")])
    for variant in ("roc", "grpo"):
        assert [r["seed"] for r in results["runs"][variant]] == [0, 1, 2]
        assert [r["eval/pass@1"][-1] for r in results["runs"][variant]] == pytest.approx([0.1, 0.2, 0.3])
    assert results["summary"]["roc"]["eval/pass@1"]["mean"] == pytest.approx([0.1, 0.2])
    if jobs == 2:  # two at a time, each on its own core
        assert {cpus for _, _, _, cpus, _ in events} == {frozenset({0}), frozenset({1})}
        running, most = set(), 0
        for kind, name, _, cpus, _ in events:
            running = running | {cpus} if kind == "start" else running - {cpus}
            most = max(most, len(running))
        assert most == 2
    else:
        assert {cpus for _, _, _, cpus, _ in events} == {None}


def test_a_failed_launch_stops_the_rest_and_is_raised(learning, tmp_path, monkeypatch):
    def launch(args, log, cpus=None, xla_flags=""):
        raise SystemExit(f"launcher failed (1), see {log}")
    monkeypatch.setattr(learning, "launch", launch)
    with pytest.raises(SystemExit, match="launcher failed"):
        learning.run(TINY, seeds=range(3), variants=["roc"], out=tmp_path,
                     jobs=2)
