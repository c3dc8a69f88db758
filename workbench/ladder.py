"""The GPU cost ladder's analysis: step costs, the draft/verify cost ratio c, and speedup curves.

Reads a cost-ladder run folder (``steps.jsonl``, ``walls.jsonl``; written by
``benchmarks/cost_ladder.py``) and derives, from those raw rows alone:

* ``step_costs``: median and IQR (ms) of the target's decode step
  (vanilla, ``tokens == batch``), its verification step (``tokens == batch *
  (gamma + 1)``) and the drafter's ``propose`` (gamma draft forwards), per
  size, batch, gamma and drafter graphs on/off;
* ``cost_ratio``: c = (propose / gamma) / verification step per cell, the
  predicted speedup at alpha = 1, S(1, gamma, c) = (gamma + 1) / (gamma c + 1),
  the step-level prediction (gamma + 1) * decode / (verify + propose), and the
  measured forced-acceptance speedup (vanilla wall time / spec wall time for
  the same prompts and output length);
* ``speedup_curve``: S(alpha, gamma, c) for alpha in [0.5, 0.98].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

ALPHAS = np.round(np.arange(0.50, 0.981, 0.02), 2)

# Published operating points for the S(alpha) figure.
SEED_POINT = {"label": "seed PR: 1.28x TPOT, Qwen3-VL-32B + 0.6B draft, acceptance length 1.49",
              "speedup": 1.28, "acceptance_length": 1.49}
QUANTSPEC_POINT = {"label": "QuantSpec: ~2.5x at >90% acceptance", "speedup": 2.5, "alpha": 0.9}


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


def load(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    run_dir = Path(run_dir)
    steps_path, walls_path = run_dir / "steps.jsonl", run_dir / "walls.jsonl"
    for p in (steps_path, walls_path):
        if not p.is_file():
            raise FileNotFoundError(f"cost-ladder run {run_dir} has no {p.name}")
    steps = pd.read_json(steps_path, lines=True)
    walls = pd.read_json(walls_path, lines=True)
    walls = walls[walls["wall_s"].notna()] if "wall_s" in walls else walls.iloc[0:0]
    return steps, walls


def _iqr(s: pd.Series) -> pd.Series:
    return pd.Series({"median_ms": s.median(), "q1_ms": s.quantile(0.25), "q3_ms": s.quantile(0.75), "n": len(s)})


def step_costs(steps: pd.DataFrame) -> pd.DataFrame:
    s = steps[~steps["prefill"].astype(bool)].copy()
    g = s["gamma"].fillna(0).astype(int)
    rows = []
    decode = s[(s["kind"] == "vanilla") & (s["tokens"] == s["batch"]) & (s["reqs"] == s["batch"])]
    for keys, grp in decode.groupby(["size", "batch"]):
        rows.append({"size": keys[0], "batch": keys[1], "gamma": None, "draft_graphs": None,
                     "role": "target decode", **_iqr(grp["target_ms"])})
    spec = s[(s["kind"] == "spec") & (s["reqs"] == s["batch"]) & (s["tokens"] == s["batch"] * (g + 1))]
    for keys, grp in spec.groupby(["size", "batch", "gamma", "draft_graphs"]):
        base = {"size": keys[0], "batch": keys[1], "gamma": int(keys[2]), "draft_graphs": bool(keys[3])}
        rows.append({**base, "role": "target verify", **_iqr(grp["target_ms"])})
        rows.append({**base, "role": "draft propose", **_iqr(grp["draft_ms"].dropna())})
    out = pd.DataFrame(rows)
    if not out.empty:
        out["n"] = out["n"].astype(int)
    return out


def cost_ratio(costs: pd.DataFrame, walls: pd.DataFrame) -> pd.DataFrame:
    if costs.empty:
        return pd.DataFrame()
    med = costs.set_index(["size", "batch", "gamma", "draft_graphs", "role"])["median_ms"]
    decode = costs[costs["role"] == "target decode"].set_index(["size", "batch"])["median_ms"]
    rows = []
    for (size, batch, gamma, graphs), _ in costs[costs["role"] == "target verify"].groupby(
            ["size", "batch", "gamma", "draft_graphs"]):
        verify = med[(size, batch, gamma, graphs, "target verify")]
        propose = med[(size, batch, gamma, graphs, "draft propose")]
        c = (propose / gamma) / verify
        row = {"size": size, "batch": batch, "gamma": int(gamma), "draft_graphs": bool(graphs),
               "verify_ms": verify, "propose_ms": propose, "draft_forward_ms": propose / gamma,
               "c": c, "gamma_c": propose / verify, "S_pred_alpha1": float(speedup(1.0, int(gamma), c))}
        dec = decode.get((size, batch))
        row["decode_ms"] = dec
        row["S_steps_alpha1"] = (gamma + 1) * dec / (verify + propose) if dec is not None else None
        w_van = walls[(walls["size"] == size) & (walls["kind"] == "vanilla")
                      & (walls["batch"] == batch)]["wall_s"].median()
        w_spec = walls[(walls["size"] == size) & (walls["kind"] == "spec") & (walls["gamma"] == gamma)
                       & (walls["draft_graphs"] == graphs) & (walls["batch"] == batch)]["wall_s"].median()
        ok = w_van == w_van and w_spec == w_spec and w_spec > 0
        row["S_measured_alpha1"] = w_van / w_spec if ok else None
        rows.append(row)
    return pd.DataFrame(rows)


def speedup_curve(ratios: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in ratios.itertuples():
        for a, s in zip(ALPHAS, speedup(ALPHAS, r.gamma, r.c)):
            rows.append({"size": r.size, "batch": r.batch, "gamma": r.gamma, "draft_graphs": r.draft_graphs,
                         "alpha": float(a), "S": float(s)})
    return pd.DataFrame(rows)


def write_tables(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    run_dir = Path(run_dir)
    steps, walls = load(run_dir)
    costs = step_costs(steps)
    ratios = cost_ratio(costs, walls)
    curve = speedup_curve(ratios) if not ratios.empty else pd.DataFrame()
    tables = {"step_costs": costs, "cost_ratio": ratios, "speedup_curve": curve}
    (run_dir / "tables").mkdir(exist_ok=True)
    for name, df in tables.items():
        df.to_csv(run_dir / "tables" / f"{name}.csv", index=False, float_format="%.4f")
    try:
        figs = figures(tables)
        (run_dir / "figures").mkdir(exist_ok=True)
        for name, fig in figs.items():
            # plotly.min.js once beside the figures: offline, without a copy per file
            fig.write_html(run_dir / "figures" / f"{name}.html", include_plotlyjs="directory")
    except ImportError:
        pass
    return tables


def figures(tables: dict[str, pd.DataFrame]) -> dict:
    import plotly.express as px
    import plotly.graph_objects as go

    costs, ratios, curve = tables["step_costs"], tables["cost_ratio"], tables["speedup_curve"]
    out = {}
    if not costs.empty:
        c = costs.copy()
        c["series"] = c.apply(lambda r: r["role"] + ("" if r["gamma"] is None or r["gamma"] != r["gamma"] else
                                                     f" g={int(r['gamma'])}" + (" graphs" if r["draft_graphs"] else " eager")), axis=1)
        out["step_cost_vs_batch"] = px.line(c, x="batch", y="median_ms", color="series", facet_col="size",
                                            markers=True, log_x=True, title="Engine-side step cost vs batch",
                                            labels={"median_ms": "ms per step"})
    if not ratios.empty:
        r = ratios.copy()
        r["drafter"] = r["draft_graphs"].map({True: "CUDA graphs", False: "eager"})
        out["c_by_graphs"] = px.bar(r, x="batch", y="c", color="drafter", barmode="group", facet_col="size",
                                    facet_row="gamma", title="c = draft forward / verification step")
    if not curve.empty:
        fig = go.Figure()
        for (size, batch, gamma, graphs), g in curve.groupby(["size", "batch", "gamma", "draft_graphs"]):
            if not graphs:
                continue
            fig.add_trace(go.Scatter(x=g["alpha"], y=g["S"], mode="lines",
                                     name=f"{size} b={batch} g={gamma}"))
        fig.add_trace(go.Scatter(x=[alpha_for_length(SEED_POINT["acceptance_length"], 1)],
                                 y=[SEED_POINT["speedup"]], mode="markers", marker_symbol="x", marker_size=12,
                                 name=SEED_POINT["label"]))
        fig.add_trace(go.Scatter(x=[QUANTSPEC_POINT["alpha"]], y=[QUANTSPEC_POINT["speedup"]], mode="markers",
                                 marker_symbol="diamond", marker_size=12, name=QUANTSPEC_POINT["label"]))
        fig.add_hline(y=1.0, line_dash="dot")
        fig.update_layout(title="Predicted speedup S(alpha) at the measured c (drafter CUDA graphs on)",
                          xaxis_title="alpha (per-token acceptance)", yaxis_title="speedup")
        out["speedup_curves"] = fig
    return out


def summary_markdown(run_dir: str | Path) -> str:
    """The README table: one row per size, batch and gamma, graphs on and off."""
    ratios = pd.read_csv(Path(run_dir) / "tables" / "cost_ratio.csv")
    lines = ["| size | batch | γ | decode ms | verify ms | draft fwd ms (graphs / eager) | c (graphs / eager) "
             "| S(1,γ,c) | measured S at α=1 (graphs / eager) |", "|" + "---|" * 9]
    for (size, batch, gamma), g in ratios.groupby(["size", "batch", "gamma"]):
        on = g[g["draft_graphs"]].iloc[0] if g["draft_graphs"].any() else None
        off = g[~g["draft_graphs"]].iloc[0] if (~g["draft_graphs"]).any() else None
        if on is None:
            continue
        f = lambda v: "–" if v is None or v != v else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {size} | {batch} | {gamma} | {f(on['decode_ms'])} | {f(on['verify_ms'])} | "
                     f"{f(on['draft_forward_ms'])} / {f(off['draft_forward_ms'] if off is not None else None)} | "
                     f"{f(on['c'])} / {f(off['c'] if off is not None else None)} | {f(on['S_pred_alpha1'])} | "
                     f"{f(on['S_measured_alpha1'])} / {f(off['S_measured_alpha1'] if off is not None else None)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.ladder", description="recompute a cost-ladder run's tables")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    args = ap.parse_args(argv)
    write_tables(args.run_dir)
    if args.markdown:
        print(summary_markdown(args.run_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
