"""Base images pinned by digest, against a real registry and engine; matrix.toml edited in place; the
committed locks; the gate's image column.

The registry is Debian's docker-registry (the Docker Distribution registry) on 127.0.0.1:5000, started
by .ci/run (TILEPILOT_REGISTRY names another). Where no registry or engine runs, those tests skip with
the reason; CI sets TILEPILOT_REQUIRE_REGISTRY=1 and they fail instead.
"""

from __future__ import annotations

import io
import os
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_engine
from test_containers import BASE, _engine, cpu_device, engine, smoke, smoke_matrix, tilepilot  # noqa: F401 (fixtures)

from tilepilot import containers, digests, matrix, paths

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = os.environ.get("TILEPILOT_REGISTRY", "127.0.0.1:5000")
# What a registry serves for `docker push` of a local image (schema 2, one platform).
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
DIGEST = "sha256:" + "ab" * 32


def _registry() -> str | None:
    """Why the registry tests cannot run here, or None."""
    why = _engine()
    if why is not None:
        return why
    try:
        urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=5).close()
    except (OSError, urllib.error.URLError) as exc:
        return f"no registry at {REGISTRY} ({type(exc).__name__}; `.ci/run` starts Debian's docker-registry)"
    return None


@pytest.fixture(scope="module")
def registry() -> str:
    require_engine(_registry(), "TILEPILOT_REQUIRE_REGISTRY", "CI must start docker-registry on 127.0.0.1:5000")
    return REGISTRY


def _served_digest(repo: str, tag: str) -> str:
    """The digest the registry itself serves for repo:tag, from its HTTP API (not through the engine)."""
    host, _, name = repo.partition("/")
    req = urllib.request.Request(
        f"http://{host}/v2/{name}/manifests/{tag}", method="HEAD", headers={"Accept": MANIFEST_V2}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(r.headers["Docker-Content-Digest"])


def _push(c: Any, image: Any, repo: str, tag: str) -> None:
    image.tag(repo, tag)
    for line in c.images.push(repo, tag=tag, stream=True, decode=True):
        assert "error" not in line, line


def _untag(c: Any, *refs: str) -> None:
    import docker

    for ref in refs:
        try:
            c.images.remove(ref, noprune=True)
        except docker.errors.ImageNotFound:
            pass


@pytest.fixture
def pushed(registry: str) -> Iterator[dict[str, Any]]:
    """The local Debian base pushed to the registry under a tag of a repository new to this test."""
    import docker

    c = docker.from_env(timeout=120)
    repo = f"{registry}/tilepilot-test/debian-{uuid.uuid4().hex[:10]}"
    _push(c, c.images.get(BASE), repo, "bookworm")
    yield {"client": c, "repo": repo, "tag": f"{repo}:bookworm", "digest": _served_digest(repo, "bookworm")}
    _untag(c, f"{repo}:bookworm")


def _matrix_for(dst: Path, base: str) -> Path:
    """The smoke matrix whose cpu device's base is `base`, with a comment on its base_digest line."""
    text = smoke_matrix(dst).read_text()
    cpu = cpu_device("cpu", "CPU smoke device (proves the container path)")
    mine = cpu.replace(f'base_image = "{BASE}"', f'base_image = "{base}"').replace(
        'base_digest = "unpinned"', 'base_digest = "unpinned"   # the test pins it'
    )
    dst.write_text(text.replace(cpu, mine, 1))
    return dst


# -- against the registry --------------------------------------------------------------------------


def test_pin_build_move_check_against_a_real_registry(
    pushed: dict[str, Any], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    c, repo, tag, d1 = pushed["client"], pushed["repo"], pushed["tag"], pushed["digest"]
    wheels_and_lock: dict[str, Path] = request.getfixturevalue("smoke")  # test_containers': lock and wheelhouse
    mpath = _matrix_for(tmp_path / "matrix.toml", tag)
    before = mpath.read_text()
    m = str(mpath)
    env = {"TILEPILOT_LOCKS": str(wheels_and_lock["locks"])}

    # Pin: the digest the registry serves for the tag, into base_digest, on that one line only.
    r = tilepilot("--matrix", m, "image", "pin", "--device", "cpu", **env)
    assert r.returncode == 0, r.stderr
    assert f"devices.cpu.base_digest = {d1} (was unpinned)" in r.stdout
    after = mpath.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert changed == [('base_digest = "unpinned"   # the test pins it', f'base_digest = "{d1}"   # the test pins it')]
    assert matrix.load(mpath).devices["cpu"].base_digest == d1

    # From now on FROM names the digest; the check finds the pin holding.
    rendered = tilepilot("--matrix", m, "image", "render", "--device", "cpu", **env)
    assert f"\nFROM {repo}@{d1}\n" in rendered.stdout
    ok = tilepilot("--matrix", m, "image", "check", "--device", "cpu", **env)
    assert ok.returncode == 0 and f"still at the pinned {d1}" in ok.stdout, ok.stdout + ok.stderr

    # The CPU smoke image, built FROM the digest (the engine pulls it by digest: no local name for it).
    _untag(c, tag, f"{repo}@{d1}")
    built = tilepilot(
        "--matrix",
        m,
        "image",
        "build",
        "--device",
        "cpu",
        "--rebuild",
        "--wheelhouse",
        str(wheels_and_lock["wheels"]),
        **env,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr
    assert f"FROM {repo}@{d1}" in built.stdout
    image_tag = built.stdout.strip().splitlines()[-1]
    first = c.images.get(image_tag)
    base_layers = c.images.get(BASE).attrs["RootFS"]["Layers"]
    assert first.attrs["RootFS"]["Layers"][: len(base_layers)] == base_layers
    assert first.labels["tilepilot.base.digest"] == d1

    # Another image under the same tag: a layer and a label more, so a build from it would show both.
    moved_img, _ = c.images.build(
        fileobj=io.BytesIO(
            f'FROM {BASE}\nRUN echo moved > /etc/tilepilot-moved\nLABEL tilepilot.test.moved="yes"\n'.encode()
        ),
        network_mode="host",
        rm=True,
    )
    _push(c, moved_img, repo, "bookworm")
    d2 = _served_digest(repo, "bookworm")
    assert d2 != d1

    # The check names both digests on one line, exit 1.
    moved = tilepilot("--matrix", m, "image", "check", **env)
    assert moved.returncode == 1, moved.stdout + moved.stderr
    (line,) = [ln for ln in moved.stderr.splitlines() if "devices.cpu" in ln]
    assert f"the tag {tag} moved: pinned {d1}, now {d2}" in line and "Traceback" not in moved.stderr
    assert "re-pin with `tilepilot image pin --device cpu`" in line

    # The pinned build still takes the original: rebuilt after the move (the final image removed, no
    # local name for the base), it pulls d1 again and lands on the same layers, without the new ones.
    _untag(c, tag, f"{repo}@{d1}", image_tag)
    again = tilepilot(
        "--matrix", m, "image", "build", "--device", "cpu", "--wheelhouse", str(wheels_and_lock["wheels"]), **env
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr
    assert again.stdout.strip().splitlines()[-1] == image_tag and f"FROM {repo}@{d1}" in again.stdout
    rebuilt = c.images.get(image_tag)
    assert rebuilt.attrs["RootFS"]["Layers"] == first.attrs["RootFS"]["Layers"]
    assert "tilepilot.test.moved" not in (rebuilt.labels or {})
    assert moved_img.attrs["RootFS"]["Layers"][-1] not in rebuilt.attrs["RootFS"]["Layers"]


def test_a_digest_that_no_longer_resolves_is_one_line(pushed: dict[str, Any], tmp_path: Path) -> None:
    # A digest the registry never had for this repository: the pin cannot be pulled anywhere.
    mpath = _matrix_for(tmp_path / "matrix.toml", pushed["tag"])
    mpath.write_text(digests.set_base_digest(mpath.read_text(), "cpu", DIGEST, mpath))
    r = tilepilot("--matrix", str(mpath), "image", "check", "--device", "cpu")
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert f"the pinned {DIGEST} no longer resolves" in line and f"the tag is now {pushed['digest']}" in line


def test_pin_of_a_tag_the_registry_lacks_is_one_line(registry: str, tmp_path: Path) -> None:
    tag = f"{registry}/tilepilot-test/absent-{uuid.uuid4().hex[:10]}:none"
    mpath = _matrix_for(tmp_path / "matrix.toml", tag)
    before = mpath.read_text()
    r = tilepilot("--matrix", str(mpath), "image", "pin", "--device", "cpu")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert f"devices.cpu.base_image: {tag} does not resolve in its registry" in line
    assert mpath.read_text() == before  # nothing written


def test_an_unreachable_registry_is_one_line(registry: str, tmp_path: Path) -> None:
    tag = "127.0.0.1:9/tilepilot-test/debian:bookworm"  # the discard port: nothing listens
    mpath = _matrix_for(tmp_path / "matrix.toml", tag)
    mpath.write_text(digests.set_base_digest(mpath.read_text(), "cpu", DIGEST, mpath))
    r = tilepilot("--matrix", str(mpath), "image", "check", "--device", "cpu")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "cannot ask the registry of 127.0.0.1:9/tilepilot-test/debian:bookworm" in line


# -- everywhere ------------------------------------------------------------------------------------


def test_set_base_digest_changes_one_value_and_keeps_the_rest() -> None:
    text = (ROOT / "matrix.toml").read_text()
    new = digests.set_base_digest(text, "sm80", DIGEST, "matrix.toml")
    diff = [(a, b) for a, b in zip(text.splitlines(True), new.splitlines(True), strict=True) if a != b]
    assert diff == [('base_digest = "unpinned"\n', f'base_digest = "{DIGEST}"\n')]
    # sm90's line has a comment; it stays, and sm80's pin is untouched by sm90's.
    both = digests.set_base_digest(new, "sm90", DIGEST.replace("ab", "cd"), "matrix.toml")
    (line,) = [ln for ln in both.splitlines() if "cdcd" in ln]
    assert line.startswith('base_digest = "sha256:cdcd') and line.endswith(
        "# pinned by the image issue (#4) once a registry is reachable"
    )
    mx = matrix.parse(both, "m")
    assert mx.devices["sm80"].base_digest == DIGEST and mx.devices["gfx942"].base_digest == "unpinned"


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        (lambda t: t.replace("[devices.sm80]\n", "[devices.sm81]\n"), r"no \[devices\.sm80\] table to pin"),
        (
            lambda t: t.replace('base_digest = "unpinned"\n', "", 2),
            r"devices\.sm80\.base_digest: want exactly one line .* found 0",
        ),
        (
            lambda t: t.replace(
                'base_digest = "unpinned"\n', 'base_digest = "unpinned"\nbase_digest = "unpinned"\n', 1
            ),
            r"devices\.sm80\.base_digest: want exactly one line .* found 2",
        ),
    ],
)
def test_set_base_digest_fails_closed(edit: Any, want: str) -> None:
    text = edit((ROOT / "matrix.toml").read_text())
    with pytest.raises(digests.UserError, match=want):
        digests.set_base_digest(text, "sm80", DIGEST, "matrix.toml")


def test_pinned_cuda_image_renders_from_the_digest_and_passes_hadolint(tmp_path: Path) -> None:
    import subprocess
    import sys

    mpath = tmp_path / "matrix.toml"
    mpath.write_text(digests.set_base_digest((ROOT / "matrix.toml").read_text(), "sm90", DIGEST, mpath))
    r = tilepilot("--matrix", str(mpath), "image", "render", "--device", "sm90")
    assert r.returncode == 0, r.stderr
    assert f"\nFROM nvidia/cuda@{DIGEST}\n" in r.stdout
    assert 'tilepilot.base="nvidia/cuda:13.0.0-devel-ubuntu24.04"' in r.stdout  # the tag it was pinned from
    hadolint = Path(sys.executable).parent / "hadolint"
    lint = subprocess.run(
        [str(hadolint), "--no-color", "-"], input=r.stdout, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize(
    ("ref", "repo"),
    [
        ("nvidia/cuda:13.0.0-devel-ubuntu24.04", "nvidia/cuda"),
        ("127.0.0.1:5000/a/debian:bookworm", "127.0.0.1:5000/a/debian"),
        ("127.0.0.1:5000/debian", "127.0.0.1:5000/debian"),
        (f"debian:12@{DIGEST}", "debian"),
    ],
)
def test_repository_drops_tag_and_digest_not_the_port(ref: str, repo: str) -> None:
    assert digests.repository(ref) == repo


def test_committed_cuda_locks_are_hash_locked_for_cuda_13() -> None:
    """sm90 and sm80 resolve from PyPI alone: torch 2.11.0 there is CUDA 13.0's build, with its nvidia-* wheels."""
    mx = matrix.load(ROOT / "matrix.toml")
    for device in ("sm90", "sm80"):
        lines = (ROOT / "containers" / "locks" / f"{device}.lock").read_text().splitlines()
        pins = [ln for ln in lines if not ln.startswith("#")]
        assert pins and all(re.fullmatch(r"[a-z0-9.-]+==\S+ --hash=sha256:[0-9a-f]{64}", p) for p in pins), pins
        assert f"torch=={mx.devices[device].torch} " in "\n".join(pins) + " "
        assert any(p.startswith(f"tilelang=={mx.devices[device].tilelang} ") for p in pins)
        assert any(p.startswith("nvidia-cuda-runtime==13.0.") for p in pins)
        assert any(p.startswith("nvidia-ml-py==") for p in pins)


def test_a_row_that_needs_another_index_says_the_command() -> None:
    r = tilepilot("image", "lock", "--device", "gfx942", "--from", "pypi")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "PyPI has no ROCm build of torch 2.9.1" in line
    assert "`tilepilot image lock --device gfx942 --from torch-index`" in line
    assert "https://download.pytorch.org/whl/rocm6.4 is reachable" in line


def test_check_of_unpinned_bases_needs_no_engine_and_fails() -> None:
    r = tilepilot("image", "check", DOCKER_HOST="unix:///nonexistent/docker.sock")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(matrix.load(ROOT / "matrix.toml").devices)
    assert all("unpinned" in ln and "tilepilot image pin --device" in ln for ln in lines)


def test_not_reproducible_names_base_and_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = matrix.load(ROOT / "matrix.toml").devices["sm90"]
    monkeypatch.setenv("TILEPILOT_LOCKS", str(tmp_path))
    monkeypatch.setattr(paths, "_used", None)  # an earlier in-process command may have fixed the paths
    assert digests.not_reproducible(row, "sm90") == ["base unpinned", "no lock"]
    (tmp_path / "sm90.lock").write_text("x==1 --hash=sha256:" + "0" * 64 + "\n")
    pinned = row.model_copy(update={"base_digest": DIGEST})
    assert digests.not_reproducible(pinned, "sm90") == []
    assert containers.render(matrix.load(ROOT / "matrix.toml"), "sm90").count("FROM nvidia/cuda:13.0.0") == 1
