"""Structure: the import graph of ``workbench`` and ``vllm_patch`` has no cycle and runs one way, down the layers.

Every module is parsed with ``ast`` (nothing is imported); an import anywhere in a module (top level or
inside a function) is an edge. A module may import modules of its own layer or of a lower one, never of a
higher one; ``vllm_patch`` (the plugin) imports nothing from ``workbench``. A new module is declared in
``LAYERS`` (the test names any that is not).

Also here: ``LLM(`` is written in one module of ``workbench`` and ``benchmarks`` (``workbench.engine``).
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("workbench", "vllm_patch")

# Lowest first. A pattern ending in ".*" covers a package's submodules.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("plugin", ("vllm_patch", "vllm_patch.*")),
    # file names and writers, prompts, knobs, formulas, the engine builder: import nothing of the workbench
    ("base", ("workbench", "workbench.runfolder", "workbench.prompts", "workbench.childproc", "workbench.knobs",
              "workbench.placement", "workbench.reaper",
              "workbench.metrics", "workbench.metrics.*", "workbench.datasets.scoring", "workbench.engine",
              "workbench.acceptance", "workbench.shm")),
    # what a run is made of: models, data sets, the catalogue, the plan, the environment, teacher forcing
    ("inputs", ("workbench.chat", "workbench.datasets", "workbench.datasets._common", "workbench.datasets.hub",
                "workbench.datasets.mathvista", "workbench.datasets.mmvet", "workbench.datasets.pid_lists",
                "workbench.datasets.stand_in", "workbench.datasets.tiny_set", "workbench.tiny", "workbench.tiny.*",
                "workbench.shapes", "workbench.registry", "workbench.registry.*", "workbench.planning",
                "workbench.groups", "workbench.envcapture", "workbench.teacher",
                "workbench.exactness", "workbench.testing", "workbench.parallel", "workbench.organism", "workbench.organism.corpus",
                "workbench.organism.corpus_drawing", "workbench.organism.corpus_templates",
                "workbench.organism.rows", "workbench.organism.evaluation",
                "workbench.organism.train", "workbench.organism.models", "workbench.datasets.organism_set",
                "workbench.grounding", "workbench.teacher_cache", "workbench.memory_plan", "workbench.checkpoints",
                "workbench.combinations")),
    # one leg = one process: engine legs, score legs, cost-ladder engines
    ("runners", ("workbench.leg", "workbench.leg.*", "workbench.score", "workbench.ladder_engine", "workbench.serve_leg",
                 "workbench.serve_server", "workbench.serve_client", "workbench.serve_requests",
                 "workbench.serve_prime", "workbench.serve_args")),
    # reading a run folder: records, legs, the cost ladder's rows and tables
    ("results", ("workbench.results", "workbench.ladder", "workbench.ladder_compare", "workbench.serving", "workbench.serving_compare", "workbench.serving_predict",
                 "workbench.serving_overtake")),
    ("plots", ("workbench.plots", "workbench.plots.*")),
    ("analyses", ("workbench.analyses", "workbench.analyses.*")),
    ("export", ("workbench.export",)),
    # preflight, the run folder, legs as processes (the runner table)
    ("protocol", ("workbench.runners", "workbench.hostruns", "workbench.preparing", "workbench.legrun", "workbench.ray_executor", "workbench.execution",
                  "workbench.protocol")),
    # what people call: the command line, the explorer, the demo, the doctor
    ("front", ("workbench.cli", "workbench.notebook_params", "workbench.widgets", "workbench.widgets.*", "workbench.demo", "workbench.doctor", "workbench.datasets.cli",
               "workbench.datasets.__main__")),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _targets(mods: dict[str, Path], current: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of ``mods`` an import statement in ``current`` loads (the deepest one each name names)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = current.split(".")
            if mods[current].name != "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != current:
            out.add(name)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import}, top-level and function-level imports alike."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(mods, name, node):
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int | None:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(module == p or (p.endswith(".*") and fnmatch.fnmatch(module, p)) for p in patterns):
            return i
    return None


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, {})):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, f"declare these modules in tests/test_import_graph.py LAYERS: {missing}"


def test_no_import_cycle():
    graph = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_imports_run_down_the_layers():
    up = []
    for module, edges in sorted(import_graph().items()):
        mine = layer_of(module)
        for target, line in sorted(edges.items()):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                up.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}) at line {line}")
    assert not up, "imports from a lower layer up:\n  " + "\n  ".join(up)


def test_the_plugin_imports_nothing_of_the_workbench():
    bad = sorted(f"{m} -> {t}" for m, edges in import_graph().items() if m.split(".")[0] == "vllm_patch"
                 for t in edges if t.split(".")[0] == "workbench")
    assert not bad, bad


def test_the_graph_sees_known_edges():
    """The parser itself: relative, aliased and function-level imports are edges."""
    graph = import_graph()
    assert "workbench.runfolder" in graph["workbench.leg.run"]      # from ..runfolder import (...)
    assert "workbench.engine" in graph["workbench.leg.run"]         # from .. import engine as engines
    assert "workbench.ladder" in graph["workbench.analyses.runtables"]  # inside a function
    assert "vllm_patch.knobs" in graph["workbench.knobs"]


def test_one_module_builds_engines():
    """``LLM(`` is written in one module of workbench/ and benchmarks/: ``workbench.engine.build``."""
    pattern = re.compile(r"\bLLM\(")
    where = sorted(str(p.relative_to(REPO)) for d in ("workbench", "benchmarks") for p in (REPO / d).rglob("*.py")
                   if pattern.search(p.read_text(encoding="utf-8")))
    assert where == ["workbench/engine.py"], where
