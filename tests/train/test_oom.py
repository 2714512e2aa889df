"""An out-of-memory anywhere is a record, not a crash: an evaluation whose call does not fit the
memory cap is evaluated in smaller calls, and a call that fits nowhere (an evaluation, a step of
one data-parallel group only, building the model, a resume at fewer ranks) stops every rank
cleanly with status ``oom`` at its step, the metrics written so far kept."""

from __future__ import annotations

import json

import numpy as np

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.train.to_target import summarise
from tests.helpers.train import records, train_case

# Under this cap the tiny model trains; an evaluation (its routing on the replicas chosen for the
# last training call) once did not fit it whole, and now moves its rows in rounds instead: the
# whole evaluation call is refused by the test to see it run in smaller calls.
CAP = 140_000
EVAL_DOES_NOT_FIT = {"system": "lrmoe", "steps": 6, "eval_every": 3, "seed": 0, "budget": {"memory_bytes": CAP},
                     "backward": {"selection": "local-sampled", "ratio": 0.5}}
FORCED = "forced by the test"
WHOLE_EVAL_PAIRS = 2 * 4 * 32 * 2  # ranks × sequences × tokens × top_k


def _planned(group, kw: dict, out: str, refuse=None, max_steps=None, resume=False):
    """``train_case`` with every layer plan watched: returns (the summary, the pairs of each call
    whose plan raised MemoryBudgetExceeded, with whether it was a training call). ``refuse(planner,
    training)`` true: that plan raises, as a plan that does not fit does (after the count
    exchange, before any row moves; ``pairs``: the call's)."""
    from lrmoe.planning.planner import LayerPlanner

    original, refused = LayerPlanner.plan_forward, []

    def plan_forward(self, counts_SE, forward_SE=None, training=True):
        try:
            if refuse is not None and refuse(self, training, int(counts_SE.sum())):
                raise MemoryBudgetExceeded(self.rank, 10**9, 1, FORCED, "this call")
            return original(self, counts_SE, forward_SE, training)
        except MemoryBudgetExceeded:
            refused.append((int(counts_SE.sum()), training))
            raise

    LayerPlanner.plan_forward = plan_forward
    try:
        return train_case(group, kw, out, resume=resume, max_steps=max_steps), refused
    finally:
        LayerPlanner.plan_forward = original


def _whole_evaluation_refused(planner, training: bool, pairs: int) -> bool:
    return not training and pairs >= WHOLE_EVAL_PAIRS


def test_evaluation_that_does_not_fit_whole_runs_in_smaller_calls(pool2, tmp_path):
    res = pool2.run(2, _planned, EVAL_DOES_NOT_FIT, str(tmp_path), _whole_evaluation_refused)
    for summary, refused in res:
        assert summary["status"] == "done" and summary["steps"] == 6
        assert any(not training for _, training in refused), "an evaluation call did not fit whole"
        assert [v["step"] for v in summary["val"]] == [3, 6] and all(np.isfinite(v["loss"]) for v in summary["val"])
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7)) and not any("oom" in r for r in rows)
    assert all(r["peak_expert_side_bytes"] <= CAP for r in rows)


def _eval_refused_from_step_4(planner, training: bool, pairs: int) -> bool:
    return not training and planner.steps >= 4


def test_evaluation_out_of_memory_is_recorded_at_its_step(pool2, tmp_path):
    kw = {"system": "lrmoe", "steps": 6, "eval_every": 2, "budget": {"memory_bytes": 300_000}}
    res = pool2.run(2, _planned, kw, str(tmp_path), _eval_refused_from_step_4)
    pairs = WHOLE_EVAL_PAIRS
    for summary, refused in res:
        assert summary["status"] == "oom" and summary["oom_step"] == 4 and summary["oom_during"] == "evaluation"
        assert FORCED in summary["oom"] and summary["steps"] == 4
        # the batch, then halves of it, down to one sequence a rank, before the run stops
        assert refused == [(pairs, False), (pairs // 2, False), (pairs // 4, False)]
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4], "step 4 trained and is recorded, then its oom"
    assert [r["step"] for r in rows if "val_loss" in r] == [2]
    assert rows[-1]["during"] == "evaluation" and FORCED in rows[-1]["oom"]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"
    assert np.load(tmp_path / "routing.npz")["counts"].shape[0] == 4
    result = summarise(tmp_path, 0.0, 300_000)  # what compare reads, going on to the next system
    assert (result["status"], result["oom_step"], result["steps_run"]) == ("oom", 4, 4)
    assert result["final_val_loss"] == rows[1]["val_loss"]


def _rank_1_refused_at_step_3(planner, training: bool, pairs: int) -> bool:
    import torch.distributed as dist

    return training and planner.steps == 2 and dist.get_rank() == 1


def test_one_data_parallel_group_out_of_memory_stops_every_rank(pool2, tmp_path):
    """Two expert-parallel groups of one rank: only rank 1's call of step 3 does not fit; rank 0
    stops there too (else it would wait in the gradient reduction), with rank 1's message."""
    kw = {"system": "lrmoe", "steps": 5, "eval_every": 10, "ep_size": 1, "budget": {"memory_bytes": 300_000}}
    res = pool2.run(2, _planned, kw, str(tmp_path), _rank_1_refused_at_step_3)
    assert [len(refused) for _, refused in res] == [0, 1]
    for summary, _ in res:
        assert (summary["status"], summary["oom_step"], summary["oom_during"]) == ("oom", 3, "training step")
        assert FORCED in summary["oom"]
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]


def test_model_that_cannot_be_built_is_recorded(pool2, tmp_path):
    """A cap that cannot hold a rank's own experts: a fresh run stops at step 1; a resume at one
    rank (all 16 experts there) of a run that fit at two stops after its checkpoint's step."""
    summary = pool2.run(2, train_case, {"system": "lrmoe", "budget": {"memory_bytes": 40_000}}, str(tmp_path / "a"))
    assert all((s["status"], s["oom_step"], s["oom_during"], s["steps"]) == ("oom", 1, "setup", 0) for s in summary)
    assert "its experts" in summary[0]["oom"]
    assert records(tmp_path / "a") == [{"step": 1, "oom": summary[0]["oom"], "during": "setup"}]

    kw = {"system": "lrmoe", "steps": 6, "eval_every": 2, "moe": {"num_experts": 16, "top_k": 1},
          "budget": {"memory_bytes": 300_000}}
    out = tmp_path / "b"
    pool2.run(2, train_case, kw, str(out), False, 4)
    before = records(out)
    resumed = train_case(None, {**kw, "nproc": 1}, str(out), resume=True)
    assert (resumed["status"], resumed["oom_step"], resumed["oom_during"], resumed["steps"]) == ("oom", 5, "setup", 4)
    assert [v["step"] for v in resumed["val"]] == [2, 4]
    rows = records(out)
    assert rows[:-1] == before and rows[-1]["step"] == 5 and "its experts" in rows[-1]["oom"]
    assert np.load(out / "routing.npz")["counts"].shape[0] == 4
