"""The alpha-beta cost model behind ``communication="auto"``, for planning past one machine.

``communication="auto"`` evaluates :func:`choose` at trace time; these
functions are public so that a job can be planned before it runs (see
``benchmarks/scale.py`` and docs/distributed.md, "Past one node").
"""

import warnings

from sidco_jax._src.analysis import costs as _costs
from sidco_jax._src.analysis.costs import DEFAULT_LINK, MODES, NODE_LINK, ROUTE_SLACK, Link, Plan
from sidco_jax._src.ops.codecs import Codec

# Checked where a person calls them (a bad argument raises, naming it and what is allowed);
# the library calls the unchecked ones with options checked at construction.
choose = _costs.validated(_costs.choose)
hierarchical_seconds = _costs.validated(_costs.hierarchical_seconds)
message_bytes = _costs.validated(_costs.message_bytes)
rounds = _costs.validated(_costs.rounds)
plan = _costs.validated(_costs.plan)
received_bytes = _costs.validated(_costs.received_bytes)
seconds = _costs.validated(_costs.seconds)


def messages(mode: str, devices: int, shared: bool = False) -> int:
    """Deprecated: :func:`rounds`, under the name it had (it counts rounds of latency)."""
    warnings.warn(
        "sidco.costs.messages is renamed sidco.costs.rounds", DeprecationWarning, stacklevel=2
    )
    return rounds(mode, devices, shared)


__all__ = [
    "DEFAULT_LINK",
    "MODES",
    "NODE_LINK",
    "ROUTE_SLACK",
    "Codec",
    "Link",
    "Plan",
    "choose",
    "hierarchical_seconds",
    "message_bytes",
    "plan",
    "received_bytes",
    "rounds",
    "seconds",
]
