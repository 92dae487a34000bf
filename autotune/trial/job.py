"""What the launcher hands a rank process, and the entry point it starts; torch-free, so the launcher does not import
the rank side (torch.distributed.pipelining, ~1 s) only to name it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """Everything one rank process needs; pickled to the fork server."""

    rank: int
    world_size: int
    model_path: str
    candidate: dict[str, Any]
    """Candidate.to_dict()."""
    steps: int
    warmup: int
    device: str
    """cpu or cuda."""
    memory_limit_bytes: int | None
    run_dir: str
    """Folder of the store file, result, error, log and stack files."""
    timeout_s: float
    """The whole trial's bound (the launcher enforces it)."""
    process_group_timeout_s: float
    """torch.distributed's timeout of one collective or receive (init_process_group)."""
    launched_at: float
    """time.time() when the launcher started the trial."""
    parent_pid: int | None
    """The fork server's pid: if it is gone, so is the tuner, and this rank must not run on."""
    split_at: tuple[str, ...] | None = None
    """ModelSpec.split_at: where the model file's model is cut into blocks."""
    measure_wire_error: bool = False
    """bfloat16 wire: compare gradients with a float32 wire's on the first micro-batches (TrialOptions)."""
    local_rank: int | None = None
    """This rank's index on its machine (its GPU); None: the global rank (one machine)."""
    local_world_size: int | None = None
    """The trial's ranks on this machine (CUDA ranks share its cores); None: world_size."""
    store: str | None = None
    """The trial's rendezvous: "host:port/prefix" on the launcher's TCPStore (multi-node); None: a file in run_dir."""
    kind: str = "run"
    """run: train the candidate; probe: measure the link between two ranks (autotune.trial.probe)."""
