"""DCP checkpoints that move: a state written at one world size or expert-parallel size is
the same full state when read at another (experts, Adam moments, layer statistics); a run
resumed at another ``--nproc`` continues its step count, data position and learning rate;
only the newest checkpoints stay; unusable checkpoints are one-line errors. (torchrun's
rendezvous options: tests/train/test_launch.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lrmoe.layer import EXPERT_TENSORS, moe_layers
from lrmoe.train import checkpoint
from lrmoe.train.build import build_model
from lrmoe.train.data import Batches, TokenData
from lrmoe.train.groups import Groups, reduce_gradients
from lrmoe.train.loop import TrainStream, train
from lrmoe.train.state import TrainState
from tests.helpers.train import records, tiny, train_case

VOCAB = 64


# A case that builds process groups runs on a pool of exactly its world size: dist.new_group needs
# every process of the pool's default group (conftest.py: ``pool2`` has 2 ranks, ``pool`` 4).


def _run(pools: dict, size: int, fn, *args):
    return [fn(None, *args)] if size == 1 else pools[size].run(size, fn, *args)


# ------------------------------------------------------------------- re-sharding the state itself


def _model(group, kw: dict):
    cfg = tiny(**kw)
    groups = Groups(group, cfg.train.ep_size)
    model = build_model(cfg, VOCAB, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return model, opt, groups


def _full_state(model, opt, groups) -> dict[str, torch.Tensor]:
    """Collective: the world-size-1 view of the model, its Adam state and the layers' statistics,
    through the layer's own gathers (not the checkpoint code under test)."""
    experts = {f"{prefix}.{t}" for prefix, _ in moe_layers(model) for t in EXPERT_TENSORS}
    full = {f"model/{n}": v.clone() for n, v in model.state_dict().items() if n not in experts}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            if name not in experts or v.dim() == 0:
                full[f"optim/{name}/{k}"] = v.clone()
    for prefix, layer in moe_layers(model):
        full.update({f"model/{prefix}.{k}": v for k, v in layer.full_state_dict().items() if k in EXPERT_TENSORS})
        gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
        for k in ("exp_avg", "exp_avg_sq"):
            whole = layer._gather_experts(opt.state[gu][k], opt.state[dn][k])
            full.update({f"optim/{prefix}.{t}/{k}": whole[t] for t in EXPERT_TENSORS})
        full[f"layer/{prefix}/load_E"] = layer.planner.load_E.clone()
        full[f"layer/{prefix}/counters"] = torch.tensor([layer.planner.steps, layer.train_state()["backward_calls"]])
        if layer.planner.noise is not None:  # the noise objective's ratio, measurements and pending sums
            full[f"layer/{prefix}/noise"] = torch.tensor(layer.train_state()["noise"], dtype=torch.float64)
    return full


def save_case(group, kw: dict, out: str) -> dict[str, torch.Tensor]:
    """Two training steps on random tokens, then a checkpoint; returns the full state."""
    model, opt, groups = _model(group, kw)
    gen = torch.Generator().manual_seed(100 + groups.dp_rank)
    for _ in range(2):
        ids = torch.randint(VOCAB, (2, 33), generator=gen)
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        reduce_gradients(model, groups)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for layer in model.moe_layers:
            layer.step_end()
    state = TrainState(model, opt, groups)
    checkpoint.save(Path(out), 2, state.capture(), {"windows": 0, "history": {}}, group, groups.rank, 2)
    return _full_state(model, opt, groups)


def load_case(group, kw: dict, out: str) -> dict[str, torch.Tensor]:
    """A model of this layout with every parameter zeroed, loaded from the checkpoint."""
    model, opt, groups = _model(group, kw)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = TrainState(model, opt, groups)

    def targets(index, meta):
        assert state.misfit(index) is None
        return state.targets(index)

    meta, flat = checkpoint.load_latest(Path(out), targets, group, groups.rank)
    assert meta["step"] == 2
    state.restore(flat)
    return _full_state(model, opt, groups)


@pytest.mark.parametrize("system,experts", [("static", 6), ("laer", 4), ("symi", 4), ("lrmoe-noise", 4)])
def test_resharded_state_equals_the_full_state(pool2, pool, tmp_path, system, experts):
    """Written by 2 ranks (one expert-parallel group), read by 1 rank, by 4 ranks in one group
    (6 experts: 2, 2, 1, 1 each) and by 4 ranks in two groups of 2: every parameter, every
    expert's Adam moments and the layers' load statistics (and the noise objective's ratio)
    equal the writer's full state."""
    kw = {"system": system, "moe": {"num_experts": experts}, "nproc": 2}
    if system == "lrmoe-noise":  # a ratio below 1 after two steps: a generous threshold
        kw.update(system="lrmoe", backward={"objective": "noise", "noise_threshold": 5.0})
    pools = {2: pool2, 4: pool}
    written = pool2.run(2, save_case, kw, str(tmp_path))[0]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step_0000002").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    for size, ep in ((1, 0), (4, 0), (4, 2)):
        read = _run(pools, size, load_case, {**kw, "nproc": size, "ep_size": ep}, str(tmp_path))[0]
        assert sorted(read) == sorted(written), (size, ep)
        for key in written:
            assert torch.equal(read[key], written[key]), (size, ep, key)
    assert any(v.abs().sum() > 0 for k, v in written.items() if k.endswith("exp_avg_sq") and "experts" in k)


# ------------------------------------------------------------------- a run resumed at another world size


def test_resume_at_another_world_size_continues(pool2, pool, tmp_path):
    """8 steps at 2 ranks, against 4 at 2 ranks and 4 more at 1 rank (the same global batch:
    the losses match to rounding) or at 4 ranks in two data-parallel groups (twice the batch,
    the windows that follow): the step count, the learning rate and the data continue."""
    kw = {"system": "symi", "steps": 8, "eval_every": 100}
    pool2.run(2, train_case, kw, str(tmp_path / "straight"))
    straight = records(tmp_path / "straight")
    for size, ep in ((1, 0), (4, 2)):
        out = tmp_path / f"to{size}"
        pool2.run(2, train_case, kw, str(out), False, 4)
        _run({4: pool}, size, train_case, {**kw, "nproc": size, "ep_size": ep}, str(out), True)
        rows = records(out)
        assert [r["step"] for r in rows] == list(range(1, 9)), size
        assert [r["lr"] for r in rows] == [r["lr"] for r in straight], "the schedule continues"
        assert [r["loss"] for r in rows[:4]] == [r["loss"] for r in straight[:4]]
        if size == 1:
            np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in straight], rtol=0, atol=1e-4)
        else:
            np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in straight], rtol=0, atol=0.3)
            assert np.mean([r["loss"] for r in rows[-3:]]) < np.mean([r["loss"] for r in rows[:3]]), "it learns"
        meta = json.loads((out / "ckpt" / "step_0000008" / "meta.json").read_text())
        per_step = 4 * (2 if size == 4 else 1)
        assert meta["windows"] == 4 * 4 + 4 * per_step and meta["world"] == size
        assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_train_stream_continues_the_data_position():
    data = TokenData(train=np.arange(40 * 8 + 1), val=np.arange(8 * 8 + 1), vocab_size=400)
    one = TrainStream(data, 8, 4, 0, 1, seed=3)
    plain = Batches(data, 8, 4, 0, 1, seed=3)
    for step in range(12):  # unresumed, the windows of Batches, around the permutation too
        assert torch.equal(one.train_batch(step)[0], plain.train_batch(step)[0])

    def firsts(stream, step):
        return sorted((stream.train_batch(step)[0][:, 0] // 8).tolist())

    halves = [TrainStream(data, 8, 4, r, 2, seed=3) for r in (0, 1)]
    for s in halves:  # resumed at step 3 of the one-replica run: 12 windows drawn
        s.origin_step, s.origin = 3, one.position(3)
    assert one.position(3) == 12 and halves[0].position(5) == 12 + 2 * 8
    assert sorted(firsts(halves[0], 3) + firsts(halves[1], 3)) == sorted(firsts(one, 3) + firsts(one, 4))


# ------------------------------------------------------------------- keeping, pruning, unusable checkpoints


def test_only_the_newest_checkpoints_stay(tmp_path):
    cfg = tiny(system="static", steps=5, nproc=1, checkpoint_every=1, eval_every=100, keep_checkpoints=2)
    train(cfg, tmp_path)
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000004", "step_0000005"]
    # what a dead attempt leaves (a half-written folder, one past ``latest``) goes with the next save
    shutil.copytree(root / "step_0000005", root / "step_0000009")
    (root / "step_0000006.tmp").mkdir()
    (root / "latest").write_text("4")
    assert checkpoint.candidates(tmp_path) == [4]
    train(cfg.with_train(steps=6, keep_checkpoints=3), tmp_path, resume=True)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000004", "step_0000005", "step_0000006"]
    assert [r["step"] for r in records(tmp_path)] == list(range(1, 7))


def test_unusable_checkpoints_are_one_line_errors(tmp_path):
    cfg = tiny(system="static", steps=2, nproc=1, eval_every=100)
    train(cfg, tmp_path / "run")
    bigger = tiny(system="static", steps=2, nproc=1, eval_every=100, moe={"ffn_dim": 48})
    with pytest.raises(checkpoint.CheckpointError) as e:
        train(bigger, tmp_path / "run", resume=True)
    assert str(e.value).count("\n") == 0 and "does not fit this run" in str(e.value)
    assert "blocks.0.mlp.experts.gate_up_proj of expert 0 is [64, 32] there, [96, 32] here" in str(e.value)
    more = tiny(system="static", steps=2, nproc=1, eval_every=100, moe={"num_experts": 5})
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this run"):
        train(more, tmp_path / "run", resume=True)
    old = tmp_path / "old" / "ckpt" / "step_0000002"
    old.mkdir(parents=True)
    torch.save({"step": 2}, old / "rank_0.pt")
    (old.parent / "latest").write_text("2")
    with pytest.raises(checkpoint.CheckpointError, match="earlier lrmoe .* --overwrite") as e:
        train(cfg, tmp_path / "old", resume=True)
    assert str(e.value).count("\n") == 0


# The user's path, ``lrmoe train --nproc 2`` then ``--nproc 1 --resume``, and a checkpoint of an
# earlier lrmoe as a one-line error with exit 2: tests/train/test_cli.py,
# test_used_out_failed_resume_resume_and_overwrite.
