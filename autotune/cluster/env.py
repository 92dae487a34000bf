"""Pure: which node this process is, how many there are, and where the launcher's store is (torchrun or Slurm).

torchrun (static or c10d rendezvous) runs one autotune process per node (--nproc-per-node 1): GROUP_RANK is the node,
WORLD_SIZE the node count, and its agent already hosts a TCPStore at MASTER_ADDR:MASTER_PORT
(TORCHELASTIC_USE_AGENT_STORE=True; with c10d rendezvous that port is the shared store's, not --rdzv-endpoint's).
Slurm (srun --ntasks-per-node 1): SLURM_PROCID is the node, SLURM_NTASKS the count, the head is the first host of
SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (parsed here, no scontrol), and node 0 hosts the store itself.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from autotune.errors import ClusterError


@dataclass(frozen=True, kw_only=True)
class ClusterEnv:
    """Where this process sits in a multi-node run."""

    node: int
    """This process's node index (0 runs the study)."""
    n_nodes: int
    """Nodes in the run (1: no cluster)."""
    master_addr: str
    """Host of the launcher's store."""
    master_port: int
    """Port of the launcher's store."""
    host_store: bool
    """This process must start the store (Slurm node 0); False under torchrun, whose agent hosts it."""
    launcher: str
    """torchrun, slurm or local."""
    run_id: str
    """Names this run's keys in the store."""


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv:
    """The cluster this process was started in; a ClusterError for a launch autotune cannot use."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        if env.get("LOCAL_WORLD_SIZE", "1") != "1":
            raise ClusterError("start autotune with torchrun --nproc-per-node 1: it starts each node's ranks itself")
        return ClusterEnv(
            node=int(env.get("GROUP_RANK", env.get("RANK", "0"))), n_nodes=int(env.get("WORLD_SIZE", "1")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", "29500")),
            host_store=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True", launcher="torchrun",
            run_id=env["TORCHELASTIC_RUN_ID"],
        )
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    if "SLURM_PROCID" in env and tasks > 1:
        nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", str(tasks))))
        if nodes != tasks:
            raise ClusterError("start autotune with srun --ntasks-per-node 1: it starts each node's ranks itself")
        hosts = expand_nodelist(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost")))
        job = env.get("SLURM_JOB_ID", "0")
        return ClusterEnv(
            node=int(env["SLURM_PROCID"]), n_nodes=tasks, master_addr=env.get("MASTER_ADDR", hosts[0]),
            master_port=int(env.get("MASTER_PORT", str(20000 + int(job) % 20000))),
            host_store=env["SLURM_PROCID"] == "0", launcher="slurm", run_id=f"slurm-{job}",
        )
    return ClusterEnv(node=0, n_nodes=1, master_addr="127.0.0.1", master_port=0, host_store=True, launcher="local",
                      run_id="local")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compact host list: 'gpu[01-03,07],login1' -> [gpu01, gpu02, gpu03, gpu07, login1]."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", text):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1))
    return hosts


def die_with_launcher() -> None:
    """Under torchrun: get SIGTERM when the torchrun agent (our parent) dies. Its workers live in their own session,
    so a SIGKILLed agent would otherwise leave this process, its fork server and its ranks running."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: nothing to arm
        return
    if os.getppid() == 1:
        raise ClusterError("the torchrun agent that started this process is gone")
