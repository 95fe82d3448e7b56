"""What a compiled step communicates and launches, read from its optimized HLO.

For tests and benchmarks that check a compressor's claims instead of trusting
a formula: :func:`collectives` lists the cross-device collectives with their
bytes, :func:`launches` counts the ops that each launch a kernel on a GPU, and
:func:`kernels` counts the kernels along the longest and the cheapest path of
a CPU, GPU or TPU program.
"""

from sidco_jax._src.analysis.hlo import Collective, Kernels, collectives, kernels, launches

__all__ = ["Collective", "Kernels", "collectives", "kernels", "launches"]
