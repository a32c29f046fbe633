"""The commands' shared entry point: a config from `--config=FILE` and `--config.a.b=v`, checked
whole before any work, and errors a user can fix reported without a traceback.

    def main() -> None:
        config_command(DEFAULT_CONFIG, run)      # run(config) after validation

    if __name__ == "__main__":
        main()

The command line is that of `ml_collections.config_flags`: `--config=FILE`, `--config.a.b=v` or
`--config.a.b v`, booleans as `--config.flag` / `--noconfig.flag`, tuples as `"('a','b')"` (or a
repeated flag). config_flags stops at the first bad override (an unknown field is a bare
AttributeError in a traceback), so every override is checked here first, on its own: an unknown or misspelled field (with
did-you-mean), a section set as a whole, a value that does not parse as the field's type. Then
the good ones are parsed for real, `prepare(config)` runs, and `validate` checks every value. All
problems are printed together on stderr, one `error: config.<field>: <message>` line each, and the
command exits with status 2. A `UserError` from `run` (bad data, checkpoint, request) is reported
the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from rstar_jax.config import ConfigError, leaf_paths, load_config_file, unknown_field, validate
from rstar_jax.errors import UserError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # as a shell reports SIGINT
HELP_FLAGS = ("-h", "--help", "-help", "--helpshort")

_CONFIG_FILE = re.compile(r"^--?config(?:=(.*))?$", re.S)
_OVERRIDE = re.compile(r"^--?(no)?config\.([^=]*)(?:=(.*))?$", re.S)
# How a parse failure names what the field expects.
_EXPECTED = {int: "int", float: "float", bool: "bool (true or false)"}


def fail(problems: Sequence[str]) -> NoReturn:
    """Prints `error: <problem>` per line on stderr and exits with status 2."""
    for problem in problems:
        for line in str(problem).splitlines() or [""]:
            print(f"error: {line}", file=sys.stderr)
    sys.stderr.flush()
    sys.exit(EXIT_USER_ERROR)


@dataclasses.dataclass
class _Override:
    start: int  # argv[start:end] are its tokens (the value may be the next token)
    end: int
    path: str
    negated: bool  # --noconfig.a.b
    raw: str | None  # the value as typed; None for a bare boolean flag or a missing value


def _one_line(text) -> str:
    line = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return re.sub(r"^ERROR:+\s*", "", line)  # absl's prefix on some messages; ours is "error: "


def _load_problem(path: str, error: BaseException) -> str:
    """One line for a config file that cannot be loaded, with the file's line that raised."""
    if isinstance(error, ConfigError):
        return f"--config={path}: {_one_line(error)}"
    where = ""  # a SyntaxError's message already holds its place
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]
    if frames and not isinstance(error, SyntaxError):
        where = f" ({frames[-1].filename}:{frames[-1].lineno})"
    return f"--config={path}: loading the config failed: {type(error).__name__}: {_one_line(error)}{where}"


def _config_file(argv: Sequence[str], default: str) -> tuple[str, int]:
    """The config file argument and its index in argv (-1 for the default), as config_flags finds it."""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            break
        found = _CONFIG_FILE.match(arg)
        if found:
            if found.group(1) is not None:
                return found.group(1), i
            return (argv[i + 1] if i + 1 < len(argv) else ""), i
    return default, -1


def _field_type(config: ConfigDict, path: str):
    """The field's type, ConfigDict for a section, None when there is no such field."""
    node = config
    parts = path.split(".")
    for part in parts[:-1]:
        if not isinstance(node, ConfigDict) or part not in node:
            return None
        node = node[part]
    if not isinstance(node, ConfigDict) or parts[-1] not in node:
        return None
    if isinstance(node[parts[-1]], ConfigDict):
        return ConfigDict
    return node.get_type(parts[-1])


def _overrides(argv: Sequence[str], config: ConfigDict) -> list[_Override]:
    """The `--config.a.b[=v]` arguments, grouped with a value given as the next argument."""
    found = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        match = _OVERRIDE.match(arg)
        if match is None:
            i += 1
            continue
        negated, path, raw = match.group(1) is not None, match.group(2), match.group(3)
        kind = _field_type(config, path)
        end = i + 1
        if raw is None and not negated and kind is not bool and end < len(argv):
            # absl takes the next argument as the value of a non-boolean flag; for an unknown field,
            # only when it does not look like a flag.
            if kind is not None or not argv[end].startswith("-"):
                raw = argv[end]
                end += 1
        found.append(_Override(i, end, path, negated, raw))
        i = end
    return found


def _parse_problem(override: _Override, kind, error: BaseException) -> str:
    raw = override.raw
    if kind in (tuple, list):
        return (f"config.{override.path}: expected a tuple, got {raw!r}: quote each element and separate them "
                f"with commas, e.g. \"('a.jsonl','b.jsonl')\"")
    if kind in _EXPECTED:
        return f"config.{override.path}: expected {_EXPECTED[kind]}, got {raw!r}"
    message = _one_line(error)
    message = re.sub(r"^flag --\S+?: ", "", message)
    return f"config.{override.path}: {message}"


def check_overrides(argv: Sequence[str], config: ConfigDict, config_index: int = -1) -> tuple[list[str], list[int]]:
    """Every problem of the `--config.*` overrides in argv, and the argv indices of the bad ones.

    Each good-looking override is parsed on its own against a copy of `config`, as config_flags
    would parse it, so one bad value does not hide the next.
    """
    leaves = leaf_paths(config)
    problems: list[tuple[int, str]] = []
    bad: set[int] = set()
    groups: list[list[_Override]] = []  # parsed together: a tuple's repeated flags, else one override
    tuples: dict[str, list[_Override]] = {}

    def reject(override: _Override, message: str) -> None:
        problems.append((override.start, message))
        bad.update(range(override.start, override.end))

    for override in _overrides(argv, config):
        path, kind = override.path, _field_type(config, override.path)
        flag = f"--{'no' if override.negated else ''}config.{path}"
        if _sets_none(override, kind):
            continue  # applied after parsing (`none_overrides`); config_flags cannot parse it
        if kind is None:
            reject(override, unknown_field(path, leaves))
        elif kind is ConfigDict:
            fields = [p for p in leaves if p.startswith(path + ".")]
            reject(override, f"config.{path}: is a section; set its fields one by one "
                             f"(e.g. --config.{fields[0] if fields else path + '.<field>'}=...)")
        elif override.negated and kind is not bool:
            reject(override, f"config.{path}: {flag} is for boolean fields; this one is "
                             f"{getattr(kind, '__name__', kind)}: use --config.{path}=VALUE")
        elif override.raw is None and kind is not bool:
            reject(override, f"config.{path}: no value given: use --config.{path}=VALUE")
        elif 0 <= config_index and override.start < config_index:
            reject(override, f"config.{path}: {flag} comes before --config=FILE, which would replace it: "
                             f"put --config first")
        elif kind in (tuple, list):
            if path not in tuples:
                tuples[path] = []
                groups.append(tuples[path])
            tuples[path].append(override)
        else:
            groups.append([override])

    for group in groups:
        override = group[-1]
        kind = _field_type(config, override.path)
        argv_one = [argv[0], *(token for o in group for token in argv[o.start:o.end])]
        values = flags.FlagValues()
        try:
            config_flags.DEFINE_config_dict("config", copy.deepcopy(config), flag_values=values,
                                            sys_argv=argv_one, lock_config=True)
            values(argv_one)
        except Exception as e:  # noqa: BLE001  (any failure here is this override's problem)
            problems.append((group[0].start, _parse_problem(override, kind, e)))
            for o in group:
                bad.update(range(o.start, o.end))
    problems.sort(key=lambda item: item[0])
    return [message for _, message in problems], sorted(bad)


def _sets_none(override: _Override, kind) -> bool:
    """`--config.a.b=None` on a scalar field: config_flags parses it only for dataclass fields. On a
    string field only `None` itself: `none` is a name there (`model.remat_policy=none`)."""
    if override.raw is None or override.negated or kind in (None, ConfigDict, bool, tuple, list):
        return False
    return override.raw.strip() in (("None",) if kind is str else ("None", "none"))


def none_overrides(argv: Sequence[str], config: ConfigDict) -> list[_Override]:
    """The `--config.a.b=None` overrides of scalar fields: set to None after parsing (validation
    then says whether the field may be None, e.g. `rl.dual_clip` to turn dual-clip off)."""
    return [o for o in _overrides(argv, config) if _sets_none(o, _field_type(config, o.path))]


def _set_path(config: ConfigDict, path: str, value) -> None:
    *sections, name = path.split(".")
    node = config
    for section in sections:
        node = node[section]
    node[name] = value


def config_command(default_config: str | os.PathLike, run: Callable[[ConfigDict], object], *,
                   prepare: Callable[[ConfigDict], object] | None = None,
                   check_files: bool | flags.FlagHolder = True,
                   check: Callable[[ConfigDict], object] | None = None,
                   user_errors: tuple[type[BaseException], ...] = (),
                   libraries: Sequence[str] = (),
                   argv: Sequence[str] | None = None,
                   flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Parses `--config=FILE` (default `default_config`) and its overrides, validates, runs `run(config)`.

    prepare: changes the config before validation (evaluate sets `config.mode = "eval"`).
    check_files: `validate`'s check_files; a boolean flag's holder is read after parsing.
    check: a command's own preconditions (`check_filter_hard`); its ConfigError's problems are
        reported with validate's.
    user_errors: exception types from `run` reported like a UserError (exit 2, no traceback).
    libraries: the modules `run` imports (JAX, grain, orbax, ...), which the command imports there,
        after the flags are parsed, so that --help and config mistakes answer in a moment. They are
        imported before parsing only when the command line names a flag not defined yet (grain's and
        orbax's absl flags) or asks for --helpfull.
    Command-specific absl flags are defined before calling this; absl logging defaults to WARNING
    unless --verbosity is given (orbax logs every save at INFO).
    """
    argv = list(sys.argv if argv is None else argv)
    try:
        argv = flag_values.read_flags_from_files(argv, force_gnu=False)
    except flags.Error as e:
        fail([_one_line(e)])
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        print(usage(str(default_config), flag_values))
        sys.exit(0)
    if libraries and _names_undefined_flags(argv, flag_values):
        for module in libraries:
            importlib.import_module(module)
    path, index = _config_file(argv, str(default_config))
    try:
        loaded = load_config_file(path)
    except Exception as e:  # noqa: BLE001  (a broken config file is the user's to fix)
        fail([_load_problem(path, e)])
    problems, bad = check_overrides(argv, loaded, index)
    set_none = none_overrides(argv, loaded)
    dropped = set(bad) | {i for o in set_none for i in range(o.start, o.end)}
    argv = [arg for i, arg in enumerate(argv) if i not in dropped]  # what absl and config_flags parse

    config_flag = config_flags.DEFINE_config_file(
        "config", str(default_config), "Path to a config file (get_config()); override fields with "
        "--config.a.b=value.", flag_values=flag_values, lock_config=True, sys_argv=argv)

    def parse(args: list[str]) -> list[str]:
        try:
            return flag_values(args)
        except flags.Error as e:
            fail([*problems, _one_line(e)])

    def main(args: list[str]) -> None:
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments: {args[1:]}", exitcode=EXIT_USER_ERROR)
        if not flag_values["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        config = config_flag.value
        for override in set_none:
            _set_path(config, override.path, None)
        if prepare is not None:
            prepare(config)
        found = list(problems)

        def collect(step: Callable[[], object]) -> None:
            try:
                step()
            except ConfigError as e:
                found.extend(p for p in e.problems if p not in found)

        collect(lambda: validate(config, check_files=_flag_value(check_files)))
        if check is not None:
            collect(lambda: check(config))
        if found:
            fail(found)
        try:
            run(config)
        except (UserError, *user_errors) as e:
            fail(str(e).splitlines() or [type(e).__name__])
        except KeyboardInterrupt:  # Ctrl-C: the user's choice, not a failure to explain
            print("interrupted", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)

    app.run(main, argv=argv, flags_parser=parse)


def _names_undefined_flags(argv: Sequence[str], flag_values: flags.FlagValues) -> bool:
    """Whether argv holds a flag that is not defined yet (besides --config and its overrides), or
    --helpfull / --helpxml, which list every flag."""
    for arg in argv[1:]:
        if arg == "--":
            break
        if not arg.startswith("-") or _CONFIG_FILE.match(arg) or _OVERRIDE.match(arg):
            continue
        name = arg.lstrip("-").partition("=")[0]
        if name in ("helpfull", "helpxml"):
            return True
        if name not in ("undefok", "flagfile") and name not in flag_values \
                and not (name.startswith("no") and name[2:] in flag_values):
            return True
    return False


def usage(default_config: str, flag_values: flags.FlagValues = flags.FLAGS) -> str:
    """`--help`: the command's own docstring, `--config` and its overrides, and the command's flags."""
    main = sys.modules.get("__main__")
    lines = [(getattr(main, "__doc__", None) or "").strip(), "", "flags:",
             f"  --config=FILE: a config file defining get_config() (default: {_shown(default_config)})",
             "  --config.a.b=VALUE: set any field of configs/base.py, e.g. --config.train.steps=40 "
             "(`python -m rstar_jax.config --config=FILE` prints them all)"]
    by_module = flag_values.flags_by_module_dict()  # absl's own lists: read, not extended
    own = [*by_module.get(getattr(main, "__name__", "__main__"), []),
           *(by_module.get(sys.argv[0], []) if sys.argv else [])]
    for flag in sorted({f.name: f for f in own}.values(), key=lambda f: f.name):
        lines.append(f"  --{flag.name}: {flag.help} (default: {flag.default!r})")
    lines.append("  --verbosity=N: absl logging (default: warnings only); --helpfull: every absl flag")
    return "\n".join(lines).lstrip("\n")


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _flag_value(value: bool | flags.FlagHolder) -> bool:
    return bool(value.value) if isinstance(value, flags.FlagHolder) else bool(value)
