"""workbench.results: reading run folders from raw files."""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_runs import LADDER_LEGS, write_run  # noqa: E402

from workbench.results import leg_dir, list_runs, load_run, new_run_id, run_dir  # noqa: E402


def test_load_run_statuses_and_records(tmp_path):
    rdir = write_run(tmp_path, legs=LADDER_LEGS, n_prompts=5, failed=("vanilla_1",),
                     incomplete=("strict_g4",), pending=("vanilla_2",))
    run = load_run(rdir)
    status = dict(zip(run.legs["leg"], run.legs["status"]))
    assert status == {"vanilla_0": "complete", "strict_g2": "complete", "strict_g4": "incomplete",
                      "vanilla_1": "failed", "strict_g6": "complete", "relaxed_g6_x0.693": "complete",
                      "vanilla_2": "pending"}
    assert run.legs_order == [leg["name"] for leg in LADDER_LEGS]
    # Only complete legs contribute records, 5 prompts each, in planned order.
    assert sorted(run.records["leg"].unique()) == sorted(["vanilla_0", "strict_g2", "strict_g6", "relaxed_g6_x0.693"])
    assert len(run.records) == 4 * 5
    assert run.records.groupby("leg")["leg_index"].first().to_dict() == {
        "vanilla_0": 0, "strict_g2": 1, "strict_g6": 4, "relaxed_g6_x0.693": 5}
    failed = run.legs.set_index("leg").loc["vanilla_1"]
    assert "synthetic engine crash" in failed["error"]
    g6 = run.legs.set_index("leg").loc["strict_g6"]
    assert g6["gamma"] == 6 and g6["tier"] == "strict" and g6["spec_num_drafts"] > 0
    assert run.config["experiment"] == "E1" and run.env["patch_fingerprint"] == "synthetic"
    assert run.experiment == "E1" and run.run_id == rdir.name
    rel = run.records[run.records["leg"] == "relaxed_g6_x0.693"]
    assert (rel["relax_logtau"] == 0.693).all()


def test_unplanned_leg_folder_comes_after_plan(tmp_path):
    rdir = write_run(tmp_path, n_prompts=2)
    extra = write_run(tmp_path / "other", n_prompts=2, legs=[{"name": "zz_extra", "tier": "vanilla"}])
    (rdir / "legs" / "zz_extra").mkdir()
    for f in ("records.jsonl", "summary.json"):
        (rdir / "legs" / "zz_extra" / f).write_text((extra / "legs" / "zz_extra" / f).read_text())
    run = load_run(rdir)
    assert run.legs_order[-1] == "zz_extra"
    assert (run.records["leg"] == "zz_extra").sum() == 2


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="run.json"):
        load_run(tmp_path)
    rdir = write_run(tmp_path, n_prompts=3)
    recs = rdir / "legs" / "strict_g6" / "records.jsonl"
    lines = recs.read_text().splitlines()
    recs.write_text("\n".join(lines[:2] + ["{not json"]) + "\n")
    with pytest.raises(ValueError, match=r"records.jsonl:3"):
        load_run(rdir)
    recs.write_text("\n".join(lines[:2]) + "\n")
    with pytest.raises(ValueError, match="n_prompts=3"):
        load_run(rdir)
    bad = json.loads(lines[0])
    del bad["tok_s"]
    recs.write_text("\n".join([json.dumps(bad)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match=r"records.jsonl:1: record lacks field\(s\) \['tok_s'\]"):
        load_run(rdir)


def test_record_in_wrong_leg_folder_is_rejected(tmp_path):
    rdir = write_run(tmp_path, n_prompts=2)
    recs = rdir / "legs" / "strict_g6" / "records.jsonl"
    recs.write_text(recs.read_text().replace('"leg": "strict_g6"', '"leg": "vanilla_0"'))
    with pytest.raises(ValueError, match="lies in leg folder 'strict_g6'"):
        load_run(rdir)


def test_list_runs_counts(tmp_path):
    write_run(tmp_path, run_id="20260101T000000Z-aaaa", n_prompts=2, failed=("vanilla_1",))
    write_run(tmp_path, run_id="20260102T000000Z-bbbb", n_prompts=2)
    write_run(tmp_path, experiment="E4", run_id="20260103T000000Z-cccc", n_prompts=2, incomplete=("strict_g6",))
    runs = list_runs(tmp_path)
    assert list(runs["run_id"]) == ["20260101T000000Z-aaaa", "20260102T000000Z-bbbb", "20260103T000000Z-cccc"]
    first = runs.iloc[0]
    assert (first["n_legs"], first["n_complete"], first["n_failed"]) == (3, 2, 1)
    assert runs.iloc[2]["n_incomplete"] == 1
    assert list(list_runs(tmp_path, "E4")["experiment"]) == ["E4"]
    with pytest.raises(FileNotFoundError):
        list_runs(tmp_path / "nope")


def test_names_and_ids():
    rid = new_run_id(datetime(2026, 11, 29, 10, 15, 0, tzinfo=timezone.utc))
    assert re.fullmatch(r"20261129T101500Z-[0-9a-f]{8}", rid)
    assert len({new_run_id() for _ in range(50)}) > 1
    assert run_dir("results", "E1", rid) == Path("results") / "E1" / rid
    assert leg_dir("results/E1/x", "strict_g6") == Path("results/E1/x/legs/strict_g6")
    for bad in ("../up", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="invalid leg name"):
            leg_dir("r", bad)
    with pytest.raises(ValueError, match="timezone"):
        new_run_id(datetime(2026, 1, 1))


def test_git_state_names_changed_files_whole(tmp_path, monkeypatch):
    """env.json's changed_files are whole paths (the first one lost a character before)."""
    import subprocess

    from workbench import envcapture

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "README.md").write_text("a\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "README.md"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    (tmp_path / "README.md").write_text("b\n")
    monkeypatch.setattr(envcapture, "REPO_ROOT", tmp_path)
    state = envcapture.git_state()
    assert state["dirty"] is True and state["changed_files"] == ["README.md"]


def test_git_state_outside_a_checkout_takes_the_named_commit(tmp_path, monkeypatch):
    """A `git archive` copy (no .git) records the commit it was made from when WORKBENCH_GIT_COMMIT names it."""
    from workbench import envcapture

    monkeypatch.setattr(envcapture, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("WORKBENCH_GIT_COMMIT", raising=False)
    assert envcapture.git_state()["commit"] is None
    monkeypatch.setenv("WORKBENCH_GIT_COMMIT", "630539f")
    state = envcapture.git_state()
    assert state["commit"] == "630539f" and "WORKBENCH_GIT_COMMIT" in state["note"]


def test_a_named_commit_wins_over_a_stale_checkout_head(monkeypatch):
    """A tree sent to a GPU host can carry an older .git: the commit the sender names is the one recorded."""
    from workbench import envcapture

    monkeypatch.setenv("WORKBENCH_GIT_COMMIT", "0123abc")
    state = envcapture.git_state()
    head = envcapture._git("rev-parse", "HEAD")
    assert state["commit"] == "0123abc" and state["checkout_head"] == head and "checkout_head" in state["note"]
    monkeypatch.setenv("WORKBENCH_GIT_COMMIT", head[:7])  # naming the checkout's own commit changes nothing
    assert envcapture.git_state()["commit"] == head
