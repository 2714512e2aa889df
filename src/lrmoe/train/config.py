"""Run configuration: TOML files (standard library ``tomllib``), CLI overrides, validation.

A config has four tables: ``[model]`` (a preset plus overrides, with a nested ``[model.moe]``),
``[train]`` (everything about the run), ``[backward]`` (the LRMoE selection, a
:class:`BackwardConfig`) and an optional ``[budget]`` (a :class:`ClusterBudget`, for ``lrmoe``,
plus ``memory_per_rank``: a whole rank's memory, from which the launcher derives
``memory_bytes``, :mod:`lrmoe.train.memory_split`). With ``train.hf_model`` the keys left out
take the checkpoint defaults (:mod:`lrmoe.train.hf_defaults`).
``[compare]`` configures ``lrmoe compare``; ``[cluster]`` puts the ranks on emulated nodes
(:mod:`lrmoe.emulation`). The resolved config is written next to the results
(``config.toml``, :mod:`lrmoe.train.toml_dump`) so a run can be repeated exactly.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.emulation.config import ClusterConfig
from lrmoe.models import ModelConfig
from lrmoe.sizes import SizeError, parse_bytes
from lrmoe.systems import COMPARE_DEFAULT, DEFAULT_SYSTEM, REFERENCE_SYSTEM, SYSTEMS, SystemName, names_where, spec_of
from lrmoe.systems import parse_system_name as _parse_system_name
from lrmoe.train.config_checks import ConfigError, check_tables, require_int, require_number
from lrmoe.train.data import DEFAULT_CORPUS
from lrmoe.train.hf_defaults import fill_hf_defaults
from lrmoe.validation import is_int_at_least

# what [model] still sets when train.hf_model names a transformers checkpoint: the window length
HF_MODEL_KEYS = {"seq_len"}


@dataclass(frozen=True)
class TrainConfig:
    system: str = DEFAULT_SYSTEM
    steps: int = 200
    batch: int = 8  # sequences per data-parallel rank
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 20
    seed: int = 0
    eval_every: int = 25
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only at the end (every eval_every steps when ranks may restart)
    keep_checkpoints: int = 2  # the newest this many stay, so a corrupt newest one has a predecessor
    nproc: int = 2
    ep_size: int = 0  # ranks per expert-parallel group; 0: all ranks form one group
    data: str = DEFAULT_CORPUS
    vocab_size: int = 1024
    val_fraction: float = 0.05
    bias_update_rate: float = 1e-3  # aux-loss-free router bias step (sigmoid routers)
    capacity_factor: float = 1.25
    replan_interval: int = 10
    on_nonfinite: str = "skip"  # "skip" the step or "stop" the run
    routing_trace: str = ""  # smartmoe: a routing.npz of an earlier run for its offline pool
    device: str = "auto"  # "auto" (CUDA when available, with NCCL), "cpu" (gloo) or "cuda"
    tensorboard: bool = False  # also write every metrics.jsonl record to out/tensorboard (lrmoe[tensorboard])
    hf_model: str = ""  # a transformers checkpoint folder to train instead of [model] (its tokenizer too)

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ConfigError(f"train.system={self.system!r} is invalid: expected one of {SYSTEMS}")
        for name in ("steps", "batch", "eval_every", "eval_batches", "nproc", "vocab_size", "replan_interval",
                     "keep_checkpoints"):
            require_int(f"train.{name}", getattr(self, name), 1)
        for name in ("warmup", "checkpoint_every", "ep_size", "seed"):
            require_int(f"train.{name}", getattr(self, name), 0)
        for name in ("lr", "capacity_factor"):
            require_number(f"train.{name}", getattr(self, name), 0, strict=True)
        for name in ("weight_decay", "bias_update_rate"):
            require_number(f"train.{name}", getattr(self, name), 0, strict=False)
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"train.val_fraction={self.val_fraction!r} is invalid: expected 0 < x < 0.5")
        if self.vocab_size < 260:
            raise ConfigError(f"train.vocab_size={self.vocab_size} is invalid: a byte-level BPE needs >= 260")
        if self.ep_size and self.nproc % self.ep_size:
            raise ConfigError(f"train.ep_size={self.ep_size} is invalid: it must divide nproc={self.nproc}")
        if self.routing_trace and not spec_of(self.system).takes_trace:
            users = " or ".join(map(repr, names_where(takes_trace=True)))
            raise ConfigError(f"train.routing_trace={self.routing_trace!r} is used by system {users}, "
                              f"not {self.system!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device={self.device!r} is invalid: expected 'auto', 'cpu' or 'cuda'")
        if self.on_nonfinite not in ("skip", "stop"):
            raise ConfigError(f"train.on_nonfinite={self.on_nonfinite!r} is invalid: expected 'skip' or 'stop'")
        if self.hf_model and self.routing_trace:
            raise ConfigError("train.routing_trace is not supported with train.hf_model: its offline pool is per "
                              "built-in layer")
        if not isinstance(self.tensorboard, bool):
            raise ConfigError(f"train.tensorboard={self.tensorboard!r} is invalid: expected true or false")


def with_restart_checkpoints(cfg: RunConfig, max_restarts: int) -> RunConfig:
    """``cfg`` as a run torchrun may restart ``max_restarts`` times: left at 0 (at the end only),
    ``train.checkpoint_every`` would send a restarted rank back to step 0, so it becomes
    ``train.eval_every``; a value the user set stays."""
    if max_restarts > 0 and cfg.train.checkpoint_every == 0:
        return cfg.with_train(checkpoint_every=cfg.train.eval_every)
    return cfg


def parse_system_name(name: str) -> SystemName:
    """:func:`lrmoe.systems.parse_system_name` (``system[-selection][@ratio]``, iterable as
    (system, selection or None, ratio or None)) with a bad name as a user-facing ConfigError."""
    try:
        return _parse_system_name(name)
    except ValueError as e:
        raise ConfigError(f"compare {e}") from None


@dataclass(frozen=True)
class CompareConfig:
    systems: tuple[str, ...] = COMPARE_DEFAULT
    target_fraction: float = 0.8  # static's validation loss at this share of its steps is the target
    # a second, strict target (0: none): the reference's loss at this later share of its steps;
    # every system runs on to it and both targets are read off the same runs
    strict_fraction: float = 0.0
    budget_factor: float = 1.5  # the others may run this many times static's steps
    target_loss: float | None = None  # a given target instead
    reference: str = REFERENCE_SYSTEM  # the target's run: this system, without the memory cap
    dense_eval_every: int = 5  # where the target was crossed, evaluate every this many steps (0: off)
    seeds: tuple[int, ...] = ()  # several: the whole comparison once per seed, then mean and spread

    def __post_init__(self) -> None:
        require_int("compare.dense_eval_every", self.dense_eval_every, 0)
        seeds = self.seeds
        if not isinstance(seeds, tuple) or not all(is_int_at_least(v, 0) and v < 2**63 for v in seeds) \
                or len(set(seeds)) != len(seeds):
            shown = list(seeds) if isinstance(seeds, tuple) else seeds
            raise ConfigError(f"compare.seeds={shown!r} is invalid: expected distinct integers from 0 to 2**63 - 1")
        if len(set(self.systems)) != len(self.systems):
            raise ConfigError(f"compare.systems={list(self.systems)!r} is invalid: a system listed twice would run "
                              "twice into one folder")
        for s in (*self.systems, self.reference):
            try:
                parse_system_name(s)
            except ConfigError as e:
                raise ConfigError(f"compare.systems={list(self.systems)!r}: {e}") from None
        if not 0 < self.target_fraction <= 1:
            raise ConfigError(f"compare.target_fraction={self.target_fraction} is invalid: expected (0, 1]")
        if self.strict_fraction and not self.target_fraction < self.strict_fraction <= 1:
            raise ConfigError(f"compare.strict_fraction={self.strict_fraction} is invalid: expected 0 (no strict "
                              f"target) or in (target_fraction={self.target_fraction}, 1]")
        if not 1 <= self.budget_factor <= 100:
            raise ConfigError(f"compare.budget_factor={self.budget_factor} is invalid: expected 1 to 100 (times the "
                              "reference's steps)")
        if self.target_loss is not None and not (math.isfinite(self.target_loss) and self.target_loss > 0):
            raise ConfigError(f"compare.target_loss={self.target_loss} is invalid: expected a finite loss > 0 (or "
                              "none: the reference's loss at target_fraction)")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    budget: ClusterBudget | None = None
    compare: CompareConfig = field(default_factory=CompareConfig)
    # [budget] memory_per_rank: a rank's whole memory (bytes); the launcher turns it into
    # budget.memory_bytes (lrmoe.train.memory_split), so a resolved config has only the latter
    memory_per_rank: int | None = None
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        check_tables(self.model, self.train.system, self.train.hf_model, self.backward, self.budget,
                     self.memory_per_rank, self.cluster.emulated)

    def with_train(self, **overrides) -> RunConfig:
        """A copy with ``[train]`` fields replaced (CLI flags, compare's per-system runs), validated again."""
        return replace(self, train=replace(self.train, **overrides))

    def to_dict(self) -> dict:
        """The resolved config as TOML-ready tables, written next to the results to repeat a run."""
        moe = asdict(self.model.moe)
        moe["dtype"] = str(moe["dtype"]).replace("torch.", "")
        model = {f.name: getattr(self.model, f.name) for f in fields(ModelConfig) if f.name != "moe"}
        model = {k: model[k] for k in HF_MODEL_KEYS} if self.train.hf_model else {**model, "moe": moe}
        out = {"model": model, "train": asdict(self.train), "backward": asdict(self.backward),
               "compare": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.compare).items()}}
        if self.cluster.emulated:
            out["cluster"] = {k: v for k, v in asdict(self.cluster).items() if v is not None}
        if self.budget is not None:
            out["budget"] = asdict(self.budget)
        if self.memory_per_rank is not None:
            out.setdefault("budget", {})["memory_per_rank"] = self.memory_per_rank
        return out


def _table(raw: dict, name: str, cls, **extra):
    table = dict(raw.get(name, {}))
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"[{name}] has unknown keys {sorted(unknown)}: expected {sorted(known)}")
    if "systems" in table:
        table["systems"] = tuple(table["systems"])
    if isinstance(table.get("seeds"), list):
        table["seeds"] = tuple(table["seeds"])
    try:
        return cls(**table, **extra)
    except ValueError as e:
        raise ConfigError(f"[{name}] {e}") from None
    except TypeError as e:
        raise ConfigError(f"[{name}] {e}") from None


def from_dict(raw: dict) -> RunConfig:
    """A validated config from parsed TOML tables; every problem is a ConfigError naming its table."""
    unknown = set(raw) - {"model", "train", "backward", "budget", "compare", "cluster"}
    if unknown:
        raise ConfigError(f"unknown tables {sorted(unknown)}: expected model, train, backward, budget, compare, "
                          "cluster")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # filled below, not the caller's
    fill_hf_defaults(raw)
    try:
        model = ModelConfig.from_dict(raw.get("model", {}))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[model] {e}") from None
    per_rank = raw.get("budget", {}).get("memory_per_rank")
    if per_rank is not None:  # not ClusterBudget's: a layer's budget knows nothing of the whole rank
        raw = {**raw, "budget": {k: v for k, v in raw["budget"].items() if k != "memory_per_rank"}}
        try:
            per_rank = parse_bytes(per_rank, "budget.memory_per_rank")
        except SizeError as e:
            raise ConfigError(str(e)) from None
    budget = _table(raw, "budget", ClusterBudget) if raw.get("budget") else None
    hf_model = raw.get("train", {}).get("hf_model")
    shaped = sorted(set(raw.get("model", {})) - HF_MODEL_KEYS)
    if hf_model and shaped:
        raise ConfigError(f"[model] {shaped} cannot be set with train.hf_model={hf_model!r}: the checkpoint's "
                          f"config.json fixes the model; [model] takes only {sorted(HF_MODEL_KEYS)} there")
    return RunConfig(model, _table(raw, "train", TrainConfig), _table(raw, "backward", BackwardConfig), budget,
                     _table(raw, "compare", CompareConfig), per_rank, _table(raw, "cluster", ClusterConfig))


def _keys_of(path: list[str]) -> set[str] | None:
    """The keys the table at ``path`` takes (None: not a table of the config)."""
    tables = {("train",): TrainConfig, ("backward",): BackwardConfig, ("budget",): ClusterBudget,
              ("compare",): CompareConfig, ("model", "moe"): MoEConfig, ("cluster",): ClusterConfig}
    if tuple(path) == ("model",):
        return {f.name for f in fields(ModelConfig)} | {"preset"}
    if tuple(path) == ("budget",):
        return {f.name for f in fields(ClusterBudget)} | {"memory_per_rank"}
    cls = tables.get(tuple(path))
    return None if cls is None else {f.name for f in fields(cls)}


def apply_sets(raw: dict, sets: list[str] | tuple[str, ...]) -> dict:
    """``raw`` (parsed TOML tables) with every ``--set section.key=value`` applied, in order.
    A value is parsed as a TOML value (``3``, ``1e-3``, ``true``, ``"text"``, ``["a", "b"]``);
    a bare word that is not TOML is a string (``train.device=cpu``). An unknown table or key is a
    ConfigError; the values are validated with the rest of the config by :func:`from_dict`."""
    for item in sets:
        key, eq, text = item.partition("=")
        path = key.strip().split(".")
        if not eq or len(path) < 2 or not all(path):
            raise ConfigError(f"--set {item!r} is invalid: expected section.key=value (e.g. train.steps=3)")
        table_path, name = path[:-1], path[-1]
        known = _keys_of(table_path)
        if known is None:
            raise ConfigError(f"--set {item!r}: no table [{'.'.join(table_path)}]: expected train, backward, "
                              f"budget, compare, cluster, model or model.moe")
        if name not in known or (table_path == ["model"] and name == "moe"):
            raise ConfigError(f"--set {item!r}: unknown key {name!r} in [{'.'.join(table_path)}]: "
                              f"expected one of {sorted(known - {'moe'})}")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        if isinstance(value, dict):
            raise ConfigError(f"--set {item!r} is invalid: expected a value, not a table")
        table = raw
        for part in table_path:
            table = table.setdefault(part, {})
        table[name] = value
    return raw


def read_config(path: str | Path) -> dict:
    """A TOML file's tables; a missing or malformed file is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None


def load(path: str | Path, sets: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A validated config from a TOML file with ``--set`` overrides (:func:`apply_sets`)
    applied; a missing or malformed file is a ConfigError too."""
    return from_dict(apply_sets(read_config(path), sets))
