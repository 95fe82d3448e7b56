"""jax.distributed on localhost: 2 processes x 4 CPU devices with gloo collectives."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import train_least_squares

pytestmark = pytest.mark.slow  # -m 'not slow' leaves this file out of a quick run

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
LIMIT = 120  # seconds: a hung job is killed, never left to block the suite
FATAL = "Terminating process because the JAX distributed service detected fatal errors"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, processes=2, local_devices=4, *extra):
    """Runs the worker in ``processes`` processes; returns their (exit code, output, seconds)."""
    # The suite's other XLA flags too (conftest.py): results compared bit for
    # bit must come from the same generated code.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={local_devices}")
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    port, start = free_port(), time.monotonic()
    args = [str(processes), str(port), str(out), *map(str, extra)]
    # Output goes to files, not pipes: a pipe nobody drains could block a worker.
    logs = [pathlib.Path(out).with_name(f"process{i}.log") for i in range(processes)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as sink:  # the child keeps its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(i), *args],
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
    results = []
    for proc, log in zip(procs, logs, strict=True):
        try:
            proc.wait(timeout=max(LIMIT - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(
                f"multi-process job still running after {LIMIT} s:\n{log.read_text()[-2000:]}"
            )
        results.append((proc.returncode, log.read_text(), time.monotonic() - start))
    return results


# Mesh 0: flat over the 8 devices; 1 to 3: one node per process, dense over its 4 devices
# (or reduce-scattered over them, each compressing its slice, or its shard of the weights),
# compressed across the 2 processes. One job trains all four, one after the other.
MESHES = {0: (False, False), 1: (True, False), 2: (True, True), 3: (True, "params")}


def test_two_processes_of_four_devices_train_like_one_process_of_eight(tmp_path):
    results = launch(tmp_path / "out.npz", 2, 4, -1, "".join(map(str, MESHES)))
    for code, output, _ in results:
        assert code == 0, output[-3000:]
    with np.load(tmp_path / "out.npz") as archive:
        got = dict(archive)
    flat = None
    for mesh, (hierarchical, sharded) in MESHES.items():
        # This process: 8 devices (2 x 4 for the hierarchical meshes).
        params, metrics = train_least_squares(30, hierarchical=hierarchical, sharded=sharded)
        assert 0.5 < float(metrics["density"]) / 0.05 < 1.5
        if not hierarchical:  # the compressed axis moves values only (all_gather): exact
            np.testing.assert_array_equal(got[f"{mesh}/params"], params)
            for key, value in metrics.items():
                np.testing.assert_array_equal(got[f"{mesh}/{key}"], value, err_msg=key)
            flat = params
            continue
        # The dense inner mean adds 4 floats in the collective's own order (gloo's ring
        # across processes, XLA's loop in one): last-bit differences, compounded over 30
        # steps.
        np.testing.assert_allclose(got[f"{mesh}/params"], params, rtol=1e-4, atol=1e-6)
        for key, value in metrics.items():
            np.testing.assert_allclose(
                got[f"{mesh}/{key}"], value, rtol=1e-4, atol=1e-6, err_msg=f"{mesh}/{key}"
            )
        assert not np.array_equal(params, flat)  # the mesh did change what was compressed


def test_each_process_writes_and_checks_the_checksums_of_its_shards(tmp_path):
    results = launch(tmp_path / "out.npz", 2, 4, -1, 0, 1)
    for code, output, _ in results:
        assert code == 0, output[-3000:]
    reports = [json.loads((tmp_path / f"out.npz.process{i}.json").read_text()) for i in range(2)]
    assert [r["same"] for r in reports] == [True, True]
    assert reports[0]["files"] == ["process_0.json", "process_1.json"]
    # Process 1 holds the residual rows of devices 4 to 7 (256 a device) and names them;
    # process 0, whose rows are intact, refuses the checkpoint too.
    found = re.search(
        r"is damaged: \[1\]\[0\]\.residual\[(\d+):\d+\] does not hold", reports[1]["damaged"]
    )
    assert found and int(found.group(1)) >= 4 * 256, reports[1]["damaged"]
    assert "is damaged: process 1 found arrays that do not hold" in reports[0]["damaged"]


@pytest.mark.parametrize("dying", [0, 1])
def test_a_dying_process_makes_the_other_fail_with_a_clear_error(tmp_path, dying):
    results = launch(tmp_path / "out.npz", 2, 4, dying)
    code, output, seconds = results[1 - dying]
    assert results[dying][0] == 17  # the worker's own crash code
    assert code != 0
    assert FATAL in output, output[-3000:]
    assert seconds < 60  # heartbeat_timeout_seconds=10 in the worker


def test_the_cnn_example_runs_one_process_per_node_like_one_process(tmp_path):
    # The recipe of docs/examples.md: 2 processes of 4 CPU devices, one per node, joined by
    # jax.distributed; each node's devices share its compression (--nodes 2).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    run = [sys.executable, "-m", "examples.cnn.main", "--config", "tiny", "--nodes", "2"]
    run += ["--compressors", "sidco-e", "--capture-steps", "--steps", "6"]
    port, procs = free_port(), []
    for i in range(2):
        joined = [f"--coordinator=127.0.0.1:{port}", f"--process-id={i}"]
        with (tmp_path / f"process{i}.log").open("w") as log:  # the child keeps its own copy
            procs.append(
                subprocess.Popen(
                    [*run, *joined, "--workdir", str(tmp_path / f"p{i}")],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=pathlib.Path(__file__).parent.parent,
                )
            )
    try:
        for i, proc in enumerate(procs):
            try:
                assert proc.wait(timeout=LIMIT) == 0, (tmp_path / f"process{i}.log").read_text()
            except subprocess.TimeoutExpired:
                pytest.fail((tmp_path / f"process{i}.log").read_text()[-2000:])
    finally:  # one that failed leaves no other running (a ResourceWarning in a later test)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert not (tmp_path / "p1").exists()  # process 0 writes the results
    # The same run in this process, one process of 8 devices.
    from examples.cnn import main

    main.main([*run[3:], "--workdir", str(tmp_path / "one")])
    got = json.loads((tmp_path / "p0" / "results.json").read_text())
    want = json.loads((tmp_path / "one" / "results.json").read_text())
    (got,), (want,) = got["runs"], want["runs"]
    # The node's reduce-scatter adds 4 floats in gloo's order or XLA's: last bits.
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert got["bytes_per_step"] == want["bytes_per_step"]
