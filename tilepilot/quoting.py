"""Quoting for the files tilepilot generates from matrix.toml (Dockerfiles, sbatch scripts).

The matrix schema keeps bad values out; these filters are the second wall: a value that reached a
template without validation (a model built with model_construct or model_copy) still cannot add a
line, a Dockerfile instruction or a shell command. A valid value renders exactly as written.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

# What #SBATCH takes bare: sbatch's own parser splits on whitespace and quotes, and starts a comment at #.
_SBATCH_BARE = re.compile(r"^[A-Za-z0-9_.:|&,()\[\]*%/@+=-]+$")


def visible(value: Any) -> str:
    """One line: every character that is not printable (newline, CR, other controls, Unicode line and
    paragraph separators) becomes its Python escape, so that it shows and cannot end the line; a
    trailing backslash too, since Dockerfiles and shells would join the next line to it."""
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(value))
    return text[:-1] + "\\x5c" if text.endswith("\\") else text


def sh(value: Any) -> str:
    """One bash word, on one line: shlex.quote, or bash's $'...' where the value holds a character
    that a single-quoted word would carry onto a new line."""
    text = str(value)
    if text.isprintable():
        return shlex.quote(text)
    out = []
    for c in text:
        if c in "\\'":
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return "$'" + "".join(out) + "'"


def sbatch(value: Any) -> str:
    """One #SBATCH argument: bare when it is a plain Slurm word (every value the schema admits),
    otherwise double-quoted with sbatch's backslash escapes, its unprintable characters made visible."""
    text = str(value)
    if _SBATCH_BARE.match(text):
        return text
    return '"' + visible(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def docker_json(value: Any) -> str:
    """A JSON string for a Dockerfile's exec (JSON array) form: ASCII, escapes for everything else."""
    return json.dumps(str(value), ensure_ascii=True)


def docker_str(value: Any) -> str:
    """A double-quoted word for ENV, ARG and LABEL: JSON's escapes keep it on one line, and $ is
    escaped, since Docker expands variables in these instructions."""
    return docker_json(value).replace("$", "\\$")


SHELL_FILTERS = {"q": sh, "line": visible, "sbatch": sbatch}
DOCKER_FILTERS = {"line": visible, "json": docker_json, "dq": docker_str}
