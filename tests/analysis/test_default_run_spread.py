"""benchmarks/default_run_spread.py: every (variant, seed) runs once with its variant's XLA_FLAGS and
cores (one-core variants two at a time on disjoint cores), finished runs are read again, and the
table and last line report what the runs' logs and metrics say."""

import json
import threading
import time

import pytest
from tests.benchmark_scripts import benchmark_script


@pytest.fixture
def spread():
    with benchmark_script("default_run_spread") as module:
        yield module


def _fake_launcher(calls: list, lock: threading.Lock):
    """Stands in for the launcher: leaves what a finished default run leaves (its log's stage line,
    metrics with held-out pass@1 at steps 0 and 20, the wall time)."""
    def launch(args, run_dir, xla_flags, cpus):
        seed = int(next(a.split("=")[1] for a in args if a.startswith("--config.seed=")))
        with lock:
            calls.append((run_dir.name, xla_flags, cpus, time.monotonic(), "start"))
        time.sleep(0.05)
        run_dir.mkdir(parents=True)
        end = "took all its steps, to 992, no criterion met: ..." if seed == 1 else \
            f"ended at step {100 + seed} of 992: 64 of its 64 held-out conversations reproduced by greedy decoding (...)"
        run_dir.with_suffix(".log").write_text(f"[sft] 1/1067 ...\n[sft] stage 1 {end}\n[rl] done: ...\n")
        evals = [{"step": 0, "eval/pass@1": 0.2, "eval/pass@1_stderr": 0.03},
                 {"step": 20, "eval/pass@1": 0.5 if seed == 1 else 0.95, "eval/pass@1_stderr": 0.01}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"sft/loss": 1.0, "step": s}) + "\n" for s in (1, 2)) +
                                               "".join(json.dumps(e) + "\n" for e in evals))
        (run_dir / "wall_seconds.json").write_text(json.dumps({"seconds": 700.0 if seed == 1 else 300.0}))
        with lock:
            calls.append((run_dir.name, xla_flags, cpus, time.monotonic(), "end"))
        return 0.05
    return launch


def test_every_variant_runs_each_seed_once_under_its_arithmetic(spread, tmp_path, monkeypatch, capsys):
    calls, lock = [], threading.Lock()
    monkeypatch.setattr(spread, "launch", _fake_launcher(calls, lock))
    monkeypatch.setattr(spread.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    runs = spread.run([0, 1], ["native", "avx2", "one_core", "one_core_avx2"], tmp_path, ["--config.x=1"], jobs=2)
    started = {name: (flags, cpus) for name, flags, cpus, _, event in calls if event == "start"}
    assert len(started) == len([c for c in calls if c[4] == "start"]) == 8  # each once
    for seed in (0, 1):
        assert started[f"native_seed{seed}"] == ("", None) and started[f"avx2_seed{seed}"] == ("--xla_cpu_max_isa=AVX2", None)
        assert started[f"one_core_seed{seed}"][0] == "" and started[f"one_core_avx2_seed{seed}"][0] == "--xla_cpu_max_isa=AVX2"
    pinned = [cpus for name, (_, cpus) in started.items() if name.startswith("one_core")]
    assert all(cpus in (frozenset({0}), frozenset({1})) for cpus in pinned)
    # Every-core runs never overlap anything; one-core runs overlap only on another core.
    spans = {}
    for name, _, cpus, t, event in calls:
        spans.setdefault(name, [cpus, None, None])[1 if event == "start" else 2] = t
    for a, (ca, sa, ea) in spans.items():
        for b, (cb, sb, eb) in spans.items():
            if a < b and sa < eb and sb < ea:
                assert ca is not None and cb is not None and ca != cb, (a, b)
    assert runs["native_seed0"] == {"stage_1_end": 100, "stage_1_by": "reproduced", "sft_steps": 2, "pass@1_first": 0.2,
                                    "pass@1": 0.95, "pass@1_stderr": 0.01, "rl_steps": 20, "seconds": 300.0}
    assert (runs["avx2_seed1"]["stage_1_end"], runs["avx2_seed1"]["stage_1_by"]) == (992, "all steps")

    # Read again, not repeated.
    calls.clear()
    again = spread.run([0, 1], ["native", "one_core"], tmp_path, [], jobs=2)
    assert calls == [] and again["one_core_seed1"] == runs["one_core_seed1"]


def test_the_last_line_counts_runs_below_the_goals(spread, tmp_path, monkeypatch, capsys):
    calls, lock = [], threading.Lock()
    monkeypatch.setattr(spread, "launch", _fake_launcher(calls, lock))
    monkeypatch.setattr("sys.argv", ["default_run_spread.py", "--seeds", "0,1", "--variants", "native,sse4_2",
                                     "--out", str(tmp_path)])
    spread.main()
    out = capsys.readouterr().out
    assert "| sse4_2 | --xla_cpu_max_isa=SSE4_2 | all | 1 | 992 (all steps) | 0.200 -> 0.500 +- 0.010 | 700 s |" in out
    assert out.strip().splitlines()[-1] == "min_pass@1=0.500 max_wall_s=700 runs=4 below_0.85=2 over_600s=2"
    assert json.loads((tmp_path / "spread.json").read_text())["runs"]["native_seed0"]["pass@1"] == 0.95
    monkeypatch.setattr("sys.argv", ["default_run_spread.py", "--variants", "native,avx512"])
    with pytest.raises(SystemExit):
        spread.main()
    assert "--variants: unknown ['avx512']" in capsys.readouterr().err
