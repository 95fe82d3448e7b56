"""The rate-limited virtual link and a short run of benchmarks/network.py over it.

The link needs root and iproute2 (CI runs as root); without them these tests
are skipped with the reason, and the benchmark itself exits cleanly.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import network  # noqa: E402
import virtual_link  # noqa: E402

BENCHMARK = [sys.executable, str(ROOT / "benchmarks" / "network.py")]
LIMIT = 300  # seconds for a whole benchmark run: a hung job fails the test, never CI


def _namespaces_unavailable() -> str | None:
    reason = virtual_link.unavailable()
    if reason:
        return reason
    probe = f"sidcoprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made.stderr.strip() or None if made.returncode else None


needs_link = pytest.mark.skipif(
    bool(reason := _namespaces_unavailable()), reason=f"no network namespaces here: {reason}"
)


def _ours() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("sidco")}


@pytest.mark.parametrize(("rate", "bits"), [("100mbit", 1e8), ("1gbit", 1e9), ("2.5Gbit", 2.5e9)])
def test_rates_parse(rate, bits):
    assert virtual_link.bits_per_second(rate) == bits


@pytest.mark.parametrize("rate", ["100", "fast", "1 gbps", "-1mbit"])
def test_bad_rates_are_refused_before_anything_is_created(rate, capsys):
    with pytest.raises(ValueError, match=f"rate must look like 100mbit.*{rate!r}"):
        network.main([f"--bandwidths={rate}"])


def test_without_root_the_benchmark_says_so_and_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert network.main([]) == 0
    assert "network benchmark skipped: network namespaces need root" in capsys.readouterr().out
    with pytest.raises(PermissionError, match="need root"), virtual_link.VirtualLink():
        pass


SENDER = """
import socket, sys, time
host, size = sys.argv[1], int(sys.argv[2])
for _ in range(100):
    try:
        sink = socket.create_connection((host, 5599)); break
    except OSError:
        time.sleep(0.05)
start = time.perf_counter(); sink.sendall(b"x" * size); sink.shutdown(socket.SHUT_WR)
sink.recv(1)  # the receiver's byte: everything arrived
print(time.perf_counter() - start)
"""
RECEIVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 5599)); peer, _ = server.accept(); got = 0
while chunk := peer.recv(1 << 20):
    got += len(chunk)
peer.sendall(b"!"); print(got)
"""


def _transfer(link, size: int) -> float:
    receiver = subprocess.Popen(
        link.command(1, [sys.executable, "-c", RECEIVER, link.addresses[1]]),
        stdout=subprocess.PIPE,
        text=True,
    )
    sender = subprocess.run(
        link.command(0, [sys.executable, "-c", SENDER, link.addresses[1], str(size)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert int(receiver.communicate(timeout=60)[0]) == size, sender.stderr
    return float(sender.stdout)


@needs_link
def test_the_link_carries_tcp_at_its_rate_and_is_removed_on_exit():
    with virtual_link.VirtualLink() as link:
        assert link.exists()
        link.shape("100mbit")
        size = 5_000_000
        slow = _transfer(link, size)
        # 5 MB at 12.5 MB/s takes 0.4 s; the bucket lets at most 10 ms of burst through early.
        assert 0.3 < slow < 3.0, slow
        sent_before = link.sent_bytes(0)
        link.shape("10gbit")
        fast = _transfer(link, size)
        assert fast < slow / 3, (fast, slow)
        assert link.sent_bytes(0) - sent_before >= size  # the counters see the transfer
    assert not link.exists()
    assert not any(pathlib.Path(f"/etc/netns/{name}").exists() for name in link.namespaces)


@needs_link
def test_short_benchmark_runs_over_the_link_and_cleans_up(tmp_path):
    before = _ours()
    out = tmp_path / "network.json"
    options = "--bandwidths 100mbit --jobs cnn:tiny --compressors dense sidco-e --ratios 0.05"
    command = [*BENCHMARK, *options.split(), "--steps", "2", "--json", str(out)]
    command += ["--timeout", str(LIMIT - 30)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {row["compressor"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "sidco-e"}
    for row in rows.values():
        assert row["step_ms"] > 0 and row["compute_ms"] > 0
        assert row["wire_bytes"] >= row["hlo_bytes"] > 0  # the payload crossed the veth
    assert rows["sidco-e"]["hlo_bytes"] < rows["dense"]["hlo_bytes"] / 4
    assert rows["sidco-e"]["wire_bytes"] < rows["dense"]["wire_bytes"]
    assert "| 100mbit | 0.05 | sidco-e |" in done.stdout
    assert _ours() == before


@needs_link
def test_an_interrupted_benchmark_removes_what_it_created(tmp_path):
    before = _ours()
    options = "--bandwidths 100mbit --jobs cnn:tiny --compressors dense --steps 1000"
    command = [*BENCHMARK, *options.split()]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    mine = {f"sidco{process.pid}a", f"sidco{process.pid}b"}

    def workers() -> bytes:  # their command lines name the link's devices
        return subprocess.run(["pgrep", "-f", f"sidco{process.pid}a0"], capture_output=True).stdout

    deadline = time.monotonic() + 60
    while not (mine <= _ours() and workers()):
        assert time.monotonic() < deadline and process.poll() is None, "no worker started"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode != 0
    assert _ours() == before
    assert not workers()
