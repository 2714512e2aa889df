"""What-if: lrmoe against the best symi that fits, under other assumptions than the headline's.

Two assumptions of the headline are the least certain: lrmoe's steps to target (measured on a
tiny model, one seed) and the host time of the planners (a benchmark on a shared 2-core VM, in
Python). For each memory cap the table re-computes lrmoe's MoE time to target against symi's
with the simulated device time unchanged and

- lrmoe's steps to target at 1.00× and 1.05× static's, and as measured (the headline's);
- host planning at 0 (overlapped with device work, or free), 1 ms per layer call, and the
  benchmark's figures (the headline's), the same rule for both systems.

symi computes the exact gradient, so its steps are static's throughout.
"""

from __future__ import annotations

STEPS = ("1.00", "1.05", "measured")
HOSTS = ("0", "1 ms", "bench")


def _host_ms(row: dict, host: str, moe_layers: int) -> float:
    if host == "0":
        return 0.0
    if host == "1 ms":
        return 1.0 * moe_layers  # one ms per layer call
    return row["host_ms"]


def what_if(lrmoe: dict, symi: dict, moe_layers: int) -> dict[str, dict[str, float | None]]:
    """{steps: {host: reduction of MoE time to target vs symi, %}} for one cap; None where
    lrmoe's measured steps are unknown; {} where either does not fit (status not "ok"/"not reached")."""
    fits = ("ok", "not reached")
    if lrmoe.get("status") not in fits or symi.get("status") not in fits:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for steps in STEPS:
        ratio = lrmoe.get("steps_ratio") if steps == "measured" else float(steps)
        out[steps] = {}
        for host in HOSTS:
            if ratio is None:
                out[steps][host] = None
                continue
            t_lrmoe = (lrmoe["device_step_ms"] + _host_ms(lrmoe, host, moe_layers)) * ratio
            t_symi = (symi["device_step_ms"] + _host_ms(symi, host, moe_layers)) * symi["steps_ratio"]
            out[steps][host] = 100 * (t_symi - t_lrmoe) / t_symi
    return out
