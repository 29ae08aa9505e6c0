"""The model step (tilepilot.model.measure_model) on small shapes: every variant, compile, profile and
breakdown path of both phases in about a minute, before a pilot spends ten on the full sizes.

    PYTHONPATH=$PWD python3 scripts/h200-model-smoke.py [OUT.json] [--full-decode] [--compile-mode MODE]

Prefill at 512 tokens (bf16) and decode at batch 1 and 8 against a 2048-token cache (bf16); prints the
pilot's breakdown tables and exits 1 when a configuration errors or disagrees. --full-decode: the
matrix's own decode phase instead of the small one (what the shipped decode kernels change).
--compile-mode: the compiled references under another torch.compile mode than the matrix's
(max-autotune-no-cudagraphs: its compile time and latency, before the matrix asks for it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepilot import breakdown, matrix, model


def main() -> int:
    mx = matrix.load()
    assert mx.model.decoding is not None, "matrix.toml [model] has no decode phase"
    args = sys.argv[1:]
    full = "--full-decode" in args
    mode = mx.model.compile
    if "--compile-mode" in args:
        if args.index("--compile-mode") + 1 >= len(args):
            print("h200-model-smoke.py: --compile-mode needs a mode (e.g. max-autotune-no-cudagraphs)")
            return 2
        mode = args[args.index("--compile-mode") + 1]
    out = next((Path(a) for a in args if not a.startswith("--") and a != mode), None)
    decoding = mx.model.decoding if full else mx.model.decoding.model_copy(update={"batch": [1, 8], "cache": [2048]})
    update = {"tokens": [512], "dtypes": ["bfloat16"], "decoding": decoding, "compile": mode}
    small = mx.model.model_copy(update=update)
    t = time.perf_counter()
    data = model.measure_model(mx.model_copy(update={"model": small}), "sm90", None)
    print(f"model step ({mode or 'no compile'}): {time.perf_counter() - t:.1f} s")
    for k, c in data["cases"].items():
        print(k, "first calls (compile):", c.get("compile"))
    if out is not None:
        out.write_text(json.dumps(data, indent=1))
    print(breakdown.tables(data["cases"]))
    bad = {k: c.get("error", "disagrees") for k, c in data["cases"].items() if "error" in c or not c.get("agrees")}
    for k, why in bad.items():
        print(f"FAIL {k}: {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
