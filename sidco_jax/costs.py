"""The alpha-beta cost model behind ``communication="auto"``, for planning past one machine.

``communication="auto"`` evaluates :func:`choose` at trace time; these
functions are public so that a job can be planned before it runs (see
``benchmarks/scale.py`` and docs/distributed.md, "Past one node").
"""

from sidco_jax._src.costs import (
    DEFAULT_LINK,
    NODE_LINK,
    ROUTE_SLACK,
    Link,
    Plan,
    choose,
    hierarchical_seconds,
    message_bytes,
    messages,
    plan,
    received_bytes,
    seconds,
)

__all__ = [
    "DEFAULT_LINK",
    "NODE_LINK",
    "ROUTE_SLACK",
    "Link",
    "Plan",
    "choose",
    "hierarchical_seconds",
    "message_bytes",
    "messages",
    "plan",
    "received_bytes",
    "seconds",
]
