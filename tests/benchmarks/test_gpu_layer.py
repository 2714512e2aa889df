"""The GPU layer benchmark in its CPU mode: correctness check and every row, at a small shape,
all experts (``--ep 1``) and one rank of 4-way expert parallelism (``--ep 4``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from tests.helpers.benchmarks import import_script

MODELS = ("qwen3-30b-a3b", "glm45-air")


@pytest.fixture(scope="module")
def gpu_layer():
    return import_script("gpu_layer")


def _finite(v) -> bool:
    return v is None or math.isfinite(v)


@pytest.mark.parametrize("ep", [1, 4])
def test_gpu_layer_cpu_small(gpu_layer, tmp_path, ep):
    out = tmp_path / "gpu_layer.json"
    result = gpu_layer.main(["--device", "cpu", "--small", "--ep", str(ep), "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["ep"] == ep
    tokens = result["tokens"]
    for model in MODELS:
        r = result[model]
        shape = gpu_layer.SMALL[model]
        setup = r["setup"]
        assert setup["ep"] == ep and setup["selection"] == gpu_layer.ROWS["lrmoe@0.25"][1].selection
        assert setup["local_experts"] == shape["num_experts"] // ep
        assert setup["rows"] == (tokens if ep == 1 else tokens * shape["top_k"])
        assert setup["shared_expert"] == (ep == 1 and "num_shared_experts" in shape)
        c = r["correctness"]
        assert max(c["out_rel_err"], c["dx_rel_err"]) < gpu_layer.TOLERANCE
        assert 0 <= c["route_flips"] < 0.1
        rows = {name: row for name, row in r.items() if name not in ("setup", "correctness")}
        # transformers' block beside static where it has the shape: GLM's always has a shared expert
        has_hf = model == "qwen3-30b-a3b" or ep == 1
        assert set(rows) == set(gpu_layer.ROWS) | ({gpu_layer.HF} if has_hf else set())
        for name, row in rows.items():
            assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0, name
            assert all(_finite(row[k]) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "bwd_vs_static",
                                                  "fwd_bwd_vs_hf")), name
            assert (row["fwd_bwd_vs_hf"] is not None) == has_hf
            assert (row["peak_bytes"] is None) == (name == gpu_layer.HF)
            assert row["peak_bytes"] is None or row["peak_bytes"] > 0
        assert rows["static"]["bwd_vs_static"] == 1.0


def test_ep_setup_real_shapes(gpu_layer):
    """At N=64 a rank of the real models holds 2 experts and receives 65,536 rows."""
    for shape in gpu_layer.MODELS.values():
        local, rows = gpu_layer.ep_setup(shape, 8192, 64)
        assert (local["num_experts"], local["top_k"], rows) == (2, 1, 65_536)
        assert (local["dim"], local["ffn_dim"]) == (shape["dim"], shape["ffn_dim"])
        assert "num_shared_experts" not in local
    assert gpu_layer.ep_setup(gpu_layer.MODELS["glm45-air"], 8192, 1) == (gpu_layer.MODELS["glm45-air"], 8192)
    with pytest.raises(ValueError, match="divisor"):
        gpu_layer.ep_setup(gpu_layer.MODELS["qwen3-30b-a3b"], 8192, 3)


def test_hf_row_carries_the_same_weights(gpu_layer):
    for model, shape in gpu_layer.SMALL.items():
        for ep in (1, 4):
            local, rows = gpu_layer.ep_setup(shape, 32, ep)
            torch.manual_seed(0)
            layer = MoELayer(MoEConfig(**local))
            hf = gpu_layer.hf_block(local, layer.state_dict(), torch.float32, torch.device("cpu"))
            if hf is None:
                assert model == "glm45-air" and ep > 1
                continue
            x = torch.randn(1, rows, local["dim"])
            with torch.no_grad():
                torch.testing.assert_close(layer(x), hf(x))


def test_correctness_check_can_fail(gpu_layer, monkeypatch):
    """Routing fixed, the bf16 layer is within tolerance; a perturbed weight is caught."""
    shape, _ = gpu_layer.ep_setup(gpu_layer.SMALL["glm45-air"], 64, 1)
    good = gpu_layer.correctness(shape, 64, torch.device("cpu"), torch.bfloat16)
    assert max(good["out_rel_err"], good["dx_rel_err"]) < gpu_layer.TOLERANCE
    load = MoELayer.load_full_state_dict

    def broken(self, sd):
        sd = dict(sd)
        if self.config.torch_dtype == torch.bfloat16:
            sd["experts.down_proj"] = sd["experts.down_proj"] * 1.2
        load(self, sd)

    monkeypatch.setattr(MoELayer, "load_full_state_dict", broken)
    bad = gpu_layer.correctness(shape, 64, torch.device("cpu"), torch.bfloat16)
    assert bad["out_rel_err"] > gpu_layer.TOLERANCE
