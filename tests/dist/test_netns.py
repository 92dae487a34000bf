"""bench/_netns.py, the two "nodes" of bench/internode.py: two namespaces joined by a veth pair, tbf-shaped. Bytes
cross, the shaping holds (a shaped link is never faster than its rate, however busy the machine), and the teardown
leaves no namespace, no interface and no process behind. Skipped without root or `ip netns`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _netns import NamespacePair, unavailable  # noqa: E402

pytestmark = pytest.mark.dist


def listed(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True).stdout


def test_two_namespaces_carry_bytes_at_the_shaped_rate_and_leave_nothing_behind() -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    pair = NamespacePair(tag=f"t{time.monotonic_ns() % 10000}")
    with pair:
        assert all(ns in listed("netns", "list") for ns in pair.namespaces)
        assert pair.interfaces[0] not in listed("link", "show")  # moved into its namespace
        unshaped = pair.transfer_rate(4 * 2**20)  # 4 MiB from namespace 0 to namespace 1, all of it arrived
        pair.shape(50)
        assert "tbf" in pair.exec(pair.namespaces[0], ["tc", "qdisc", "show", "dev", pair.interfaces[0]])
        shaped = pair.transfer_rate(2**20)
        assert shaped <= 50e6 / 8 * 1.05 < unshaped
        pair.shape(None)
        assert "tbf" not in pair.exec(pair.namespaces[1], ["tc", "qdisc", "show", "dev", pair.interfaces[1]])
        left = pair.popen(1, ["sleep", "600"])  # still running at the teardown: killed by it
    assert left.wait(timeout=10) != 0
    assert not any(ns in listed("netns", "list") for ns in pair.namespaces)
    assert not any(dev in listed("link", "show") for dev in pair.interfaces)
