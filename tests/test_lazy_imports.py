"""The catalogue and the CLI's list/show/legs/doctor work without the plotting stack (#19 item 4)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# An import hook that makes pandas and plotly unimportable, as on a host without the plotting stack.
BLOCKER = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pandas", "plotly"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_the_blocker_blocks():
    res = _run("import pandas")
    assert res.returncode != 0 and "blocked by the test" in res.stderr


def test_registry_and_cli_catalogue_without_pandas_and_plotly():
    res = _run("import workbench.registry as r\n"
               "reg = r.load_registry()\n"
               "assert 'E1' in reg.ids() and reg.experiment('E1').analyses\n"
               "from workbench.cli import main\n"
               "for argv in (['list'], ['show', 'E4'], ['legs', 'E1', '--profile', 'tiny']):\n"
               "    assert main(argv) == 0, argv\n"
               "assert 'pandas' not in sys.modules and 'plotly' not in sys.modules\n"
               "print('ok')\n")
    assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stderr[-3000:]
    assert "E16" in res.stdout and "strict_g6" in res.stdout


def test_doctor_without_pandas_and_plotly():
    res = _run("from workbench.cli import main\nrc = main(['doctor', '--json'])\n"
               "assert 'pandas' not in sys.modules and 'plotly' not in sys.modules\nprint('rc', rc)\n")
    assert "rc " in res.stdout and "blocked by the test" not in res.stderr, res.stderr[-3000:]


def test_a_typo_in_an_analysis_name_is_still_refused_without_the_plotting_stack(tmp_path):
    import yaml
    raw = yaml.safe_load((REPO / "workbench" / "experiments.yaml").read_text())
    first = next(iter(raw["experiments"])) if "experiments" in raw else next(iter(raw))
    exps = raw["experiments"] if "experiments" in raw else raw
    exps[first]["analyses"] = ["speedup_distributon"]
    bad = tmp_path / "experiments.yaml"
    bad.write_text(yaml.safe_dump(raw))
    res = _run(f"import workbench.registry as r\ntry:\n    r.load_registry({str(bad)!r})\n"
               f"except r.RegistryError as exc:\n    print('refused:', exc)\n")
    assert "refused:" in res.stdout and "speedup_distributon" in res.stdout, res.stderr[-3000:]


def test_the_names_the_registry_reads_are_the_analysis_registry():
    from workbench import analyses, registry
    assert registry.analysis_names() == tuple(analyses.ANALYSES)
