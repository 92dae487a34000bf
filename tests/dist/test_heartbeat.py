"""Multi-node liveness on a real TCPStore: two nodes' heartbeats ride out a store that fails for a few seconds, and a
store that stays down past the node timeout still ends in a node counted as gone."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from autotune.cluster.env import ClusterEnv
from autotune.cluster.node import BEAT_S, NODE_TIMEOUT_S, Beat, Watch, node_timeout_s

pytestmark = pytest.mark.dist
ROOT = "autotune/test"


class Outage:
    """While `down` is set, every client of the store fails as a store server that is unreachable does: requests
    raise, new connections are refused."""

    def __init__(self, server: dist.TCPStore) -> None:
        self.server = server
        self.down = threading.Event()
        self.refused = 0

    def connect(self) -> FlakyStore:
        if self.down.is_set():
            self.refused += 1
            raise dist.DistNetworkError("Connection refused")
        client = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, wait_for_workers=False)
        return FlakyStore(client, self)


class FlakyStore:
    def __init__(self, store: dist.Store, outage: Outage) -> None:
        self.store, self.outage = store, outage

    def add(self, key: str, amount: int) -> int:
        if self.outage.down.is_set():
            self.outage.refused += 1
            raise dist.DistStoreError("Socket Timeout")
        return self.store.add(key, amount)


def env(node: int) -> ClusterEnv:
    return ClusterEnv(node=node, n_nodes=2, master_addr="127.0.0.1", master_port=0, host_store=False,
                      launcher="local", run_id="test")


def poll(condition, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def outage():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield Outage(server)


def beats(store: FlakyStore) -> tuple[int, int]:
    return tuple(store.store.add(f"{ROOT}/nodes/{n}/beat", 0) for n in (0, 1))


def test_two_node_heartbeat_rides_out_a_store_failing_for_seconds(outage):
    timeout = node_timeout_s(2)  # the defaults of a two-node run: beat every 0.5 s, gone after 5.2 s
    assert timeout > 3.0 + 2 * BEAT_S
    nodes = [Beat(env(n), ROOT, connect=outage.connect) for n in (0, 1)]
    reader = outage.connect()
    watches = [Watch(outage.connect(), ROOT, [1], timeout_s=timeout), Watch(outage.connect(), ROOT, [0],
                                                                            timeout_s=timeout)]
    poll(lambda: min(beats(reader)) >= 2, within_s=10)

    outage.down.set()  # the store fails for 3 s: every beat and every read of the beats raises
    failed_at = time.monotonic()
    while time.monotonic() - failed_at < 3.0:
        assert [w.gone() for w in watches] == [[], []]
        time.sleep(0.05)
    assert all(node.failures >= 3 for node in nodes)  # the beat threads kept trying
    outage.down.clear()
    before = beats(reader)

    # For longer than the node timeout after the store is back: nobody is lost and both beats move again.
    healed_at = time.monotonic()
    while time.monotonic() - healed_at < timeout + 1.0:
        assert [w.gone() for w in watches] == [[], []]
        assert all(node.is_alive() and node.lost is None for node in nodes)
        time.sleep(0.05)
    after = beats(reader)
    assert all(a > b for a, b in zip(after, before))


def test_a_store_down_past_the_node_timeout_still_loses_the_node(outage):
    node = Beat(env(1), ROOT, connect=outage.connect, beat_s=0.05, timeout_s=1.0)
    watch = Watch(outage.connect(), ROOT, [1], timeout_s=1.0, every_s=0.05)
    reader = outage.connect()
    poll(lambda: beats(reader)[1] >= 2, within_s=10)
    assert watch.gone() == []
    outage.down.set()
    poll(lambda: node.lost is not None and not node.is_alive(), within_s=10)
    assert "Connection refused" in node.lost or "Socket Timeout" in node.lost
    outage.down.clear()
    poll(lambda: watch.gone() != [], within_s=10)  # the beat stopped for good: the reader counts node 1 as gone
    assert watch.gone()[0][0] == 1


def test_node_timeout_grows_with_the_node_count():
    assert node_timeout_s(2) == pytest.approx(NODE_TIMEOUT_S + 0.2)
    assert node_timeout_s(128) == pytest.approx(NODE_TIMEOUT_S + 12.8)
    assert node_timeout_s(128) > node_timeout_s(16) > node_timeout_s(2)
