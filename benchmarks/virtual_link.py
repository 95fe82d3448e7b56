"""Two network namespaces joined by a rate-limited veth pair: a slow network on one machine.

Needs root and iproute2 (``ip``, ``tc``). :class:`VirtualLink` creates the
namespaces, the veth pair and a ``tbf`` rate limit on both ends (a ``netem``
delay too when asked, where the kernel has it), and removes all of it on exit,
also after an exception, Ctrl-C or SIGTERM. Processes started with
:meth:`VirtualLink.command` see only that link and their own loopback.

JAX's gloo collectives advertise the address the machine's host name resolves
to; ``ip netns exec`` reads ``/etc/netns/<namespace>/hosts`` in place of
``/etc/hosts``, so each namespace maps the host name to its own address there.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def bits_per_second(rate: str) -> float:
    """Parses a ``tc`` rate such as ``"100mbit"`` or ``"1gbit"`` into bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if not match:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 500kbit, got {rate!r}")
    return float(match[1]) * UNITS[match[2]]


def unavailable() -> str | None:
    """Why a link cannot be made here (not root, no ``ip``/``tc``), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is missing: {', '.join(missing)} not found"
    return None


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


class VirtualLink:
    """Namespaces ``<tag>a`` and ``<tag>b`` joined by veth ``<tag>a0`` -- ``<tag>b0``.

    Use as a context manager. ``addresses[i]`` is namespace ``i``'s address on
    the link; nothing else is reachable from inside.

    Args:
      subnet: the first three octets of the link's /24 (private to the namespaces).
    """

    def __init__(self, subnet: str = "10.77.0"):
        tag = f"sidco{os.getpid()}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.devices = (f"{tag}a0", f"{tag}b0")
        self.addresses = (f"{subnet}.1", f"{subnet}.2")
        self._previous_handler = None

    def __enter__(self) -> "VirtualLink":
        reason = unavailable()
        if reason:
            raise PermissionError(reason)
        # SIGTERM unwinds like Ctrl-C, so the namespaces are removed either way.
        self._previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        for namespace in self.namespaces:
            _run("ip", "netns", "add", namespace)
        _run("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        hostname = socket.gethostname()
        for namespace, device, address in zip(
            self.namespaces, self.devices, self.addresses, strict=True
        ):
            _run("ip", "link", "set", device, "netns", namespace)
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
            _run("ip", "-n", namespace, "link", "set", device, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            folder = f"/etc/netns/{namespace}"
            os.makedirs(folder, exist_ok=True)
            with open(f"{folder}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{address} {hostname}\n")

    def shape(self, rate: str, delay_ms: float = 0.0) -> None:
        """Limits both directions to ``rate`` (a tc rate) with ``delay_ms`` one-way delay."""
        bytes_per_second = bits_per_second(rate) / 8
        # A bucket of 10 ms of traffic (at least 64 KiB): enough for tbf to reach the rate.
        burst = str(max(65536, int(bytes_per_second / 100)))
        for namespace, device in zip(self.namespaces, self.devices, strict=True):
            tc = ("ip", "netns", "exec", namespace, "tc", "qdisc")
            subprocess.run((*tc, "del", "dev", device, "root"), capture_output=True, check=False)
            tbf = ("tbf", "rate", rate, "burst", burst, "latency", "100ms")
            if delay_ms:
                netem = ("netem", "delay", f"{delay_ms}ms")
                try:
                    _run(*tc, "add", "dev", device, "root", "handle", "1:", *netem)
                except RuntimeError as error:
                    raise RuntimeError(f"a delay needs the netem qdisc: {error}") from None
                _run(*tc, "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf)
            else:
                _run(*tc, "add", "dev", device, "root", *tbf)

    def command(self, side: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def sent_bytes(self, side: int) -> int:
        """Bytes namespace ``side`` has sent on the link so far."""
        path = f"/sys/class/net/{self.devices[side]}/statistics/tx_bytes"
        out = subprocess.run(
            self.command(side, ["cat", path]), capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    def close(self) -> None:
        """Removes the namespaces (their veth ends go with them) and their hosts files."""
        # A command run in a namespace and killed by an interrupt may still be exiting
        # (subprocess waits a quarter second for it then): until it has, its mount keeps
        # the namespace busy and ``ip netns del`` fails. So try again for a while.
        deadline = time.monotonic() + 10
        for namespace in self.namespaces:
            while True:
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
                if not self._listed(namespace) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
        # Only left in the root namespace when creation failed before moving it.
        subprocess.run(["ip", "link", "del", self.devices[0]], capture_output=True, check=False)
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def exists(self) -> bool:
        """Whether any of this link's namespaces is still there."""
        return any(self._listed(namespace) for namespace in self.namespaces)

    @staticmethod
    def _listed(namespace: str) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(name.split()[0] == namespace for name in listed.splitlines() if name)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
