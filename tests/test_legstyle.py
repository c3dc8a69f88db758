"""Each leg in its own colour, the same in every view; measured and predicted of one leg in one hue; legends
name legs as a reader would (``workbench.plots.legstyle``)."""

from __future__ import annotations

import pytest

from synthetic_runs import write_run
from workbench import analyses
from workbench.plots import PREDICTED_DASH, LegStyles
from workbench.results import load_run

DRAFTERS = [
    {"name": "vanilla_1", "tier": "vanilla"},
    {"name": "strict_twin", "tier": "strict", "gamma": 6, "draft": "twin"},
    {"name": "strict_small-vlm", "tier": "strict", "gamma": 6, "draft": "small-vlm"},
    {"name": "strict_text-draft", "tier": "strict", "gamma": 6, "draft": "text-draft"},
    {"name": "vanilla_2", "tier": "vanilla"},
]
TAU_LADDER = [
    {"name": "vanilla_1", "tier": "vanilla"},
    {"name": "strict_g4", "tier": "strict", "gamma": 4, "draft": "twin"},
    {"name": "relaxed_g4_x0.3", "tier": "relaxed", "gamma": 4, "relax_logtau": 0.3, "draft": "twin"},
    {"name": "relaxed_g4_x0.693", "tier": "relaxed", "gamma": 4, "relax_logtau": 0.693, "draft": "twin"},
    {"name": "vanilla_2", "tier": "vanilla"},
]
SPEC = {"strict_twin": "int4 twin", "strict_small-vlm": "small VLM", "strict_text-draft": "text draft"}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    rdir = write_run(tmp_path_factory.mktemp("e6"), experiment="E6", legs=DRAFTERS, n_prompts=6)
    return analyses.RunTables(load_run(rdir), teacher=False)


def _colour(trace) -> str:
    if trace.type in ("bar", "box", "violin"):
        return trace.marker.color
    return trace.line.color if trace.line.color is not None else trace.marker.color


def test_drafters_are_named_as_a_reader_names_them(drafters):
    st = drafters.leg_styles
    assert {leg: st[leg].label for leg in SPEC} == SPEC
    assert len({st[leg].color for leg in SPEC}) == 3


def test_every_view_draws_each_drafter_in_its_colour(drafters):
    st = drafters.leg_styles
    for name in ("speedup_vs_gamma", "speedup_distribution", "per_position_acceptance", "acceptance_vs_tau",
                 "acceptance_over_position"):
        fig = analyses.view_figure(drafters, name, 6, 0.4)
        seen: dict[str, set[str]] = {}
        for t in fig.data:
            leg = (t.meta or {}).get("leg") or ((t.meta or {}).get("legs") or [None])[0]
            if leg in SPEC:
                seen.setdefault(leg, set()).add(_colour(t))
        assert set(seen) == set(SPEC), name
        assert all(cols == {st[leg].color} for leg, cols in seen.items()), (name, seen)


def test_speedup_vs_gamma_keeps_drafters_apart(drafters):
    fig = analyses.view_figure(drafters, "speedup_vs_gamma", 6, 0.0)
    lines = [t for t in fig.data if t.meta.get("role") == "speedup"]
    assert sorted(t.name for t in lines) == sorted(SPEC.values())


def test_predicted_shares_its_legs_hue_and_is_dotted(drafters):
    fig = analyses.view_figure(drafters, "per_position_acceptance", 6, 0.4)
    bars = {t.meta["leg"]: t.marker.color for t in fig.data if t.meta.get("role") == "measured"}
    predicted = [t for t in fig.data if t.meta.get("role") == "predicted"]
    assert predicted and all(t.line.color == bars[t.meta["leg"]] and t.line.dash == PREDICTED_DASH
                             for t in predicted)


def test_tau_ladder_and_several_gammas_read_apart(tmp_path):
    st = analyses.RunTables(load_run(write_run(tmp_path, legs=TAU_LADDER, n_prompts=4))).leg_styles
    assert [st[l].label for l in ("strict_g4", "relaxed_g4_x0.3", "relaxed_g4_x0.693")] == [
        "strict", "relaxed x = 0.3", "relaxed x = 0.69"]
    assert len({st[l].color for l in ("strict_g4", "relaxed_g4_x0.3", "relaxed_g4_x0.693")}) == 3


def test_legs_of_one_series_at_several_gammas_share_a_hue_with_gamma_in_the_label():
    import pandas as pd
    st = LegStyles.from_frame(pd.DataFrame({"leg": ["s2", "s4", "s6"], "tier": "strict", "gamma": [2, 4, 6]}))
    assert [st[l].label for l in ("s2", "s4", "s6")] == ["strict, γ = 2", "strict, γ = 4", "strict, γ = 6"]
    assert len({st[l].color for l in st}) == 3 and len({st[l].series for l in st}) == 1


def test_serving_legs_of_one_setting_pool_and_drawn_acceptance_reads_apart():
    import pandas as pd
    legs = pd.DataFrame({"leg": ["v_c1", "twin_a1_c1", "twin_a1_c4", "twin_a0.9_c1", "text_c1"],
                         "tier": ["vanilla", "strict", "strict", "strict", "strict"],
                         "gamma": [None, 4, 4, 4, 3], "concurrency": [1, 1, 4, 1, 1],
                         "acceptance": [None, 1.0, 1.0, 0.9, None]})
    st = LegStyles.from_frame(legs)
    assert st["twin_a1_c1"].label == st["twin_a1_c4"].label            # one server setting, two concurrencies
    assert st["twin_a1_c1"].color == st["twin_a1_c4"].color
    assert "synthetic α = 0.9" in st["twin_a0.9_c1"].label
    assert len({st[l].color for l in ("twin_a1_c1", "twin_a0.9_c1", "text_c1")}) == 3


def test_a_drawn_acceptance_as_the_knob_states_it_names_the_leg():
    import pandas as pd

    from workbench.plots.legstyle import drawn_alpha

    assert drawn_alpha("alpha:0.9") == 0.9 and drawn_alpha("synthetic α (alpha:0.75)") == 0.75
    assert drawn_alpha("real") is None and drawn_alpha(None) is None and drawn_alpha(1.0) == 1.0
    st = LegStyles.from_frame(pd.DataFrame({"leg": ["vanilla_1", "twin_a0.9_auto"], "tier": ["vanilla", "synthetic"],
                                            "gamma": [None, 4], "acceptance": ["real", "alpha:0.9"]}))
    assert st["twin_a0.9_auto"].label == "synthetic α = 0.9"
