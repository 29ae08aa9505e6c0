"""Step 2: expand the matrix into cases, one per operator x shape x dtype x variant.

A case id is stable across runs and is the key everything downstream is filed under:
``<operator>/<shape id>/<dtype>/<variant>``, as ``gemm/llama8b-qkv-t4096/float16/nt``. The
expansion reads only the matrix (no torch): what an operator's shapes must hold is checked by
its harness (tilepilot.registry.check).
"""

from __future__ import annotations

import fnmatch

from tilepilot.matrix import Matrix
from tilepilot.operator import Case

__all__ = ["Case", "expand"]


def expand(matrix: Matrix, pattern: str | None = None) -> list[Case]:
    """All cases of the matrix, in a fixed order; `pattern` is an fnmatch glob over case ids."""
    out: list[Case] = []
    for op, sec in matrix.operators.items():
        for group, shapes in (("representative", sec.shapes.representative), ("edge", sec.shapes.edge)):
            for shape in shapes:
                for dtype in sec.dtypes:
                    for variant in shape.variants or sec.variants:
                        out.append(Case(op, shape.id, group, dtype, variant, shape.dims, sec.tolerance[dtype]))
    if pattern:
        out = [c for c in out if any(fnmatch.fnmatch(c.id, p) for p in pattern.split(","))]
    return out
