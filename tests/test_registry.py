"""The operator registry: every operator is one kernel package with its harness, every step iterates
the registry, and no module of the harness names an operator in its logic."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tilepilot import cases, matrix, registry, repro
from tilepilot.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
OPS = registry.names()
# The operators themselves (kernels/), and the model block, which is a model written in its ops.
# The Llama block names its own ops (its GEMMs, attention, decode attention): model-level, not the registry's.
MAY_NAME_OPERATORS = {"tilepilot/model.py", "tilepilot/blockspec.py", "tilepilot/breakdown.py"}


def _logic_names(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every operator name in a module's logic: string constants (docstrings and
    comments are prose, not logic), names, attributes of `kernels`, imports of kernels.<op>."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    word = re.compile(rf"(?<![\w.])({'|'.join(OPS)})(?![\w])")
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            hits += [(node.lineno, f"string {node.value[:60]!r}") for _ in word.finditer(node.value)][:1]
        elif isinstance(node, ast.Name) and node.id in OPS:
            hits.append((node.lineno, f"name {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in OPS:
            if isinstance(node.value, ast.Name) and node.value.id in ("kernels", "operators"):
                hits.append((node.lineno, f"attribute {node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "kernels" and (set(parts[1:]) & set(OPS) or {a.name for a in node.names} & set(OPS)):
                hits.append((node.lineno, f"import from {node.module}"))
    return hits


def _harness_modules() -> list[Path]:
    files = [*sorted((ROOT / "tilepilot").rglob("*.py")), ROOT / "benchmarks" / "_suite.py", ROOT / "noxfile.py"]
    return [f for f in files if f.relative_to(ROOT).as_posix() not in MAY_NAME_OPERATORS]


# The [model] section's decode phase is the block's phase (one new token per sequence), named in
# matrix.toml as the issue names it; in Python it is Model.decoding. Only the key's alias may say it.
PHASE_KEYS = {("tilepilot/matrix.py", "string 'decode'")}


def test_no_module_of_the_harness_names_an_operator() -> None:
    found = {
        f"{f.relative_to(ROOT)}:{line}: {what}"
        for f in _harness_modules()
        for line, what in _logic_names(f)
        if (f.relative_to(ROOT).as_posix(), what) not in PHASE_KEYS
    }
    assert not found, "operator names in the harness's logic (ask tilepilot.registry):\n" + "\n".join(sorted(found))


def test_the_name_check_can_fail(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        '"""gemm in a docstring is prose."""\n'
        "import kernels\n"
        "# attention in a comment is prose\n"
        'OPS = ("gemm",)\n'
        "y = kernels.attention\n"
        "from kernels.decode import harness\n"
        "x = b'a'.decode()\n"
    )
    assert sorted(line for line, _ in _logic_names(f)) == [4, 5, 6]


def test_registry_and_matrix_agree() -> None:
    mx = matrix.load()
    registry.check(mx)
    assert OPS == sorted(mx.operators) == ["attention", "decode", "gemm", "swiglu"]
    for name in OPS:
        op = registry.get(name)
        assert op.name == name and type(op).__module__ == f"kernels.{name}.harness"
        assert (ROOT / "benchmarks" / f"bench_{name}.py").is_file(), f"{name}: no asv suite"
        assert {"sm_90a", "sm_80"} <= set(op.source_checks), f"{name}: no source checks per target"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda t: t.replace("head_dim = 128\n\n[[operators.attention", "head_dim = 96\n\n[[operators.attention", 1),
            r"operators\.attention\.shapes\.representative\.\d \(.*\): head_dim 96",
        ),
        (
            lambda t: t.replace("cache_len = 4096\nmin_len = 4096", "cache_len = 4096\nmin_len = 5000", 1),
            r"operators\.decode\.shapes\.\w+\.\d \(.*\): want seq_q <= min_len <= cache_len",
        ),
        (
            lambda t: t.replace('variants = ["nt", "nn"]', 'variants = ["nt", "tn"]'),
            r"operators\.gemm\.variants: 'tn' is not one of nt, nn",
        ),
        (
            lambda t: t.replace('id = "m1-decode"\nm = 1\n', 'id = "m1-decode"\nm = 1\nq = 3\n', 1),
            r"operators\.gemm\.shapes\.edge\.0 \(m1-decode\): unknown key q",
        ),
        (
            lambda t: t.replace("[operators.decode]", "[operators.decode_old]").replace(
                "operators.decode.", "operators.decode_old."
            ),
            r"no \[operators\.decode\] section for kernels/decode/harness\.py",
        ),
    ],
    ids=["head-dim", "min-len", "variant", "unknown-dim", "harness-without-section"],
)
def test_a_shape_the_operator_cannot_take_is_one_line_naming_the_key(edit: object, needle: str, tmp_path: Path) -> None:
    text = (ROOT / "matrix.toml").read_text()
    new = edit(text)  # type: ignore[operator]
    assert new != text
    bad = tmp_path / "matrix.toml"
    bad.write_text(new)
    with pytest.raises(UserError) as err:
        registry.check(matrix.load(bad), bad)
    assert re.search(needle, str(err.value)) and "\n" not in str(err.value), str(err.value)
    r = subprocess.run(
        [sys.executable, "-m", "tilepilot", "--matrix", str(bad), "cases"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", OPS)
def test_each_operator_keeps_the_contract_on_the_cpu(name: str) -> None:
    """What the steps ask of an operator, on its small case and CPU tensors: seeded inputs that are
    not zeros and repeat, an output of the reference's shape, the public call falling back to the
    framework op, the high-precision reference agreeing with it, work figures, a shrink round trip
    and a reproducer that is valid Python."""
    import torch

    op = registry.get(name)
    case = op.small_case()
    a, b = op.inputs(case, 0, device="cpu"), op.inputs(case, 0, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a, op.inputs(case, 1, device="cpu"), strict=True))
    assert all(x.is_floating_point() is False or bool(x.abs().sum() > 0) for x in a)
    out = op.output(case, a).fill_(float("nan"))
    got = op.public(case, a, out)
    exact = op.exact(case, a)
    assert got.data_ptr() == out.data_ptr() and out.shape == exact.shape and exact.dtype == torch.float64
    err = float(torch.linalg.vector_norm(out.double() - exact) / torch.linalg.vector_norm(exact))
    assert err < case.tolerance.rel_fro, err
    assert op.flops(case) > 0 and op.bytes(case) > 0
    assert op.case_dims(op.shrink_dims(case)) == case.dims
    assert set(op.shrink_order) <= set(op.shrink_dims(case))
    src = repro.render(case, "sm90", "wrong", op.shrink_dims(case), {"block_M": 64}, case.seed(0))
    compile(src, f"repro-{name}.py", "exec")


def test_every_case_of_the_matrix_has_its_operator() -> None:
    for case in cases.expand(matrix.load()):
        op = registry.of(case)
        assert set(op.build_args(case)) >= {"dtype"} and op.flops(case) > 0, case.id


def test_a_kernel_package_or_config_without_an_operator_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that the configs could ship but no harness measures would pass the gate unjudged."""
    import shutil

    fake = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels", fake, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(registry, "KERNELS", fake)
    registry.check(matrix.load())
    (fake / "rmsnorm").mkdir()
    (fake / "rmsnorm" / "__init__.py").write_text("")
    with pytest.raises(UserError, match=r"kernels/rmsnorm/: a kernel package without its harness\.py"):
        registry.check(matrix.load())
    shutil.rmtree(fake / "rmsnorm")
    with (fake / "configs" / "sm90.toml").open("a") as f:
        f.write("\n[rmsnorm.default]\nthreads = 128\n")
    with pytest.raises(UserError, match=r"kernels/configs/sm90\.toml: \[rmsnorm\]: no operator 'rmsnorm'"):
        registry.check(matrix.load())
