"""Issue 19 item 3: the plugin's shape, kept so.

Every ``vllm_patch`` module stays under 400 lines; no module holds state in a module-level object
that code written after import changes (the per-engine state is an ``EngineState`` created at
install and handed to the hooks); the plugin imports nothing from the workbench; installing twice,
even after re-importing the plugin's modules, puts in no second set of patches.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

PLUGIN = Path(REPO) / "vllm_patch"
MODULES = sorted(PLUGIN.glob("*.py"))
MAX_LINES = 400

# Module-level objects written after import that are not engine state: memos of a value that is
# the same every time it is computed. (module file, name) -> why.
ALLOWED_MEMOS = {
    ("twin_gemv_kernel.py", "_SM_COUNT"): "multiprocessor count per CUDA device",
    ("twin_gemv_kernel.py", "_COUNTERS"): "the split-K kernels' counter workspace per device, allocated once",
    ("twin_cuda.py", "_EXT"): "the compiled CUDA extension, built or loaded once per process",
    ("twin_attention.py", "_EXT"): "the compiled decode-attention extension, built or loaded once per process",
    ("twin_cuda.py", "_SMS"): "multiprocessor count per CUDA device",
    ("twin_cuda.py", "_COUNTERS"): "the split-K counter workspace per device, allocated once",
    ("twin_hybrid.py", "_LAYERS"): "the custom op's handle to each live layer (a string key, as vLLM's attention "
                                   "op finds its layer by name), held weakly: a freed model leaves nothing",
}

MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "remove",
            "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"}


def test_every_plugin_module_is_under_400_lines():
    assert MODULES
    long = {p.name: n for p in MODULES
            if (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert not long, f"vllm_patch modules of {MAX_LINES} lines or more: {long}"


def _module_names(tree: ast.Module) -> dict[str, str]:
    """Names bound at module level, by kind: 'value' (assignment, def, class) or 'plugin' (an import of a
    vllm_patch module). Imports of vLLM / third-party modules are the patches' targets, not state."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = "value"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = "value"
        elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("vllm_patch")):
            for a in node.names:
                names[a.asname or a.name] = "plugin"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("vllm_patch"):
                    names[(a.asname or a.name).split(".")[0]] = "plugin"
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _local_names(fn: ast.AST) -> set[str]:
    """Parameters and names a function (or its nested functions) binds for itself."""
    out: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


def module_state_writes(source: str) -> list[tuple[str, int, str]]:
    """(name, line, how) for each write, inside a function, to a module-level object of this module
    (or to an attribute of another plugin module): ``global`` rebinding, attribute or item assignment,
    ``setattr``, augmented assignment, or a mutating method call (append, update, setdefault, ...)."""
    tree = ast.parse(source)
    names = _module_names(tree)
    found: list[tuple[str, int, str]] = []
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for fn in funcs:
        declared_global = {g for n in ast.walk(fn) if isinstance(n, ast.Global) for g in n.names}
        local = _local_names(fn) - declared_global

        def module_level(name: str | None) -> bool:
            return name is not None and name in names and name not in local

        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                found += [(g, n.lineno, "global") for g in n.names]
            targets: list[ast.AST] = []
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            elif isinstance(n, ast.Delete):
                targets = n.targets
            for t in targets:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and module_level(_root_name(t)):
                    found.append((_root_name(t), n.lineno, "assigned into"))
            if isinstance(n, ast.Call):
                f = n.func
                if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and n.args \
                        and module_level(_root_name(n.args[0])):
                    found.append((_root_name(n.args[0]), n.lineno, f.id))
                if isinstance(f, ast.Attribute) and f.attr in MUTATORS and module_level(_root_name(f.value)):
                    found.append((_root_name(f.value), n.lineno, f".{f.attr}()"))
    return found


def test_the_static_check_finds_module_state_written_after_import():
    src = textwrap.dedent("""
        from . import engine_state as es
        CACHE = {}
        class S: pass
        G = S()
        N = 0
        def a(k): CACHE[k] = 1
        def b(): G.trace = None
        def c(): CACHE.setdefault(1, 2)
        def d():
            global N
            N += 1
        def e(): es.anything = 1
        def f(): setattr(S, "x", 1)
        def fine(CACHE, G):
            CACHE[1] = 2; G.trace = 1
            local = {}; local[1] = 2
            from vllm.v1.worker import gpu_model_runner as gmr
            gmr.DraftModelProposer = S
    """)
    got = {(name, how) for name, _, how in module_state_writes(src)}
    assert got == {("CACHE", "assigned into"), ("G", "assigned into"), ("CACHE", ".setdefault()"),
                   ("N", "global"), ("es", "assigned into"), ("S", "setattr")}


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_no_module_level_state_written_after_import(path):
    writes = [(name, line, how) for name, line, how in module_state_writes(path.read_text())
              if (path.name, name) not in ALLOWED_MEMOS]
    assert not writes, (f"{path.name} writes module-level state after import (keep per-engine state on the "
                        f"EngineState apply() creates): {writes}")


def _writes_to_the_vllm_module(source: str) -> list[tuple[str, int]]:
    """(function, line) of each ``setattr(vllm, ...)`` / ``vllm.x = ...`` (``vllm`` the package itself)."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" and n.args \
                    and isinstance(n.args[0], ast.Name) and n.args[0].id == "vllm":
                out.append((fn.name, n.lineno))
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                                   and t.value.id == "vllm" for t in n.targets):
                out.append((fn.name, n.lineno))
    return out


def test_the_one_process_wide_fact_is_set_in_one_place():
    """The installed EngineState is the only process-global (vLLM gives no handle for it: see
    engine_state's docstring); it is written in exactly one function, engine_state.publish."""
    writes = {p.name: w for p in MODULES if (w := _writes_to_the_vllm_module(p.read_text()))}
    assert {name: [f for f, _ in w] for name, w in writes.items()} == {"engine_state.py": ["publish"]}


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_the_plugin_imports_nothing_from_the_workbench(path):
    bad = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            bad += [a.name for a in n.names if a.name.split(".")[0] in ("workbench", "benchmarks")]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] in (
                "workbench", "benchmarks"):
            bad.append(n.module)
    assert not bad, f"{path.name} imports {bad}"


_APPLY_TWICE = textwrap.dedent("""
    import importlib, json, sys
    import vllm_patch
    from vllm_patch import engine_patches, engine_state
    from vllm_patch.knobs import read_knobs

    def patched():
        from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct
        from vllm.v1.engine import async_llm, input_processor as ip
        from vllm.v1.sample import rejection_sampler as rs
        from vllm.v1.worker import gpu_model_runner as gmr
        from vllm.v1.worker.worker_base import WorkerBase
        R = gmr.GPUModelRunner
        objs = {"proposer": gmr.DraftModelProposer, "rejection_sample": rs.rejection_sample,
                "validate": ip.InputProcessor._validate_params, "generate": async_llm.AsyncLLM.generate,
                "ignore": ct.should_ignore_layer, "rpc": WorkerBase.twin_spec_flush_trace}
        for name in ("_gather_mm_embeddings", "_execute_mm_encoder", "_get_encoder_output_from_cache",
                     "_update_states", "_sample", "capture_model", "initialize_kv_cache", "execute_model",
                     "_model_forward", "propose_draft_token_ids", "sample_tokens"):
            objs[name] = getattr(R, name)
        return {k: id(v) for k, v in objs.items()}

    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.worker import gpu_model_runner as gmr
    before = id(rs.rejection_sample), id(gmr.GPUModelRunner._sample)
    vllm_patch.register()
    first, state = patched(), engine_state.current()
    vllm_patch.register()               # vLLM loads its plugins more than once per process
    second = patched()
    for name in list(sys.modules):      # the plugin imported afresh, then installed again
        if name.startswith("vllm_patch."):
            importlib.reload(sys.modules[name])
    importlib.reload(vllm_patch)
    vllm_patch.register()
    third = patched()
    print("APPLY " + json.dumps({
        "patched": before != (first["rejection_sample"], first["_sample"]),
        "same_twice": first == second, "same_after_reimport": first == third,
        "one_state": state is not None and sys.modules["vllm_patch.engine_state"].current() is state,
        "apply_returns_it": sys.modules["vllm_patch.engine_patches"].apply(state.knobs) is state,
        "G_is_it": sys.modules["vllm_patch.engine_patches"].G is state,
        "step_timer": state.steps is not None}))
""")


@pytest.mark.vllm
def test_applying_twice_installs_one_set_of_patches(tmp_path):
    env = {**os.environ, "VLLM_SPEC_REPORT_DIR": str(tmp_path), "VLLM_SPEC_RELAX_LOGTAU": "0.5",
           "VLLM_SPEC_STEP_TIMING": "1", "VLLM_SPEC_TRACE": "1"}
    res = subprocess.run([sys.executable, "-c", _APPLY_TWICE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    lines = [x for x in res.stdout.splitlines() if x.startswith("APPLY ")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    got = json.loads(lines[-1][len("APPLY "):])
    assert got == {"patched": True, "same_twice": True, "same_after_reimport": True, "one_state": True,
                   "apply_returns_it": True, "G_is_it": True, "step_timer": True}
    reports = list(tmp_path.glob("engine-*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["knobs"]["relax_logtau"] == 0.5


def test_the_cuda_sources_ship_with_the_package():
    """Every file of vllm_patch/csrc matches a package-data pattern: an installed plugin builds its kernels from
    the package's own copy (a server started outside the source tree has no other)."""
    import fnmatch
    import tomllib

    conf = tomllib.loads((PLUGIN.parent / "pyproject.toml").read_text())
    patterns = conf["tool"]["setuptools"]["package-data"]["vllm_patch"]
    sources = sorted((PLUGIN / "csrc").iterdir())
    assert sources and all(any(fnmatch.fnmatch(f"csrc/{f.name}", pat) for pat in patterns) for f in sources), [
        f.name for f in sources]
