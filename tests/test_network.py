"""The rate-limited virtual link and a short run of benchmarks/network.py over it.

The link needs root and iproute2 (CI runs as root); without them these tests
are skipped with the reason, and the benchmark itself exits cleanly.
"""

import itertools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import sidco_jax as sidco
from benchmarks import network, virtual_link

# -m 'not slow' leaves this file out of a quick run; its links run on one worker at a time.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARK = [sys.executable, "-m", "benchmarks.network"]
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


def _links_of(pid: int) -> set[str]:
    """The namespaces of the link a benchmark process creates: another test's benchmark,
    on the other xdist worker, may hold a link of its own meanwhile."""
    return {f"sidco{pid}a", f"sidco{pid}b"}


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


@pytest.mark.parametrize(("count", "rounds"), [(2, 3), (3, 3), (15, 3), (15, 1), (4, 9)])
def test_every_round_runs_every_run_once_and_starts_somewhere_else(count, rounds):
    order = network.schedule(count, rounds)
    assert order == network.schedule(count, rounds)  # the same in both processes
    assert len(order) == rounds
    assert all(sorted(r) == list(range(count)) for r in order)
    assert all(a != b for a, b in itertools.pairwise(order))  # consecutive rounds differ
    # Rotations of one list, starting at different runs while there are runs to start at.
    assert all(r == [(r[0] + i) % count for i in range(count)] for r in order)
    starts = [r[0] for r in order]
    assert len(set(starts)) == min(count, rounds)
    if rounds <= count:  # spread over the list: 15 runs, 3 rounds -> 0, 5, 10
        assert starts == [k * count // rounds for k in range(rounds)]


def test_a_single_run_or_none_still_gets_its_rounds():
    assert network.schedule(1, 3) == [[0], [0], [0]]
    assert network.schedule(0, 2) == [[], []]


@pytest.mark.parametrize("flag", ["--rounds", "--steps"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_rounds_and_steps_below_one_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        network.main([flag, value])
    assert "must be at least 1" in capsys.readouterr().err


def _row(compressor: str, step_ms: list[list[float]], compute=1.0, alone=2.0) -> dict:
    shape = [len(r) for r in step_ms]
    row = {
        "job": "j",
        "bandwidth": "1gbit",
        "compressor": compressor,
        "ratio": 0.01,
        "parameters": 10,
        "local_devices": 1,
        "wire_bytes": 1.0,
        "hlo_bytes": 1,
        "samples_s": {
            "step": [[x / 1e3 for x in r] for r in step_ms],
            "compute": [[compute / 1e3] * n for n in shape],
            "alone": [[alone / 1e3] * n for n in shape],
        },
    }
    return network.summarize(row)


def test_unknown_compressors_are_refused_before_anything_is_created(capsys):
    with pytest.raises(SystemExit) as exit_:
        network.main(["--compressors", "dense", "sidco-e stear"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown compressor 'sidco-e stear'; allowed: sidco-e, " in err
    assert ", sidco-e paper," in err


def test_outer_step_runs_need_a_whole_number_of_steps(capsys):
    with pytest.raises(SystemExit) as exit_:
        network.main(["--target-compressors", "sidco-e@0"])
    assert exit_.value.code == 2
    assert "sidco-e@0: H must be a whole number of steps, at least 1" in capsys.readouterr().err


def test_time_to_target_is_per_round_and_summarized_against_sidco_every_step():
    def trace(name, bandwidth, r, seconds_per_step, losses):
        seconds = [seconds_per_step * (i + 1) for i in range(len(losses))]
        return {
            "job": "j",
            "bandwidth": bandwidth,
            "compressor": name,
            "ratio": 0.01,
            "round": r,
            "seconds": seconds,
            "loss": losses,
            "final_eval": 5.0 + r,
        }

    slow = [4.0, 3.0, 2.0, 2.0]  # reaches 2.0 (the highest final loss) at its step 3
    fast = [4.0, 2.0, 1.0, 1.0]  # at its step 2
    traces = [
        trace(name, bw, r, per_step, losses)
        for bw in ("50mbit", "1gbit")
        for r in (0, 1)
        for name, per_step, losses in (
            ("sidco-e", 1.0 + r, slow),
            ("sidco-e@32", 0.5, fast),
        )
    ]
    rows = network.time_to_target(traces, window=1)
    assert {r["target_loss"] for r in rows} == {2.0}
    assert [r["steps"] for r in rows[:2]] == [3, 2]
    summary = {(t["bandwidth"], t["compressor"]): t for t in network.target_summary(rows)}
    outer = summary[("50mbit", "sidco-e@32")]
    assert outer["seconds"] == 1.0 and (outer["low"], outer["high"]) == (1.0, 1.0)
    # Round 0: sidco-e took 3 s, round 1: 6 s; the outer run 1 s in both.
    assert outer["vs_base"] == {"median": 4.5, "low": 3.0, "high": 6.0}
    assert summary[("1gbit", "sidco-e")]["vs_base"]["median"] == 1.0
    assert outer["final_eval"] == 5.5
    assert "| j | 50mbit | sidco-e@32 | 0.01 | 2.000 | 2 | 1.0 (1.0-1.0) | 4.50x (3.00-6.00) |" in (
        network.tables([], [], rows)
    )


def test_runs_may_name_an_adaptation():
    # "sidco-e" fills the payload (the default); "sidco-e paper" runs the paper's rule.
    g = np.random.default_rng(0).standard_t(3, size=10_000).astype(np.float32)
    sent = {}
    for label in ("sidco-e paper", "sidco-e"):
        tx = network.compressor(label, 0.01, None)
        sent[label] = float(tx.update(g, tx.init(g))[1].last.density)
    assert sent["sidco-e"] == pytest.approx(sidco.capacity(g.size, 0.01) / g.size)
    assert sent["sidco-e"] != sent["sidco-e paper"]


def test_hierarchical_runs_need_several_devices_per_process(capsys):
    with pytest.raises(SystemExit) as exit_:
        network.main(["--hierarchical", "sidco-e"])
    assert exit_.value.code == 2
    assert "--hierarchical needs --local-devices 2 or more" in capsys.readouterr().err


def test_parts_are_medians_of_paired_steps_with_their_quartiles():
    row = _row("topk", [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]], 1.0, 4.0)
    assert (row["rounds"], row["steps"]) == (3, 4)
    assert row["step_rounds_ms"] == pytest.approx([11.5, 21.5, 31.5])
    assert row["step_ms"] == pytest.approx(21.5)
    assert row["step_p25_ms"] == pytest.approx(12.75)  # numpy's linear percentile of 12 steps
    assert row["step_p75_ms"] == pytest.approx(30.25)
    assert row["compute_ms"] == pytest.approx(1.0)
    assert row["compression_ms"] == pytest.approx(3.0)
    assert row["communication_ms"] == pytest.approx(21.5 - 4.0)
    for part in network.PARTS:
        assert row[f"{part}_p25_ms"] <= row[f"{part}_ms"] <= row[f"{part}_p75_ms"]


def test_speedups_are_per_round_ratios_so_drift_between_rounds_cancels():
    # The machine got twice and three times slower in rounds 2 and 3, for everyone alike.
    dense = _row("dense", [[100, 110, 90], [200, 220, 180], [300, 330, 270]])
    topk = _row("topk", [[50, 55, 45], [100, 110, 90], [150, 165, 135]])
    sidco = _row("sidco-e", [[40, 44, 36], [100, 110, 90], [100, 110, 90]])
    dgc = _row("dgc", [[40, 44, 36], [80, 88, 72], [150, 165, 135]])
    rows = [dense, topk, dgc, sidco]
    network.speedups(rows)
    assert topk["vs_dense"] == {"median": 2.0, "low": 2.0, "high": 2.0, "rounds": [2.0] * 3}
    assert sidco["vs_dense"]["rounds"] == pytest.approx([2.5, 2.0, 3.0])
    assert sidco["vs_dense"]["median"] == pytest.approx(2.5)
    assert (sidco["vs_dense"]["low"], sidco["vs_dense"]["high"]) == pytest.approx((2.0, 3.0))
    assert sidco["vs_topk"]["rounds"] == pytest.approx([1.25, 1.0, 1.5])
    assert dense["vs_topk"]["median"] == pytest.approx(0.5)
    assert sidco["vs_dgc"]["rounds"] == pytest.approx([1.0, 0.8, 1.5])
    assert dgc["vs_dgc"]["rounds"] == [1.0] * 3
    for row in rows:
        for speedup in (row["vs_dense"], row["vs_topk"], row["vs_dgc"]):
            assert speedup["low"] <= speedup["median"] <= speedup["high"]
    table = network.tables(rows, [], [])
    assert "| 1gbit | 0.01 | sidco-e | 90.0 (44.0-100) | 40.0 / 100 / 100 |" in table
    last = "| 2.50x (2.00-3.00) | 1.25x (1.00-1.50) | 1.00x (0.80-1.50) |"
    assert table.splitlines()[-1].endswith(last)
    assert "3 rounds x 3 steps per compressor" in table


def test_the_crossover_fits_the_median_steps():
    rows = []
    for bandwidth, dense_ms in (("100mbit", [1000, 1010, 990]), ("1gbit", [200, 210, 190])):
        for compressor, ms in (("dense", dense_ms), ("sidco-e", [300, 900, 310])):
            row = _row(compressor, [ms])  # one round: medians 1000 / 200 and 310
            rows.append(dict(row, bandwidth=bandwidth))
    [fit] = network.crossovers(rows)
    # dense: a + b x through (8e-5 ms/byte, 1000) and (8e-6, 200); sidco-e: flat 310.
    assert fit["fixed_ms"] == pytest.approx(310)
    b = (1000 - 200) / (8e-5 - 8e-6)
    a = 200 - b * 8e-6
    assert fit["crossover_bits"] == pytest.approx(8e3 * b / (310 - a))
    assert 1e8 < fit["crossover_bits"] < 1e9  # dense's median step is 310 ms at ~447 Mbit/s


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
        link.shape("10mbit")
        size = 2_500_000
        slow = _transfer(link, size)
        # 2.5 MB at 1.25 MB/s takes 2 s; the bucket lets at most 10 ms of burst through early.
        # Slow enough that the unshaped transfer, which takes 0.2 s on a busy 2-core runner
        # (Python start-up and scheduling, not the link), stays far below it.
        assert 1.5 < slow < 10.0, slow
        sent_before = link.sent_bytes(0)
        link.shape("10gbit")
        fast = _transfer(link, size)
        assert fast < slow / 3, (fast, slow)
        assert link.sent_bytes(0) - sent_before >= size  # the counters see the transfer
    assert not link.exists()
    assert not any(pathlib.Path(f"/etc/netns/{name}").exists() for name in link.namespaces)


ROUNDS, STEPS = 2, 3  # the fewest that show rotation and a spread; cnn:tiny steps take ms

SPEEDUP = r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)"  # 1.43x (1.38-1.49)


@needs_link
def test_short_benchmark_interleaves_the_compressors_over_the_link_and_cleans_up(tmp_path):
    out = tmp_path / "network.json"
    options = "--bandwidths 100mbit --jobs cnn:tiny --compressors dense sidco-e --ratios 0.05"
    command = [*BENCHMARK, *options.split(), "--rounds", str(ROUNDS), "--steps", str(STEPS)]
    command += ["--json", str(out), "--timeout", str(LIMIT - 30)]
    targets = "--target-bandwidth 100mbit --target-compressors sidco-e sidco-e@2"
    command += [*targets.split(), "--target-rounds", "2", "--target-steps", "4"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    stdout, stderr = process.communicate(timeout=LIMIT)
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    record = json.loads(out.read_text())
    rows = {row["compressor"]: row for row in record["rows"]}
    assert record["host"]["cpu"] and record["host"]["cores"] >= 1
    assert set(rows) == {"dense", "sidco-e"}
    for row in rows.values():
        for kind in ("step", "compute", "alone"):  # rounds x steps samples of each
            assert [len(r) for r in row["samples_s"][kind]] == [STEPS] * ROUNDS, kind
        for part in network.PARTS:
            assert row[f"{part}_p25_ms"] <= row[f"{part}_ms"] <= row[f"{part}_p75_ms"], part
            assert len(row[f"{part}_rounds_ms"]) == ROUNDS
        assert row["step_ms"] > 0 and row["compute_ms"] > 0
        assert row["wire_bytes"] >= row["hlo_bytes"] > 0  # the payload crossed the veth
        for speedup in (row["vs_dense"], row["vs_topk"], row["vs_dgc"]):
            assert speedup is None or speedup["low"] <= speedup["median"] <= speedup["high"]
        assert len(row["vs_dense"]["rounds"]) == ROUNDS
    assert rows["dense"]["vs_dense"]["rounds"] == [1.0] * ROUNDS
    # The local timings ran on the state the steps had reached: SIDCo's stage count is read
    # from it (the default starts at 3 and stays within [1, max_stages]).
    assert rows["dense"]["stages"] == [None] * ROUNDS
    assert len(rows["sidco-e"]["stages"]) == ROUNDS
    assert all(1 <= s <= sidco.stats.max_stages(0.05) for s in rows["sidco-e"]["stages"])
    assert rows["sidco-e"]["hlo_bytes"] < rows["dense"]["hlo_bytes"] / 4
    assert rows["sidco-e"]["wire_bytes"] < rows["dense"]["wire_bytes"]

    # Both processes ran the same rotated order, and the blocks really ran in that order.
    [job] = record["orders"]
    first, second = job["orders"]
    assert first == second
    runs = [["dense", 0.05], ["sidco-e", 0.05]]
    assert all(sorted(round_) == runs for round_ in first)
    assert first[0] != first[1]  # each round starts somewhere else
    blocks = sorted(
        (t, [row["compressor"], row["ratio"]]) for row in rows.values() for t in row["started"]
    )
    assert [run for _, run in blocks] == [run for round_ in first for run in round_]

    line = next(x for x in stdout.splitlines() if x.startswith("| 100mbit | 0.05 | sidco-e |"))
    assert re.search(rf"\| {SPEEDUP} \| - \| - \|$", line), line  # vs dense; no top-k, DGC
    assert f"{ROUNDS} rounds x {STEPS} steps per compressor" in stdout
    # The time-to-loss runs, outer steps among them, each trained in each of 2 rounds.
    reached = record["time_to_target"]
    assert sorted((t["compressor"], t["round"]) for t in reached) == [
        ("sidco-e", 0),
        ("sidco-e", 1),
        ("sidco-e@2", 0),
        ("sidco-e@2", 1),
    ]
    assert all(1 <= t["steps"] <= 4 and 0 < t["final_eval"] <= 1 for t in reached)
    for trace in record["traces"]:  # the clock starts once the first step (the compile) is done
        assert trace["seconds"][0] == 0.0 and np.all(np.diff(trace["seconds"]) > 0), trace
    assert "| cnn:tiny | 100mbit | sidco-e@2 | 0.01 |" in stdout
    assert not _links_of(process.pid) & _ours()


@needs_link
def test_an_interrupted_benchmark_removes_what_it_created(tmp_path):
    options = "--bandwidths 100mbit --jobs cnn:tiny --compressors dense --steps 1000"
    command = [*BENCHMARK, *options.split()]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    mine = _links_of(process.pid)

    def workers() -> bytes:  # their command lines name the link's devices
        return subprocess.run(["pgrep", "-f", f"sidco{process.pid}a0"], capture_output=True).stdout

    deadline = time.monotonic() + 60
    while not (mine <= _ours() and workers()):
        assert time.monotonic() < deadline and process.poll() is None, "no worker started"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode != 0
    assert not mine & _ours()
    assert not workers()
