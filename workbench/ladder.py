"""The GPU cost ladder's analysis: step costs, the draft/verify cost ratio c, and speedup curves.

Reads the raw rows of a cost ladder (``steps.jsonl``, ``walls.jsonl``): a run folder of
experiment E16 (``workbench run E16``), whose complete legs hold the rows
(``legs/<leg>/steps.jsonl``; ``merge_rows`` also writes them whole at the run folder's top),
or the run folder ``benchmarks/cost_ladder.py`` writes (rows at its top, no legs). From those
rows alone it derives:

* ``step_costs``: median and IQR (ms) of the target's decode step
  (vanilla, ``tokens == batch``), its verification step (``tokens == batch *
  (gamma + 1)``), the drafter's ``propose`` (one gamma+1-token first pass,
  gamma-1 single-token passes and the sampling) and, where the step timer marks
  them, one of its single-token steps, per size, batch, gamma and drafter
  graphs on/off;
* ``cost_ratio``: c = (propose / gamma) / verification step per cell
  (``propose_per_token_ms`` = propose / gamma; ``single_step_ms`` beside it), the
  predicted speedup at alpha = 1, S(1, gamma, c) = (gamma + 1) / (gamma c + 1),
  the step-level prediction (gamma + 1) * decode / (verify + propose), and the
  measured forced-acceptance speedup (vanilla wall time / spec wall time for
  the same prompts and output length), end to end (``S_measured_alpha1``) and
  decode only (``S_measured_decode_alpha1``: the time to the first token, timed
  apart by the engine as ``first_wall_s``, taken off; the figure to set beside
  S(1, gamma, c), which models the decode alone);
* ``speedup_curve``: S(alpha, gamma, c) for alpha in [0.5, 0.98].

These three are tables of the analysis registry (``workbench.analyses``), and
their figures (``workbench.plots``: step cost vs batch, c with and without
drafter graphs, S(alpha) with the published operating points) are analyses, so
the experiment notebook, ``workbench export`` and the explorer show an E16 run
or a benchmark folder like any other run; this module writes no tables or figures
of its own (``python -m workbench.ladder DIR --markdown`` prints the README table).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .runfolder import LADDER_STEPS as STEPS, LADDER_WALLS as WALLS, write_text_atomic

ALPHAS = np.round(np.arange(0.50, 0.981, 0.02), 2)

# Published operating points for the S(alpha) figure.
SEED_POINT = {"label": "seed PR: 1.28x TPOT, Qwen3-VL-32B + 0.6B draft, acceptance length 1.49",
              "speedup": 1.28, "acceptance_length": 1.49}
QUANTSPEC_POINT = {"label": "QuantSpec: ~2.5x at >90% acceptance", "speedup": 2.5, "alpha": 0.9}
# How the operating points are placed on the alpha axis (the figure's caption and hover text).
OPERATING_POINTS_NOTE = (
    "Seed PR (1.28x TPOT, acceptance length L = 1.49, Qwen3-VL-32B with a 0.6B draft): placed, for each "
    "curve's gamma, at the alpha whose expected acceptance length is 1.49, from "
    "L = (1 - alpha^(gamma+1)) / (1 - alpha) (tokens per verification step, bonus token included). "
    "QuantSpec (~2.5x at > 90% acceptance): drawn at alpha = 0.9, the lower end of what it reports.")


def speedup(alpha, gamma: int, c: float):
    """Expected speedup of speculative decoding: (1 - a^(g+1)) / ((1 - a)(g c + 1))."""
    a = np.asarray(alpha, dtype=float)
    tokens = np.where(np.isclose(a, 1.0), gamma + 1.0, (1 - a ** (gamma + 1)) / np.where(a == 1, 1, 1 - a))
    return tokens / (gamma * c + 1)


def alpha_for_length(length: float, gamma: int) -> float:
    """The per-token acceptance alpha whose expected acceptance length at gamma is ``length``."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (gamma + 1)) / (1 - mid) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _is_run_folder(run_dir: Path) -> bool:
    return (run_dir / "run.json").is_file()


def _leg_row_files(run_dir: Path) -> list[Path]:
    """Leg folders of a protocol run (run.json order) whose ladder leg is complete."""
    from .runfolder import leg_status, read_json

    cfg = read_json(run_dir / "run.json")
    names = [leg["name"] for leg in cfg.get("legs", []) if isinstance(leg, dict) and "name" in leg]
    return [run_dir / "legs" / n for n in names if (run_dir / "legs" / n / STEPS).is_file()
            and leg_status(run_dir / "legs" / n) == "complete"]


def _top_rows(run_dir: Path) -> bool:
    """Rows at the folder's top (the benchmark's folder; an E16 run's merged rows are its legs')."""
    return (run_dir / STEPS).is_file() and (run_dir / STEPS).stat().st_size > 0 and (run_dir / WALLS).is_file()


def has_rows(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds cost-ladder rows (a run with a complete ladder leg, or rows at its top:
    the benchmark's folder)."""
    run_dir = Path(run_dir)
    if _is_run_folder(run_dir) and _leg_row_files(run_dir):
        return True
    return _top_rows(run_dir)


def _read_rows(paths: list[Path]) -> pd.DataFrame:
    frames = [pd.read_json(p, lines=True) for p in paths if p.is_file() and p.stat().st_size > 0]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def load(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The raw (steps, walls) rows; in a protocol run those of its complete legs, in a benchmark folder its files."""
    run_dir = Path(run_dir)
    legs = _leg_row_files(run_dir) if _is_run_folder(run_dir) else []
    if legs:
        steps, walls = _read_rows([d / STEPS for d in legs]), _read_rows([d / WALLS for d in legs])
    elif _is_run_folder(run_dir) and not _top_rows(run_dir):
        raise FileNotFoundError(f"cost-ladder run {run_dir} has no complete leg with {STEPS}")
    else:
        steps_path, walls_path = run_dir / STEPS, run_dir / WALLS
        for p in (steps_path, walls_path):
            if not p.is_file():
                raise FileNotFoundError(f"cost-ladder run {run_dir} has no {p.name}")
        steps = pd.read_json(steps_path, lines=True)
        walls = pd.read_json(walls_path, lines=True)
    walls = walls[walls["wall_s"].notna()] if "wall_s" in walls else walls.iloc[0:0]
    return steps, walls


def merge_rows(run_dir: str | Path) -> dict[str, Path]:
    """A protocol run's rows written whole at its top (``steps.jsonl``, ``walls.jsonl``), as the benchmark
    script writes them: the complete legs' files, in run order (each file written aside, then renamed)."""
    run_dir = Path(run_dir)
    legs = _leg_row_files(run_dir)
    out = {}
    for name in (STEPS, WALLS):
        write_text_atomic(run_dir / name, "".join((d / name).read_text(encoding="utf-8") for d in legs
                                                  if (d / name).is_file()))
        out[name] = run_dir / name
    return out


def _iqr(s: pd.Series) -> pd.Series:
    return pd.Series({"median_ms": s.median(), "q1_ms": s.quantile(0.25), "q3_ms": s.quantile(0.75), "n": len(s)})


DRAFTER_TAGS = ("draft_linear_kernel", "draft_cudagraph_mode", "async_scheduling")


def _drafter(row: pd.Series) -> str:
    """The drafter setup a spec row was measured with (its tags; rows from before the tags: "as shipped")."""
    tags = [row.get(k) for k in DRAFTER_TAGS]
    if all(t is None or t != t for t in tags):
        return "as shipped"
    kernel, mode, sched = tags
    tp, head, attn = row.get("tensor_parallel_size"), row.get("draft_lm_head"), row.get("draft_attention")
    return (f"{kernel} {mode}" + (" async" if sched is True else "")
            + (" int4-head" if head == "int4" else "") + (f" {attn}-attn" if attn in ("twin", "mixed") else "")
            + (f" tp{int(tp)}" if tp is not None and tp == tp and int(tp) > 1 else ""))


def _by_drafter(rows: pd.DataFrame) -> pd.DataFrame:
    """Spec rows of several drafter setups of one size (a folder holding a before and an after) are told
    apart by their size label, "32b [marlin piecewise async]"; the size's vanilla rows are repeated under
    each label, so every table and figure downstream compares each setup with the same vanilla engine."""
    if rows.empty:
        return rows
    rows = rows.copy()
    spec = rows["kind"] == "spec"
    rows["drafter"] = None
    rows.loc[spec, "drafter"] = [_drafter(r) for _, r in rows[spec].iterrows()]
    parts = []
    for size, grp in rows.groupby("size", sort=False):
        setups = list(dict.fromkeys(grp.loc[grp["kind"] == "spec", "drafter"]))
        if len(setups) <= 1:
            parts.append(grp)
            continue
        van = grp[grp["kind"] != "spec"]
        for d in setups:
            label = f"{size} [{d}]"
            parts += [van.assign(size=label), grp[(grp["kind"] == "spec") & (grp["drafter"] == d)].assign(size=label)]
    return pd.concat(parts, ignore_index=True)


ROLE_COLS = ["size", "batch", "gamma", "draft_graphs", "role", "rep", "ms"]
SPEC_ROLES = ("target verify", "draft propose", "draft single-token step")


def role_rows(steps: pd.DataFrame) -> pd.DataFrame:
    """Every decode step's time under its cell and role (``ROLE_COLS``): the vanilla engine's one-token steps
    (``target decode``), and for each spec step its verify, its propose and, from a step timer that marks
    them, one of its γ − 1 single-token draft steps. Prefill steps and mixed steps are left out."""
    s = _by_drafter(steps[~steps["prefill"].astype(bool)].copy())
    if "rep" not in s:
        s["rep"] = 0
    g = s["gamma"].fillna(0).astype(int)
    decode = s[(s["kind"] == "vanilla") & (s["tokens"] == s["batch"]) & (s["reqs"] == s["batch"])]
    spec = s[(s["kind"] == "spec") & (s["reqs"] == s["batch"]) & (s["tokens"] == s["batch"] * (g + 1))]
    spec = spec.assign(gamma=spec["gamma"].astype(int), draft_graphs=spec["draft_graphs"].astype(bool))
    parts = [decode.assign(gamma=None, draft_graphs=None, role="target decode", ms=decode["target_ms"]),
             spec.assign(role=SPEC_ROLES[0], ms=spec["target_ms"]),
             spec.assign(role=SPEC_ROLES[1], ms=spec["draft_ms"])]
    if "draft_loop_ms" in spec:
        loop = spec[(spec["gamma"] > 1) & spec["draft_loop_ms"].notna()]
        parts.append(loop.assign(role=SPEC_ROLES[2], ms=loop["draft_loop_ms"] / (loop["gamma"] - 1)))
    out = pd.concat([p[ROLE_COLS] for p in parts], ignore_index=True)
    return out[out["ms"].notna()]


def step_costs(steps: pd.DataFrame) -> pd.DataFrame:
    rows = []
    long = role_rows(steps)
    for keys, grp in long[long["role"] == "target decode"].groupby(["size", "batch"]):
        rows.append({"size": keys[0], "batch": keys[1], "gamma": None, "draft_graphs": None,
                     "role": "target decode", **_iqr(grp["ms"])})
    spec = long[long["role"] != "target decode"]
    for keys, grp in spec.groupby(["size", "batch", "gamma", "draft_graphs"]):
        base = {"size": keys[0], "batch": keys[1], "gamma": int(keys[2]), "draft_graphs": bool(keys[3])}
        for role in SPEC_ROLES:
            ms = grp.loc[grp["role"] == role, "ms"]
            if len(ms):
                rows.append({**base, "role": role, **_iqr(ms)})
    out = pd.DataFrame(rows)
    if not out.empty:
        out["n"] = out["n"].astype(int)
    return out


def _decode_s_per_token(walls: pd.DataFrame) -> pd.Series:
    """Per walls row (one repeat), the decode-only seconds per output token after the first:
    (wall_s - first_wall_s) / (out_tokens - batch). NaN where the row has no ``first_wall_s`` (written
    before the engine timed the first token apart), no token after the first, or a first token that took
    at least the whole timed generate: the two are timed in separate calls, and on a loaded host (a CPU
    shared with other work) that can happen; such a row has no usable decode time, and a negative one
    would pull the median."""
    if "first_wall_s" not in walls or "out_tokens" not in walls:
        return pd.Series(np.nan, index=walls.index, dtype=float)
    after = pd.to_numeric(walls["out_tokens"], errors="coerce") - pd.to_numeric(walls["batch"], errors="coerce")
    decode = pd.to_numeric(walls["wall_s"], errors="coerce") - pd.to_numeric(walls["first_wall_s"], errors="coerce")
    return decode.where(decode > 0) / after.where(after > 0)


def _first_ms(walls: pd.DataFrame) -> float:
    """Median time to the first token of the batch (ms), NaN without ``first_wall_s``."""
    if "first_wall_s" not in walls:
        return float("nan")
    return float(pd.to_numeric(walls["first_wall_s"], errors="coerce").median() * 1e3)


def _ratio(num: float, den: float) -> float:
    return num / den if np.isfinite(num) and np.isfinite(den) and den > 0 else float("nan")


def cost_ratio(costs: pd.DataFrame, walls: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (size, batch, gamma, drafter graphs): step costs, c, S(1, gamma, c), measured speedups.

    ``S_measured_alpha1``: median vanilla wall / median spec wall, end to end (each wall holds the prefill,
    and in a spec engine the draft's prefill and first propose, once per request). ``S_measured_decode_alpha1``:
    the same with that first token taken off, median over repeats of the seconds per output token after
    the first, vanilla / spec; ``first_ms_vanilla`` / ``first_ms_spec``: the median time to the first
    token (ms), the fixed cost the end-to-end figure carries. The last three are NaN for walls rows
    written before the engine timed the first token apart.
    """
    if costs.empty:
        return pd.DataFrame()
    walls = _by_drafter(walls)  # the same size labels as step_costs gave the steps
    med = costs.set_index(["size", "batch", "gamma", "draft_graphs", "role"])["median_ms"]
    decode = costs[costs["role"] == "target decode"].set_index(["size", "batch"])["median_ms"]
    rows = []
    for (size, batch, gamma, graphs), _ in costs[costs["role"] == "target verify"].groupby(
            ["size", "batch", "gamma", "draft_graphs"]):
        verify = med[(size, batch, gamma, graphs, "target verify")]
        propose = med[(size, batch, gamma, graphs, "draft propose")]
        c = (propose / gamma) / verify
        row = {"size": size, "batch": batch, "gamma": int(gamma), "draft_graphs": bool(graphs),
               # propose / gamma: a gamma+1-token first pass, gamma-1 single-token passes and sampling,
               # per drafted token (not one draft forward)
               "verify_ms": verify, "propose_ms": propose, "propose_per_token_ms": propose / gamma,
               "single_step_ms": med.get((size, batch, gamma, graphs, "draft single-token step")),
               "c": c, "gamma_c": propose / verify, "S_pred_alpha1": float(speedup(1.0, int(gamma), c))}
        dec = decode.get((size, batch))
        row["decode_ms"] = dec
        row["S_steps_alpha1"] = (gamma + 1) * dec / (verify + propose) if dec is not None else None
        van = walls[(walls["size"] == size) & (walls["kind"] == "vanilla") & (walls["batch"] == batch)]
        spec = walls[(walls["size"] == size) & (walls["kind"] == "spec") & (walls["gamma"] == gamma)
                     & (walls["draft_graphs"] == graphs) & (walls["batch"] == batch)]
        w_van, w_spec = van["wall_s"].median(), spec["wall_s"].median()
        ok = w_van == w_van and w_spec == w_spec and w_spec > 0
        row["S_measured_alpha1"] = w_van / w_spec if ok else None
        # decode only: what S(1, gamma, c) models (the first token is a fixed cost per request, the
        # draft's prefill included on the spec side)
        row["S_measured_decode_alpha1"] = _ratio(_decode_s_per_token(van).median(),
                                                 _decode_s_per_token(spec).median())
        row["first_ms_vanilla"], row["first_ms_spec"] = _first_ms(van), _first_ms(spec)
        rows.append(row)
    return pd.DataFrame(rows)


def first_token_costs(steps: pd.DataFrame) -> pd.DataFrame:
    """Where the spec engine's first token goes, per cell (size, batch, gamma): the target's prefill in the
    vanilla engine and in the spec engine, the draft's first propose (its prefill of the prompt plus its
    gamma-1 single-token steps), one single-token step from the decode rows, and the draft's prefill alone
    (first propose - (gamma-1) single-token steps). ``first_step_ratio`` = (spec target prefill + draft
    first propose) / vanilla prefill: what the twin adds to the time to the first token, engine side."""
    pre = _by_drafter(steps[steps["prefill"].astype(bool)].copy())
    dec = _by_drafter(steps[~steps["prefill"].astype(bool)].copy())
    rows = []
    van = pre[pre["kind"] == "vanilla"].groupby(["size", "batch"])["target_ms"].median()
    spec = pre[pre["kind"] == "spec"]
    for (size, batch, gamma), grp in spec.groupby(["size", "batch", "gamma"]):
        g = int(gamma)
        cell = dec[(dec["kind"] == "spec") & (dec["size"] == size) & (dec["batch"] == batch) & (dec["gamma"] == gamma)]
        # rows from before the step timer marked the single-token steps have no draft_loop_ms
        loop = cell["draft_loop_ms"].dropna() if "draft_loop_ms" in cell else pd.Series(dtype=float)
        single = float(loop.median() / (g - 1)) if len(loop) and g > 1 else float("nan")
        first = float(grp["draft_ms"].median())
        target = float(grp["target_ms"].median())
        vanilla = float(van.get((size, batch), float("nan")))
        draft_prefill = first - (g - 1) * single if single == single else float("nan")
        rows.append({"size": size, "batch": int(batch), "gamma": g, "prompt_tokens": int(grp["tokens"].iloc[0]),
                     "vanilla_prefill_ms": vanilla, "target_prefill_ms": target, "draft_first_propose_ms": first,
                     "draft_single_step_ms": single, "draft_prefill_ms": draft_prefill,
                     "draft_prefill_over_target": _ratio(draft_prefill, vanilla),
                     "first_step_ratio": _ratio(target + first, vanilla)})
    return pd.DataFrame(rows)


def first_token_markdown(run_dir: str | Path) -> str:
    """The first-token table of a cost-ladder folder, as markdown."""
    t = first_token_costs(load(run_dir)[0])
    if t.empty:
        return "(no prefill rows of a spec leg)"
    f = lambda v: "–" if v != v else f"{v:.2f}"  # noqa: E731
    lines = ["| size | batch | γ | prompt tokens | vanilla prefill ms | spec: target prefill ms "
             "| draft first propose ms | draft single-token step ms | draft prefill ms | draft prefill / vanilla "
             "| first step, spec / vanilla |", "|" + "---|" * 11]
    for r in t.itertuples():
        lines.append(f"| {r.size} | {r.batch} | {r.gamma} | {r.prompt_tokens} | {f(r.vanilla_prefill_ms)} | "
                     f"{f(r.target_prefill_ms)} | {f(r.draft_first_propose_ms)} | {f(r.draft_single_step_ms)} | "
                     f"{f(r.draft_prefill_ms)} | {f(r.draft_prefill_over_target)} | {f(r.first_step_ratio)} |")
    return "\n".join(lines)


def speedup_curve(ratios: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in ratios.itertuples():
        for a, s in zip(ALPHAS, speedup(ALPHAS, r.gamma, r.c)):
            rows.append({"size": r.size, "batch": r.batch, "gamma": r.gamma, "draft_graphs": r.draft_graphs,
                         "alpha": float(a), "S": float(s)})
    return pd.DataFrame(rows)


def tables(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The three ladder tables of a folder's rows, computed as the analysis registry computes them (nothing
    written: ``workbench export`` / ``workbench.analyses.analyze_run`` write a run's tables and figures)."""
    steps, walls = load(run_dir)
    costs = step_costs(steps)
    ratios = cost_ratio(costs, walls)
    curve = speedup_curve(ratios) if not ratios.empty else pd.DataFrame()
    return {"step_costs": costs, "cost_ratio": ratios, "speedup_curve": curve,
            "first_token_costs": first_token_costs(steps)}


def summary_markdown(run_dir: str | Path | None = None, ratios: pd.DataFrame | None = None) -> str:
    """The README table: one row per size, batch and gamma, graphs on and off (from ``ratios`` or the run's csv).

    The decode-only measured speedup gets a column where some cell has one (rows that time the first token
    apart); tables of older folders keep their ten columns.
    """
    if ratios is None:
        ratios = tables(run_dir)["cost_ratio"]
    if ratios.empty:
        return "(no cost-ratio rows: no complete spec leg)"
    ratios = ratios.assign(draft_graphs=ratios["draft_graphs"].astype(bool))
    decode = "S_measured_decode_alpha1" in ratios and bool(ratios["S_measured_decode_alpha1"].notna().any())
    lines = ["| size | batch | γ | decode ms | verify ms | propose/γ ms (graphs / eager) "
             "| single-token step ms (graphs / eager) | c (graphs / eager) "
             "| S(1,γ,c) | measured S at α=1 (graphs / eager) |"
             + (" measured S at α=1, decode only (graphs / eager) |" if decode else ""),
             "|" + "---|" * (11 if decode else 10)]
    for (size, batch, gamma), g in ratios.groupby(["size", "batch", "gamma"]):
        on = g[g["draft_graphs"]].iloc[0] if g["draft_graphs"].any() else None
        off = g[~g["draft_graphs"]].iloc[0] if (~g["draft_graphs"]).any() else None
        if on is None:
            continue
        f = lambda v: "–" if v is None or v != v else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {size} | {batch} | {gamma} | {f(on['decode_ms'])} | {f(on['verify_ms'])} | "
                     f"{f(on['propose_per_token_ms'])} / "
                     f"{f(off['propose_per_token_ms'] if off is not None else None)} | "
                     f"{f(on.get('single_step_ms'))} / {f(off.get('single_step_ms') if off is not None else None)} | "
                     f"{f(on['c'])} / {f(off['c'] if off is not None else None)} | {f(on['S_pred_alpha1'])} | "
                     f"{f(on['S_measured_alpha1'])} / {f(off['S_measured_alpha1'] if off is not None else None)} |"
                     + (f" {f(on['S_measured_decode_alpha1'])} / "
                        f"{f(off['S_measured_decode_alpha1'] if off is not None else None)} |" if decode else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.ladder",
                                 description="print a cost-ladder folder's README table (its tables and figures: "
                                             "workbench export, or benchmarks/cost_ladder.py --analyze)")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--markdown", action="store_true", help="print the README table (the default)")
    ap.add_argument("--first-token", action="store_true",
                    help="print where the first token's time goes (prefill of target and draft) instead")
    args = ap.parse_args(argv)
    print(first_token_markdown(args.run_dir) if args.first_token else summary_markdown(args.run_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
