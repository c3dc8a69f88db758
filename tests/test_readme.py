"""The README and docs/ agree with the run folders they name.

- every run folder named (``results/<experiment>/<run id>``) exists;
- every embedded figure exists and lies inside a run folder; a speedup-curve SVG's legend names
  exactly the cells of its folder's ``tables/cost_ratio.csv``, each with its c;
- a table marked ``<!-- table: cost_ratio RUN -->`` is checked cell by cell against
  ``RUN/tables/cost_ratio.csv`` (within the rounding printed); one marked ``<!-- table: ladder RUN -->``
  must be the table ``python -m workbench.ladder RUN`` prints from the folder's raw rows; one marked
  ``<!-- table: serving -->`` (each row links its own run folder, or says "same run") against each
  folder's ``tables/serving_speedup.csv`` and ``serving_legs.csv``;
- the demo block equals ``workbench.demo.report`` of the E1 run it names (a line ending in ``...`` is
  a prefix);
- the knob table names every leg knob with its leg default, option, engine variable and CPU rule;
- every relative link resolves to a file or folder of the repository, and its #anchor to a heading.

No engine starts; only pandas.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS, REPO / "results" / "README.md"]

RUN_RE = re.compile(r"results/([A-Za-z0-9_-]+)/(\d{8}T\d{6}Z-[A-Za-z0-9-]+)")
MARK_RE = re.compile(r"<!-- table: (\w+)(?: (\S+))? -->")
IMG_RE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
LINK_RE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _table_after(text: str, pos: int) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the markdown table that starts on the line after ``pos``."""
    lines = text[pos:].splitlines()[1:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert len(rows) >= 3, f"no table after the marker at {pos}"
    return rows[0], [r for r in rows[2:]]


def _close(text: str, value) -> bool:
    """``text`` (e.g. '0.53', '–') is ``value`` as printed: within half a unit of the last digit."""
    if text in ("–", "-", ""):
        return value is None or (isinstance(value, float) and math.isnan(value))
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - float(value)) <= 0.5 * 10 ** -decimals + 1e-9


# README worked-example columns -> cost_ratio.csv columns
RATIO_COLUMNS = {"verify ms": "verify_ms", "propose/γ ms": "propose_per_token_ms", "c": "c",
                 "S(1,γ,c)": "S_pred_alpha1", "measured S at α=1": "S_measured_alpha1", "decode ms": "decode_ms",
                 "single-token step ms": "single_step_ms",
                 "measured S at α=1, decode only": "S_measured_decode_alpha1"}


def check_cost_ratio_table(header: list[str], rows: list[list[str]], run: Path) -> list[str]:
    """Disagreements between a README table and ``run/tables/cost_ratio.csv`` (empty: they agree)."""
    csv = pd.read_csv(run / "tables" / "cost_ratio.csv")
    if "propose_per_token_ms" not in csv and "draft_forward_ms" in csv:  # folders written before issue 18
        csv = csv.rename(columns={"draft_forward_ms": "propose_per_token_ms"})
    col = {h: i for i, h in enumerate(header)}
    for key in ("size", "batch", "γ", "drafter graphs"):
        assert key in col, f"worked-example table lacks column {key!r}"
    problems = []
    for r in rows:
        graphs = {"on": True, "off": False}[r[col["drafter graphs"]]]
        hit = csv[(csv["size"] == r[col["size"]]) & (csv["batch"] == int(r[col["batch"]]))
                  & (csv["gamma"] == int(r[col["γ"]])) & (csv["draft_graphs"].astype(bool) == graphs)]
        if len(hit) != 1:
            problems.append(f"row {r[:4]}: {len(hit)} rows in {run}/tables/cost_ratio.csv")
            continue
        row = hit.iloc[0]
        for h, c in RATIO_COLUMNS.items():
            if h in col and not _close(r[col[h]], row.get(c)):
                problems.append(f"row {r[:4]} column {h!r}: README {r[col[h]]}, cost_ratio.csv {row.get(c)}")
    return problems


# columns of a `speedup_model` table -> speedup_model.csv columns (rows keyed by the `leg` column)
MODEL_COLUMNS = {"acceptance": "acceptance_rate", "c": "c", "predicted, decode only": "predicted_speedup",
                 "predicted with prefill": "predicted_with_prefill", "measured": "measured_speedup"}


def check_speedup_model_table(header: list[str], rows: list[list[str]], run: Path) -> list[str]:
    """Disagreements between a README table and ``run/tables/speedup_model.csv`` (empty: they agree)."""
    csv = pd.read_csv(run / "tables" / "speedup_model.csv").set_index("leg")
    col = {h: i for i, h in enumerate(header)}
    assert "leg" in col and set(MODEL_COLUMNS) & set(col), f"speedup_model table lacks leg or value columns: {header}"
    problems = []
    for r in rows:
        leg = r[col["leg"]]
        if leg not in csv.index:
            problems.append(f"leg {leg!r} not in {run}/tables/speedup_model.csv")
            continue
        for h, c in MODEL_COLUMNS.items():
            if h in col and not _close(r[col[h]], csv.loc[leg, c]):
                problems.append(f"leg {leg} column {h!r}: README {r[col[h]]}, speedup_model.csv {csv.loc[leg, c]}")
    return problems


SPEEDUP_CELL = re.compile(r"^\**([0-9.]+)×\**(?: \(([0-9.]+)–([0-9.]+)\))?$")
TTFT_CELL = re.compile(r"^([0-9.]+) ms(?: \(vanilla ([0-9.]+)(?:–([0-9.]+))?)?")


def check_serving_table(header: list[str], rows: list[list[str]], run: Path | None = None) -> list[str]:
    """Disagreements between a serving table and the run folders its rows link (empty: they agree).

    Columns: the first names the setup and links its run folder (or says "same run": the row above's);
    ``leg``; ``c N``: the leg's TPOT speedup at concurrency N (``tables/serving_speedup.csv``), in brackets its
    interval over requests (``tpot_speedup_ci_lo``–``_hi``) where the cell gives one; ``TTFT at c 1``:
    the leg's median TTFT at concurrency 1 in ms, and in brackets the vanilla legs' (``serving_legs.csv``)."""
    col = {h: i for i, h in enumerate(header)}
    assert "leg" in col and any(h.startswith("c ") for h in col), f"serving table lacks leg or c columns: {header}"
    problems, folder = [], None
    for r in rows:
        m = RUN_RE.search(" | ".join(r))
        if m:
            folder = REPO / m.group(0)
        elif "same run" not in r or folder is None:
            problems.append(f"row {r[0]!r} names no run folder")
            continue
        leg = r[col["leg"]].strip("`")
        speed = pd.read_csv(folder / "tables" / "serving_speedup.csv")
        speed = speed[speed["leg"] == leg]
        if speed.empty:
            problems.append(f"leg {leg!r} not in {folder}/tables/serving_speedup.csv")
            continue
        for h, i in col.items():
            if not h.startswith("c "):
                continue
            cell, hit = SPEEDUP_CELL.match(r[i]), speed[speed["concurrency"] == int(h[2:])]
            if cell is None or len(hit) != 1 or not _close(cell.group(1), hit["tpot_speedup"].iloc[0]):
                got = hit["tpot_speedup"].tolist()
                problems.append(f"{leg} {h}: table {r[i]!r}, serving_speedup.csv {got}")
            elif cell.group(2) and not all(_close(cell.group(k), hit[f"tpot_speedup_ci_{e}"].iloc[0])
                                           for k, e in ((2, "lo"), (3, "hi"))):
                ci = hit[["tpot_speedup_ci_lo", "tpot_speedup_ci_hi"]].iloc[0].tolist()
                problems.append(f"{leg} {h}: interval in {r[i]!r}, serving_speedup.csv {ci}")
        if "TTFT at c 1" in col:
            problems += _ttft_problems(r[col["TTFT at c 1"]], folder, leg)
    return problems


def _ttft_problems(cell: str, folder: Path, leg: str) -> list[str]:
    m = TTFT_CELL.match(cell)
    if m is None:
        return [f"{leg}: TTFT cell {cell!r} is not 'N ms (vanilla A–B ...'"]
    legs = pd.read_csv(folder / "tables" / "serving_legs.csv")
    at1 = legs[legs["concurrency"] == 1].set_index("leg")["ttft_ms_median"]
    problems = [] if _close(m.group(1), at1.get(leg)) else [f"{leg}: TTFT {m.group(1)} ms, the folder {at1.get(leg)}"]
    if m.group(2):
        vanilla = at1[[name.startswith("vanilla") for name in at1.index]]
        lo, hi = m.group(2), m.group(3) or m.group(2)
        if not (_close(lo, vanilla.min()) and _close(hi, vanilla.max())):
            problems.append(f"{leg}: vanilla TTFT {lo}–{hi} ms, the folder {sorted(vanilla.round(2))}")
    return problems


CHECKERS = {"cost_ratio": check_cost_ratio_table, "speedup_model": check_speedup_model_table,
            "serving": check_serving_table}


def _marked_tables():
    for page in PAGES:
        text = page.read_text()
        for m in MARK_RE.finditer(text):
            yield page, m.group(1), REPO / m.group(2) if m.group(2) else None, _table_after(text, m.start())


def _pages_text():
    return {p: p.read_text() for p in PAGES}


def test_named_run_folders_exist():
    missing = [f"{_rel(p)}: {m.group(0)}" for p, t in _pages_text().items() for m in RUN_RE.finditer(t)
               if not (REPO / m.group(0)).is_dir()]
    assert not missing, missing
    assert RUN_RE.search(README.read_text())


def test_relative_links_resolve():
    bad = []
    for page, text in _pages_text().items():
        for target in LINK_RE.findall(text) + IMG_RE.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or REPO not in path.parents:
                bad.append(f"{_rel(page)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                bad.append(f"{_rel(page)}: {target} (no such heading)")
    assert not bad, bad


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page."""
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def _figures():
    for page, text in _pages_text().items():
        for target in IMG_RE.findall(text):
            yield page, (page.parent / target).resolve()


def test_figures_lie_in_the_run_folder_they_name():
    figs = list(_figures())
    assert any(p == README for p, _ in figs), "the README embeds no figure"
    for page, fig in figs:
        assert fig.is_file(), f"{_rel(page)}: {fig} missing"
        m = RUN_RE.search(str(fig.relative_to(REPO)))
        assert m and fig.parent.name == "figures" and fig.parent.parent == REPO / m.group(0), \
            f"{_rel(page)}: {fig} is not in a run folder's figures/"
        assert m.group(0) in page.read_text().replace(str(fig.relative_to(REPO)), ""), \
            f"{_rel(page)}: the run folder of {fig.name} ({m.group(0)}) is not named in the text"


def svg_legend_cells(svg: Path) -> set[tuple[str, int, int, bool, str]]:
    """The cells a speedup-curve SVG draws, from its legend: (size, batch, gamma, graphs, c)."""
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg.read_text())
    cells = set()
    for t in texts:
        m = re.fullmatch(r"(.+) b=(\d+) γ=(\d+) (graphs|eager), c=([0-9.]+)", t)
        if m:
            cells.add((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4) == "graphs", m.group(5)))
    return cells


def csv_cells(run: Path) -> set[tuple[str, int, int, bool, str]]:
    csv = pd.read_csv(run / "tables" / "cost_ratio.csv")
    return {(r.size, int(r.batch), int(r.gamma), bool(r.draft_graphs), f"{r.c:.2f}") for r in csv.itertuples()}


def test_speedup_figures_draw_their_run_folders_cells():
    checked = 0
    for page, fig in _figures():
        if fig.name == "speedup_curves.svg":
            run = fig.parent.parent
            assert svg_legend_cells(fig) == csv_cells(run), f"{_rel(page)}: {fig} vs {run}/tables/cost_ratio.csv"
            checked += 1
    assert checked


def test_readme_worked_example_matches_its_run_folder():
    marked = [(page, kind, run, table) for page, kind, run, table in _marked_tables() if page == README]
    assert "cost_ratio" in [k for _, k, _, _ in marked], "the README's worked example has no checked table"
    assert "serving" in [k for _, k, _, _ in marked], "the README's serving table is not checked"
    for _, kind, run, (header, rows) in marked:
        assert rows
        assert not CHECKERS[kind](header, rows, run)
        if kind == "cost_ratio":  # the figure beside it comes from the same folder
            assert f"{run.relative_to(REPO)}/figures/" in README.read_text()


def test_docs_ladder_tables_are_what_the_ladder_prints():
    from workbench import ladder

    n = 0
    for page, kind, run, (header, rows) in _marked_tables():
        if kind in CHECKERS:
            assert not CHECKERS[kind](header, rows, run), _rel(page)
            continue
        assert kind == "ladder", f"{_rel(page)}: unknown table marker {kind!r}"
        want = [[c.strip() for c in line.strip().strip("|").split("|")]
                for line in ladder.summary_markdown(run).splitlines()]
        assert [header, *rows] == [want[0], *want[2:]], f"{_rel(page)}: table of {run} differs from its folder"
        n += 1
    assert n


def _readme_demo_block() -> tuple[str, list[str]]:
    text = README.read_text()
    m = re.search(r"From `(results/E1/[^`]+)`.*?```\n(.*?)```", text, re.S)
    assert m, "no demo block in the README"
    return m.group(1), m.group(2).rstrip("\n").splitlines()


def demo_block_problems(run: str, block: list[str]) -> list[str]:
    from workbench import demo

    text, exact = demo.report(REPO / run)
    got = [line for line in text.splitlines() if not line.startswith("run folder:")]
    if len(got) != len(block):
        return [f"{len(block)} lines in the README, {len(got)} from the run"]
    problems = []
    for want, have in zip(block, got):
        ok = have.startswith(want[:-3]) if want.endswith("...") else have.rstrip() == want.rstrip()
        if not ok:
            problems.append(f"README {want!r} != run {have!r}")
    return problems + ([] if exact else ["the run fails the exactness rule"])


def test_demo_block_is_the_named_run():
    run, block = _readme_demo_block()
    assert not demo_block_problems(run, block)


def _knob_table() -> dict[str, list[str]]:
    text = README.read_text()
    section = text[text.index("## Knobs"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 6:
            rows[cells[0].strip("`")] = cells
    return rows


def test_knob_table_is_the_table():
    from workbench.knobs import KNOBS, LEG_KNOBS, Knobs

    table = _knob_table()
    assert set(table) == set(LEG_KNOBS), (sorted(table), LEG_KNOBS)
    defaults = Knobs()
    for name in LEG_KNOBS:
        k = KNOBS[name]
        _, _, default, option, env, cpu = table[name]
        d = getattr(defaults, name)
        shown = default.strip("`")
        want = {None: "none", True: "true", False: "false"}.get(d, d) if not isinstance(d, float) else d
        if isinstance(want, float):
            assert float(shown) == want, name
        else:
            assert shown == str(want), f"{name}: leg default {shown} vs {want}"
        assert option.strip("`").replace("[no-]", "") == k.flag, name
        assert (env.split("`")[1] if "`" in env else None) == k.env, name
        assert cpu == ("yes" if k.applies_on_cpu else "no"), name
        assert k.spec_only, f"{name}: the README says every knob in the table is spec-only"


def test_the_checks_catch_a_disagreement(tmp_path):
    """Each check fails on a README whose number is edited."""
    page, kind, run, (header, rows) = next(t for t in _marked_tables() if t[0] == README and t[1] == "cost_ratio")
    bad = [list(r) for r in rows]
    i = header.index("c")
    bad[0][i] = f"{float(bad[0][i]) + 0.02:.2f}"
    assert check_cost_ratio_table(header, bad, run)
    _, _, _, (header, rows) = next(t for t in _marked_tables() if t[0] == README and t[1] == "serving")
    assert not check_serving_table(header, rows)
    bump = lambda c: re.sub(r"[0-9.]+", lambda m: f"{float(m.group(0)) + 0.05:.3f}", c, count=1)  # noqa: E731
    bump_ci = lambda c: re.sub(r"–([0-9.]+)", lambda m: f"–{float(m.group(1)) + 0.05:.2f}", c)  # noqa: E731
    for column, edit in (("c 16", bump), ("c 1", bump_ci), ("TTFT at c 1", bump),
                         ("leg", lambda c: c + "_x")):
        bad = [list(r) for r in rows]
        bad[-1][header.index(column)] = edit(bad[-1][header.index(column)])
        assert check_serving_table(header, bad), column
    bad = [list(r) for r in rows]
    bad[0][header.index("run folder")] = "–"  # the first row without its folder
    assert check_serving_table(header, bad)
    erun, block = _readme_demo_block()
    edited = [line.replace("0.627", "0.672") for line in block]
    assert demo_block_problems(erun, edited)
    svg = next(f for _, f in _figures() if f.name == "speedup_curves.svg")
    cells = csv_cells(svg.parent.parent)
    assert svg_legend_cells(svg) != cells - {next(iter(cells))}
