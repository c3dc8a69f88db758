"""What the Ray executor costs: one several-group run under ``local`` and under ``ray`` on this host.

    python benchmarks/bench_ray.py [--leg-s 2] [--gpus 2] [--results DIR]

The run is E4 under the tiny profile with five spec legs (strict + four relaxed), planned with vanilla
legs of its own per bracket (``own_brackets``, as ``--executor ray`` plans it): three bracket groups,
eleven legs. Every leg is a stand-in process that sleeps ``--leg-s`` seconds and writes a leg's files
(no engine), so the wall times measure the executors, not vLLM. Three runs of the same plan:

- ``local``: the legs one after another in this process (today's executor);
- ``ray, 1 GPU``: a local Ray instance with one logical GPU: the groups one after another, so
  (this wall − local's) / groups is Ray's scheduling overhead per group (instance start included);
- ``ray, N GPUs``: the groups side by side on N logical GPUs.

Prints one line per run and the overhead per group; nothing is written outside ``--results``
(a temporary folder by default).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAND_IN_LEG = '''
import json, os, sys, time
cfg = sys.argv[sys.argv.index("--config") + 1]
c = json.load(open(cfg))
here = os.path.dirname(os.path.abspath(cfg))
out = os.path.normpath(os.path.join(here, c["out"]))
prompts = os.path.normpath(os.path.join(here, c["prompts"]))
time.sleep(float(os.environ["BENCH_RAY_LEG_S"]))
spec = c["draft"] is not None
pids = [json.loads(l)["pid"] for l in open(prompts) if l.strip()][: int(c["n"])]
with open(os.path.join(out, "records.jsonl"), "w") as fh:
    for pid in pids:
        fh.write(json.dumps({"pid": pid, "mode": "spec" if spec else "vanilla", "tier": "strict" if spec else
                             "vanilla", "gamma": c["knobs"].get("gamma") if spec else None, "in_len": 1,
                             "gen_len": 1, "t": 1.0, "tok_s": 1.0, "gen_ids": [1], "text": "x"}) + "\\n")
json.dump({"status": "complete", "leg": c["leg"], "mode": "spec" if spec else "vanilla", "n_prompts": len(pids)},
          open(os.path.join(out, "summary.json"), "w"))
'''

SWEEP = ["relax_logtau=0.105,0.288,0.693,1.386"]


def one_run(results: Path, leg: Path, executor: str, gpus: int | None) -> tuple[float, float, int, int]:
    """Wall seconds, Ray's start (or 0), legs and groups of one run of the plan under ``executor``."""
    from workbench import protocol
    from workbench.groups import bracket_groups
    from workbench.planning import PlannedLeg
    from workbench.runfolder import read_json

    rdir = protocol.prepare_run("E4", "tiny", SWEEP, True, results, own_brackets=True,
                                model_paths={"target": "stand-in/target", "twin": "stand-in/twin"})
    legs = [PlannedLeg.from_dict(d) for d in read_json(rdir / "run.json")["legs"]]
    t0 = time.monotonic()
    st = protocol.execute(rdir, runner=[sys.executable, str(leg)], executor=executor, gpus=gpus,
                          log=lambda s: None)
    wall = time.monotonic() - t0
    if set(st.values()) != {"complete"}:
        raise SystemExit(f"{rdir}: legs not complete: {st}")
    start = (read_json(rdir / "protocol.json").get("executor") or {}).get("start_s") or 0.0
    return wall, start, len(legs), len(bracket_groups(legs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leg-s", type=float, default=2.0, help="seconds each stand-in leg takes (default 2)")
    ap.add_argument("--gpus", type=int, default=2, help="logical GPUs of the side-by-side run (default 2)")
    ap.add_argument("--results", default=None, help="results root (default: a temporary folder)")
    args = ap.parse_args(argv)
    os.environ["BENCH_RAY_LEG_S"] = str(args.leg_s)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        results = Path(args.results or tmp)
        leg = Path(tmp) / "stand_in_leg.py"
        leg.write_text(STAND_IN_LEG)
        local, _, n_legs, n_groups = one_run(results, leg, "local", None)
        serial, start, _, _ = one_run(results, leg, "ray", 1)
        side, start2, _, _ = one_run(results, leg, "ray", args.gpus)
    print(f"E4 tiny, {n_legs} stand-in legs of {args.leg_s:g} s in {n_groups} bracket groups, on one host")
    print(f"  local                 {local:7.1f} s")
    print(f"  ray, 1 GPU            {serial:7.1f} s   (groups one after another; local instance start {start:.1f} s)")
    print(f"  ray, {args.gpus} GPUs           {side:7.1f} s   (groups side by side; {local / side:.2f}x local; "
          f"start {start2:.1f} s)")
    print(f"  Ray scheduling overhead per group: {(serial - local - start) / n_groups:.2f} s "
          f"((ray 1 GPU - local - instance start) / {n_groups} groups); the instance starts once per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
