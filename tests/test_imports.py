"""The package's import graph points one way (DESIGN.md), deferred imports included.

Every `import` in every module under rstar_jax/ and sandbox_service/ is read from the source (also
those inside functions), mapped to the package it reaches, and checked against what DESIGN allows:
commands -> `app/` -> (`train/`, `evaluation/`, `engine/`, `rollout/`) -> (`rl/`, `model/`, `agent/`,
`data/`, `parallel/`). `config/` is imported by `app/` and the commands only, and reaches the libraries
only through their jax-free settings modules (the types and enums it validates against);
`rl/` and `model/` import no other layer; `rollout/` (the client side) knows the agent protocol and
the sandbox, not the engine, the model or an optimizer; `engine/` (the serving side) implements the
rollout's generator protocol and knows nothing else of it; `sandbox_service` stands alone.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = {"launch", "evaluate", "serve", "filter_hard", "aot"}  # and `python -m rstar_jax.config`
BASE = {"model", "parallel", "rl", "agent", "data"}
# What each node may import (besides itself). "rstar_jax" is the root package (its version string).
ALLOWED = {
    "errors": set(),
    "lazy": set(),
    "rstar_jax": set(),
    "config": {"errors", "agent", "data", "engine", "model", "rl", "rollout", "train"},
    "model": {"errors", "lazy"},
    "parallel": {"errors", "lazy", "model"},
    "rl": {"errors", "lazy"},
    "agent": {"errors", "sandbox_service"},
    "data": {"errors", "lazy", "agent"},
    "rollout": {"errors", "rstar_jax", "agent", "sandbox_service"},
    "engine": {"errors", "rstar_jax", "model", "rollout"},
    "evaluation": {"errors", "agent", "data", "rollout"},
    "train": {"errors", "engine", "rollout"} | BASE,
    "app": {"errors", "rstar_jax", "config", "sandbox_service", "train", "evaluation", "engine", "rollout"} | BASE,
    "analysis": {"errors", "rollout", "train"} | BASE,
    "sandbox_service": set(),
    **{command: {"errors", "rstar_jax", "config", "app", "parallel"} for command in COMMANDS},
}
ALLOWED["config.__main__"] = {"errors", "config"}
# Edges allowed between two nodes only through these modules.
ONLY_THROUGH = {
    ("engine", "rollout"): {"rstar_jax.rollout.protocol"},
    ("config", "agent"): {"rstar_jax.agent.conversation", "rstar_jax.agent.reward", "rstar_jax.agent.template"},
    ("config", "data"): {"rstar_jax.data.synthetic"},
    ("config", "engine"): {"rstar_jax.engine.settings", "rstar_jax.engine.weight_transfer"},
    ("config", "model"): {"rstar_jax.model.config"},
    ("config", "rl"): {"rstar_jax.rl.roc", "rstar_jax.rl.settings"},
    ("config", "rollout"): {"rstar_jax.rollout.loop", "rstar_jax.rollout.scheduler", "rstar_jax.rollout.tool_env"},
    ("config", "train"): {"rstar_jax.train.settings", "rstar_jax.train.run_files"},
}


SUBMODULES = {p.stem for p in (ROOT / "rstar_jax").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def _node(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "sandbox_service":
        return "sandbox_service"
    if parts[0] != "rstar_jax":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in SUBMODULES else "rstar_jax"


def _source_node(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    node = _node(".".join(parts))
    if parts[0] == "rstar_jax" and parts[-1] == "__main__":
        return f"{node}.__main__"  # `python -m rstar_jax.<package>`: a command over its package
    return node


def _imports(path: pathlib.Path, package: str | None = None):
    """(line, imported module) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    if package is None:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:  # `from rstar_jax import model` names a subpackage
                if base in ("rstar_jax", "sandbox_service"):
                    yield node.lineno, f"{base}.{alias.name}"


def _graph():
    edges: dict[tuple[str, str], list[str]] = {}
    modules: list[tuple[str, str, str]] = []
    for top in ("rstar_jax", "sandbox_service"):
        for path in sorted((ROOT / top).rglob("*.py")):
            source = _source_node(path)
            for line, module in _imports(path):
                target = _node(module)
                if target is None or target == source or (module == "rstar_jax" and target == "rstar_jax"):
                    continue
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                edges.setdefault((source, target), []).append(where)
                modules.append((source, module, where))
    return edges, modules


def test_imports_follow_the_allowed_directions():
    edges, modules = _graph()
    assert edges, "no imports found: the test reads the wrong tree"
    bad = [f"{source} -> {target}: {wheres[0]}" for (source, target), wheres in sorted(edges.items())
           if target not in ALLOWED.get(source, set())]
    bad += [f"{source} -> {module}: {where}" for source, module, where in modules
            if (source, _node(module)) in ONLY_THROUGH and module not in ONLY_THROUGH[(source, _node(module))]]
    assert not bad, "imports against DESIGN's direction:\n" + "\n".join(bad)


def test_the_package_graph_has_no_cycle():
    edges, _ = _graph()
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(
                    edges[(a, b)][0] for a, b in zip(cycle, cycle[1:])))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from rstar_jax.app import builders\n"
                      "    import sandbox_service.client\n    from . import loop\n    from rstar_jax import serve\n")
    found = [module for _, module in _imports(source, package="rstar_jax.rollout")]
    assert found == ["os", "rstar_jax.app", "sandbox_service.client", "rstar_jax.rollout", "rstar_jax",
                     "rstar_jax.serve"]
    assert [_node(m) for m in found] == [None, "app", "sandbox_service", "rollout", "rstar_jax", "serve"]


@pytest.mark.parametrize("command", ["launch", "evaluate", "serve", "filter_hard", "config/__main__"])
def test_commands_are_thin_entry_points(command):
    """A command parses, validates and calls the library; the work lives in the packages."""
    source = (ROOT / "rstar_jax" / f"{command}.py").read_text()
    assert len(source.splitlines()) <= 80
    tree = ast.parse(source)
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(functions) <= 3 and not any(isinstance(n, ast.ClassDef) for n in tree.body)


# Below the composition layer the libraries take typed settings; only these read a ConfigDict.
READS_CONFIG = {"config", "app", *COMMANDS, "config.__main__"}


def _config_sections() -> set[str]:
    """The schema's sections (`rl`, `rollout`, ...): a typed settings object may well have a `seed`."""
    import ml_collections

    from rstar_jax.config import base_config

    return {key for key, value in base_config().items() if isinstance(value, ml_collections.ConfigDict)}


def _config_reads(path: pathlib.Path, sections: set[str]):
    """(line, what) for each place the module reads a ConfigDict: `ml_collections` imported, or a
    config section read off a name called `config` / `cfg` / `c`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "ml_collections" or n.startswith("ml_collections.") for n in names):
                yield node.lineno, "imports ml_collections"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("config", "cfg", "c") and node.attr in sections:
            yield node.lineno, f"reads {node.value.id}.{node.attr}"
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id in ("config", "cfg", "c") and isinstance(node.slice, ast.Constant) \
                and node.slice.value in sections:
            yield node.lineno, f"reads {node.value.id}[{node.slice.value!r}]"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("from_config", "for_sft"):
            yield node.lineno, f"defines {node.name}"



def test_no_module_below_the_composition_layer_reads_a_config():
    sections = _config_sections()
    found = []
    for top in ("rstar_jax", "sandbox_service"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if _source_node(path) in READS_CONFIG:
                continue
            found += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in _config_reads(path, sections)]
    assert not found, "a ConfigDict read below app/ (resolve it in rstar_jax.config.resolve):\n" + "\n".join(found)


def test_the_config_read_checker_can_fail(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import ml_collections\n\ndef f(config, cfg):\n    return config.rl.clip_low, cfg.sandbox, config.seed\n"
                      "\ndef from_config(c):\n    return c['rl']\n")
    assert sorted(what for _, what in _config_reads(source, {"rl", "sandbox"})) == \
        ["defines from_config", "imports ml_collections", "reads c['rl']", "reads cfg.sandbox", "reads config.rl"]
