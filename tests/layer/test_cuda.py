"""The CUDA path: every system of ``lrmoe.systems.SYSTEMS`` at world 1 on the GPU in
fp32 and bf16 against the same layer on the CPU (outputs and gradients close), and the host
reads of the selective backward under ``torch.cuda.set_sync_debug_mode``.

Skipped where CUDA is absent. ``ALLOWED_HOST_READS`` below is the one list of the device→host
reads the selective backward may make; the sync tests fail on any other.
"""

from __future__ import annotations

import ast
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig, MoELayer
from lrmoe.systems import SYSTEMS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")

CFG = dict(dim=32, ffn_dim=48, num_experts=8, top_k=2)
GLM = dict(dim=32, ffn_dim=48, num_experts=8, top_k=2, router="sigmoid", n_group=2, topk_group=1,
           num_shared_experts=1)
TOKENS = 96
DEVICE = "cuda"  # the device under test; the reference runs on the CPU

# The device→host reads a selective backward (lrmoe, world 1, the default local-sampled
# selection) may make, as (file, function) → why. The most acceptable is the kept counts that size
# the all-to-all splits plus one more small read; a local selection needs neither: its kept
# counts come from the plan (lrmoe.selection.strata), its ``nonfinite`` flag stays on the device until
# ``last_stats`` is read. So none. (tests/selection/test_strata.py checks the same on the CPU by finding
# every op that needs values on the host; this checks it where it counts.)
ALLOWED_HOST_READS: dict[tuple[str, str], str] = {}


def _kwargs(system: str, E: int) -> dict:
    if system == "topoep":
        return {"budget": ClusterBudget(ranks_per_node=1)}
    if system == "smartmoe":
        trace = torch.ones(4, E)
        trace[::2, 0] = 20
        return {"routing_trace": trace}
    return {}


def _layer(system: str, cfg: dict, dtype: torch.dtype, device: str, sd: dict,
           backward: BackwardConfig | None = None) -> MoELayer:
    layer = MoELayer(MoEConfig(**cfg, dtype=dtype), system=system, backward=backward,
                     **_kwargs(system, cfg["num_experts"])).to(device)
    # the full state dict on the layer's device (load_full_state_dict indexes there)
    layer.load_full_state_dict({k: v.to(device=device, dtype=dtype if v.is_floating_point() and "router" not in k
                                        else v.dtype) for k, v in sd.items()})
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


CASES = [(s, None) for s in SYSTEMS] + [("lrmoe", BackwardConfig(selection="local-sampled", ratio=0.5)),
                                        ("lrmoe", BackwardConfig(selection="lrm", ratio=0.5))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [CFG, GLM], ids=["qwen3", "glm45"])
@pytest.mark.parametrize(("system", "backward"), CASES,
                         ids=[s if b is None else f"{s}-{b.selection}@{b.ratio}" for s, b in CASES])
def test_cuda_matches_cpu(system, backward, cfg, dtype):
    torch.manual_seed(0)
    sd = MoELayer(MoEConfig(**cfg)).state_dict()
    if dtype == torch.bfloat16 and backward is not None and backward.ratio < 1:
        pytest.skip("a trimmed backward's kept set follows bf16 scores, which differ between devices")
    layers = {"ref": _layer(system, cfg, dtype, "cpu", sd, backward),
              "dev": _layer(system, cfg, dtype, DEVICE, sd, backward)}
    gen = torch.Generator().manual_seed(1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for step in range(2):  # step_end between: replica systems refresh on the device
        x = torch.randn(TOKENS, cfg["dim"], generator=gen).to(dtype)
        g = torch.randn(TOKENS, cfg["dim"], generator=gen).to(dtype)
        got = {}
        for key, layer in layers.items():
            dev = "cpu" if key == "ref" else DEVICE
            layer.zero_grad(set_to_none=True)
            xi = x.to(dev).requires_grad_(True)
            y = layer(xi)
            y.backward(g.to(dev))
            assert y.device.type == dev and y.dtype == dtype
            grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
            got[key] = (y, xi.grad, grads)
            layer.step_end()
        (y_c, dx_c, gr_c), (y_g, dx_g, gr_g) = got["ref"], got["dev"]
        assert _rel(y_g, y_c) < tol, (step, "out", _rel(y_g, y_c))
        assert _rel(dx_g, dx_c) < tol, (step, "dx", _rel(dx_g, dx_c))
        assert set(gr_g) == set(gr_c)
        for name in gr_c:
            assert gr_g[name].device.type == DEVICE, name
            assert _rel(gr_g[name], gr_c[name]) < tol, (step, name, _rel(gr_g[name], gr_c[name]))


# ------------------------------------------------------------------- host reads


@cache
def _functions(path: str) -> list[tuple[int, int, str]]:
    tree = ast.parse(Path(path).read_text())
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _site(filename: str, lineno: int) -> tuple[str, str]:
    """(file, innermost enclosing function) of a source line."""
    try:
        spans = [s for s in _functions(filename) if s[0] <= lineno <= s[1]]
    except (OSError, SyntaxError):
        spans = []
    name = min(spans, key=lambda s: s[1] - s[0])[2] if spans else "<module>"
    return Path(filename).name, name


def _selective_call(dtype: torch.dtype):
    torch.manual_seed(0)
    sd = MoELayer(MoEConfig(**CFG)).state_dict()
    layer = _layer("lrmoe", CFG, dtype, "cuda", sd, BackwardConfig(selection="local-sampled", ratio=0.25))
    x = torch.randn(TOKENS, CFG["dim"], device="cuda", dtype=dtype, requires_grad=True)
    y = layer(x)
    torch.cuda.synchronize()
    return y, torch.randn_like(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_backward_host_reads_are_the_allowed_ones(dtype):
    """Every synchronising call of the backward, located by file and function, is allowed."""
    y, g = _selective_call(dtype)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            y.backward(g)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [r for r in records if "synchronizing" in str(r.message)]
    offenders = sorted({f"{Path(r.filename).name}:{r.lineno} ({_site(r.filename, r.lineno)[1]})"
                        for r in syncs if _site(r.filename, r.lineno) not in ALLOWED_HOST_READS})
    assert not offenders, f"{len(syncs)} synchronising calls; not allowed: {offenders}"


def test_selective_backward_under_sync_debug_error():
    y, g = _selective_call(torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        y.backward(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
