"""benchmarks/common.py: the benchmarks' processes keep freed host memory as training does
(lrmoe.train.host_memory), so their absolute times carry no page fault per fresh tensor."""

from __future__ import annotations

import torch

from tests.helpers.benchmarks import import_script


def test_time_rows_keeps_freed_memory_on_the_host(monkeypatch):
    common = import_script("common")
    calls = []
    monkeypatch.setattr(common, "keep_freed_memory", lambda: calls.append(1) or True)
    layer = torch.nn.Linear(4, 4)
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    timed = common.time_rows({"linear": layer}, x, g, repeats=2)
    assert calls == [1]
    assert set(timed["linear"]) == {"fwd_ms", "bwd_ms", "fwd_bwd_ms"}
