"""Un-jitted updates: a Python loop of ``tx.update`` compiles once and holds its memory.

Eagerly, JAX compiles every ``lax.cond`` anew on each call and maps its code
into the process: about 186 mappings a step, until XLA crashes at the
kernel's limit near 350 steps. These tests count ``/proc/self/maps``.
"""

import contextlib
import sys

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from harness import quick_first

import sidco_jax as sidco

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")

PARAMS = {"w": jnp.zeros(1000), "b": jnp.zeros(10)}


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def _grads(i):
    return jax.tree.map(lambda p: jax.random.normal(jax.random.key(i), p.shape), PARAMS)


LOOPS = {  # the README Quickstart's style of use, and what else a loop meets
    "compress": lambda: optax.chain(sidco.compress(0.01), optax.sgd(0.1)),
    "dense": lambda: optax.chain(sidco.dense(), optax.sgd(0.1)),
    "warmup": lambda: sidco.topk(0.05, warmup_steps=3),
    "accumulate": lambda: sidco.accumulate(sidco.dgc(0.05), 2),
    # The factory is called again on every update, with the injected values.
    "inject": lambda: optax.inject_hyperparams(
        sidco.compress, static_args=("ratio", "capacity_factor")
    )(0.01, adaptation=None, stages=2),
}


@pytest.mark.parametrize("loop", quick_first(list(LOOPS)))
def test_an_eager_loop_does_not_grow_the_process(loop):
    tx = LOOPS[loop]()
    state = tx.init(PARAMS)
    for i in range(5):  # compiles on the first step
        _, state = tx.update(_grads(i), state, PARAMS)
    before = _mappings()
    for i in range(5, 105):
        _, state = tx.update(_grads(i), state, PARAMS)
    assert _mappings() - before < 50, (before, _mappings())


@pytest.mark.slow  # the long form of the test above, whose first case runs in the quick tier
def test_ten_thousand_eager_steps_at_flat_memory():
    tx = LOOPS["compress"]()
    state = tx.init(PARAMS)
    counts = []
    grads = _grads(0)
    for i in range(10_000):
        _, state = tx.update(grads, state, PARAMS)
        if i in (100, 9_999):
            counts.append(_mappings())
    assert counts[1] - counts[0] < 50, counts
    assert int(state[0].count) == 10_000


def test_an_eager_update_equals_the_jitted_one():
    tx = sidco.compress(0.05, warmup_steps=1)
    state = tx.init(PARAMS)
    jitted = jax.jit(tx.update)
    for i in range(3):
        eager_out, eager_state = tx.update(_grads(i), state, PARAMS)
        out, state = jitted(_grads(i), state, PARAMS)
        chex.assert_trees_all_equal((eager_out, eager_state), (out, state))


@contextlib.contextmanager
def compilations():
    """A list that counts the programs XLA compiles inside the block."""
    found = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            found.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield found
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


INNER = optax.chain(sidco.topk(0.1), optax.sgd(0.1))
INJECTED = {  # an eager loop under inject_hyperparams: a schedule, or constants
    "schedule": lambda: optax.inject_hyperparams(
        sidco.compress, static_args=("ratio", "capacity_factor")
    )(0.01, first_ratio=lambda count: 0.25 + 0.01 * count, seed=lambda count: count),
    "capacity_factor injected": lambda: optax.inject_hyperparams(
        sidco.topk, static_args=("ratio",)
    )(0.01, seed=lambda count: count),
    "accumulate": lambda: optax.inject_hyperparams(sidco.accumulate)(INNER, every_k=2),
    "diloco": lambda: optax.inject_hyperparams(sidco.diloco)(
        optax.sgd(0.1), optax.sgd(0.7), every=2, compressor=sidco.topk(0.1)
    ),
}


@pytest.mark.parametrize("loop", quick_first(list(INJECTED)))
def test_an_eager_loop_under_inject_hyperparams_compiles_once(loop):
    # A schedule's new value on every step recompiled the update every step (about a
    # second each); accumulate and diloco did so even with constants.
    tx = INJECTED[loop]()
    state = tx.init(PARAMS)
    for i in range(2):
        _, state = tx.update(_grads(i), state, PARAMS)
    with compilations() as compiled:
        for i in range(2, 6):
            _, state = tx.update(_grads(i), state, PARAMS)
    assert compiled == []


def test_an_injected_schedule_updates_as_under_jit():
    tx = INJECTED["schedule"]()
    state = jitted_state = tx.init(PARAMS)
    jitted = jax.jit(tx.update)
    for i in range(3):
        out, state = tx.update(_grads(i), state, PARAMS)
        want, jitted_state = jitted(_grads(i), jitted_state, PARAMS)
        chex.assert_trees_all_equal((out, state), (want, jitted_state))


def test_equal_arguments_build_the_same_transformation():
    assert sidco.compress(0.01, stages=2) is sidco.compress(0.01, stages=2)
    assert sidco.compress(0.01, stages=2) is not sidco.compress(0.01, stages=1)
    # As optax.inject_hyperparams passes them: concrete arrays key by value.
    assert sidco.topk(jnp.asarray(0.5)) is sidco.topk(jnp.asarray(0.5))
    with pytest.raises(TypeError, match="ratio must be a real number"):
        sidco.topk(True)  # never the transformation built for ratio=1
