"""What a benchmark ran on, recorded beside its results.

Ratios between methods move with the CPU, not only with the code: on two
2-core machines (an Intel Xeon and an AMD EPYC) ``lax.top_k``'s sort and the
allocator's page faults took different shares of an update
(docs/benchmarks.md), so every result file names its processor.
"""

import os
import platform


def cpu_model() -> str:
    """The processor's model name (Linux's ``/proc/cpuinfo``), else what Python knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    """The host's architecture, processor and the cores this process may run on."""
    pinned = getattr(os, "sched_getaffinity", None)  # Linux: what taskset allows
    return {
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cores": len(pinned(0)) if pinned else os.cpu_count(),
    }
