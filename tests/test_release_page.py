"""The release manager's page, html/release/index.html, as the gate writes it from the committed
history beside the published asv pages, loaded in headless chromium from a local server and from the
file system: the matrix, the verdicts and the baselines are in the rendered DOM, the plots are drawn
(their colours counted in a screenshot, kept under the test's tmp dir), every link resolves, nothing
is fetched from elsewhere, and it prints. Without chromium these skip (fail where CI=true or
TILEPILOT_REQUIRE_BROWSER=1), as tests/test_pages.py's do."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import threading
import zlib
from collections.abc import Iterator
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.test_pages import RESULTS, _browser, _Quiet, load, published, text  # noqa: F401 (fixture)
from tilepilot import gate as gate_mod

HEAD = "c115568777bb9c90a8883692a60192230c6057bc"
PLOT_BLUE = (0x1F, 0x77, 0xB4)  # the first series' colour
BAR_BLUE = (0x4C, 0x78, 0xA8)  # the histograms' bars


@pytest.fixture(scope="module")
def page(published: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The gate's page for the measured head, written into the published asv folder's release/."""
    out = tmp_path_factory.mktemp("gate")
    rc = gate_mod.gate(HEAD, out_dir=out, results=RESULTS, page_dir=published / "release")
    assert rc == 0
    return published / "release" / "index.html"


@pytest.fixture(scope="module")
def site(published: Path, page: Path) -> Iterator[str]:  # noqa: F811
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(published)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _pixels(png: bytes) -> list[tuple[int, int, int]]:
    """The RGB pixels of an 8-bit RGB(A) PNG, as chromium writes its screenshots."""
    pos, idat, (w, h, ctype) = 8, b"", (0, 0, 0)
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, _, ctype = struct.unpack(">IIBB", data[:10])
        elif kind == b"IDAT":
            idat += data
        pos += 12 + n
    bpp = 4 if ctype == 6 else 3
    raw, stride, prev, out = zlib.decompress(idat), w * bpp, bytearray(w * bpp), []
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += [tuple(line[i : i + 3]) for i in range(0, stride, bpp)]
        prev = line
    return out  # type: ignore[return-value]


def _chromium(*args: str, tmp: Path) -> None:
    cmd = [
        _browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        f"--user-data-dir={tmp / 'profile'}",
        *args,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False, cwd=tmp)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("where", ["server", "file"])
def test_the_page_renders_the_matrix_and_verdicts(site: str, page: Path, tmp_path: Path, where: str) -> None:
    url = f"{site}/release/index.html" if where == "server" else page.as_uri()
    dom, requested = load(url, tmp_path)
    shown = text(dom)
    assert "Release gate: PASS" in shown
    assert f"code commit {HEAD}" in shown
    matrix = dom[dom.index('<table id="matrix">') : dom.index("</table>", dom.index('<table id="matrix">'))]
    for cell in ("sm90", "sm80", "gfx942", ">gemm<", ">attention<", ">decode<", "model block"):
        assert cell in matrix, cell
    assert matrix.count('class="verdict"') == 9  # three devices x three operators
    assert "AMBIGUOUS" in shown and "codegen changed: kernel source" in shown
    assert re.search(r"release\s*:\s*missing: no tag matching 'v\*'", shown)
    assert "model/llama-decode-b32-c32768/bfloat16" in shown
    assert dom.count("<polyline") >= 6 and dom.count('class="bar"') >= 30
    if where == "server":  # chromium's net log: the page itself asked for nothing beyond itself
        assert all(u.startswith(site + "/") for u in requested), requested


def test_the_plots_are_drawn_and_the_page_prints(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "release-page.png"  # the screenshot stays here as the test's artifact
    _chromium("--window-size=1400,2600", f"--screenshot={shot}", page.as_uri(), tmp=tmp_path)
    px = _pixels(shot.read_bytes())
    assert sum(p == PLOT_BLUE for p in px) > 200, "the history plot's first series is not drawn"
    assert sum(p == BAR_BLUE for p in px) > 2000, "the speedup histograms are not drawn"
    pdf = tmp_path / "release-page.pdf"
    _chromium(f"--print-to-pdf={pdf}", "--no-pdf-header-footer", page.as_uri(), tmp=tmp_path)
    data = pdf.read_bytes()
    assert data.startswith(b"%PDF") and len(re.findall(rb"/Type\s*/Page\b", data)) >= 2


def test_every_link_resolves(page: Path, published: Path) -> None:  # noqa: F811
    """Each href is a file beside the page or in the published asv folder; an asv graph link names a
    benchmark, machine and case that asv's index.json has."""
    html = page.read_text()
    hrefs = re.findall(r'href="([^"]+)"', html)
    assert any("#bench_decode.TrackDecode.track_kernel_ms?" in h for h in hrefs)
    index = json.loads((published / "index.json").read_text())
    for href in {h.replace("&amp;", "&") for h in hrefs}:
        parts = urlsplit(href)
        assert not parts.scheme and not parts.netloc, href  # nothing off the site
        target = (page.parent / unquote(parts.path)).resolve()
        assert target.is_file(), href
        if parts.fragment:
            bench, _, query = parts.fragment.partition("?")
            assert bench in index["benchmarks"], href
            q = dict(p.split("=", 1) for p in query.split("&"))
            assert unquote(q["machine"]) in index["params"]["machine"], href
            (pname,) = [k for k in q if k.startswith("p-")]
            assert unquote(q[pname]) in index["benchmarks"][bench]["params"][0], href
