"""Base images pinned by digest: resolve a device's base tag in its registry, write the digest into
matrix.toml, and check later that the pin still holds.

    tilepilot image pin --device sm90   base_image's tag -> its manifest digest -> devices.sm90.base_digest
    tilepilot image check               every pinned base: does its digest still resolve, has its tag moved?

Digests are asked of the registry through the Docker engine (the SDK's `images.get_registry_data`,
the engine's own distribution endpoint), so the engine's registry settings and credentials apply and
nothing is pulled. matrix.toml is edited in place, one value on one line, so that its comments and
layout stay as written; the result is validated before it replaces the file (atomically).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilepilot import matrix, paths, quoting, record
from tilepilot.errors import UserError

UNPINNED = "unpinned"


class Drift(UserError):
    """A pin that no longer holds: a verdict about the matrix (exit 1), not bad input."""

    exit_code = 1


def repository(ref: str) -> str:
    """An image reference without its tag and digest: `host:5000/a/b:tag@sha256:..` -> `host:5000/a/b`."""
    name = ref.split("@", 1)[0]
    head, sep, last = name.rpartition("/")  # a registry's :port sits before the last slash, a tag after it
    return head + sep + last.split(":", 1)[0]


def pinned_ref(row: matrix.Device) -> str:
    """What FROM names: the repository at the pinned digest, or the tag where the base is unpinned."""
    return row.base_image if row.base_digest == UNPINNED else f"{repository(row.base_image)}@{row.base_digest}"


def _tagged(row: matrix.Device, device: str, where: Path) -> str:
    if "@" in row.base_image:
        raise UserError(
            f"{where}: devices.{device}.base_image: {row.base_image!r} names a digest already; name the tag "
            "(repository:tag) and let base_digest hold the digest"
        )
    return row.base_image


@dataclass(frozen=True)
class Resolved:
    digest: str | None  # None: the registry answered that there is no such manifest
    why: str = ""


def resolve(c: Any, ref: str) -> Resolved:
    """The manifest digest that `ref` (a tag or a digest reference) has in its registry now.

    A registry that answers "no such manifest" gives Resolved(None); one that cannot be asked at all
    (unreachable, refused, unauthorised) is a UserError, since nothing can be said about the pin."""
    import docker

    try:
        return Resolved(str(c.images.get_registry_data(ref).id))
    except docker.errors.APIError as exc:
        msg = quoting.visible(str(exc.explanation or exc)).strip()
        if exc.status_code == 404 or "manifest unknown" in msg or "not found" in msg.lower():
            return Resolved(None, msg)
        raise UserError(
            f"cannot ask the registry of {ref} ({msg.splitlines()[0] if msg else type(exc).__name__}); "
            "run where that registry is reachable (and `docker login` to it if it needs one)"
        ) from None


def set_base_digest(text: str, device: str, digest: str, where: Path | str) -> str:
    """matrix.toml's text with devices.<device>.base_digest set to `digest`: only the quoted value on
    that one line changes (its comment, the other keys, blank lines and comments stay as they are)."""
    header = re.compile(rf'^\s*\[\s*devices\s*\.\s*("?){re.escape(device)}\1\s*\]\s*(#.*)?$')
    any_table = re.compile(r"^\s*\[")
    key = re.compile(r'^(?P<head>\s*base_digest\s*=\s*)"[^"\\]*"(?P<tail>\s*(#.*)?)$')
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if header.match(ln.rstrip("\r\n"))), None)
    if start is None:
        raise UserError(f"{where}: no [devices.{device}] table to pin (`tilepilot matrix check` lists the devices)")
    hits: list[int] = []
    for i in range(start + 1, len(lines)):
        body = lines[i].rstrip("\r\n")
        if any_table.match(body):
            break
        if key.match(body):
            hits.append(i)
    if len(hits) != 1:
        raise UserError(
            f'{where}: devices.{device}.base_digest: want exactly one line `base_digest = "..."` in '
            f"[devices.{device}], found {len(hits)}; write it as one plain string, then pin again"
        )
    i = hits[0]
    body = lines[i].rstrip("\r\n")
    m = key.match(body)
    assert m is not None  # matched above
    lines[i] = f'{m["head"]}"{digest}"{m["tail"]}' + lines[i][len(body) :]
    new = "".join(lines)
    if matrix.parse(new, where).devices[device].base_digest != digest:  # the edit landed where the schema reads
        raise UserError(f"{where}: devices.{device}.base_digest: the edit did not take; set it by hand to {digest}")
    return new


def pin(mx: matrix.Matrix, device: str, matrix_path: Path, c: Any) -> tuple[str, str]:
    """Resolve the device's base tag to its digest and write it into matrix.toml; (old, new) digest."""
    row = mx.device(device)
    tag = _tagged(row, device, matrix_path)
    now = resolve(c, tag)
    if now.digest is None:
        raise UserError(
            f"{matrix_path}: devices.{device}.base_image: {tag} does not resolve in its registry ({now.why})"
        )
    text = matrix_path.read_text(encoding="utf-8")
    new = set_base_digest(text, device, now.digest, matrix_path)
    if new != text:
        record.write_text(matrix_path, new)
    return row.base_digest, now.digest


def check(mx: matrix.Matrix, devices: list[str], matrix_path: Path, c: Any) -> list[tuple[bool, str]]:
    """One (ok, line) per device: its pin holds, or why not, naming the pinned digest and the tag's."""
    out: list[tuple[bool, str]] = []
    for device in devices:
        row = mx.device(device)
        at = f"{matrix_path}: devices.{device}.base_digest"
        if row.base_digest == UNPINNED:
            out.append(
                (
                    False,
                    f"{at}: unpinned ({row.base_image} by tag only); pin it with "
                    f"`tilepilot image pin --device {device}` where its registry is reachable",
                )
            )
            continue
        tag = _tagged(row, device, matrix_path)
        now = resolve(c, tag).digest
        held = resolve(c, pinned_ref(row)).digest
        if held is None:
            out.append(
                (
                    False,
                    f"{at}: the pinned {row.base_digest} no longer resolves in the registry of {tag} "
                    f"(the tag is now {now or 'gone too'}); review the new base, then re-pin with "
                    f"`tilepilot image pin --device {device}`",
                )
            )
        elif now != row.base_digest:
            out.append(
                (
                    False,
                    f"{at}: the tag {tag} moved: pinned {row.base_digest}, now {now or 'gone'}; builds keep "
                    f"the pinned digest; review the new base, then re-pin with `tilepilot image pin --device {device}`",
                )
            )
        else:
            out.append((True, f"{device}: {tag} still at the pinned {row.base_digest}"))
    return out


def not_reproducible(row: matrix.Device, device: str) -> list[str]:
    """What keeps the device's image from being rebuilt as it was: an unpinned base, a missing lock."""
    why = []
    if row.base_digest == UNPINNED:
        why.append("base unpinned")
    if not (paths.current().locks / f"{device}.lock").is_file():
        why.append("no lock")
    return why
