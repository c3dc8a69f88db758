"""Command line for data sets: `python -m workbench.datasets fetch|verify|build-tiny|pid-list`.

`add_cli(subparsers)` mounts `fetch` and `verify` on another argparse tree
(the main `workbench data ...` command).
"""

from __future__ import annotations

import argparse
import sys

from workbench.datasets._common import DatasetError
from workbench.prompts import PromptError


def _fetch(args) -> int:
    from workbench.datasets import fetch

    kw = {"force": args.force}
    if args.revision:
        kw["revision"] = args.revision
    if args.repo_id:
        kw["repo_id"] = args.repo_id
    if args.stand_in_images:
        kw["stand_in_images"] = True
    if args.stand_in_max_side:
        if args.name != "mathvista":
            raise DatasetError("--stand-in-max-side applies to MathVista only")
        kw["stand_in_max_side"] = args.stand_in_max_side
    out = fetch(args.name, source=args.source, out=args.out, **kw)
    from workbench.datasets._common import read_manifest

    m = read_manifest(out)
    rows = ", ".join(f"{k}: {v}" for k, v in m["rows"].items())
    print(f"fetched {m['dataset']} into {out} ({rows}; {len(m['images'])} images; "
          f"revision {m['revision']}; licence {m['licence']})")
    if m.get("images_are_stand_ins"):
        print(f"NOTE: {len(m.get('stand_in_pids', []))} image(s) are synthetic stand-ins; "
              f"accuracy on them is meaningless")
    if m["source"].get("kind") == "hub" and args.revision is None:
        print(f"to pin this revision, set it in data/hub_revisions.json: {m['revision']}")
    return 0


def _verify(args) -> int:
    from workbench.datasets import verify

    m = verify(args.target)
    print(f"ok: {m['dataset']} matches its manifest ({len(m['files'])} files, {len(m['images'])} images)")
    return 0


def _build_tiny(args) -> int:
    from workbench.datasets.tiny_set import build

    prompts = build(args.out)
    print(f"wrote {len(prompts)} tiny prompts")
    return 0


def _pid_list(args) -> int:
    from workbench.datasets import mathvista
    from workbench.datasets.pid_lists import write_seed20

    _, rows, _, _ = mathvista.load_rows(args.source)
    print(f"wrote {write_seed20(rows)}")
    return 0


def add_cli(subparsers) -> None:
    """Add `fetch` and `verify` to an argparse subparsers object; each sets `func(args) -> exit code`."""
    p = subparsers.add_parser("fetch", help="materialise MathVista or MM-Vet into data/<name>/ with a manifest")
    p.add_argument("name", choices=["mathvista", "mmvet"])
    p.add_argument("--from", dest="source", default=None,
                   help="local copy: JSON layout / original layout folder, parquet file or folder, or a "
                        "fetched folder (default: the Hugging Face hub)")
    p.add_argument("--out", default=None, help="output folder (default data/mathvista or data/mm-vet)")
    p.add_argument("--revision", default=None, help="hub revision (default: data/hub_revisions.json)")
    p.add_argument("--repo-id", default=None, help="hub repository (default: data/hub_revisions.json)")
    p.add_argument("--stand-in-images", action="store_true",
                   help="MathVista: draw synthetic stand-ins where the source has no images (marked as such)")
    p.add_argument("--stand-in-max-side", type=int, default=None,
                   help="MathVista: shrink stand-ins to this longest side (e.g. 320 for the tiny profile)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=_fetch)
    v = subparsers.add_parser("verify", help="check a fetched folder against its manifest")
    v.add_argument("target", help="mathvista, mmvet, or a folder path")
    v.set_defaults(func=_verify)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.datasets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_cli(sub)
    t = sub.add_parser("build-tiny", help="redraw the built-in tiny prompt set")
    t.add_argument("--out", default=None)
    t.set_defaults(func=_build_tiny)
    q = sub.add_parser("pid-list", help="rebuild data/pid_lists/mathvista_testmini_seed20.json")
    q.add_argument("source", help="a MathVista source (JSON layout, parquet, or fetched folder)")
    q.set_defaults(func=_pid_list)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (DatasetError, PromptError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
