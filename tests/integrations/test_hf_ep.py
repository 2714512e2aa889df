"""lrmoe inside transformers' expert parallelism (``DistributedConfig(ep_implementation="lrmoe")``,
lrmoe.integrations.transformers): the registration, exactness against ``"all_to_all"`` at a kept
ratio of 1 for Qwen3-MoE, Mixtral and DeepSeek-V3 on 2 gloo ranks (loss, logits, every gradient),
a trimmed run (all_to_all's loss, lrmoe's own trimmed expert gradients, fewer backward bytes) and
the one-line refusals. Training loops and checkpoints: tests/integrations/test_hf_ep_train.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers.distributed.expert_parallel")
pytest.importorskip("accelerate")

import torch.distributed as dist  # noqa: E402
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface  # noqa: E402

from lrmoe import BackwardConfig, ClusterBudget  # noqa: E402
from lrmoe.integrations import transformers as lt  # noqa: E402
from lrmoe.integrations.hf import patch_model  # noqa: E402
from lrmoe.layer import moe_layers  # noqa: E402
from tests.helpers import hf_ep  # noqa: E402

EXACT = BackwardConfig(ratio=1.0, objective="memory")
TRIMMED = BackwardConfig(selection="lrm", ratio=0.5)
FP32 = 2e-5  # relative to each tensor's largest value


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_ep")
    return {f: hf_ep.make_checkpoint(f, str(root / f)) for f in (*hf_ep.FAMILIES, "gpt-oss")}


# ---------------------------------------------------------------- rank cases (run on both ranks)
def _with_lrmoe(path: str, backward: BackwardConfig):
    lt.register(backward=backward)
    try:
        return hf_ep.load(path, "lrmoe")
    finally:
        lt.register()  # the defaults again, for whatever loads next on this rank


def _exact_case(group, path: str) -> dict:
    ids = hf_ep.batch(dist.get_rank())
    reference = hf_ep.load(path, "all_to_all")
    want_loss, want_logits = hf_ep.step(reference, ids)
    model = _with_lrmoe(path, EXACT)
    loss, logits = hf_ep.step(model, ids)
    return dict(loss=(loss.item(), want_loss.item()),
                logits=((logits - want_logits).abs().max().item(), want_logits.abs().max().item()),
                grads=hf_ep.differences(hf_ep.full_grads(model), hf_ep.full_grads(reference)),
                kept=[s["kept_ratio"] for s in lt.layer_stats(model).values()])


def _trimmed_case(group, path: str) -> dict:
    ids = hf_ep.batch(dist.get_rank())
    reference = hf_ep.load(path, "all_to_all")
    want_loss, _ = hf_ep.step(reference, ids)
    exact = hf_ep.full_grads(reference)
    a2a_bytes = hf_ep.all_to_all_backward_bytes(reference, ids)
    model = _with_lrmoe(path, TRIMMED)
    loss, _ = hf_ep.step(model, ids)
    grads, stats = hf_ep.full_grads(model), lt.layer_stats(model)
    # lrmoe's own layer, trimmed alike on the same pairs: patch_model on the plain checkpoint
    plain = patch_model(hf_ep.load(path, None), system="lrmoe", backward=TRIMMED, group=group)
    plain(input_ids=ids, labels=ids).loss.backward()
    own = {f"{name}.experts.{t}": g for name, layer in moe_layers(plain)
           for t in ("gate_up_proj", "down_proj") for g in [layer.gather_full_grads()[f"experts.{t}"]]}
    # transformers' FSDP divides the experts' gradients by the 2 data-parallel ranks; the layer sums them
    halved = {n: g / hf_ep.EP_SIZE for n, g in own.items()}
    return dict(loss=(loss.item(), want_loss.item()), kept=[s["kept_ratio"] for s in stats.values()],
                bwd_bytes=[s["bwd_a2a_bytes"] for s in stats.values()], a2a_bytes=a2a_bytes,
                own=hf_ep.differences({n: grads[n] for n in halved}, halved),
                exact=hf_ep.differences({n: grads[n] for n in halved}, {n: exact[n] for n in halved}),
                last_router=hf_ep.differences({"g": grads["model.layers.1.mlp.gate.weight"]},
                                              {"g": exact["model.layers.1.mlp.gate.weight"]})["g"])


def _replicas_case(group, path: str, budget: ClusterBudget) -> dict:
    """Three SGD steps each: every step's loss, and what the replicas cost lrmoe."""
    ids, losses, placed = hf_ep.batch(dist.get_rank()), {}, []
    for name in ("all_to_all", "lrmoe"):
        lt.register(backward=EXACT, budget=budget)
        model = hf_ep.load(path, name)
        lt.register()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(3):
            losses[name].append(hf_ep.step(model, ids)[0].item())
            optimizer.step()
            optimizer.zero_grad()
            placed += [s["placement_bytes"] for s in lt.layer_stats(model).values()]
    return dict(losses=losses, placed=placed)


def _refused_case(group, path: str) -> str:
    try:
        hf_ep.load(path, "lrmoe")
    except ValueError as err:
        return str(err)
    return "loaded"


# ---------------------------------------------------------------- tests
def _close(label: str, err: float, scale: float) -> None:
    assert err <= FP32 * max(scale, 1e-3), f"{label}: max abs error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("family", list(hf_ep.FAMILIES))
def test_exact_at_ratio_one_equals_all_to_all(pool2, checkpoints, family):
    for rank, out in enumerate(pool2.run(2, _exact_case, checkpoints[family])):
        _close(f"rank {rank} loss", abs(out["loss"][0] - out["loss"][1]), abs(out["loss"][1]))
        _close(f"rank {rank} logits", *out["logits"])
        assert out["kept"] and all(k == 1.0 for k in out["kept"]), out["kept"]  # lrmoe ran every MoE layer
        experts = [n for n in out["grads"] if ".experts." in n]
        assert len(experts) == 2 * len(out["kept"]), experts
        for name, (err, scale) in out["grads"].items():
            assert scale > 0 or "bias" in name, f"{name}: no gradient"
            _close(f"rank {rank} {name}", err, scale)


def test_trimmed_keeps_the_forward_and_sends_fewer_backward_bytes(pool2, checkpoints):
    for rank, out in enumerate(pool2.run(2, _trimmed_case, checkpoints["qwen3-moe"])):
        _close(f"rank {rank} loss", abs(out["loss"][0] - out["loss"][1]), abs(out["loss"][1]))
        assert all(0.3 < k < 0.7 for k in out["kept"]), out["kept"]
        for layer, (sent, a2a) in enumerate(zip(out["bwd_bytes"], out["a2a_bytes"])):
            assert sent < a2a, f"rank {rank} layer {layer}: lrmoe sent {sent} B, all_to_all {a2a} B"
        for name, (err, scale) in out["own"].items():  # lrmoe's own trimmed gradients
            _close(f"rank {rank} {name}", err, scale)
        assert max(err / scale for err, scale in out["exact"].values()) > 1e-2  # and not the exact ones
        _close(f"rank {rank} last router", *out["last_router"])  # the router's gradient stays exact


def test_replicas_follow_the_optimizer_steps(pool2, checkpoints):
    """A budget whose slots place a replica of another rank's expert on each rank: the replicas are
    refetched from their owners after every optimizer step, so every step stays all_to_all's."""
    budget = ClusterBudget(memory_bytes=10**7, slots=3)
    outs = pool2.run(2, _replicas_case, checkpoints["qwen3-moe"], budget)
    for rank, out in enumerate(outs):
        for step, (got, want) in enumerate(zip(out["losses"]["lrmoe"], out["losses"]["all_to_all"])):
            _close(f"rank {rank} step {step} loss", abs(got - want), abs(want))
    # parameter bytes the owners sent to the replicas, every call of every layer (3 steps x 2 layers)
    sent = [sum(per_rank) for per_rank in zip(*(out["placed"] for out in outs))]
    assert len(sent) == 6 and all(b > 0 for b in sent), sent


def test_refused_block_is_one_line(pool2, checkpoints):
    for message in pool2.run(2, _refused_case, checkpoints["gpt-oss"]):
        assert "\n" not in message and "GptOssExperts" in message and "biases" in message, message


def test_register_sets_what_loads_next():
    interface = EPImplementationInterface()
    assert issubclass(interface["lrmoe"], EPImplementation)
    budget = ClusterBudget(memory_bytes=10**9)
    try:
        registered = lt.register(backward=TRIMMED, budget=budget)
        assert EPImplementationInterface()["lrmoe"] is registered
        assert registered.backward is TRIMMED and registered.budget is budget
        with pytest.raises(TypeError, match="BackwardConfig"):
            lt.register(backward="lrm")
        with pytest.raises(ValueError, match="memory cap"):
            lt.register(backward=BackwardConfig(keep="x"), budget=budget)
    finally:
        lt.register()
    assert EPImplementationInterface()["lrmoe"].backward is None


def test_import_changes_only_the_lrmoe_entry():
    script = (
        "import transformers.distributed.expert_parallel as ep\n"
        "from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES\n"
        "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
        "def snap(): return [dict(ep.EPImplementationInterface._global_mapping),"
        " dict(ALL_PARALLEL_STYLES._global_mapping), dict(ALL_EXPERTS_FUNCTIONS._global_mapping)]\n"
        "before = snap()\n"
        "import lrmoe.integrations.transformers as lt\n"
        "after = snap()\n"
        "assert issubclass(after[0].pop('lrmoe'), lt.LRMoEImplementation)\n"
        "assert before == after, 'changed'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_experts_lrmoe_cannot_compute_are_refused():
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    name, kwargs = hf_ep.FAMILIES["qwen3-moe"]
    lt.check_experts(Qwen3MoeExperts(getattr(transformers, name)(**kwargs)))
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts: hidden_act='gelu'"):
        lt.check_experts(Qwen3MoeExperts(getattr(transformers, name)(**kwargs, hidden_act="gelu")))
    with pytest.raises(ValueError, match="GptOssExperts: expert biases, transposed expert weights, interleaved"):
        lt.check_experts(GptOssExperts(transformers.GptOssConfig(**hf_ep.GPT_OSS)))

    class Mesh:  # a tensor-parallel mesh of 2: the rows would be split over it first
        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match="tp_size=2"):
        lt.LRMoEImplementation(Qwen3MoeExperts(getattr(transformers, name)(**kwargs)), Mesh(), Mesh())


def test_stats_need_no_process_group():
    assert lt.layer_stats(torch.nn.Linear(2, 2)) == {}
