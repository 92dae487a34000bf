"""The multi-node protocol on the launcher's TCPStore: node 0's trial runner (Cluster) and the other nodes' agent
loop (serve). Every node forks its own ranks from its fork server (trial.launch.run_ranks); global rank = node x
gpus_per_node + local rank; the trial's process group meets under a per-trial prefix of the store.

Keys, under autotune/<run id>/:
  nodes/<n>/hello              agent -> node 0, once: host, pid, gpus per node
  nodes/<n>/beat               every node, a counter bumped every BEAT_S from a thread with its own client (store
                               errors retried); a node whose counter stays still for node_timeout_s(nodes) by the
                               reader's clock is gone
  trial/<k>/job                node 0: model path, candidate, trial options, gpus per node
  trial/<k>/pg/...             the trial's process group
  trial/<k>/failed             counter: a rank failed on some node (every node gives its ranks the failure grace)
  trial/<k>/abort              node 0: why the trial stops (a node is gone)
  trial/<k>/node/<n>/outcome   each agent: its ranks' RanksOutcome
  shutdown, nodes/<n>/bye      node 0 at the end, and each agent's answer
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from autotune.candidate import Candidate, Measurement
from autotune.cluster.env import ClusterEnv
from autotune.errors import ClusterError
from autotune.model_file import ModelSpec
from autotune.trial.launch import LIVE, RanksOutcome, TrialOptions, measure, run_ranks

log = logging.getLogger(__name__)

BEAT_S = 0.5
"""How often each node bumps its beat, and how often a reader looks at the beats."""
NODE_TIMEOUT_S = 5.0
NODE_TIMEOUT_PER_NODE_S = 0.1
"""A node whose beat has not moved for node_timeout_s(n_nodes) = NODE_TIMEOUT_S + NODE_TIMEOUT_PER_NODE_S x n_nodes
is gone (5.2 s for 2 nodes, 17.8 s for 128): one store server serves every node's beats and node 0 reads them one
round trip per node, so a look at every beat takes longer, and one slow host is likelier, as nodes are added."""
JOIN_TIMEOUT_S = 120.0
OUTCOME_MARGIN_S = 15.0
"""How long after the trial timeout node 0 waits for the other nodes' outcomes."""
BYE_TIMEOUT_S = 10.0


def connect(env: ClusterEnv, timeout_s: float = 60.0) -> dist.TCPStore:
    """This process's client of the run's store (Slurm node 0: its server)."""
    try:
        return dist.TCPStore(env.master_addr, env.master_port, world_size=None, is_master=env.host_store,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:
        raise ClusterError(
            f"cannot reach the launcher's store at {env.master_addr}:{env.master_port} ({type(exc).__name__}); "
            f"check --master-addr/--master-port (MASTER_ADDR/MASTER_PORT)"
        ) from None


def stop_on_sigterm() -> None:
    """SIGTERM (torchrun stopping us, or our torchrun agent dying): kill this node's ranks and leave at once, without
    Python's exit handlers (multiprocessing would join the ranks while the beat thread kept beating)."""

    def terminate(signum: int, frame: object) -> None:
        for p in LIVE:
            if p.exitcode is None:
                p.kill()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def node_timeout_s(n_nodes: int) -> float:
    """Seconds without a beat before a node of an n_nodes run counts as gone."""
    return NODE_TIMEOUT_S + NODE_TIMEOUT_PER_NODE_S * n_nodes


class Beat(threading.Thread):
    """Bumps this node's beat counter on a client of its own. A store error is retried, on a new client, every beat
    (a slow or restarting store server, a reset connection); `lost` says why once the store has been unreachable
    for the whole node timeout (by then the other nodes count this one as gone anyway)."""

    def __init__(self, env: ClusterEnv, root: str, connect: Callable[[], dist.Store] | None = None,
                 beat_s: float = BEAT_S, timeout_s: float | None = None) -> None:
        super().__init__(daemon=True, name="autotune-beat")
        self.key = f"{root}/nodes/{env.node}/beat"
        self.timeout_s = node_timeout_s(env.n_nodes) if timeout_s is None else timeout_s
        # One request may take half the timeout (at least 2 s), so a stuck one still leaves time to retry.
        request = timedelta(seconds=max(2.0, self.timeout_s / 2))
        self.connect = connect or (lambda: dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                                         timeout=request))
        self.beat_s = beat_s
        self.store: dist.Store | None = self.connect()
        self.lost: str | None = None
        self.failures = 0
        """Store errors retried so far."""
        self.start()

    def run(self) -> None:
        failing_since: float | None = None
        while True:
            try:
                if self.store is None:
                    self.store = self.connect()
                self.store.add(self.key, 1)
                if failing_since is not None:
                    log.info("heartbeat: the store answers again after %.1f s", time.monotonic() - failing_since)
                failing_since = None
            except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / DistNetworkError / RuntimeError
                self.failures += 1
                self.store = None  # a client whose request failed may be out of step with the server: a new one
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("heartbeat: store error, retrying every %g s: %s: %s", self.beat_s,
                                type(exc).__name__, exc)
                if now - failing_since > self.timeout_s:
                    self.lost = f"{type(exc).__name__}: {exc} (no beat for {now - failing_since:.0f} s)"
                    return
            time.sleep(self.beat_s)


class Watch:
    """Which other nodes stopped beating, by this process's own clock (no comparison of clocks across hosts). The
    beats are read at most every BEAT_S; a read that fails is no news (a node's beat must move within the timeout)."""

    def __init__(self, store: dist.Store, root: str, nodes: list[int], timeout_s: float = NODE_TIMEOUT_S,
                 every_s: float = BEAT_S) -> None:
        self.store, self.root, self.timeout_s, self.every_s = store, root, timeout_s, every_s
        now = time.monotonic()
        self.seen = {n: (-1, now) for n in nodes}
        self.read_at = -float("inf")

    def gone(self) -> list[tuple[int, float]]:
        """(node, seconds since its beat last moved) of every node silent for the timeout."""
        now = time.monotonic()
        if now - self.read_at >= self.every_s:
            self.read_at = now
            for n, (value, _) in self.seen.items():
                try:
                    current = self.store.add(f"{self.root}/nodes/{n}/beat", 0)
                except Exception as exc:  # noqa: BLE001 - see Beat.run
                    log.debug("reading the beats: %s: %s", type(exc).__name__, exc)
                    break
                if current != value:
                    self.seen[n] = (current, now)
        return [(n, now - since) for n, (_, since) in self.seen.items() if now - since > self.timeout_s]


def _trial_watch(store: dist.Store, prefix: str, abort: Any) -> Any:
    """run_ranks' watch for one trial: tell the other nodes when a rank failed here, hear when one failed there."""
    told = False

    def watch(failed_here: bool) -> tuple[bool, str | None]:
        nonlocal told
        if failed_here and not told:
            store.add(f"{prefix}/failed", 1)
            told = True
        return store.add(f"{prefix}/failed", 0) > 0, abort()

    return watch


class Cluster:
    """Node 0's side: waits for the agents, runs each trial on every node (a TrialRunner), stops them at the end."""

    def __init__(self, env: ClusterEnv, gpus_per_node: int) -> None:
        self.env, self.gpus_per_node = env, gpus_per_node
        self.root = f"autotune/{env.run_id}"
        self.store = connect(env)
        self.beat = Beat(env, self.root)
        self.others = list(range(1, env.n_nodes))
        self.watch: Watch | None = None
        self.jobs = 0

    def join(self) -> None:
        """Wait for every agent's hello; their ranks per node must match this node's."""
        for n in self.others:
            try:
                self.store.wait([f"{self.root}/nodes/{n}/hello"], timedelta(seconds=JOIN_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError on a timeout
                raise ClusterError(
                    f"node {n} did not join within {JOIN_TIMEOUT_S:g} s: start the same command on every node"
                ) from None
            hello = json.loads(self.store.get(f"{self.root}/nodes/{n}/hello"))
            if hello["gpus_per_node"] != self.gpus_per_node:
                self.shutdown(2, "nodes disagree on --gpus-per-node")
                raise ClusterError(
                    f"node {n} ({hello['host']}) has {hello['gpus_per_node']} ranks per node, node 0 has "
                    f"{self.gpus_per_node}: pass the same --gpus-per-node everywhere"
                )
        self.watch = Watch(self.store, self.root, self.others, timeout_s=node_timeout_s(self.env.n_nodes))

    def __call__(self, spec: ModelSpec, candidate: Candidate, options: TrialOptions) -> Measurement:
        """Run one trial on every node; ClusterError when a node stops answering (the trial counts as failed)."""
        candidate.validate(spec.n_layers)
        if candidate.world_size != self.gpus_per_node * self.env.n_nodes:
            raise ClusterError(f"{candidate.world_size} ranks do not fill {self.env.n_nodes} nodes of "
                               f"{self.gpus_per_node}; pass --gpus {self.gpus_per_node * self.env.n_nodes}")
        assert self.watch is not None, "join() first"
        watch = self.watch
        self.jobs += 1
        prefix = f"{self.root}/trial/{self.jobs}"
        job = {"model_path": str(spec.path), "split_at": list(spec.split_at) if spec.split_at else None,
               "candidate": candidate.to_dict(),
               "options": dataclasses.asdict(options), "gpus_per_node": self.gpus_per_node}
        started = time.time()
        self.store.set(f"{prefix}/job", json.dumps(job))
        gone: list[tuple[int, float]] = []

        def abort() -> str | None:
            gone[:] = watch.gone()
            if gone:
                self.store.set(f"{prefix}/abort", f"node {gone[0][0]} is gone")
                return f"node {gone[0][0]} is gone"
            return None

        g = self.gpus_per_node
        outcomes = {0: run_ranks(str(spec.path), candidate, options, ranks=range(0, g), node=0, split_at=spec.split_at,
                                 store=f"{self.env.master_addr}:{self.env.master_port}/{prefix}/pg",
                                 watch=_trial_watch(self.store, prefix, abort))}
        while not gone:
            for n in self.others:
                key = f"{prefix}/node/{n}/outcome"
                if n not in outcomes and self.store.check([key]):
                    outcomes[n] = RanksOutcome.from_dict(json.loads(self.store.get(key)))
            if len(outcomes) == self.env.n_nodes or time.time() > started + options.timeout_s + OUTCOME_MARGIN_S:
                break
            gone[:] = [d for d in watch.gone() if d[0] not in outcomes]
            time.sleep(0.05)
        if gone:
            n, quiet = gone[0]
            raise ClusterError(f"node {n} stopped answering (no heartbeat for {quiet:.0f} s): its agent or host died; "
                               f"the study is kept, --resume continues it")
        missing = [n for n in self.others if n not in outcomes]
        if missing:
            raise ClusterError(f"node {missing[0]} sent no outcome within the trial timeout + {OUTCOME_MARGIN_S:g} "
                               f"s; the study is kept, --resume continues it")
        return measure(candidate, options, [outcomes[n] for n in sorted(outcomes)], time.time() - started)

    def probe(self, device: str, timeout_s: float = 60.0) -> tuple[float, float, float | None, bool] | None:
        """(latency s, bandwidth bytes/s of one send, all-reduce bandwidth bytes/s or None, whether the two nodes
        are one machine) from node 0 to node 1, measured by two ranks (trial.probe); None when the probe failed
        (the planner then keeps the one-node link)."""
        assert self.watch is not None, "join() first"
        watch = self.watch
        self.jobs += 1
        prefix = f"{self.root}/trial/{self.jobs}"
        options = TrialOptions(timeout_s=timeout_s, device=device)
        self.store.set(f"{prefix}/job", json.dumps({"kind": "probe", "nodes": [0, 1],
                                                    "options": dataclasses.asdict(options)}))

        def abort() -> str | None:
            return "node gone" if watch.gone() else None

        mine = run_ranks("", None, options, ranks=range(0, 1), node=0, kind="probe", world_size=2,
                         store=f"{self.env.master_addr}:{self.env.master_port}/{prefix}/pg",
                         watch=_trial_watch(self.store, prefix, abort))
        key, deadline = f"{prefix}/node/1/outcome", time.time() + OUTCOME_MARGIN_S
        while not self.store.check([key]) and time.time() < deadline and not watch.gone():
            time.sleep(0.05)
        result = mine.results.get(0)
        if result is None:
            return None
        reduced = result.get("allreduce_bandwidth_bytes_per_s")
        return (float(result["latency_s"]), float(result["bandwidth_bytes_per_s"]),
                float(reduced) if reduced else None, bool(result.get("same_host")))

    def shutdown(self, code: int, reason: str) -> None:
        """Tell the agents to exit (code 0: done) and wait a little for their byes: under Slurm this process hosts
        the store, and leaving first would look like a crash to them."""
        try:
            self.store.set(f"{self.root}/shutdown", json.dumps({"code": code, "reason": reason}))
            self.store.wait([f"{self.root}/nodes/{n}/bye" for n in self.others], timedelta(seconds=BYE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - an agent that is gone cannot say bye
            pass


def serve(env: ClusterEnv, gpus_per_node: int, say: Any = print) -> int:
    """An agent (node > 0): announce itself, run this node's ranks of every trial node 0 publishes, exit when node 0
    says so (its code) or stops answering (ClusterError)."""
    root = f"autotune/{env.run_id}"
    store = connect(env)
    beat = Beat(env, root)
    store.set(f"{root}/nodes/{env.node}/hello",
              json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "gpus_per_node": gpus_per_node}))
    say(f"node {env.node} of {env.n_nodes}: joined {env.master_addr}:{env.master_port}, waiting for node 0's trials")
    watch = Watch(store, root, [0], timeout_s=node_timeout_s(env.n_nodes))
    k = 1
    try:
        while True:
            if store.check([f"{root}/shutdown"]):
                done = json.loads(store.get(f"{root}/shutdown"))
                store.set(f"{root}/nodes/{env.node}/bye", "1")
                say(f"node {env.node}: node 0 finished ({done['reason']})")
                return int(done["code"])
            prefix = f"{root}/trial/{k}"
            if store.check([f"{prefix}/job"]):
                job = json.loads(store.get(f"{prefix}/job"))
                _run_job(env, store, prefix, job, watch)
                k += 1
                continue
            if watch.gone() or beat.lost:
                raise ClusterError(f"node {env.node}: node 0 stopped answering; exiting")
            time.sleep(0.05)
    except ClusterError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store went away with node 0
        raise ClusterError(f"node {env.node}: lost the run's store ({type(exc).__name__}): node 0 is gone; "
                           f"exiting") from None


def _run_job(env: ClusterEnv, store: dist.Store, prefix: str, job: dict[str, Any], watch: Watch) -> None:
    if env.node not in job.get("nodes", [env.node]):
        return  # the probe: node 0 and node 1 only
    options = TrialOptions(**job["options"])
    abort_key = f"{prefix}/abort"

    def abort() -> str | None:
        if watch.gone():
            return "node 0 is gone"
        return store.get(abort_key).decode() if store.check([abort_key]) else None

    where = {"node": env.node, "store": f"{env.master_addr}:{env.master_port}/{prefix}/pg",
             "watch": _trial_watch(store, prefix, abort)}
    if job.get("kind") == "probe":
        outcome = run_ranks("", None, options, ranks=range(1, 2), kind="probe", world_size=2, **where)
    else:
        g = int(job["gpus_per_node"])
        split_at = job.get("split_at")
        outcome = run_ranks(job["model_path"], Candidate.from_dict(job["candidate"]), options,
                            ranks=range(env.node * g, (env.node + 1) * g),
                            split_at=tuple(split_at) if split_at else None, **where)
    store.set(f"{prefix}/node/{env.node}/outcome", json.dumps(outcome.to_dict()))
