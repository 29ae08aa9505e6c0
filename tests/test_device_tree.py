"""scripts/device-tree.py: a device call carries the commit's identity and manifest instead of the history.
Real git throughout: a sparse clone is the checkout a call sends, a copy of it with an empty .git is
the device's tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "scripts/device-tree.py"


def _load() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_tree", ROOT / SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def tool(cmd: str, bundle: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(cwd / SCRIPT), cmd, str(bundle)], cwd=cwd, capture_output=True, text=True, check=False
    )


def _clone(src: Path, at: Path, depth: int | None = None, bundle: Path | None = None) -> Path:
    """A sparse clone of `src` (of that depth, else whole), carrying `bundle` as its .device as a call would."""
    # A depth needs git's file:// transport; a whole clone takes the local one (hard links, fast).
    how = ["--depth", str(depth), f"file://{src}"] if depth else [str(src)]
    git("clone", "-q", "--no-checkout", *how, str(at), cwd=at.parent)
    git("sparse-checkout", "set", "--no-cone", *_load().SPARSE, cwd=at)  # type: ignore[attr-defined]
    git("checkout", "-q", "HEAD", cwd=at)
    if bundle is not None:
        shutil.copytree(bundle, at / ".device")
    return at


def _code_commit(clone: Path) -> str:
    """The code commit the bundle in clone's .device names."""
    return str(json.loads((clone / ".device" / "git.json").read_text())["commit"])


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the sparse checkout a call sends, with its .device written; the device's copy of what travels)."""
    base = tmp_path_factory.mktemp("device-tree")
    clone = _clone(ROOT, base / "clone")
    r = tool("write", clone / ".device", clone)
    assert r.returncode == 0, r.stderr
    dev = base / "dev"
    shutil.copytree(clone, dev, ignore=shutil.ignore_patterns(".git"))
    git("init", "-q", cwd=dev)  # the device's copy has a .git with no commits
    return clone, dev


def test_the_sparse_checkout_is_what_the_manifest_lists(sent: tuple[Path, Path]) -> None:
    clone, _ = sent
    listed = {row.split(" ", 2)[2] for row in (clone / ".device" / "manifest").read_text().splitlines()}
    present = {
        str(p.relative_to(clone))
        for p in clone.rglob("*")
        if (p.is_file() or p.is_symlink()) and p.relative_to(clone).parts[0] not in (".git", ".device")
    }
    assert present == listed
    assert "results/asv/benchmarks.json" in listed and not any(p.startswith("results/records/") for p in listed)


def test_the_device_tree_is_the_commit_and_asv_finds_it(sent: tuple[Path, Path]) -> None:
    clone, dev = sent
    r = tool("check", dev / ".device", dev)
    assert r.returncode == 0, r.stderr
    ident = json.loads(r.stdout)
    code = git(
        "log", "-1", "--format=%H", "HEAD", "--", ".", ":!results", ":!docs", ":!gate", ":!*.md", ":!tests", cwd=clone
    )
    assert ident["commit"] == code.strip() and ident["dirty"] is False
    # What asv asks git about the commit (asv.plugins.git: rev-parse, rev-list --format=%at).
    assert git("rev-parse", "HEAD^{commit}", cwd=dev).strip() == ident["commit"]
    when = git("rev-list", "-n", "1", "--format=%at", ident["commit"], cwd=dev).split()[-1]
    assert when == git("log", "-1", "--format=%at", ident["commit"], cwd=clone).strip()


def test_check_writes_nothing_into_a_checkout_with_its_own_history(sent: tuple[Path, Path]) -> None:
    """`check` installs a one-commit shallow repository where the copy's .git has no commits: in a
    repository with a history (the home checkout, or a device copy that carries its .git, as the
    H100 of 2026-12-07 did) that would cut the history at HEAD, and the gate would find no ancestor.
    There it checks the tree and prints the identity, writing nothing; the device's copy runs again
    once installed (a warm machine's second call)."""
    clone, dev = sent
    before = git("rev-list", "--count", "HEAD", cwd=clone)
    r = tool("check", clone / ".device", clone)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["commit"] == _code_commit(clone)
    assert not (clone / ".git" / "shallow").exists()
    assert git("rev-list", "--count", "HEAD", cwd=clone) == before and int(before) > 1
    for _ in range(2):
        r = tool("check", dev / ".device", dev)
        assert r.returncode == 0, r.stderr


def test_worktree_and_shallow_clone_keep_their_history(sent: tuple[Path, Path], tmp_path: Path) -> None:
    """The history is HEAD's ancestors, wherever git keeps them: a worktree (its .git a file) and a
    shallow clone (a .git/shallow of its own) deep enough to hold the code commit and one ancestor
    pass as the home checkout does, their depth kept. (Its depth is counted from the code commit:
    HEAD may be docs and results commits past it, as many as the day's pilots and notes made.)"""
    clone, _ = sent
    code = _code_commit(clone)
    wt = tmp_path / "wt"
    git("worktree", "add", "-q", "--detach", str(wt), cwd=clone)
    git("sparse-checkout", "set", "--no-cone", *_load().SPARSE, cwd=wt)  # type: ignore[attr-defined]
    shutil.copytree(clone / ".device", wt / ".device")
    past = int(git("rev-list", "--count", f"{code}..HEAD", cwd=clone))
    shallow = _clone(clone, tmp_path / "shallow", past + 2, clone / ".device")
    try:
        for tree in (wt, shallow):
            before = git("rev-list", "--count", "HEAD", cwd=tree)
            r = tool("check", tree / ".device", tree)
            assert r.returncode == 0, r.stderr
            assert git("rev-list", "--count", "HEAD", cwd=tree) == before and int(before) > 1
    finally:
        git("worktree", "remove", "--force", str(wt), cwd=clone)


def test_a_shallow_clone_short_of_the_code_commit_gets_it_as_the_device_does(
    sent: tuple[Path, Path], tmp_path: Path
) -> None:
    """A clone whose depth stops after the code commit (HEAD a results commit past it, depth 1) does
    not hold what asv asks about: the commit is installed as on the device's copy, and asv finds it
    with its date. The history such a clone lacks was never there to cut."""
    clone, _ = sent
    deep = _clone(clone, tmp_path / "deep")
    (deep / "results" / "later.txt").parent.mkdir(parents=True, exist_ok=True)
    (deep / "results" / "later.txt").write_text("a pilot's record, after the code commit\n")
    git("add", "--sparse", "results/later.txt", cwd=deep)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "results only", cwd=deep)
    shallow = _clone(deep, tmp_path / "shallow", 1, clone / ".device")
    code = _code_commit(clone)
    assert subprocess.run(["git", "cat-file", "-e", code], cwd=shallow, check=False).returncode != 0
    r = tool("check", shallow / ".device", shallow)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["commit"] == code
    when = git("rev-list", "-n", "1", "--format=%at", code, cwd=shallow).split()[-1]
    assert when == git("log", "-1", "--format=%at", code, cwd=clone).strip()


def test_a_device_copy_with_commits_of_its_own_gets_the_commit(sent: tuple[Path, Path], tmp_path: Path) -> None:
    """The H100 of 2026-12-07 sent the tree with a .git holding commits of the lending tool's, never
    the bundle's: the commit is installed there as on an empty .git, and asv finds it with its date."""
    clone, dev = sent
    tree = tmp_path / "other"
    shutil.copytree(dev, tree, ignore=shutil.ignore_patterns(".git"))
    git("init", "-q", cwd=tree)
    for n in range(2):
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", f"c{n}", cwd=tree)
    r = tool("check", tree / ".device", tree)
    assert r.returncode == 0, r.stderr
    ident = json.loads(r.stdout)
    assert git("rev-parse", "HEAD^{commit}", cwd=tree).strip() == ident["commit"]
    when = git("rev-list", "-n", "1", "--format=%at", ident["commit"], cwd=tree).split()[-1]
    assert when == git("log", "-1", "--format=%at", ident["commit"], cwd=clone).strip()


@pytest.mark.parametrize("how", ["changed", "untracked", "missing", "mode", "linked-folder"])
def test_a_tree_that_is_not_the_commit_is_refused_in_one_line(
    sent: tuple[Path, Path], tmp_path: Path, how: str
) -> None:
    _, dev = sent
    tree = tmp_path / "dev"
    shutil.copytree(dev, tree, symlinks=True)
    # What a run writes (its records, caches) is not a change to the code.
    (tree / "results" / "records" / "m").mkdir(parents=True)
    (tree / "results" / "records" / "m" / "run.json").write_text("{}")
    (tree / "tilepilot" / "__pycache__").mkdir(exist_ok=True)
    (tree / "tilepilot" / "__pycache__" / "x.pyc").write_bytes(b"")
    assert tool("check", tree / ".device", tree).returncode == 0
    target = tree / "tilepilot" / "gate.py"
    if how == "changed":
        target.write_text(target.read_text() + "\n# edited\n")
    elif how == "untracked":
        (tree / "tilepilot" / "stray.py").write_text("")
        target = tree / "tilepilot" / "stray.py"
    elif how == "missing":
        target.unlink()
    elif how == "mode":
        target.chmod(0o755)
    else:  # a link travels as a link: a folder of code the manifest never named
        target = tree / "tilepilot" / "more"
        target.symlink_to("../kernels")
    r = tool("check", tree / ".device", tree)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(target.relative_to(tree)) in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("README.md", "uncommitted changes"),
        # envinfo does not count results/ as a change to the code; the device's check would refuse it
        ("results/asv/benchmarks.json", "would not pass the device's check"),
        ("merged/results/records/run.json", "would not pass the device's check"),  # an untracked file
    ],
)
def test_a_checkout_the_device_would_refuse_writes_no_bundle(
    sent: tuple[Path, Path], tmp_path: Path, path: str, says: str
) -> None:
    clone, _ = sent
    f = clone / path
    before = f.read_bytes() if f.exists() else None
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes((before or b"") + b"\nedited\n")
    try:
        r = tool("write", tmp_path / "out", clone)
    finally:
        if before is None:
            shutil.rmtree(clone / path.split("/")[0])
        else:
            f.write_bytes(before)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "out" / "git.json").exists()
    assert tool("write", tmp_path / "again", clone).returncode == 0  # restored, it writes
