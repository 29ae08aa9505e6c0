"""The `tilepilot` command: matrix check, env, cases, pilot, image, publish, gate; submit, status,
collect and merge for a cluster; ci render for GitHub Actions; ab and pin-stack for a new stack.

Every command validates matrix.toml first; a UserError becomes one line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from tilepilot import matrix, paths
from tilepilot.errors import UserError

EXAMPLES = """\
examples:
  # the pilot for an H100/H200 host, in this environment (the pinned stack: README, Set-up)
  tilepilot pilot --device sm90 --host

  # on a machine without the GPU: build and check the kernels only, on whatever stack is here
  tilepilot pilot --device sm90 --host --compile-only --allow-unpinned --cases '*/tiny-16/*'

  # the release verdict for the checked-out commit: gate/gate.md, exit 0 only on PASS
  tilepilot gate --commit HEAD
"""


class _Parser(argparse.ArgumentParser):
    """Bad flags get one line (not the usage block), naming the flag; exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse turns the ValueError into one line, exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number > 0")
    return value


def stack_item(text: str) -> tuple[str, str]:
    """An argparse type: KEY=VERSION for --stack, KEY one of tilelang, torch."""
    key, _, version = text.partition("=")
    if key not in ("tilelang", "torch") or not version.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not tilelang=VERSION or torch=VERSION")
    return key, version.strip()


STACK_HELP = (
    "an A/B side: KEY=VERSION (tilelang=0.1.14, torch=2.12.0; repeatable) over the device's pins. Container "
    "mode builds the side's own image (its lock containers/locks/<device>__<side>.lock, its content hash); "
    "host mode checks that this environment holds it. The run is filed under its own machine name"
)


def _parser() -> argparse.ArgumentParser:
    from tilepilot import merge  # its docstring is `merge --help`: the rules, the messages, the exit status

    p = _Parser(
        prog="tilepilot", description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--matrix",
        type=Path,
        default=None,
        help="path to matrix.toml (default: $TILEPILOT_MATRIX, else matrix.toml; the gate: the commit's)",
    )
    sub = p.add_subparsers(
        dest="cmd",
        required=True,
        metavar="COMMAND",
        help="one of these (COMMAND --help: its flags)",
        parser_class=_Parser,
    )
    m = sub.add_parser("matrix", help="matrix.toml commands")
    m.add_argument("action", choices=["check"], help="check: validate matrix.toml (one line per problem, exit 2)")
    sub.add_parser("env", help="print the environment capture")
    c = sub.add_parser("cases", help="list the case ids")
    c.add_argument("--cases", default=None, help="fnmatch globs over case ids, comma-separated")
    r = sub.add_parser(
        "pilot",
        help="build, correctness, measure, publish for one device",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("--device", required=True, help="the matrix.toml device to run for (sm90, sm80, gfx942, ...)")
    r.add_argument("--host", action="store_true", help="run in this environment, not the pinned image")
    r.add_argument("--cases", default=None, help="fnmatch globs over case ids, comma-separated")
    r.add_argument("--workers", type=positive_int, default=None, help="compile workers (default: all cores)")
    r.add_argument(
        "--trials",
        type=positive_int,
        default=3,
        help="correctness trials per case, each on fresh seeded inputs (default: 3)",
    )
    r.add_argument(
        "--no-publish", action="store_true", help="leave html/ as it is (asv publish is `tilepilot publish`)"
    )
    r.add_argument(
        "--cold",
        choices=["changed", "always"],
        default="changed",
        help="cold compiles: measure only kernels whose source, config or stack changed (default), or all",
    )
    r.add_argument(
        "--compile-only",
        action="store_true",
        help="without the device's GPU: build and check the kernels, measure nothing (otherwise exit 2)",
    )
    r.add_argument(
        "--allow-unpinned",
        action="store_true",
        help="run on a stack that differs from the device's pins; the records list the differences "
        "(`unpinned`) and the gate fails the run (otherwise exit 2)",
    )
    r.add_argument("--stack", type=stack_item, action="append", default=[], metavar="KEY=VERSION", help=STACK_HELP)
    r.add_argument("--rebuild", action="store_true", help="container mode: build the image even if its tag exists")
    r.add_argument("--wheelhouse", type=Path, default=None, help="container mode: install wheels from DIR, offline")
    i = sub.add_parser("image", help="the device's pinned image: lock, render, build; its base: pin, check")
    i.add_argument(
        "action",
        choices=["lock", "render", "build", "tag", "pin", "check"],
        help="lock: write containers/locks/<device>.lock; render: print the Dockerfile; build: build or "
        "reuse the image; tag: print its tag; pin: resolve base_image's tag to its digest and write it "
        "into matrix.toml's base_digest; check: each pinned base still resolves and its tag has not moved "
        "(exit 1 when one has)",
    )
    i.add_argument(
        "--device", default=None, help="the matrix.toml device whose image it is (check: default every device)"
    )
    i.add_argument("--rebuild", action="store_true", help="build the image even if its tag exists")
    i.add_argument("--stack", type=stack_item, action="append", default=[], metavar="KEY=VERSION", help=STACK_HELP)
    i.add_argument("--wheelhouse", type=Path, default=None, help="resolve (lock) or install (build) from DIR")
    i.add_argument(
        "--from",
        dest="source",
        choices=["auto", "pypi", "torch-index"],
        default="auto",
        help="lock: resolve from PyPI alone, or from the row's torch_index with PyPI (default auto: PyPI "
        "where it has the row's torch build, CPU and CUDA; the torch index for ROCm)",
    )
    sub.add_parser("publish", help="asv publish into html/")
    t = sub.add_parser("tune", help="autotune the representative cases whose pinned config passes correctness (GPU)")
    t.add_argument("--device", required=True, help="the matrix.toml device to tune for; its GPU must be here")
    t.add_argument("--ops", default=None, help="comma-separated operators (default: every operator of matrix.toml)")
    t.add_argument("--cases", default=None, help="fnmatch globs over case ids")
    t.add_argument(
        "--budget-s", type=positive_float, default=480.0, help="stop starting new cases after this many seconds"
    )
    sm = sub.add_parser("submit", help="the device matrix on a cluster: one pilot job per device, then merge + gate")
    sm.add_argument("--engine", choices=["slurm"], required=True, help="the scheduler to submit to")
    sm.add_argument(
        "--devices", default=None, help="comma-separated device ids (default: every device with a slurm table)"
    )
    sm.add_argument("--cases", default=None, help="passed to each pilot: fnmatch globs over case ids")
    sm.add_argument(
        "--workdir", type=Path, default=None, help="where job scripts, logs and staging trees go (default: jobs/)"
    )
    sm.add_argument("--gate-partition", default="", help="partition of the merge/gate job (default: the cluster's)")
    sm.add_argument(
        "--on-duplicate",
        choices=["refuse", "keep-both"],
        default="refuse",
        help="when a machine's results of the commit are already in the history",
    )
    st = sub.add_parser("status", help="the state of each device's job in a submission")
    st.add_argument("--submission", default=None, help="its id or folder (default: the newest)")
    st.add_argument("--workdir", type=Path, default=None, help="where the submissions are (default: jobs/)")
    co = sub.add_parser("collect", help="(the gate job) final job states, merge, publish, gate")
    co.add_argument("--submission", required=True, help="the submission's id or folder")
    mg = sub.add_parser(
        "merge",
        help="merge results trees (job staging folders, CI artifacts) into the history",
        description=merge.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mg.add_argument("sources", nargs="*", type=Path, help="results trees to merge (each like results/)")
    mg.add_argument("--into", type=Path, default=None, help="the history to merge into (default: results/)")
    mg.add_argument(
        "--on-duplicate",
        choices=["refuse", "keep-both"],
        default="refuse",
        help="a second result of the same machine, commit and case: stop (default) or keep both runs' samples",
    )
    mg.add_argument(
        "--lock-timeout",
        type=float,
        default=merge.LOCK_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long to wait for another merge into the same history (default: {merge.LOCK_TIMEOUT_S:g})",
    )
    ci = sub.add_parser("ci", help="GitHub Actions: render .github/workflows/pilot.yml from matrix.toml")
    ci.add_argument("action", choices=["render"], help="render: write the workflow and actionlint's config")
    ci.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="the folder that gets workflows/pilot.yml and actionlint.yaml, and nothing outside it "
        "(default: the repository's .github)",
    )
    g = sub.add_parser(
        "gate",
        help="the release gate for a commit",
        description="Judge the code commit's evidence on every device of matrix.toml. Exit status: 0 PASS, "
        "1 FAIL (a verdict), 2 bad input (a flag, matrix.toml, the commit), 3 an internal error (traceback "
        "in a log file).",
    )
    g.add_argument(
        "--commit", default="HEAD", help="the revision to judge (default HEAD); its last code commit is judged"
    )
    g.add_argument(
        "--out", type=Path, default=None, help="where gate.json and gate.md go (default: $TILEPILOT_GATE, else gate/)"
    )
    g.add_argument(
        "--results",
        type=Path,
        default=None,
        help="the results tree to judge (default: $TILEPILOT_RESULTS, else results/)",
    )
    ab = sub.add_parser(
        "ab",
        help="A/B of two stacks at one code commit: SAFE TO UPGRADE or BLOCKED (exit 1)",
        description="Compare the two sides (runs filed under each stack, tilepilot.stack) of one code commit "
        "and device, case by case; write <out>/<device>-<base>-vs-<new>.md and .json. Exit status: 0 SAFE TO "
        "UPGRADE, 1 BLOCKED, 2 bad input.",
    )
    ab.add_argument("--device", required=True, help="the matrix.toml device whose sides are compared")
    ab.add_argument("--tilelang", default=None, metavar="BASE,NEW", help="the two TileLang versions, base first")
    ab.add_argument("--torch", default=None, metavar="BASE,NEW", help="the two torch versions, base first")
    ab.add_argument("--commit", default="HEAD", help="the revision whose code commit both sides ran (default HEAD)")
    ab.add_argument("--machine", default=None, help="the plain machine name, where several hold both sides")
    ab.add_argument(
        "--results", type=Path, default=None, help="the results tree (default: $TILEPILOT_RESULTS, else results/)"
    )
    ab.add_argument("--out", type=Path, default=None, help="where the report goes (default: gate/ab/)")
    ps = sub.add_parser(
        "pin-stack",
        help="move a device's TileLang/torch pin in matrix.toml, only where an A/B report says SAFE TO UPGRADE",
    )
    ps.add_argument("device", nargs="?", default=None, help="the matrix.toml device whose pin moves")
    ps.add_argument(
        "--device", dest="device_flag", default=None, help="the same, as a flag (as other commands take it)"
    )
    ps.add_argument("--tilelang", default=None, help="the new TileLang pin")
    ps.add_argument("--torch", default=None, help="the new torch pin")
    ps.add_argument(
        "--from-ab", "--from", dest="report", type=Path, required=True, help="the `tilepilot ab` report (.json)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    where = paths.Paths.from_env()  # every path this command uses, resolved once
    # The gate judges a commit against its own matrix.toml unless one is named (flag or environment).
    named_matrix = args.matrix is not None or bool(os.environ.get("TILEPILOT_MATRIX"))
    if args.matrix is None:
        args.matrix = where.matrix
    elif args.matrix != where.matrix:  # the pilot's children and asv read the same one
        os.environ["TILEPILOT_MATRIX"] = str(args.matrix.resolve())
        where = dataclasses.replace(where, matrix=args.matrix.resolve())
    paths.use(where)
    try:
        mx = matrix.load(args.matrix)
        if args.cmd in ("matrix", "cases", "pilot", "tune", "submit", "gate"):
            # What each operator's shapes must hold, its harness says (importing it imports torch):
            # for the commands that run or judge operators, not those that move files.
            from tilepilot import registry

            registry.check(mx, args.matrix)
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

            return pilot.pilot(
                args.device,
                host=args.host,
                pattern=args.cases,
                workers=args.workers,
                trials=args.trials,
                matrix_path=args.matrix,
                publish=not args.no_publish,
                cold=args.cold,
                rebuild=args.rebuild,
                wheelhouse=args.wheelhouse,
                compile_only=args.compile_only,
                allow_unpinned=args.allow_unpinned,
                over=dict(args.stack) or None,
            )
        if args.cmd == "image":
            return _image(args, mx)
        if args.cmd == "publish":
            from tilepilot import history

            return history.publish()
        if args.cmd == "tune":
            from tilepilot import cases, tune

            ops = [o for o in args.ops.split(",") if o] if args.ops else list(mx.operators)
            bad = [o for o in ops if o not in mx.operators]
            if bad:
                raise UserError(f"--ops {bad[0]!r}: not an operator of matrix.toml ({', '.join(mx.operators)})")
            mx.device(args.device)
            # Before the GPU is looked for: a pattern that selects nothing is a typo, wherever it runs.
            if not [c for c in cases.expand(mx, args.cases) if c.group == "representative" and c.op in ops]:
                raise UserError(
                    f"--cases {args.cases!r} matches no representative {'/'.join(ops)} case in matrix.toml "
                    "(`tilepilot cases` lists them)"
                )
            return tune.tune(args.device, ops, args.cases, args.budget_s, args.matrix)
        if args.cmd == "submit":
            from tilepilot import slurm

            devices = args.devices.split(",") if args.devices else [d for d, r in mx.devices.items() if r.slurm]
            if not devices:
                raise UserError(f"{args.matrix}: no device has a [devices.<id>.slurm] table to submit")
            sub = slurm.submit(
                mx,
                devices,
                args.matrix.resolve(),
                workdir=args.workdir,
                pilot_args=["--cases", args.cases] if args.cases else [],
                gate_partition=args.gate_partition,
                on_duplicate=args.on_duplicate,
            )
            for d, j in sub["devices"].items():
                print(f"tilepilot: {d}: slurm job {j['job']} ({j['script']})")
            print(
                f"tilepilot: merge, publish, gate: slurm job {sub['gate']['job']} (afterany); "
                f"`tilepilot status --submission {sub['id']}` shows them"
            )
            return 0
        if args.cmd == "status":
            from tilepilot import slurm

            return slurm.status(args.submission, args.workdir)
        if args.cmd == "collect":
            from tilepilot import slurm

            return slurm.collect(args.submission)
        if args.cmd == "merge":
            from tilepilot import merge

            into = args.into or paths.current().results
            if not args.sources:
                print("tilepilot: merge: no sources given, nothing to merge")
                return 0
            print(merge.report(merge.merge(args.sources, into, args.on_duplicate, args.lock_timeout), into))
            return 0
        if args.cmd == "ci":
            from tilepilot import ci

            print(f"tilepilot: wrote {', '.join(map(str, ci.write(mx, args.out or ci.GITHUB)))}")
            return 0
        if args.cmd == "ab":
            from tilepilot import ab

            mx.device(args.device)
            return ab.run(
                args.device,
                args.tilelang,
                args.torch,
                rev=args.commit,
                machine=args.machine,
                results=args.results,
                out_dir=args.out,
                matrix_path=args.matrix if named_matrix else None,  # else the commit's own, as the gate
            )
        if args.cmd == "pin-stack":
            from tilepilot import ab

            device = args.device or args.device_flag
            if device is None or (args.device and args.device_flag and args.device != args.device_flag):
                raise UserError("pin-stack: name one device: `tilepilot pin-stack sm90 --tilelang X --from-ab REPORT`")
            mx.device(device)
            versions = {k: v for k, v in (("tilelang", args.tilelang), ("torch", args.torch)) if v}
            for line in ab.pin_stack(device, versions, args.report, args.matrix):
                print(f"tilepilot: {line}")
            return 0
        if args.cmd == "gate":
            from tilepilot import gate

            return gate.gate(args.commit, args.matrix if named_matrix else None, args.out, args.results)
    except UserError as exc:
        print(f"tilepilot: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("tilepilot: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # A bug, not bad input: the traceback goes to a file, the terminal gets one line and exit 3.
        log = _internal_error_log()
        print(
            f"tilepilot: internal error in `{args.cmd}` (a bug; please report it): traceback in {log}", file=sys.stderr
        )
        return 3
    return 2


def _image(args: argparse.Namespace, mx: matrix.Matrix) -> int:
    from tilepilot import containers, digests

    if args.action == "check":
        devices = [args.device] if args.device else list(mx.devices)
        for d in devices:
            mx.device(d)
        # The engine only where there is a pin to check: an unpinned base is said without one.
        pinned = any(mx.device(d).base_digest != digests.UNPINNED for d in devices)
        results = digests.check(mx, devices, args.matrix, containers.client() if pinned else None)
        for ok, line in results:
            print(f"tilepilot: {line}", file=sys.stdout if ok else sys.stderr)
        return 0 if all(ok for ok, _ in results) else 1
    if args.device is None:
        raise UserError(f"image {args.action}: --device is required (one of {', '.join(mx.devices)})")
    mx.device(args.device)
    over = dict(args.stack) or None
    if over and args.action == "pin":
        raise UserError("image pin --stack: the base image is the device's, whatever the side; pin it without --stack")
    if args.action == "lock":
        print(f"tilepilot: wrote {containers.lock(mx, args.device, args.wheelhouse, args.source, over)}")
    elif args.action == "pin":
        old, new = digests.pin(mx, args.device, args.matrix, containers.client())
        row = mx.device(args.device)
        same = " (unchanged)" if old == new else f" (was {old})"
        print(f"tilepilot: {args.matrix}: devices.{args.device}.base_digest = {new}{same}: {row.base_image}")
    elif args.action == "render":
        print(containers.render(mx, args.device, wheelhouse=args.wheelhouse is not None, over=over), end="")
    elif args.action == "tag":
        print(containers.image_tag(mx, args.device, containers.client(), args.wheelhouse is not None, over))
    else:
        print(containers.build(mx, args.device, rebuild=args.rebuild, wheelhouse=args.wheelhouse, over=over))
    return 0


def _internal_error_log() -> Path:
    import tempfile
    import time
    import traceback

    fd, name = tempfile.mkstemp(prefix=f"tilepilot-error-{time.strftime('%Y%m%dT%H%M%S')}-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(" ".join(sys.argv) + "\n\n" + traceback.format_exc())
    return Path(name)


if __name__ == "__main__":
    sys.exit(main())
