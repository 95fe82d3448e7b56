"""One process of the multi-process test (tests/test_multiprocess.py).

Run as ``python multiprocess_worker.py PROCESS_ID PROCESSES PORT OUT [DYING [MESHES
[CHECKPOINT]]]`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``: joins the
``jax.distributed`` job on localhost with gloo CPU collectives, trains
``harness.train_least_squares`` over every process's devices on each of ``MESHES``
(digits, default ``0``) in turn, and writes the results to ``OUT`` (process 0), keys
prefixed ``<mesh>/``: one job trains them all, so the processes start and join once.
Process ``DYING``, if given (-1: none), exits abruptly after joining, as a crashed
worker would. Mesh 0 is flat; 1 to 3 are node x local, one node per process: 1
replicated, 2 with ``inner_shards``, 3 with the weights sharded over the node
(``"params"``). ``CHECKPOINT`` (0 or 1) saves and restores the training state instead
(:func:`check_checkpoints`).
"""

import json
import os
import pathlib
import sys

STEPS = 30


def check_checkpoints(process_id: int, out: str) -> None:
    """Saves and restores a state, then again after damaging a checksum process 1 wrote.

    Writes ``OUT.process<i>.json``: whether the restored shards this process
    holds equal the saved ones, the manifest files, and the error of the
    damaged restore.
    """
    import jax
    import numpy as np
    from harness import least_squares_state
    from jax.experimental import multihost_utils

    import sidco_jax as sidco

    tree = least_squares_state(3)
    path = pathlib.Path(out).with_name("ckpt")
    sidco.save(path, tree)
    restored = sidco.restore(path, tree)

    def held(tree):
        return [np.asarray(s.data) for x in jax.tree.leaves(tree) for s in x.addressable_shards]

    same = all(np.array_equal(a, b) for a, b in zip(held(restored), held(tree), strict=True))
    report = {"same": same, "files": sorted(os.listdir(path / "sidco_manifest"))}
    multihost_utils.sync_global_devices("restored")
    if process_id == 1:  # as if rows of the residual this process wrote had changed on disk
        manifest = path / "sidco_manifest" / "process_1.json"
        record = json.loads(manifest.read_text())
        (residual,) = (leaf for leaf in record["leaves"] if "residual" in leaf["name"])
        residual["shards"][0]["crc32"] ^= 1
        manifest.write_text(json.dumps(record))
    multihost_utils.sync_global_devices("damaged")
    try:
        sidco.restore(path, tree)
    except ValueError as error:
        report["damaged"] = str(error)
    pathlib.Path(f"{out}.process{process_id}.json").write_text(json.dumps(report))


def main(
    process_id: int,
    processes: int,
    port: int,
    out: str,
    dying: int = -1,
    meshes: str = "0",
    checkpoint: int = 0,
) -> None:
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",  # loopback only, not every interface
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=60,
        # Where a process is to die, the other learns it sooner: the test waits for that.
        heartbeat_timeout_seconds=10 if dying < 0 else 4,
    )
    from harness import train_least_squares

    if process_id == dying:
        os._exit(17)
    if checkpoint:
        check_checkpoints(process_id, out)
        jax.distributed.shutdown()
        return
    results = {}
    for mesh in map(int, meshes):
        sharded = {2: True, 3: "params"}.get(mesh, False)
        params, metrics = train_least_squares(STEPS, hierarchical=bool(mesh), sharded=sharded)
        results |= {f"{mesh}/{k}": v for k, v in {"params": params, **metrics}.items()}
    if process_id == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    process_id, processes, port, out = sys.argv[1:5]
    given = sys.argv[5:]
    dying, meshes, checkpoint = [*given, *["-1", "0", "0"][len(given) :]]
    main(int(process_id), int(processes), int(port), out, int(dying), meshes, int(checkpoint))
