"""Where the ranks of a run meet: torchrun's rendezvous options, passed through by
``lrmoe train`` and ``lrmoe compare``.

Without any of them a run is one machine's (``torchrun --standalone``). ``--nnodes N`` spreads
the run's ``--nproc`` ranks over N machines, ``nproc / N`` on each, which meet at a c10d
rendezvous (``--rdzv-endpoint HOST:PORT``, the backend by default there; ``--rdzv-id`` names
the job) or at a static master (``--master-addr HOST [--master-port PORT]``). Every machine
runs the same command with its own ``--node-rank``: the launcher of node 0 prepares ``--out``
(refuses a used one, clears it for ``--overwrite``), the others leave it alone, so ``--out``
must be a folder every machine sees (a shared file system; checkpoints are read across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.train.config import ConfigError, require_int

BACKENDS = ("c10d", "static", "etcd", "etcd-v2")


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int = 1
    node_rank: int | None = None  # required with nnodes > 1; node 0 prepares --out
    rdzv_backend: str | None = None  # default: c10d with an endpoint, static with a master address
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d store
    rdzv_id: str | None = None  # the job's id at the rendezvous (default "lrmoe")
    master_addr: str | None = None  # static rendezvous: node 0's address
    master_port: int | None = None

    def __post_init__(self) -> None:
        require_int("--nnodes", self.nnodes, 1)
        if self.node_rank is not None:
            require_int("--node-rank", self.node_rank, 0)
            if self.node_rank >= self.nnodes:
                raise ConfigError(f"--node-rank={self.node_rank} is invalid: expected 0..{self.nnodes - 1} "
                                  f"(--nnodes={self.nnodes})")
        if self.rdzv_backend is not None and self.rdzv_backend not in BACKENDS:
            raise ConfigError(f"--rdzv-backend={self.rdzv_backend!r} is invalid: expected one of {list(BACKENDS)}")
        for flag, value in (("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-id", self.rdzv_id),
                            ("--master-addr", self.master_addr)):
            if value is not None and not value.strip():
                raise ConfigError(f"{flag}={value!r} is invalid: expected a non-empty value")
        if self.master_port is not None:
            require_int("--master-port", self.master_port, 1)
            if self.master_port > 65535 or self.master_addr is None:
                raise ConfigError(f"--master-port={self.master_port} is invalid: expected a port 1..65535 "
                                  f"with --master-addr")
        if self.rdzv_endpoint and self.master_addr:
            raise ConfigError("--rdzv-endpoint and --master-addr exclude each other: meet at a c10d endpoint or "
                              "at a static master")
        if self.backend == "c10d" and not self.rdzv_endpoint:
            raise ConfigError("--rdzv-backend=c10d needs --rdzv-endpoint HOST:PORT")
        if self.standalone and (self.rdzv_backend or self.rdzv_id):
            raise ConfigError("--rdzv-backend and --rdzv-id need --rdzv-endpoint or --master-addr (without them "
                              "the run is one machine's, torchrun --standalone)")
        if self.nnodes > 1 and self.standalone:
            raise ConfigError(f"--nnodes={self.nnodes} needs a meeting point: --rdzv-endpoint HOST:PORT (c10d) or "
                              f"--master-addr HOST (static)")
        if self.nnodes > 1 and self.node_rank is None:
            raise ConfigError(f"--nnodes={self.nnodes} needs --node-rank (0..{self.nnodes - 1}) on every machine; "
                              f"node 0 prepares --out")

    @property
    def standalone(self) -> bool:
        """One machine with its own rendezvous (no meeting point given)."""
        return not (self.rdzv_endpoint or self.master_addr)

    @property
    def backend(self) -> str:
        return self.rdzv_backend or ("c10d" if self.rdzv_endpoint else "static")

    @property
    def prepares_out(self) -> bool:
        """Whether this machine's launcher checks and clears ``--out`` (node 0, or the only one)."""
        return self.node_rank in (None, 0)

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's options for a run of ``nproc`` ranks in all (before ``--max-restarts``)."""
        if nproc % self.nnodes:
            raise ConfigError(f"--nnodes={self.nnodes} is invalid: it must divide --nproc={nproc} (the ranks of the "
                              f"whole run; each machine starts nproc / nnodes)")
        if self.standalone:
            return ["--standalone", f"--nproc-per-node={nproc}"]
        args = [f"--nnodes={self.nnodes}", f"--nproc-per-node={nproc // self.nnodes}",
                f"--rdzv-backend={self.backend}", f"--rdzv-id={self.rdzv_id or 'lrmoe'}"]
        if self.rdzv_endpoint:
            args.append(f"--rdzv-endpoint={self.rdzv_endpoint}")
        if self.master_addr:
            args.append(f"--master-addr={self.master_addr}")
        if self.master_port is not None:
            args.append(f"--master-port={self.master_port}")
        if self.backend == "static":  # torchrun ignores (and warns about) a node rank for the others
            args.append(f"--node-rank={self.node_rank or 0}")
        return args


_current = Rendezvous()


def use_rendezvous(rendezvous: Rendezvous) -> None:
    """Set the rendezvous of the launches that follow in this process (the command line sets
    it once; ``compare`` launches one run per system)."""
    global _current
    _current = rendezvous


def current_rendezvous() -> Rendezvous:
    return _current
