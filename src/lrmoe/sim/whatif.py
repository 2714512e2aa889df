"""What-if: lrmoe against the best symi that fits, under other assumptions than the headline's.

Two assumptions of the headline are the least certain: lrmoe's steps to target (measured on a
tiny model, one seed) and the host time of the planners (a benchmark on a shared 2-core VM, in
Python). For each memory cap the table re-computes lrmoe's MoE time to target against symi's
(where symi does not fit: against the fastest other system that does) with the simulated device
time unchanged and

- lrmoe's steps to target at 1.00× and 1.05× static's, and as measured (the headline's);
- host planning at 0 (overlapped with device work, or free), 1 ms per layer call, and the
  benchmark's figures (the headline's), the same rule for every system that plans (one that
  plans nothing pays nothing in every column).

The reference keeps its own steps (exact backwards: static's).
"""

from __future__ import annotations

from lrmoe.systems import REPLICATED_BASELINE, TRIMMING_SYSTEM, base_system

STEPS = ("1.00", "1.05", "measured")
HOSTS = ("0", "1 ms", "bench")
FITS = ("ok", "not reached")  # the step fits the cap (a time to target, or none measured)


def _host_ms(row: dict, host: str, moe_layers: int) -> float:
    if host == "0" or not row["host_ms"]:
        return 0.0
    if host == "1 ms":
        return 1.0 * moe_layers  # one ms per layer call
    return row["host_ms"]


def what_if_reference(rows: dict[str, dict], symi: str = REPLICATED_BASELINE) -> str | None:
    """symi (the replicated baseline) where it fits, else the fastest other system (not the
    trimming system, lrmoe, at any selection or ratio) with a time to target."""
    if rows.get(symi, {}).get("status") == "ok":
        return symi
    timed = [(r["moe_time_to_target_s"], n) for n, r in rows.items()
             if base_system(n) != TRIMMING_SYSTEM and r.get("moe_time_to_target_s") is not None]
    return min(timed)[1] if timed else None


def what_if(lrmoe: dict, ref: dict, moe_layers: int) -> dict[str, dict[str, float | None]]:
    """{steps: {host: reduction of MoE time to target vs ``ref``, %}} for one cap; None where
    lrmoe's measured steps are unknown; {} where either does not fit."""
    if lrmoe.get("status") not in FITS or ref.get("status") != "ok":
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
            t_ref = (ref["device_step_ms"] + _host_ms(ref, host, moe_layers)) * ref["steps_ratio"]
            out[steps][host] = 100 * (t_ref - t_lrmoe) / t_ref
    return out
