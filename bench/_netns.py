"""Two network namespaces joined by a veth pair, the link rate-limited with tbf on both ends: two "nodes" on one host.

    namespace <name>0                          namespace <name>1
    lo, <veth>0 10.<n>.0.1/24  <-- veth -->  <veth>1 10.<n>.0.2/24, lo
         tbf rate R (egress)                       tbf rate R (egress)

Needs root and `ip netns` (iproute2); `tc` for the shaping. netem is not needed (no latency is added). Everything
made is removed by close(), which kills the processes still inside the namespaces (by pid, `ip netns pids`) first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import TracebackType


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces): run as root"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (ip netns)"
    if shutil.which("tc") is None:
        return "needs `tc` (iproute2) for the link shaping"
    name = f"atprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class NamespacePair:
    """Two namespaces and the veth link between them; a context manager (removed on exit, error or not). Another
    process can shape a pair it did not make: NamespacePair(tag, subnet) of the same tag and subnet, not entered."""

    def __init__(self, tag: str | None = None, subnet: int | None = None) -> None:
        tag = tag or str(os.getpid() % 100000)
        self.tag = tag
        self.namespaces = (f"at{tag}n0", f"at{tag}n1")
        self.interfaces = (f"at{tag}v0", f"at{tag}v1")  # at most 15 characters
        octet = subnet if subnet is not None else 100 + os.getpid() % 100
        self.subnet = octet
        self.addresses = (f"10.{octet}.0.1", f"10.{octet}.0.2")
        self.rate_mbit: float | None = None
        self.made: list[str] = []

    # --- life cycle -------------------------------------------------------------------------------------------------

    def __enter__(self) -> NamespacePair:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self.made.append(ns)
        a, b = self.interfaces
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for ns, dev, addr in zip(self.namespaces, self.interfaces, self.addresses):
            _ip("link", "set", dev, "netns", ns)
            self.exec(ns, ["ip", "addr", "add", f"{addr}/24", "dev", dev])
            self.exec(ns, ["ip", "link", "set", dev, "up"])
            self.exec(ns, ["ip", "link", "set", "lo", "up"])

    def close(self) -> None:
        """Kill what still runs inside (SIGKILL, by pid), then delete the namespaces (the veth pair goes with them)."""
        for ns in self.made:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while any(self.pids(ns) for ns in self.made) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)
        self.made.clear()

    @staticmethod
    def pids(ns: str) -> list[int]:
        done = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    # --- use ----------------------------------------------------------------------------------------------------------

    def exec(self, ns: str, argv: Sequence[str]) -> str:
        """Run a short command inside ns and return its stdout (RuntimeError with its stderr when it fails)."""
        done = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {ns}: {done.stderr.strip() or done.returncode}")
        return done.stdout

    def popen(self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        """Start argv inside node's namespace with GLOO_SOCKET_IFNAME set to its veth."""
        environ = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.interfaces[node]}
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=environ, text=True,
                                **kwargs)  # type: ignore[call-overload]

    def shape(self, rate_mbit: float | None) -> None:
        """Rate-limit both directions with tbf (None: unshaped). The bucket is kept small: what tbf lets through at the
        veth's own speed after an idle gap, every message's first bytes, comes off each message's time, and the link
        would not have the rate it is said to have. One full frame (less drops frames) or 128 us at the rate, whichever
        is more (less slows the link: at 200 Mbit/s a 1600-byte bucket carried a TCP stream at 143 Mbit/s, a 3200-byte
        one at 191). Measured at 20 Mbit/s: a 3200-byte bucket took ~1.0 ms off every message of 16 KiB-512 KiB
        against bytes / the probed bandwidth, a 1600-byte one ~0.3 ms. tbf splits the veth's GSO packets to fit."""
        for ns, dev in zip(self.namespaces, self.interfaces):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate_mbit is not None:
                burst = max(1600, int(rate_mbit * 1e6 / 8 * 1.28e-4))
                self.exec(ns, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                               "burst", str(burst), "latency", "200ms"])
        self.rate_mbit = rate_mbit

    def transfer_rate(self, nbytes: int = 8 * 2**20) -> float:
        """Bytes per second of one TCP stream of nbytes from namespace 0 to namespace 1 (python sockets, no torch)."""
        port = 40000 + os.getpid() % 20000
        server = (
            "import socket,sys\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{self.addresses[1]}',"
            f"{port}));s.listen(1);print('ready',flush=True);c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
            "c.sendall(b'k');print(n)\n"
        )
        client = (
            "import socket,time\n"
            f"s=socket.create_connection(('{self.addresses[1]}',{port}),timeout=60);buf=bytes(1<<20);t=time.perf_counter()\n"
            f"for _ in range({nbytes // 2**20}): s.sendall(buf)\n"
            "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)\n"
        )
        import sys

        receiver = self.popen(1, [sys.executable, "-c", server], stdout=subprocess.PIPE)
        try:
            assert receiver.stdout is not None
            if receiver.stdout.readline().strip() != "ready":
                raise RuntimeError("the receiver in namespace 1 did not start")
            seconds = float(self.exec(self.namespaces[0], [sys.executable, "-c", client]))
            received = int(receiver.communicate(timeout=60)[0])
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        if received != nbytes // 2**20 * 2**20:
            raise RuntimeError(f"sent {nbytes} bytes, {received} arrived")
        return received / seconds
