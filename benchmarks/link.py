"""The emulated cluster's links against their set rate: an all-to-all per rank (the library's,
which posts receives first, and gloo's own all_to_all_single), and what the shaping costs.

    python benchmarks/link.py [--rates 0.05,0.1,0.2,0.5,1,2] [--nodes 2] [--seconds 0.25]
                              [--repeats 7] [--latency-us U] [--out FILE]

Per set rate (Gbit/s): ``--nodes`` emulated nodes of one rank each (lrmoe.emulation), every rank
sending in one exchange the bytes its link carries in about ``--seconds``; the achieved rate is
the bytes a rank sent to the others × 8 / the slowest rank's median exchange time (the links are
full duplex: each direction is shaped on its own). Beside them, the same exchange on unshaped
emulated links and on the loopback (``torchrun --standalone``), and per row an 8-byte exchange
(what a message costs: the latency seen by a collective), the machine's CPU seconds per GB
crossing a link and its busy cores while the exchange runs (/proc/stat, every core: the ranks,
the transport, the kernel's shaping and whatever else the machine runs meanwhile). With
``--latency-us`` the shaped rows add that one-way latency (where the kernel has netem).
"""

from __future__ import annotations

import argparse
import tempfile

from common import print_table, write_json

from lrmoe.emulation.namespaces import Link
from lrmoe.emulation.probe import EXCHANGES, run_probe

SMALL = 8  # bytes of the latency exchange


def measure(label: str, nodes: int, link: Link | None, size: int, repeats: int) -> dict:
    """One row: a probe of ``size`` bytes a rank and of :data:`SMALL` bytes."""
    with tempfile.TemporaryDirectory(prefix="lrmoe-link-") as tmp:
        ranks = run_probe(tmp, nproc=max(nodes, 2), nodes=nodes, link=link, sizes=(SMALL, size), repeats=repeats)
    big, small = str(size), str(SMALL)
    row = {"set_gbps": link.gbps if link else None}
    for how in EXCHANGES:
        seconds = max(r[how][big]["seconds"] for r in ranks)
        wire = ranks[0][how][big]["wire_bytes"]
        row[f"{how}_gbps"] = wire * 8 / seconds / 1e9
        row[f"{how}_small_ms"] = max(r[how][small]["seconds"] for r in ranks) * 1e3
        row[f"{how}_cpu_s_per_gb"] = ranks[0][how][big]["machine_cpu_s"] / (wire * len(ranks) / 1e9)
        row[f"{how}_busy_cores"] = ranks[0][how][big]["machine_cpu_s"] / seconds
        if row["set_gbps"]:
            row[f"{how}_over_set"] = row[f"{how}_gbps"] / row["set_gbps"]
    row["bytes_a_rank"] = wire
    print(f"{label}: " + ", ".join(f"{how} {row[f'{how}_gbps']:.3f} Gbit/s" for how in EXCHANGES), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0.05,0.1,0.2,0.5,1,2", help="set link rates, Gbit/s")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.25, help="an exchange's transfer time at the set rate")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--latency-us", type=float, default=0.0)
    ap.add_argument("--out", help="write the rows as JSON")
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    per_rank = a.nodes / (a.nodes - 1)  # a rank's bytes in all per byte it sends to others
    size = int(max(rates) * 1e9 / 8 * a.seconds * per_rank)
    rows = {"loopback": measure("loopback", 0, None, size, a.repeats),
            "unshaped links": measure("unshaped links", a.nodes, Link(), size, a.repeats)}
    for rate in rates:
        label = f"{rate:g} Gbit/s" + (f" + {a.latency_us:g} µs" if a.latency_us else "")
        rows[label] = measure(label, a.nodes, Link(rate, a.latency_us), int(rate * 1e9 / 8 * a.seconds * per_rank),
                              a.repeats)
    print_table(f"all-to-all, {a.nodes} emulated nodes of one rank (median of {a.repeats}): the library's "
                f"(receives first) and gloo's all_to_all_single", rows,
                ["set_gbps", "lrmoe_gbps", "lrmoe_over_set", "gloo_gbps", "gloo_over_set", "lrmoe_small_ms",
                 "gloo_small_ms", "lrmoe_cpu_s_per_gb", "lrmoe_busy_cores"])
    write_json(a.out, rows)


if __name__ == "__main__":
    main()
