"""The GPU layer benchmark in its CPU mode: correctness check and every row, at a small shape."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_layer_cpu_small(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_layer
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "gpu_layer.json"
    result = gpu_layer.main(["--device", "cpu", "--small", "--repeats", "1", "--out", str(out)])
    assert out.exists()
    for model in ("qwen3-30b-a3b", "glm45-air"):
        r = result[model]
        assert max(r["correctness"].values()) < 0.05
        assert set(r) == {"correctness", *gpu_layer.ROWS}
        assert all(row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["peak_bytes"] > 0
                   for name, row in r.items() if name != "correctness")
