"""Run by tests/integrations/test_hf_ep_train.py under ``torchrun --nproc-per-node 2`` (gloo):
a tiny checkpoint loaded with ``DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation="lrmoe")``
and trained with a trimmed backward in a plain PyTorch loop, then by ``transformers.Trainer``
(from the same checkpoint), each saved with ``save_pretrained`` and loaded back with
``from_pretrained``, distributed and plain. Rank 0 prints one line ``RESULT {json}``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 hf_ep_train.py CHECKPOINT OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from lrmoe import BackwardConfig
from lrmoe.integrations import transformers as lt
from tests.helpers import hf_ep

STEPS = 8


def _eval(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.loss.item(), out.logits


def _loop(path: str, out: str, rank: int) -> dict:
    model = hf_ep.load(path, "lrmoe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, losses = hf_ep.batch(rank), []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stats = lt.layer_stats(model)
    steps = [implementation.path.planner.steps for _, implementation in lt.lrmoe_experts(model)]
    _, trained_logits = _eval(model, ids)
    model.save_pretrained(f"{out}/saved")
    _, reloaded_logits = _eval(hf_ep.load(f"{out}/saved", "lrmoe"), ids)
    result = dict(losses=losses, kept=[s["kept_ratio"] for s in stats.values()], steps=steps,
                  reloaded=(reloaded_logits - trained_logits).abs().max().item())
    if rank == 0:  # the saved folder is a plain transformers checkpoint
        _, plain_logits = _eval(hf_ep.load(f"{out}/saved", None), ids)
        result["plain"] = (plain_logits - trained_logits).abs().max().item()
    return result


def _trainer(path: str, out: str, rank: int) -> dict:
    from transformers import Trainer, TrainingArguments

    model = hf_ep.load(path, "lrmoe")
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 128, (8, 16))]
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=1, save_steps=STEPS // 2, save_only_model=True, report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = dict(losses=losses, kept=[s["kept_ratio"] for s in lt.layer_stats(model).values()])
    ids = hf_ep.batch(rank)
    loss, _ = _eval(model, ids)
    if rank == 0:  # Trainer's last checkpoint, loaded plain
        result["plain"] = abs(_eval(hf_ep.load(f"{out}/checkpoint-{STEPS}", None), ids)[0] - loss)
    return result


def main(path: str, out: str) -> None:
    dist.init_process_group("gloo")
    lt.register(backward=BackwardConfig(ratio=0.5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    result = {"loop": _loop(path, f"{out}/loop", rank)}
    torch.manual_seed(0)
    result["trainer"] = _trainer(path, f"{out}/trainer", rank)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
