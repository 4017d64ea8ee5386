"""An emulated network between the client host and the inference server: the study's (docs/study.md) distributed
architecture (application on one node, Triton on another, 5 Gbit/s between them) on one machine.

Triton runs in its own network namespace behind a veth pair; both directions are shaped with
``tc netem`` (rate, delay, jitter). Kernels without the netem qdisc get ``tbf`` (rate only) and the
report says so. Needs CAP_NET_ADMIN (root, or a container allowed to create namespaces);
:func:`check` says why not where that is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import psutil

PREFIX = "gwb"
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class NamespaceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Shaping:
    rate: str = "5gbit"
    """tc rate: 5gbit, 500mbit, ..."""
    delay_ms: float = 0.25
    jitter_ms: float = 0.05

    @property
    def bits_per_second(self) -> int:
        match = re.fullmatch(r"([0-9.]+)([kmg]?bit)", self.rate.lower())
        if not match:
            raise ValueError(f"rate {self.rate!r}: expected a number and bit, kbit, mbit or gbit")
        return int(float(match.group(1)) * _UNITS[match.group(2)])


def _ip(*args: str, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def _must(result: subprocess.CompletedProcess[str]) -> None:
    if result.returncode != 0:
        raise NamespaceUnavailable(f"{' '.join(result.args)}: {result.stderr.strip() or result.returncode}")


def check() -> str | None:
    """None if network namespaces can be made here, else why not."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's {tool} command is not installed"
    name = f"{PREFIX}check{os.getpid()}"
    result = _ip("netns", "add", name)
    if result.returncode != 0:
        return f"cannot create a network namespace ({result.stderr.strip()}); run as root or with CAP_NET_ADMIN"
    _ip("netns", "delete", name)
    return None


def _remove_stale() -> None:
    """Namespaces left by runs that were killed (their pid is gone)."""
    listing = _ip("netns", "list").stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{PREFIX}(\d+)", name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _ip("netns", "delete", name)


class LinkedNamespace:
    """A network namespace joined to this one by a shaped veth pair.

    ``launcher`` runs a command inside it; ``peer_address`` is its address as seen from here."""

    def __init__(self, shaping: Shaping) -> None:
        pid = os.getpid()
        self.shaping = shaping
        self.name = f"{PREFIX}{pid}"
        self.host_if, self.peer_if = f"{PREFIX}{pid}h", f"{PREFIX}{pid}p"
        subnet = 10 + pid % 240
        self.host_address, self.peer_address = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self.applied = ""
        """What shaping the kernel accepted, in words (for the report)."""

    @property
    def launcher(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)

    def __enter__(self) -> LinkedNamespace:
        _remove_stale()
        _must(_ip("netns", "add", self.name))
        try:
            _must(_ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if))
            _must(_ip("link", "set", self.peer_if, "netns", self.name))
            _must(_ip("addr", "add", f"{self.host_address}/30", "dev", self.host_if))
            _must(_ip("link", "set", self.host_if, "up"))
            _must(_ip("addr", "add", f"{self.peer_address}/30", "dev", self.peer_if, netns=self.name))
            _must(_ip("link", "set", self.peer_if, "up", netns=self.name))
            _must(_ip("link", "set", "lo", "up", netns=self.name))
            self.applied = self._shape()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _tc(self, interface: str, netns: str | None, *qdisc: str) -> subprocess.CompletedProcess[str]:
        cmd = ["tc", "qdisc", "replace", "dev", interface, "root", *qdisc]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        return subprocess.run(cmd, capture_output=True, text=True)

    def _shape(self) -> str:
        s = self.shaping
        ends = ((self.host_if, None), (self.peer_if, self.name))
        netem = ("netem", "rate", s.rate, "delay", f"{s.delay_ms}ms", f"{s.jitter_ms}ms")
        results = [self._tc(interface, netns, *netem) for interface, netns in ends]
        if all(r.returncode == 0 for r in results):
            return f"tc netem each way: rate {s.rate}, delay {s.delay_ms} ms, jitter {s.jitter_ms} ms"
        # no netem in this kernel: shape the rate with a token bucket, 10 ms of traffic per burst
        burst = max(s.bits_per_second // 8 // 100, 64 * 1024)
        tbf = ("tbf", "rate", s.rate, "burst", str(burst), "latency", "50ms")
        for interface, netns in ends:
            result = self._tc(interface, netns, *tbf)
            if result.returncode != 0:
                return f"no shaping: neither netem nor tbf accepted ({result.stderr.strip()})"
        return f"tc tbf each way: rate {s.rate}; no added delay (this kernel has no netem qdisc)"

    def __exit__(self, *exc: object) -> None:
        _ip("link", "delete", self.host_if)
        _ip("netns", "delete", self.name)
