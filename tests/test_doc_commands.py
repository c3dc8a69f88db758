"""Every command block of the README and docs/ works as written (#38).

A ```bash block is either run by a test of the CPU suite (``RUN_BY``: the block's first line -> the tests
that run its commands, at smoke size with the same flags; each test is checked to exist) or marked as a
GPU command by ``<!-- gpu-command -->`` on the line before it. A block that is neither is flagged.

Every command of every block, marked or not, is parsed here without starting anything:

- ``workbench ...`` with the workbench's own parser; ``run`` / ``legs`` then planned (pure: the
  experiment, the profile, every ``-p`` key and value against the knob table, profile rules), roles and
  data sets of ``--model-path`` / ``--data-source`` named, the tiny models' folders by their role names;
- ``python -m MODULE ...`` and ``python SCRIPT.py ...`` with that program's argparse parser (its ``main``
  is called with argument parsing stopped right after the parse);
- ``vllm serve`` / ``vllm bench serve``: the subcommand, JSON arguments and model folders (vLLM's own
  parser costs an ``import vllm``; ``tests/test_serve.py`` runs those blocks as written);
- ``make TARGET`` against the Makefile, ``pytest`` files and markers, files a command opens;
- ``NAME=VALUE`` prefixes: a ``VLLM_SPEC_*`` / ``WORKBENCH_*`` name the code reads.

``test_a_planted_broken_command_is_caught`` plants bad commands in a copy of the pages.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_MARK = "<!-- gpu-command -->"
BLOCK_RE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)

# (page, the block's first line) -> the tests that run its commands on the CPU
RUN_BY: dict[tuple[str, str], list[str]] = {
    ("README.md", "make demo"): ["tests/test_demo.py::test_demo_report_quotes_the_run_folder",
                                 "tests/test_cli_run.py::test_workbench_run_e1_tiny_makes_a_complete_run_folder_without_a_browser"],
    ("README.md", "python -m workbench.serve_leg"): ["tests/test_serve.py::test_the_by_hand_commands_run_as_written"],
    ("docs/serving.md", "python -m workbench.serve_leg"): [
        "tests/test_serve.py::test_the_by_hand_commands_run_as_written"],
    ("docs/serving.md", "workbench run E17 --profile tiny --smoke"): [
        "tests/test_serving.py::test_spec_counters_equal_the_per_request_trace"],
    ("docs/experiments.md", ".venv/bin/python -m workbench.leg"): [
        "tests/test_engine_exact.py::test_bfloat16_int4_twin_match_rate_and_divergence_classes"],
    ("docs/experiments.md", "workbench list"): [
        "tests/test_cli.py::test_list_shows_every_experiment", "tests/test_cli.py::test_show_and_legs",
        "tests/test_cli_run.py::test_workbench_run_e1_tiny_makes_a_complete_run_folder_without_a_browser",
        "tests/test_cli_run.py::test_kill_9_of_workbench_run_leaves_no_leg_and_the_resume_runs_alone",
        "tests/test_export.py::test_export_run_regenerates_from_records",
        "tests/test_export.py::test_workbench_export_png_svg_as_documented",
        "tests/test_ray_engine.py::test_workbench_run_e2_tiny_through_ray_is_complete_exact_and_on_one_placement_per_bracket"],
    ("docs/experiments.md", "workbench run E17 --profile tiny --smoke"): [
        "tests/test_serving.py::test_spec_counters_equal_the_per_request_trace",
        "tests/test_serving_synthetic.py::test_one_server_per_leg_swept_over_the_concurrencies"],
    ("docs/experiments.md", "workbench run E16 --profile tiny"): [
        "tests/test_cost_ladder.py::test_workbench_run_e16_tiny_makes_a_complete_run_folder"],
    ("docs/experiments.md", ".venv/bin/jupyter lab notebooks/explorer.ipynb"): [
        "tests/test_explorer_notebook.py::test_explorer_notebook_under_papermill"],
    ("docs/organism.md", "python -m workbench.organism.train --variant instruct"): [
        "tests/test_organism_train.py::test_the_command_line_sets_recipe_fields",
        "tests/test_organism_profile.py::test_e1_under_the_organism_profile",
        "tests/test_organism_profile.py::test_e14_under_the_organism_resolves_each_variants_models",
        "tests/test_experiments_smoke.py::test_experiment_smoke"],
    ("docs/serving.md", "python -m workbench.serving_compare results/E18/20261207T235605Z-869510a1 --against"): [
        "tests/test_serving_compare.py::"
        "test_the_documented_command_prints_each_cell_and_a_folder_without_serving_legs_is_refused"],
    ("docs/ray.md", "python -m workbench.ladder_compare results/E16/20261205T190454Z-3310b937 --against"): [
        "tests/test_ladder_compare.py::test_the_documented_command_prints_the_table"],
    ("docs/ray.md", "python -m workbench.ladder_compare --series results/E16/20261205T21????Z-*"): [
        "tests/test_ladder_compare.py::test_the_documented_series_is_what_the_command_prints"],
    ("docs/benchmarks.md", "python benchmarks/idle_acceptance.py --out results/idle-acceptance/<id>"): [
        "tests/test_idle_acceptance.py::test_skipped_passes_are_counted_drafting_resumes_and_outputs_stay_vanillas"],
    ("docs/benchmarks.md", "python benchmarks/draft_profile.py --size tiny --out /tmp/draft-profile"): [
        "tests/test_draft_profile.py::test_the_cpu_rehearsal_splits_real_decode_steps"],
    ("docs/benchmarks.md", "python benchmarks/int4_cuda_sass.py --rev 9a4042f --rev worktree"): [
        "tests/test_int4_cuda_sass.py::test_two_revisions_side_by_side_and_the_documented_command"],
    ("docs/benchmarks.md", "python benchmarks/decode_attention.py --dry-run"): [
        "tests/test_twin_attention.py::test_the_benchmarks_dry_run_checks_the_arithmetic"],
    ("docs/tensor-parallel.md", "workbench run E1 --profile tiny -p tensor_parallel_size=2"): [
        "tests/test_tensor_parallel.py::test_e1_at_tp2_is_exact_and_accepts_what_tp1_accepts",
        "tests/test_tensor_parallel_legs.py::test_int4_twin_on_sharded_weights"],
}


@dataclass
class Block:
    page: str      # relative to the repository
    line: int      # of the opening fence
    text: str
    gpu: bool

    @property
    def first(self) -> str:
        return self.text.splitlines()[0].strip()

    def commands(self) -> list[str]:
        """Logical command lines: continuations joined, comments and a trailing ``&`` dropped."""
        out = []
        for raw in self.text.replace("\\\n", " ").splitlines():
            words = shlex.split(_placeholders(raw), comments=True)
            if words and words[-1] == "&":
                words = words[:-1]
            if words:
                out.append(words)
        return out


def _placeholders(text: str) -> str:
    return text.replace("<run id>", "20260101T000000Z-00000000")


def doc_blocks(root: Path) -> list[Block]:
    blocks = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        for m in BLOCK_RE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            blocks.append(Block(str(page.relative_to(root)), text[:m.start()].count("\n") + 1, m.group(1),
                                before == GPU_MARK))
    return blocks


# --- parsing one command -----------------------------------------------------------------------

class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _parse_only():
    """``ArgumentParser.parse_args`` returns nothing: it parses, then stops the program there."""
    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _argparse_problem(main, argv: list[str], what: str) -> str | None:
    err = io.StringIO()
    try:
        with _parse_only(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except _Parsed:
        return None
    except SystemExit as exc:
        if exc.code in (0, None):
            return None  # --help
        return f"{what}: {err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else exc}"
    return f"{what}: the program ran past its argument parsing"


@functools.lru_cache(maxsize=None)
def _known_env(root: Path) -> set[str]:
    names = set()
    for folder in ("vllm_patch", "workbench", "tests", "benchmarks", "scripts"):
        for f in (root / folder).rglob("*.py"):
            if f.name == Path(__file__).name:  # the names planted below
                continue
            names |= set(re.findall(r"\b((?:VLLM_SPEC|WORKBENCH)_[A-Z0-9_]+)", f.read_text()))
    return names


def _tiny_path_problem(path: str, root: Path) -> str | None:
    from workbench.tiny import ROLES

    parts = Path(path).parts
    if parts[:2] == ("models", "tiny") and (len(parts) != 3 or parts[2] not in ROLES):
        return f"{path}: not a tiny model (models/tiny/<{'|'.join(ROLES)}>)"
    return None


def _workbench_problems(argv: list[str], root: Path) -> list[str]:
    from workbench import cli
    from workbench.planning import plan
    from workbench.registry import DATASETS, RegistryError, load_registry

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.build_parser().parse_args(argv)
    except SystemExit:
        return [f"workbench: {err.getvalue().strip().splitlines()[-1]}"]
    problems = []
    try:
        reg = load_registry()
        if args.command == "show":
            reg.experiment(args.experiment)
        if args.command in ("run", "legs") and not getattr(args, "resume", None):
            plan(args.experiment, args.profile, args.param, cli._smoke_flag(args), registry=reg)
        elif args.command == "run":
            reg.experiment(args.experiment)
        if args.command == "run":
            for role, path in cli._pairs(args.model_path, "--model-path").items():
                problems += filter(None, [_tiny_path_problem(path, root)])
            bad = sorted(set(cli._pairs(args.data_source, "--data-source")) - set(DATASETS))
            if bad:
                problems.append(f"--data-source: unknown data set(s) {bad}")
        if hasattr(args, "formats"):
            from workbench.export import parse_formats
            parse_formats(args.formats)
    except (RegistryError, cli.CliError, ValueError) as exc:
        problems.append(f"workbench {args.command}: {exc}")
    return problems


def _python_problems(argv: list[str], root: Path) -> list[str]:
    if argv[:3] == ["-m", "workbench.serve_leg", "--dataset"]:  # a mode before its parser: arity and input
        if len(argv) < 5 or not (root / argv[3]).is_file():
            return [f"python -m workbench.serve_leg --dataset PROMPTS.jsonl OUT.jsonl: got {argv[2:]}"]
        from workbench.serve_leg import _dataset_main
        what = "python -m workbench.serve_leg --dataset"
        return list(filter(None, [_argparse_problem(_dataset_main, argv[3:], what)]))
    if argv[:1] == ["-m"] and len(argv) > 1:
        mod = importlib.import_module(argv[1])
        if not hasattr(mod, "main"):
            return [f"python -m {argv[1]}: the module has no main(argv)"]
        return list(filter(None, [_argparse_problem(mod.main, argv[2:], f"python -m {argv[1]}")]))
    script = root / argv[0]
    if not script.is_file():
        return [f"python {argv[0]}: no such script"]
    spec = importlib.util.spec_from_file_location(f"_doc_{script.stem}", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(filter(None, [_argparse_problem(mod.main, argv[1:], f"python {argv[0]}")]))


def _vllm_problems(argv: list[str], root: Path) -> list[str]:
    if argv[:1] == ["serve"]:
        rest, model = argv[1:], argv[1] if len(argv) > 1 else ""
    elif argv[:2] == ["bench", "serve"]:
        rest, model = argv[2:], None
    else:
        return [f"vllm {' '.join(argv[:2])}: only `vllm serve` and `vllm bench serve` are documented"]
    problems = []
    if model is not None and not (root / model).is_dir() and model.startswith("models/"):
        problems.append(f"vllm serve: {model} is not a model folder of the project")
    for flag, value in zip(rest, rest[1:]):
        if flag in ("--speculative-config", "--limit-mm-per-prompt"):
            try:
                data = json.loads(value)
            except ValueError as exc:
                problems.append(f"vllm {flag}: not JSON ({exc})")
                continue
            if flag == "--speculative-config":
                problems += filter(None, [_tiny_path_problem(str(data.get("model", "")), root)])
        if flag in ("--model", "--dataset-path") and value.startswith("models/"):
            problems += filter(None, [_tiny_path_problem(value, root)])
    return problems


def command_problems(words: list[str], root: Path) -> list[str]:
    """Why one command (shell words) does not work as written; empty: it parses."""
    problems = []
    known = _known_env(root)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name = words.pop(0).split("=", 1)[0]
        if name.startswith(("VLLM_SPEC_", "WORKBENCH_")) and name not in known:
            problems.append(f"{name}: no such variable (none of the project's code reads it)")
    if not words:
        return problems
    prog, argv = words[0], words[1:]
    if prog == "workbench":
        problems += _workbench_problems(argv, root)
    elif prog in ("python", "python3", ".venv/bin/python"):
        problems += _python_problems(argv, root)
    elif prog == "vllm":
        problems += _vllm_problems(argv, root)
    elif prog == "make":
        targets = set(re.findall(r"^([\w-]+):", (root / "Makefile").read_text(), re.M))
        problems += [f"make {t}: no such target" for t in argv if t not in targets]
    elif prog == "pytest":
        markers = set(re.findall(r'"(\w+):', (root / "pyproject.toml").read_text()))
        for a, b in zip(argv, argv[1:] + [""]):
            if a == "-m" and b not in markers:
                problems.append(f"pytest -m {b}: no such marker")
        problems += [f"pytest: no file {a}" for a in argv if a.endswith(".py") and not (root / a).is_file()]
    elif prog == ".venv/bin/jupyter":
        problems += [f"jupyter: no file {a}" for a in argv if a.endswith(".ipynb") and not (root / a).is_file()]
    else:
        problems.append(f"{prog}: not a command this test knows how to check")
    return problems


def block_problems(root: Path, run_by: dict[tuple[str, str], list[str]] = RUN_BY) -> list[str]:
    """Every problem of every command block under ``root``, each naming its page and line."""
    problems = []
    for b in doc_blocks(root):
        where = f"{b.page}:{b.line}"
        tests = [t for (page, first), t in run_by.items() if page == b.page and b.first.startswith(first)]
        if not b.gpu and not tests:
            problems.append(f"{where}: no test runs this block and it is not marked {GPU_MARK} "
                            f"(add it to RUN_BY in tests/test_doc_commands.py): {b.first}")
        for words in b.commands():
            problems += [f"{where}: {p}" for p in command_problems(list(words), root)]
    return problems


def _test_exists(node: str) -> bool:
    file, _, name = node.partition("::")
    path = REPO / file
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


# --- the tests ---------------------------------------------------------------------------------

def test_every_documented_command_block_is_run_or_marked_and_parses(tiny_models):
    problems = block_problems(REPO)
    assert not problems, "\n".join(problems)
    blocks = doc_blocks(REPO)
    assert len(blocks) >= 15 and any(b.gpu for b in blocks)
    stale = sorted(k for k in RUN_BY if not any(b.page == k[0] and b.first.startswith(k[1]) for b in blocks))
    assert not stale, f"RUN_BY names blocks no page has: {stale}"
    missing = sorted(t for tests in RUN_BY.values() for t in tests if not _test_exists(t))
    assert not missing, f"RUN_BY names tests that do not exist: {missing}"


@pytest.fixture
def pages(tmp_path, tiny_models) -> Path:
    """A copy of the repository's pages, with the files their commands name reachable."""
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for p in (REPO / "docs").glob("*.md"):
        shutil.copy(p, tmp_path / "docs" / p.name)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    for name in ("vllm_patch", "workbench", "tests", "benchmarks", "scripts", "notebooks", "models", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    assert block_problems(tmp_path) == []
    return tmp_path


@pytest.mark.parametrize("page, old, new, message", [
    ("docs/experiments.md", "workbench run E1 --profile tiny --formats", "workbench run E1 --profle tiny --formats",
     "unrecognized arguments: --profle"),
    ("docs/experiments.md", "-p gamma=4,6", "-p gama=4,6", "unknown parameter 'gama'"),
    ("docs/experiments.md", "workbench show E4", "workbench show E99", "E99"),
    ("docs/organism.md", "--profile organism --smoke -p max_tokens=224", "--profile organsim --smoke",
     "organsim"),
    ("docs/tensor-parallel.md", "--gamma 3 \\", "--gamma 3 --tensor-paralel-size 2 \\", "--tensor-paralel-size 2"),
    ("docs/serving.md", '"model": "models/tiny/twin-dequant"', '"model": "models/tiny/twin-dq"',
     "models/tiny/twin-dq: not a tiny model"),
    ("README.md", "VLLM_SPEC_TRACE=1 VLLM_CPU", "VLLM_SPEC_TRAC=1 VLLM_CPU", "VLLM_SPEC_TRAC: no such variable"),
    ("README.md", "make test ", "make tests ", "make tests: no such target"),
])
def test_a_planted_broken_command_is_caught(pages, page, old, new, message):
    path = pages / page
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    problems = block_problems(pages)
    assert any(message in p and p.startswith(f"{page}:") for p in problems), problems


def test_a_block_no_test_runs_is_flagged_unless_marked(pages):
    path = pages / "docs" / "install.md"
    path.write_text(path.read_text() + "\n```bash\nworkbench run E1 --profile tiny --full\n```\n")
    (problem,) = block_problems(pages)
    assert problem.startswith("docs/install.md:") and "no test runs this block" in problem
    path.write_text(path.read_text().replace("\n```bash\nworkbench run E1 --profile tiny --full",
                                             f"\n{GPU_MARK}\n```bash\nworkbench run E1 --profile tiny --full"))
    assert block_problems(pages) == []
