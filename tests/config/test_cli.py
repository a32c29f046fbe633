"""Command-line mistakes: every one reported at once, one `error:` line each naming the field, exit 2,
no traceback. The slow tests run the real entry points as users do (subprocesses); they fail
before any heavy work."""

import json
import os
import subprocess
import sys

import pytest

from rstar_jax.config.cli import check_overrides
from rstar_jax.config import REPO_CONFIGS, load_config_file

REPO = REPO_CONFIGS.parent
SHIPPED = ("base", "tiny", "sft", "stage1", "stage2", "stage3", "eval")


def _run(module, *args, cwd):
    env = {**os.environ}  # conftest set the CPU platform and fake devices
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _errors(result) -> list[str]:
    """The `error:` lines, after checking the exit status and that nothing else went wrong."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    lines = [line[len("error: "):] for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == len(set(lines)), lines  # each problem once
    return lines


# -- the override checks, in process --------------------------------------------------------------

@pytest.mark.parametrize("args,expected", [
    (["--config.train.lr=-1"], ["config.train.lr: unknown field (not in configs/base.py); did you mean optim.lr or "
                                "sft.lr?"]),
    (["--config.rl.clip_hihg", "0.3"], ["config.rl.clip_hihg: unknown field (not in configs/base.py); did you mean "
                                        "rl.clip_high?"]),
    (["--config.nosection.x=1"], ["config.nosection.x: unknown field (not in configs/base.py)"]),
    (["--config.train.steps=abc"], ["config.train.steps: expected int, got 'abc'"]),
    (["--config.train.steps=1.5"], ["config.train.steps: expected int, got '1.5'"]),
    (["--config.optim.lr", "fast"], ["config.optim.lr: expected float, got 'fast'"]),
    (["--config.sandbox.launch_local=maybe"], ["config.sandbox.launch_local: expected bool (true or false), got "
                                               "'maybe'"]),
    (["--config.data.train_files=a b"], ["config.data.train_files: expected a tuple, got 'a b': quote each element "
                                         "and separate them with commas, e.g. \"('a.jsonl','b.jsonl')\""]),
    (["--config.rl={'group_size': 4}"], ["config.rl: is a section; set its fields one by one (e.g. "
                                         "--config.rl.advantage_estimator=...)"]),
    (["--noconfig.train.steps"], ["config.train.steps: --noconfig.train.steps is for boolean fields; this one is "
                                  "int: use --config.train.steps=VALUE"]),
    (["--config.train.steps"], ["config.train.steps: no value given: use --config.train.steps=VALUE"]),
    # Good overrides in every syntax config_flags accepts.
    (["--config.train.steps", "7", "--config.rl.dual_clip=3", "--config.model.overrides.num_layers=4",
      "--config.data.train_files=('a.jsonl','b.jsonl')", "--config.sft.train_files", "c.jsonl",
      "--config.sft.train_files", "d.jsonl", "--config.sandbox.launch_local", "--noconfig.metrics.jsonl",
      "--config.rollout.seeded_sampling=false", "--verbosity=1", "--", "--config.train.lr=1"], []),
])
def test_override_problems_name_the_field(args, expected):
    config = load_config_file(REPO_CONFIGS / "stage1.py")
    problems, bad = check_overrides(["prog", *args], config)
    assert problems == expected
    assert bool(bad) == bool(expected)  # the bad ones are left out of the real parse


def test_every_bad_override_is_reported_and_dropped_the_good_ones_kept():
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    argv = ["prog", "--config.train.steps", "abc", "--config.rl.clip_high=0.3", "--config.train.lr=1",
            "--check_files", "--config.optim.warmup_steps", "5"]
    problems, bad = check_overrides(argv, config)
    assert problems == ["config.train.steps: expected int, got 'abc'",
                        "config.train.lr: unknown field (not in configs/base.py); did you mean optim.lr or sft.lr?"]
    assert [argv[i] for i in range(len(argv)) if i not in bad] == [
        "prog", "--config.rl.clip_high=0.3", "--check_files", "--config.optim.warmup_steps", "5"]
    # An override before --config=FILE would be replaced by the file.
    argv = ["prog", "--config.train.steps=3", "--config", "configs/tiny.py"]
    assert check_overrides(argv, config, 2)[0] == ["config.train.steps: --config.train.steps comes before "
                                                   "--config=FILE, which would replace it: put --config first"]


# -- the real entry points ------------------------------------------------------------------------

@pytest.mark.slow
def test_launch_reports_every_mistake_at_once(tmp_path):
    result = _run("rstar_jax.launch", f"--config={REPO_CONFIGS / 'stage1.py'}", "--config.rl.no_such=1",
                  "--config.rl.clip_hihg=0.3", "--config.train.lr=-1", "--config.train.steps=abc",
                  "--config.rl.clip_low=1.5", "--config.rl.kl_coef=0.1", cwd=tmp_path)
    assert _errors(result) == [
        "config.rl.no_such: unknown field (not in configs/base.py)",
        "config.rl.clip_hihg: unknown field (not in configs/base.py); did you mean rl.clip_high?",
        "config.train.lr: unknown field (not in configs/base.py); did you mean optim.lr or sft.lr?",
        "config.train.steps: expected int, got 'abc'",
        "config.rl.clip_low: must be in [0, 1), got 1.5",
        "config.rl.kl_coef: must be 0: the KL term needs a reference policy, which this trainer does not keep "
        "(GRPO-RoC has no KL term, spec §5.3)",
        # stage1 leaves its inputs to the command line: a run names them.
        "config.tokenizer.path: an hf tokenizer needs files: set tokenizer.path or model.hf_path (or continue a run "
        "with train.init_from)",
        "config.data.train_files: RL needs training problems: list files here or set data.synthetic.enabled=True",
    ]
    assert result.stdout == ""


@pytest.mark.slow
def test_evaluate_reports_every_mistake_at_once(tmp_path):
    # tiny.py in eval mode (the command sets it): synthetic questions, so only the policy is missing.
    result = _run("rstar_jax.evaluate", f"--config={REPO_CONFIGS / 'tiny.py'}", "--config.eval.k=0",
                  "--config.eval.kk=2", "--config.eval.temperature=hot", "--config.eval.top_p=2", cwd=tmp_path)
    assert _errors(result) == [
        "config.eval.kk: unknown field (not in configs/base.py); did you mean eval.k?",
        "config.eval.temperature: expected float, got 'hot'",
        "config.eval.top_p: must be in (0, 1], got 2.0",
        "config.eval.k: must be a positive integer, got 0",
        "config.eval.checkpoint_dir: evaluation needs a policy: set model.hf_path, eval.checkpoint_dir or "
        "eval.generator_urls",
    ]


@pytest.mark.slow
def test_evaluate_reports_a_bad_question_file_without_a_traceback(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "bad.jsonl").write_text("not json\n")
    result = _run("rstar_jax.evaluate", f"--config={REPO_CONFIGS / 'tiny.py'}",
                  f"--config.run_dir={tmp_path / 'run'}", f"--config.model.hf_path={tmp_path / 'hf'}", f"--config.eval.files=('{tmp_path / 'bad.jsonl'}',)",
                  cwd=tmp_path)
    errors = _errors(result)
    assert len(errors) == 1 and "bad.jsonl row 0 (line 1): invalid JSON" in errors[0], errors


@pytest.mark.slow
def test_filter_hard_reports_every_mistake_at_once(tmp_path):
    result = _run("rstar_jax.filter_hard", f"--config={REPO_CONFIGS / 'stage3.py'}", "--config.filter_hard.k=0",
                  f"--config.filter_hard.input_file={tmp_path / 'all.jsonl'}", "--config.nosection.x=1",
                  "--config.filter_hard.checkpoint_step=last", cwd=tmp_path)
    assert _errors(result) == [
        "config.filter_hard.input_file: unknown field (not in configs/base.py); did you mean "
        "filter_hard.input_files?",
        "config.nosection.x: unknown field (not in configs/base.py)",
        "config.filter_hard.checkpoint_step: expected int, got 'last'",
        "config.filter_hard.k: must be a positive integer, got 0",
        # The command's own preconditions, in the same report.
        "config.data.train_files: runs/stage3/hard_subset.jsonl is also filter_hard.output_file; name the full "
        "problem set in filter_hard.input_files",
        "config.train.init_from: runs/stage2/checkpoints does not exist",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_readme_config_check_works_for_every_shipped_config(name):
    """README: `python -m rstar_jax.config --config=configs/stage3.py` checks and prints a config
    without starting any work."""
    result = _run("rstar_jax.config", f"--config=configs/{name}.py", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout)
    assert printed["stage"] == load_config_file(REPO_CONFIGS / f"{name}.py").stage
    assert "error:" not in result.stderr and "Traceback" not in result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: config.")]
    assert (name == "tiny") == (not notes), result.stderr  # what a run still needs, naming the fields


@pytest.mark.slow
def test_config_command_parses_overrides_as_config_flags_does(tmp_path):
    args = [f"--config={REPO_CONFIGS / 'stage3.py'}", "--config.model.hf_path=/x",
            "--config.rollout.servers=('http://a:1','http://b:2')", "--config.rollout.backend", "sglang",
            "--config.rl.dual_clip=2.5", "--noconfig.metrics.jsonl", "--config.sft.before_rl",
            "--config.filter_hard.temperature=None"]
    result = _run("rstar_jax.config", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = json.loads(result.stdout)
    assert printed["stage"] == "stage3" and printed["rollout"]["max_turns"] == 15
    assert printed["rollout"]["servers"] == ["http://a:1", "http://b:2"] and printed["rollout"]["backend"] == "sglang"
    assert printed["rl"]["dual_clip"] == 2.5 and printed["metrics"]["jsonl"] is False and printed["sft"]["before_rl"]
    assert printed["filter_hard"]["temperature"] is None
    # --check_files turns the run's missing inputs into errors.
    checked = _run("rstar_jax.config", *args, "--check_files", cwd=tmp_path)
    assert _errors(checked) == [
        "config.sft.train_files: SFT needs conversations: list files here or set data.synthetic.enabled=True",
        "config.data.train_files: runs/stage3/hard_subset.jsonl does not exist (it is filter_hard.output_file: "
        "write it first with python -m rstar_jax.filter_hard)",
        "config.model.hf_path: /x does not exist",
        "config.train.init_from: runs/stage2/checkpoints does not exist",
    ]


@pytest.mark.slow
def test_config_command_reports_other_command_line_mistakes_in_one_line_each(tmp_path):
    result = _run("rstar_jax.config", "--chek_files", "--config.optim.lr=fast", "--config.rl=1", cwd=tmp_path)
    assert _errors(result) == [
        "config.optim.lr: expected float, got 'fast'",
        "config.rl: is a section; set its fields one by one (e.g. --config.rl.advantage_estimator=...)",
        "Unknown command line flag 'chek_files'. Did you mean: check_files ?",
    ]
    missing = _run("rstar_jax.config", "--config=missing.py", "--config.rl.clip_low=2", cwd=tmp_path)
    assert _errors(missing) == ["--config=missing.py: config file missing.py does not exist"]
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config():\n    return undefined_name\n")
    result = _run("rstar_jax.config", f"--config={broken}", cwd=tmp_path)
    assert _errors(result) == [f"--config={broken}: loading the config failed: NameError: name 'undefined_name' "
                               f"is not defined ({broken}:2)"]


@pytest.mark.parametrize("module, own_flag", [("rstar_jax.config", "--check_files"), ("rstar_jax.launch", None)])
def test_help_names_the_config_flag_and_exits_0(module, own_flag, tmp_path):
    result = _run(module, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--config=FILE" in result.stdout and "--config.a.b=VALUE" in result.stdout
    assert own_flag is None or own_flag in result.stdout


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(tmp_path):
    """A KeyboardInterrupt in the work (Ctrl-C) ends the command without a traceback."""
    code = ("import sys\nfrom rstar_jax.config.cli import config_command\nfrom rstar_jax.config import DEFAULT_CONFIG\n"
            "def run(config):\n    raise KeyboardInterrupt\n"
            "config_command(DEFAULT_CONFIG, run, check_files=False, argv=[sys.argv[0]])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in result.stderr


# -- --help and config mistakes answer before anything heavy is imported --------------------------

HEAVY = ("jax", "flax", "optax", "orbax", "grain", "transformers", "aiohttp", "grpc", "tensorboardX", "torch")
# Runs a command as `python -m` does, then reports its exit status and which heavy packages it imported.
IMPORT_PROBE = """
import runpy, sys
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
code = 0
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
heavy = sorted(h for h in {heavy!r} if any(m == h or m.startswith(h + ".") for m in sys.modules))
print("EXIT", code or 0, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""
COMMANDS = ("rstar_jax.launch", "rstar_jax.evaluate", "rstar_jax.serve", "rstar_jax.filter_hard", "rstar_jax.aot",
            "rstar_jax.config")


def _probe(module, *args, cwd):
    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(heavy=HEAVY), module, *args], cwd=cwd,
                            capture_output=True, text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("EXIT "), result.stderr[-3000:]
    code, heavy = last.split()[1], last.split("HEAVY ")[1]
    return result, int(code), heavy


@pytest.mark.parametrize("module", COMMANDS)
def test_help_imports_nothing_heavy(module, tmp_path):
    """`--help` is answered from the flags alone: JAX, grain, orbax, the HTTP and gRPC clients load
    only when a command runs."""
    result, code, heavy = _probe(module, "--help", cwd=tmp_path)
    assert code == 0, result.stderr[-3000:]
    assert heavy == "-", f"{module} --help imported {heavy}"
    flag = "--model-path" if module == "rstar_jax.serve" else "--config=FILE"
    assert flag in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("module", [m for m in COMMANDS if m != "rstar_jax.serve"])
def test_a_config_mistake_imports_nothing_heavy(module, tmp_path):
    result, code, heavy = _probe(module, f"--config={REPO_CONFIGS / 'tiny.py'}", "--config.rl.group_size=0",
                                 cwd=tmp_path)
    assert code == 2, result.stderr[-3000:]
    assert "error: config.rl.group_size: must be >= 1, got 0" in result.stderr.splitlines(), result.stderr[-3000:]
    assert heavy == "-", f"{module} imported {heavy} before reporting a config mistake"


@pytest.mark.slow
def test_a_library_flag_still_parses_and_helpfull_lists_it(tmp_path):
    """Flags the deferred libraries define (grain's, orbax's absl flags) are still accepted: a command
    line naming one, or --helpfull, imports them before parsing."""
    result, code, heavy = _probe("rstar_jax.launch", f"--config={REPO_CONFIGS / 'tiny.py'}",
                                 "--grain_py_debug_mode=false", "--config.rl.group_size=0", cwd=tmp_path)
    assert code == 2 and "Unknown command line flag" not in result.stderr, result.stderr[-3000:]
    assert "error: config.rl.group_size: must be >= 1, got 0" in result.stderr.splitlines()
    assert "grain" in heavy.split(",")
    full = _run("rstar_jax.launch", "--helpfull", cwd=tmp_path)  # absl's: every flag, exit status 1
    assert "grain_py_debug_mode" in full.stdout and "Traceback" not in full.stderr, full.stderr[-2000:]


def test_none_sets_an_optional_field_and_is_refused_by_a_required_one(tmp_path):
    """config_flags parses `=None` only for dataclass fields; an optional scalar takes it (dual-clip off
    for GSPO), a required one refuses it on one line naming the field."""
    gspo = _run("rstar_jax.config", "--config.rl.ratio_level=sequence", "--config.rl.loss_agg_mode=seq-mean-token-mean",
                "--config.rl.dual_clip=None", cwd=tmp_path)
    assert gspo.returncode == 0, gspo.stderr[-2000:]
    assert json.loads(gspo.stdout)["rl"]["dual_clip"] is None
    steps = _run("rstar_jax.config", "--config.train.steps=None", "--config.rl.dual_clip=none", cwd=tmp_path)
    assert steps.returncode == 2 and _errors(steps) == ["config.train.steps: must be a positive integer, got None"]
    # On a string field `none` is a name, not None.
    names = _run("rstar_jax.config", "--config.model.remat_policy=none", "--config.rl.rollout_is=None", cwd=tmp_path)
    assert names.returncode == 0, names.stderr[-2000:]
    printed = json.loads(names.stdout)
    assert printed["model"]["remat_policy"] == "none" and printed["rl"]["rollout_is"] is None
