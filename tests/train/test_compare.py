"""``lrmoe compare``'s systems (lrmoe.train.compare): each name's config (smartmoe with its trace,
``lrmoe-random@0.25``'s selection and ratio), and which runs count as finished for a resume."""

from __future__ import annotations

from lrmoe.train.config import from_dict


def test_compare_system_configs_and_resume(tmp_path):
    import numpy as np

    from lrmoe.train import compare
    from lrmoe.train.config import dump_toml

    cfg = from_dict({"budget": {"ranks_per_node": 1}})
    trace = tmp_path / "routing.npz"
    np.savez(trace, counts=np.ones((3, 2, 8)))
    smart = compare.system_config(cfg, "smartmoe", trace=trace)
    assert smart.train.system == "smartmoe" and smart.train.routing_trace == str(trace)
    assert compare.system_config(cfg, "smartmoe", trace=tmp_path / "none.npz").train.routing_trace == ""
    lr = compare.system_config(cfg, "lrmoe-random@0.25", trace=trace)
    assert (lr.train.system, lr.train.routing_trace, lr.backward.selection, lr.backward.ratio) == \
        ("lrmoe", "", "random", 0.25)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.toml").write_text(dump_toml(lr.to_dict()))
    assert not compare.finished(lr, folder), "no summary: the run did not finish"
    (folder / "summary.json").write_text("{}")
    assert compare.finished(lr, folder) and not compare.finished(smart, folder)
