"""What a compiled step communicates and launches, read from its optimized HLO.

For tests and benchmarks that check a compressor's claims instead of trusting
a formula: :func:`collectives` lists the cross-device collectives with their
bytes, :func:`launches` counts the ops that each launch a kernel on a GPU.
"""

from sidco_jax._src.hlo import Collective, collectives, launches

__all__ = ["Collective", "collectives", "launches"]
