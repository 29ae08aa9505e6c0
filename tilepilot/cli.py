"""The `tilepilot` command: matrix check, env, cases, pilot, publish, gate.

Every command validates matrix.toml first; a UserError becomes one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tilepilot import matrix
from tilepilot.errors import UserError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilepilot", description=__doc__)
    p.add_argument("--matrix", type=Path, default=matrix.DEFAULT_PATH, help="path to matrix.toml")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matrix", help="matrix.toml commands")
    m.add_argument("action", choices=["check"])
    sub.add_parser("env", help="print the environment capture")
    c = sub.add_parser("cases", help="list the case ids")
    c.add_argument("--cases", default=None, help="fnmatch globs over case ids, comma-separated")
    r = sub.add_parser("pilot", help="build, correctness, measure, publish for one device")
    r.add_argument("--device", required=True)
    r.add_argument("--host", action="store_true", help="run in this environment, not the pinned image")
    r.add_argument("--cases", default=None, help="fnmatch globs over case ids, comma-separated")
    r.add_argument("--workers", type=int, default=None, help="compile workers (default: all cores)")
    r.add_argument("--trials", type=int, default=3)
    r.add_argument("--no-publish", action="store_true")
    r.add_argument("--cold", choices=["changed", "always"], default="changed",
                   help="cold compiles: measure only kernels whose source, config or stack changed (default), or all")  # fmt: skip
    r.add_argument("--rebuild", action="store_true", help="container mode: build the image even if its tag exists")
    r.add_argument("--wheelhouse", type=Path, default=None, help="container mode: install wheels from DIR, offline")
    i = sub.add_parser("image", help="the device's pinned image: lock, render, build")
    i.add_argument("action", choices=["lock", "render", "build", "tag"])
    i.add_argument("--device", required=True)
    i.add_argument("--rebuild", action="store_true")
    i.add_argument("--wheelhouse", type=Path, default=None, help="resolve (lock) or install (build) from DIR")
    sub.add_parser("publish", help="asv publish into html/")
    g = sub.add_parser("gate", help="the release gate for a commit")
    g.add_argument("--commit", default="HEAD")
    g.add_argument("--out", type=Path, default=None, help="where gate.json and gate.md go (default: gate/)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.matrix != matrix.DEFAULT_PATH:  # the pilot's subprocesses (pytest, asv) read the same one
        os.environ["TILEPILOT_MATRIX"] = str(args.matrix.resolve())
        matrix.DEFAULT_PATH = args.matrix.resolve()
    try:
        mx = matrix.load(args.matrix)
        if args.cmd == "matrix":
            print(f"{args.matrix}: ok: {len(mx.devices)} devices, gate requires {', '.join(mx.gate.required)}")
            return 0
        if args.cmd == "env":
            from tilepilot import envinfo

            print(json.dumps(envinfo.capture(), indent=1))
            return 0
        if args.cmd == "cases":
            from tilepilot import cases

            for case in cases.expand(mx, args.cases):
                print(case.id)
            return 0
        if args.cmd == "pilot":
            from tilepilot import pilot

            return pilot.pilot(args.device, host=args.host, pattern=args.cases, workers=args.workers,
                               trials=args.trials, matrix_path=args.matrix, publish=not args.no_publish,
                               cold=args.cold, rebuild=args.rebuild, wheelhouse=args.wheelhouse)  # fmt: skip
        if args.cmd == "image":
            from tilepilot import containers

            mx.device(args.device)
            if args.action == "lock":
                print(f"tilepilot: wrote {containers.lock(mx, args.device, args.wheelhouse)}")
            elif args.action == "render":
                print(containers.render(mx, args.device, wheelhouse=args.wheelhouse is not None), end="")
            elif args.action == "tag":
                print(containers.image_tag(mx, args.device, containers.client(), args.wheelhouse is not None))
            else:
                print(containers.build(mx, args.device, rebuild=args.rebuild, wheelhouse=args.wheelhouse))
            return 0
        if args.cmd == "publish":
            from tilepilot import history

            return history.publish()
        if args.cmd == "gate":
            from tilepilot import gate

            return gate.gate(args.commit, args.matrix, args.out or gate.OUT)
    except UserError as exc:
        print(f"tilepilot: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 2


if __name__ == "__main__":
    sys.exit(main())
