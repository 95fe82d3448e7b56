"""One process of the multi-process test (tests/test_multiprocess.py).

Run as ``python multiprocess_worker.py PROCESS_ID PROCESSES PORT OUT [DYING [HIERARCHICAL]]``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``: joins the
``jax.distributed`` job on localhost with gloo CPU collectives, trains
``harness.train_least_squares`` over every process's devices and writes the
result to ``OUT`` (process 0). Process ``DYING``, if given (-1: none), exits
abruptly after joining, as a crashed worker would. ``HIERARCHICAL`` (0 or 1)
trains on a node x local mesh, one node per process.
"""

import os
import sys

STEPS = 30


def main(
    process_id: int, processes: int, port: int, out: str, dying: int = -1, hierarchical: int = 0
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
        heartbeat_timeout_seconds=10,
    )
    from harness import train_least_squares

    if process_id == dying:
        os._exit(17)
    params, metrics = train_least_squares(STEPS, hierarchical=bool(hierarchical))
    if process_id == 0:
        np.savez(out, params=params, **metrics)
    jax.distributed.shutdown()


if __name__ == "__main__":
    process_id, processes, port, out = sys.argv[1:5]
    main(int(process_id), int(processes), int(port), out, *map(int, sys.argv[5:]))
