"""The projection's inputs: :class:`SimConfig` (model, GPUs, caps, link, selection, budgets;
checked as a user would type them), its check of the caps, and the routing counts it runs on
(a recorded trace rescaled to the model, or the Zipf skew model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from lrmoe.config import SELECTIONS, BackwardConfig
from lrmoe.memory.bytes import expert_param_bytes
from lrmoe.sim.budget import GIB
from lrmoe.sim.errors import SimError
from lrmoe.sim.hardware import H200, Hardware
from lrmoe.sim.models import MODELS, ModelSpec
from lrmoe.sim.trace import load_trace, pick_layers, rescale_counts, zipf_counts
from lrmoe.systems import REFERENCE_SYSTEM, REPLICATED_BASELINE
from lrmoe.validation import is_int_at_least, is_number

DTYPE_BYTES = 2  # bf16
# --lrmoe-slots: the controller's per-step cost search, or the replicated baseline's default
# count, fixed; the flag's value for the latter is that system's name (a public CLI value)
LRMOE_SLOTS_SEARCH = "search"
LRMOE_SLOTS_FIXED = REPLICATED_BASELINE
LRMOE_SLOTS = (LRMOE_SLOTS_SEARCH, LRMOE_SLOTS_FIXED)
WARM_PHASE = "warm phase"  # the label of lrmoe's warm phase among SimConfig.extra_phases


@dataclass(frozen=True)
class SimConfig:
    """Everything one projection depends on; each default is documented in docs/simulation.md."""

    model: str
    gpus: int
    memory_caps_gib: tuple[float, ...]
    link_gbps: float = 400.0
    trace: str | None = None
    compare: str | None = None
    convergence: str | None = None  # a benchmarks/convergence.py JSON (default: the shipped study)
    planning: str | None = None  # a benchmarks/bench_planning.py JSON (default: the recorded figures)
    steps: int = 20
    layers: int = 4
    tokens_per_gpu: int = 4096
    ratios: tuple[float, ...] = (1.0,)  # upper caps on lrmoe's kept ratio (BackwardConfig.ratio)
    selection: str = "local-sampled"
    lrmoe_slots: str = LRMOE_SLOTS_SEARCH  # or LRMOE_SLOTS_FIXED: the replicated baseline's default count
    network_budget: float | None = 1.0  # × a balanced rank's keep-nothing backward bytes; None: no network budget
    backward: BackwardConfig = field(default_factory=BackwardConfig)  # lrmoe's objective, drop_cost, min_ratio
    # lrmoe's warm phase (BackwardConfig.trim_after) as a share of its steps to target: those steps
    # run at backward.warm_ratio with no time objective, the rest as configured; 0: none (every
    # step as configured)
    warm_share: float = 0.0
    # lrmoe's later floors (BackwardConfig.min_ratio_after) as ((share of its steps from which
    # on, the time objective's floor), ...), shares increasing and after the warm phase
    late_floors: tuple[tuple[float, float], ...] = ()
    optimizer_bytes_per_param: float = 12.0
    zipf: float = 0.3
    drift: int = 4
    seed: int = 0
    target_steps: int = 1000
    hardware: Hardware = field(default=H200)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise SimError(f"unknown model {self.model!r}: expected one of {sorted(MODELS)}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise SimError(f"--gpus={self.gpus!r} is invalid: expected an integer >= 1")
        if not self.memory_caps_gib or any(not (c > 0) for c in self.memory_caps_gib):
            raise SimError(f"--gpu-memory={self.memory_caps_gib!r} is invalid: expected GiB values > 0")
        if not (self.link_gbps > 0):
            raise SimError(f"--link-gbps={self.link_gbps!r} is invalid: expected a number > 0")
        for name in ("steps", "layers", "tokens_per_gpu", "target_steps"):
            v = getattr(self, name)
            if not is_int_at_least(v, 1):
                raise SimError(f"{name}={v!r} is invalid: expected an integer >= 1")
        if not self.ratios or any(not (0 < r <= 1) for r in self.ratios):
            raise SimError(f"--ratios={self.ratios!r} is invalid: expected values in (0, 1]")
        if self.lrmoe_slots not in LRMOE_SLOTS:
            raise SimError(f"--lrmoe-slots={self.lrmoe_slots!r} is invalid: expected "
                           f"{LRMOE_SLOTS_SEARCH!r} or {LRMOE_SLOTS_FIXED!r}")
        if self.selection not in SELECTIONS:
            raise SimError(f"--selection={self.selection!r} is invalid: expected one of {SELECTIONS}")
        if not (is_number(self.warm_share) and 0 <= self.warm_share < 1):
            raise SimError(f"--warm-share={self.warm_share!r} is invalid: expected a number in [0, 1) "
                           f"(the share of lrmoe's steps before it trims)")
        if self.backward.objective == "noise":
            raise SimError("--objective noise measures gradients while training; the projection has none "
                           "(--objective time or memory)")
        if self.backward.trim_after or self.backward.min_ratio_after:
            raise SimError("the projection's phases are shares of the steps (--warm-share, --late-floor), "
                           "not BackwardConfig.trim_after or min_ratio_after")
        shares = [self.warm_share, *(share for share, _ in self.late_floors)]
        if self.late_floors and (self.backward.objective != "time" or any(
                not (is_number(s) and is_number(f) and 0 < f <= 1) for s, f in self.late_floors)
                or any(not (a < b < 1) for a, b in zip(shares, shares[1:]))):
            raise SimError(f"--late-floor={self.late_floors!r} is invalid: expected SHARE:FLOOR pairs with "
                           f"shares increasing in (--warm-share, 1), floors in (0, 1], and --objective time "
                           f"(a floor bounds the time objective's trimming)")
        if self.network_budget is not None and not (math.isfinite(self.network_budget) and self.network_budget > 0):
            raise SimError(f"--network-budget={self.network_budget!r} is invalid: expected a number > 0 "
                           f"(0 on the command line: none)")

    def extra_phases(self) -> list[tuple[str, float, BackwardConfig]]:
        """lrmoe's steps outside its main phase (``backward`` as configured) as (label, share of
        its steps, the backward they follow): the warm phase, then each later floor's steps up to
        the next floor's (the last: to the target)."""
        phases = [(WARM_PHASE, self.warm_share, self.backward.warm_phase())] if self.warm_share else []
        ends = [share for share, _ in self.late_floors[1:]] + [1.0]
        phases += [(f"floor {floor:g}", end - share, replace(self.backward, min_ratio=floor))
                   for (share, floor), end in zip(self.late_floors, ends)]
        return phases

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def hw(self) -> Hardware:
        return self.hardware.with_link_gbps(self.link_gbps)

    @property
    def network_bytes(self) -> int | None:
        """lrmoe's ClusterBudget.network_bytes: ``network_budget`` × what a rank's expert side
        receives and returns in a keep-nothing backward that keeps every pair of a balanced load
        (dy and x in, dx out of tokens × top-k rows), so it binds only where a rank's kept rows
        exceed the balanced share."""
        if self.network_budget is None:
            return None
        spec = self.spec
        return int(self.network_budget * 3 * self.tokens_per_gpu * spec.top_k * spec.dim * DTYPE_BYTES)


def check_caps(cfg: SimConfig) -> None:
    """Every cap must at least hold the reference's (static: one copy an expert) expert
    parameters, gradients and optimizer state."""
    spec = cfg.spec
    owned = -(-spec.num_experts // cfg.gpus)
    params = expert_param_bytes(spec.dim, spec.ffn_dim, 1) * owned
    need = spec.moe_layers * params * (2 * DTYPE_BYTES + cfg.optimizer_bytes_per_param)
    for cap in cfg.memory_caps_gib:
        if cap * GIB < need:
            raise SimError(f"--gpu-memory {cap:g} GiB is too small for {spec.name} on {cfg.gpus} GPUs: "
                           f"{REFERENCE_SYSTEM}'s {owned} experts per GPU × {spec.moe_layers} layers need "
                           f"{need / GIB:.1f} GiB for parameters, gradients and optimizer state alone")


def routing_counts(cfg: SimConfig) -> tuple[np.ndarray, list[int], str]:
    """(steps, layers, E) int64 global counts at the model's scale, the layer indices they
    stand for, and a description of their source."""
    spec = cfg.spec
    tokens = cfg.tokens_per_gpu * cfg.gpus
    if cfg.trace is None:
        layers = pick_layers(spec.moe_layers, cfg.layers)
        counts = zipf_counts(cfg.steps, len(layers), spec.num_experts, tokens, spec.top_k, cfg.zipf, cfg.drift,
                             cfg.seed)
        return counts, layers, f"Zipf skew model (exponent {cfg.zipf}, {cfg.drift} swaps/step, seed {cfg.seed})"
    trace = load_trace(cfg.trace)
    steps = np.linspace(0, trace.shape[0] - 1, min(cfg.steps, trace.shape[0])).round().astype(int)
    layers = pick_layers(trace.shape[1], cfg.layers)
    counts = np.stack([np.stack([rescale_counts(trace[t, li], spec.num_experts, tokens, spec.top_k)
                                 for li in layers]) for t in steps])
    return counts, layers, (f"trace {cfg.trace} ({trace.shape[0]} steps × {trace.shape[1]} layers × "
                            f"{trace.shape[2]} experts; {len(steps)} steps used, rescaled)")
