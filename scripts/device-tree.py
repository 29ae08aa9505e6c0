"""The commit a device call measures, without carrying the history (scripts/device-bundle.sh, h200-pilot.sh).

    python3 scripts/device-tree.py write OUT_DIR     # here, on a clean checkout
    python3 scripts/device-tree.py check OUT_DIR     # there, in the carried tree: prints git.json

A call carries at most 64 MiB, and the history (results/, 24 MB packed and about 1 MB more with each
pilot) no longer fits beside TileLang's site. So the history stays here, and the call carries:
- git.json: the identity the pilot records (tilepilot.envinfo.git(): the code commit, HEAD, the date),
  handed to it as TILEPILOT_GIT, as the image's pilot gets it in container mode;
- manifest: every tracked file that travels (all but results/, save asv's benchmarks.json and
  machine.json files), with its git blob hash and mode: `check` refuses a carried tree that differs
  from it in any file, or has one more file that git would not ignore, so that a run is never
  filed under a commit whose code it did not run;
- pack-*.pack/.idx: the code commit and its trees, no blobs, which `check` installs as a shallow
  repository: asv resolves the commit, its date and HEAD through git (`asv run --set-commit-hash`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What of results/ travels: what asv's run reads of its results folder. The rest (records, asv
# results, reproducers, logs) is history the pilot never reads.
KEPT = ("results/asv/benchmarks.json",)
SPARSE = ["/*", "!/results/", "/results/asv/benchmarks.json", "/results/asv/*/machine.json"]


def travels(path: str) -> bool:
    if not path.startswith("results/"):
        return True
    parts = path.split("/")
    return path in KEPT or (len(parts) == 4 and parts[1] == "asv" and parts[3] == "machine.json")


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def blob_hash(data: bytes) -> str:
    """git's object id of a blob with these bytes (a file's content, or a link's target)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write(out: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from tilepilot import envinfo

    os.environ.pop("TILEPILOT_GIT", None)  # this checkout's git, not an identity handed in
    ident = envinfo.git()
    if ident["dirty"] or ident["dirty"] is None:
        print(
            "device-tree: the checkout has uncommitted changes: commit them (a dirty run is never judged)",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for line in _git("ls-tree", "-r", "-z", "HEAD").split("\0"):  # the commit's files, not the index
        if line:
            meta, path = line.split("\t", 1)
            mode, kind, sha = meta.split()
            if travels(path) and kind == "blob":  # a submodule's commit is no file
                rows.append(f"{mode} {sha} {path}")
    (out / "manifest").write_text("\n".join(rows) + "\n", encoding="utf-8")
    # What check would refuse there is refused here, before a machine is started for it: an untracked
    # file (say a merged tree unpacked into the checkout), a change that envinfo does not count.
    diff = differences(out, ROOT, home=True)
    if diff:
        (out / "manifest").unlink()
        print(
            f"device-tree: this checkout would not pass the device's check ({len(diff)} files): " + "; ".join(diff[:5]),
            file=sys.stderr,
        )
        return 2
    (out / "git.json").write_text(json.dumps(ident) + "\n", encoding="utf-8")
    for old in out.glob("pack-*"):
        old.unlink()
    objects = _git("rev-list", "--objects", "--no-object-names", "--filter=blob:none", "-n", "1", ident["commit"])
    subprocess.run(["git", "pack-objects", "-q", str(out / "pack")], input=objects, cwd=ROOT, text=True, check=True)
    return 0


def _ignored(paths: list[str], cwd: Path) -> set[str]:
    if not paths:
        return set()
    r = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin", "-z"],
        input="\0".join(paths),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    return set(filter(None, r.stdout.split("\0")))


def differences(bundle: Path, cwd: Path, home: bool = False) -> list[str]:
    """What in the tree at `cwd` is not the manifest's: changed, missing, or extra files. At home the
    history is there (results/, which the manifest mostly leaves out) and is not walked."""
    want: dict[str, tuple[str, str]] = {}
    for row in (bundle / "manifest").read_text(encoding="utf-8").splitlines():
        mode, sha, path = row.split(" ", 2)
        want[path] = (mode, sha)
    out = []
    for path, (mode, sha) in sorted(want.items()):
        p = cwd / path
        if mode == "120000":
            ok = p.is_symlink() and blob_hash(os.readlink(p).encode()) == sha
        else:
            ok = p.is_file() and not p.is_symlink() and blob_hash(p.read_bytes()) == sha
            ok = ok and (mode == "100755") == os.access(p, os.X_OK)
        if not ok:
            out.append(f"{'changed' if p.exists() or p.is_symlink() else 'missing'}: {path}")
    bundles = {bundle.resolve()}
    extra = []
    for dirpath, dirnames, filenames in os.walk(cwd):
        here = Path(dirpath)
        if here == cwd and home:
            dirnames[:] = [d for d in dirnames if d != "results"]
        # A link to a folder travels as a link: it is a file here, never walked into.
        filenames += [d for d in dirnames if (here / d).is_symlink()]
        dirnames[:] = [
            d for d in dirnames if d != ".git" and not (here / d).is_symlink() and (here / d).resolve() not in bundles
        ]
        rel = here.relative_to(cwd)
        for f in filenames:
            if here == cwd and f == ".git":  # a worktree's .git is a file naming its repository
                continue
            path = str(rel / f) if str(rel) != "." else f
            # What the run writes under results/ is its output, not the code it measures.
            if path not in want and not path.startswith("results/"):
                extra.append(path)
    out += [f"untracked: {p}" for p in sorted(set(extra) - _ignored(extra, cwd))]
    return out


def own_history(cwd: Path) -> bool:
    """A repository where HEAD has ancestors: the home checkout, a worktree of it, a clone of some
    depth (session 22: a shallow install there cut the history and the gate failed closed, finding
    no ancestor), or the device copy's .git when the lending tool made commits of its own."""
    count = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=cwd, capture_output=True, text=True, check=False)
    return count.returncode == 0 and count.stdout.strip().isdigit() and int(count.stdout) > 1


def holds(commit: str, cwd: Path) -> bool:
    """Whether the repository knows the commit and its date (what asv asks git)."""
    r = subprocess.run(
        ["git", "rev-list", "-n", "1", "--format=%at", commit], cwd=cwd, capture_output=True, text=True, check=False
    )
    return r.returncode == 0 and r.stdout.split()[-1:] != [] and r.stdout.split()[-1].isdigit()


def check(bundle: Path, cwd: Path) -> int:
    for name in ("manifest", "git.json"):
        if not (bundle / name).is_file():
            print(
                f"device-tree: {bundle / name} is missing: run scripts/device-bundle.sh and carry {bundle}",
                file=sys.stderr,
            )
            return 2
    ident = json.loads((bundle / "git.json").read_text(encoding="utf-8"))
    # A repository that holds the commit with its ancestors (the home checkout) is never written to:
    # a one-commit shallow install would cut its history at HEAD. The device's copy has a .git of its
    # own, with no commits (2026-12-02) or commits of the lending tool's (2026-12-07), never this one.
    known = own_history(cwd) and holds(ident["commit"], cwd)
    diff = differences(bundle, cwd)
    if diff:
        print(
            f"device-tree: the carried tree is not {bundle}'s commit ({len(diff)} files; run scripts/device-bundle.sh at HEAD): "
            + "; ".join(diff[:5]),
            file=sys.stderr,
        )
        return 2
    if known:
        print(json.dumps(ident))
        return 0
    # The code commit as a shallow repository of one commit and its trees: what asv asks git.
    git = cwd / ".git"
    if not git.is_dir():
        _git("init", "-q", cwd=cwd)
    pack_dir = git / "objects" / "pack"
    pack_dir.mkdir(parents=True, exist_ok=True)
    for f in bundle.glob("pack-*"):
        (pack_dir / f.name).write_bytes(f.read_bytes())
    (git / "shallow").write_text(ident["commit"] + "\n", encoding="utf-8")
    _git("update-ref", "HEAD", ident["commit"], cwd=cwd)
    print(json.dumps(ident))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "check"):
        print("usage: device-tree.py write|check BUNDLE_DIR", file=sys.stderr)
        return 2
    bundle = Path(argv[1])
    return write(bundle) if argv[0] == "write" else check(bundle, Path.cwd())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
