"""Can tool code import what it is expected to? The server's start-up self-test.

Before it reports ready, the server runs one call that imports every expected module on a worker
that pre-imported nothing of them ("cold": a fresh interpreter's imports, as the `release` preset's
calls run) and one on a worker that pre-imported them ("preimported", as the `rich` preset's). A
module that tool code cannot import (not installed, or installed where the isolation hides it) is
then a start-up fact in `Info`, not a failure repeated inside every call, where it reads like the
model's own mistake. Clients that cannot ask `Info` (SandboxFusion's API) run `probe_code` as an
ordinary call and read it with `parse_probe`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

# What tool code imports in the rStar2 recipe; a server adds its `--preimport` modules.
STANDARD_MODULES = ("numpy", "sympy", "mpmath")
TIMEOUT_S = 120.0  # per self-test call: cold imports of numpy + sympy on a loaded machine, with room
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_MARKER = "rstar-self-test:"


def check_module_names(names, field: str = "preimport") -> tuple[str, ...]:
    """The names as a tuple; a ValueError names `field` and the first name that is not a module path."""
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name):
            raise ValueError(f"{field}: {name!r} is not a module name (dotted Python identifiers, e.g. 'scipy.stats')")
    return names


@dataclasses.dataclass(frozen=True)
class ImportCheck:
    module: str
    mode: str  # "cold" | "preimported"
    ok: bool
    version: str = ""  # the module's __version__, when it has one
    error: str = ""  # "<Exception>: <message>" of the failed import
    origin: str = ""  # where the server's own interpreter finds the module ("" when it does not)

    def explain(self, interpreter: str = "", *, both_modes: bool = False) -> str:
        """One line naming the module, why tool code cannot import it and where it is installed.
        both_modes: the import failed alike in both modes."""
        how = ("in a fresh interpreter or pre-imported: under either preset" if both_modes
               else "in a fresh interpreter, as cold-import calls (the release preset) do" if self.mode == "cold"
               else "on the workers that pre-import it, as the rich preset's calls do")
        where = (f"the sandbox's interpreter finds it at {self.origin}" if self.origin
                 else f"it is not installed for the sandbox's interpreter{f' {interpreter}' if interpreter else ''}")
        return f"tool code cannot import {self.module} ({how}): {self.error}; {where}"


def probe_code(modules) -> str:
    """A program that imports each module and prints one marked JSON line: module -> [ok, detail]."""
    return (
        "import importlib, json\n"
        "found = {}\n"
        f"for name in {list(modules)!r}:\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        "        found[name] = [True, str(getattr(module, '__version__', ''))]\n"
        "    except BaseException as e:\n"
        "        found[name] = [False, f'{type(e).__name__}: {e}']\n"
        f"print({_MARKER!r} + json.dumps(found))\n")


def parse_probe(stdout: str, modules, mode: str, *, failure: str = "", locate: bool = False) -> list[ImportCheck]:
    """The checks `probe_code`'s output gives; every module fails with `failure` when the program did
    not get as far as its report. locate: fill in where this interpreter (the sandbox's own) finds
    the modules tool code could not import."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith(_MARKER)), None)
    found = json.loads(line[len(_MARKER):]) if line else {}
    checks = []
    for name in modules:
        ok, detail = found.get(name, (False, failure or "the self-test call ended before it reported"))
        checks.append(ImportCheck(name, mode, bool(ok), version=detail if ok else "",
                                  error="" if ok else detail, origin=origin_of(name) if locate and not ok else ""))
    return checks


def origin_of(module: str) -> str:
    """Where this interpreter finds `module` ("" when it does not): the path a failure names."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None:
        return ""
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return spec.origin
    return next(iter(spec.submodule_search_locations or []), spec.origin or "")


def failures(checks, interpreter: str = "") -> list[str]:
    """One line per module tool code cannot import (both modes in one line when they failed alike)."""
    by_module: dict[str, list[ImportCheck]] = {}
    for c in checks:
        if not c.ok:
            by_module.setdefault(c.module, []).append(c)
    lines = []
    for module, failed in by_module.items():
        if len(failed) > 1 and len({c.error for c in failed}) == 1:
            lines.append(failed[0].explain(interpreter, both_modes=True))
        else:
            lines += [c.explain(interpreter) for c in failed]
    return lines


def summary(checks) -> str:
    """'numpy 2.1.3, sympy 1.13.3, mpmath 1.3.0' of the modules every mode imports (failures left out)."""
    by_module: dict[str, list[ImportCheck]] = {}
    for c in checks:
        by_module.setdefault(c.module, []).append(c)
    ok = [f"{m} {cs[0].version}".strip() for m, cs in by_module.items() if all(c.ok for c in cs)]
    return ", ".join(ok)
