"""One rank of ``lrmoe train``, started by torch.distributed.run (see lrmoe.cli)."""

from __future__ import annotations

import argparse

from lrmoe.train.loop import main_worker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--stop-at", type=float)
    ap.add_argument("--eval-at", type=int, nargs="*", default=[])
    a = ap.parse_args()
    main_worker(a.config, a.out, a.resume, a.max_steps, a.stop_at, tuple(a.eval_at))


if __name__ == "__main__":
    main()
