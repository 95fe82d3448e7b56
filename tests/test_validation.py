"""Every public argument is checked when it is given, with an error naming it and its value.

TypeError for a wrong type (a string, a bool, a list, None, a float where an
integer is needed), ValueError for a value out of range, non-finite or not
among the allowed names.
"""

import functools
import math
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sidco_jax as sidco

NAN, INF = float("nan"), float("inf")
X = jnp.linspace(-1.0, 1.0, 64)


def says(name: str, value: str) -> str:
    """A pattern for "<name> must be <what is allowed>, got <value>"."""
    return rf"(^|\W){re.escape(name)} must be .+, got .*{re.escape(value)}"


def bad(call, *args, error, name, value, **kwargs):
    """One case: ``call(*args, **kwargs)`` raises ``error`` naming ``name`` and ``value``."""
    pattern = says(name, value)
    show = lambda v: f"{v.dtype}{list(v.shape)}" if isinstance(v, jax.Array) else repr(v)  # noqa: E731
    shown = ", ".join([*map(show, args), *(f"{k}={show(v)}" for k, v in kwargs.items())])
    case_id = f"{getattr(call, '__name__', 'call')}({shown})"
    return pytest.param(functools.partial(call, *args, **kwargs), error, pattern, id=case_id)


def accumulate_dense(every_k):
    return sidco.accumulate(sidco.dense(), every_k)


CASES = [
    # ratio: strings, lists, bools, complex and arrays are not numbers; NaN is out of range.
    bad(sidco.compress, "0.01", error=TypeError, name="ratio", value="'0.01'"),
    bad(sidco.compress, [0.01], error=TypeError, name="ratio", value="[0.01]"),
    bad(sidco.compress, True, error=TypeError, name="ratio", value="True"),
    bad(sidco.compress, 0.1 + 0j, error=TypeError, name="ratio", value="(0.1+0j)"),
    bad(sidco.compress, np.array([0.1, 0.2]), error=TypeError, name="ratio",
        value="array([0.1, 0.2])"),
    bad(sidco.compress, np.float64(NAN), error=ValueError, name="ratio", value="nan"),
    bad(sidco.topk, None, error=TypeError, name="ratio", value="None"),
    bad(sidco.compressor, "dense", "1", error=TypeError, name="ratio", value="'1'"),
    # capacity_factor: finite, >= 1, a number.
    bad(sidco.compress, 0.1, capacity_factor=INF, error=ValueError, name="capacity_factor",
        value="inf"),
    bad(sidco.redsync, 0.1, capacity_factor=NAN, error=ValueError, name="capacity_factor",
        value="nan"),
    bad(sidco.gaussiank, 0.1, capacity_factor="2", error=TypeError, name="capacity_factor",
        value="'2'"),
    bad(sidco.compress, 0.1, capacity_factor=True, error=TypeError, name="capacity_factor",
        value="True"),
    # layout: one of the names; bucket_bytes: a positive int (it sets shapes).
    bad(sidco.compress, 0.1, layout="flat", error=ValueError, name="layout", value="'flat'"),
    bad(sidco.dense, layout=None, error=ValueError, name="layout", value="None"),
    bad(sidco.topk, 0.1, bucket_bytes=0, error=ValueError, name="bucket_bytes", value="0"),
    bad(sidco.dgc, 0.1, bucket_bytes=2.5e7, error=TypeError, name="bucket_bytes",
        value="25000000.0"),
    bad(sidco.compress, 0.1, bucket_bytes=True, error=TypeError, name="bucket_bytes",
        value="True"),
    # error_feedback: a bool, nothing else.
    bad(sidco.compress, 0.1, error_feedback="no", error=TypeError, name="error_feedback",
        value="'no'"),
    bad(sidco.topk, 0.1, error_feedback=None, error=TypeError, name="error_feedback",
        value="None"),
    bad(sidco.dgc, 0.1, error_feedback=1, error=TypeError, name="error_feedback", value="1"),
    # The other options of compress.
    bad(sidco.compress, 0.1, first_ratio="0.25", error=TypeError, name="first_ratio",
        value="'0.25'"),
    bad(sidco.compress, 0.1, first_ratio=NAN, error=ValueError, name="first_ratio", value="nan"),
    bad(sidco.compress, 0.01, stages=2.0, error=TypeError, name="stages", value="2.0"),
    bad(sidco.compress, 0.01, stages="3", error=TypeError, name="stages", value="'3'"),
    bad(sidco.compress, 0.01, stages=True, error=TypeError, name="stages", value="True"),
    bad(sidco.compress, 0.01, period=2.5, error=TypeError, name="period", value="2.5"),
    bad(sidco.compress, 0.01, period=True, error=TypeError, name="period", value="True"),
    bad(sidco.compress, 0.01, band=NAN, error=ValueError, name="band", value="nan"),
    bad(sidco.compress, 0.01, band=[0.2], error=TypeError, name="band", value="[0.2]"),
    bad(sidco.compress, 0.01, estimator=None, error=ValueError, name="estimator", value="None"),
    bad(sidco.compress, 0.01, adaptation=True, error=ValueError, name="adaptation",
        value="True"),
    # The baselines' own options.
    bad(sidco.dgc, 0.1, sample_ratio=INF, error=ValueError, name="sample_ratio", value="inf"),
    bad(sidco.dgc, 0.1, sample_ratio=None, error=TypeError, name="sample_ratio", value="None"),
    bad(sidco.redsync, 0.1, tolerance=NAN, error=ValueError, name="tolerance", value="nan"),
    bad(sidco.redsync, 0.1, tolerance="small", error=TypeError, name="tolerance",
        value="'small'"),
    bad(sidco.redsync, 0.1, tolerance=1.0, error=ValueError, name="tolerance", value="1.0"),
    bad(sidco.approxk, 0.1, recall_target="0.9", error=TypeError, name="recall_target",
        value="'0.9'"),
    bad(sidco.approxk, 0.1, recall_target=True, error=TypeError, name="recall_target",
        value="True"),
    bad(sidco.approxk, 0.1, recall_target=NAN, error=ValueError, name="recall_target",
        value="nan"),
    bad(sidco.dgc, 0.1, seed=-1, error=ValueError, name="seed", value="-1"),
    bad(sidco.dgc, 0.1, seed=2**32, error=ValueError, name="seed", value="4294967296"),
    bad(sidco.randomk, 0.1, seed="0", error=TypeError, name="seed", value="'0'"),
    bad(sidco.randomk, 0.1, seed=1.5, error=TypeError, name="seed", value="1.5"),
    bad(sidco.topk, 0.1, granularity=None, error=ValueError, name="granularity", value="None"),
    bad(sidco.gaussiank, 0.1, communication=None, error=ValueError, name="communication",
        value="None"),
    # Step counts are int32 on device: 2**31 and beyond are refused when given.
    bad(sidco.compress, 0.1, warmup_steps=2**31, error=ValueError, name="warmup_steps",
        value="2147483648"),
    bad(sidco.topk, 0.1, warmup_steps=2**64, error=ValueError, name="warmup_steps",
        value=str(2**64)),
    bad(sidco.compress, 0.1, period=2**31, error=ValueError, name="period", value="2147483648"),
    bad(accumulate_dense, 2**31, error=ValueError, name="every_k", value="2147483648"),
    # Out of range.
    bad(sidco.compress, 0.0, error=ValueError, name="ratio", value="0.0"),
    bad(sidco.compress, 1.5, error=ValueError, name="ratio", value="1.5"),
    bad(sidco.topk, 0.0, error=ValueError, name="ratio", value="0.0"),
    bad(sidco.dgc, 2.0, error=ValueError, name="ratio", value="2.0"),
    bad(sidco.gaussiank, NAN, error=ValueError, name="ratio", value="nan"),
    bad(sidco.compress, 0.01, estimator="weibull", error=ValueError, name="estimator",
        value="'weibull'"),
    bad(sidco.compress, 0.001, stages=0, error=ValueError, name="stages", value="0"),
    bad(sidco.compress, 0.001, stages=11, error=ValueError, name="stages", value="11"),
    bad(sidco.compress, 0.01, capacity_factor=0.5, error=ValueError, name="capacity_factor",
        value="0.5"),
    bad(sidco.redsync, 0.1, capacity_factor=0.9, error=ValueError, name="capacity_factor",
        value="0.9"),
    bad(sidco.compress, 0.01, granularity="layer", error=ValueError, name="granularity",
        value="'layer'"),
    bad(sidco.randomk, 0.1, granularity="row", error=ValueError, name="granularity",
        value="'row'"),
    bad(sidco.compress, 0.01, adaptation="pid", error=ValueError, name="adaptation",
        value="'pid'"),
    bad(sidco.compress, 0.01, period=0, error=ValueError, name="period", value="0"),
    bad(sidco.compress, 0.01, band=1.5, error=ValueError, name="band", value="1.5"),
    bad(sidco.dgc, 0.1, sample_ratio=0.0, error=ValueError, name="sample_ratio", value="0.0"),
    bad(sidco.redsync, 0.1, tolerance=0.0, error=ValueError, name="tolerance", value="0.0"),
    bad(sidco.approxk, 0.1, recall_target=0.0, error=ValueError, name="recall_target",
        value="0.0"),
    bad(sidco.approxk, 0.1, recall_target=1.5, error=ValueError, name="recall_target",
        value="1.5"),
    bad(sidco.compressor, "approxk", 0.1, recall_target=-1, error=ValueError,
        name="recall_target", value="-1"),
    # The registry.
    bad(sidco.compressor, "nope", 0.1, error=ValueError, name="compressor", value="'nope'"),
    # The functional API: threshold, sparsify, capacity, max_stages.
    bad(sidco.threshold, X, "0.01", error=TypeError, name="ratio", value="'0.01'"),
    bad(sidco.threshold, X, True, error=TypeError, name="ratio", value="True"),
    bad(sidco.threshold, jnp.arange(1000), 0.01, error=TypeError, name="x", value="int32"),
    bad(sidco.threshold, X, 0.01, stages=10**6, error=ValueError, name="stages",
        value="1000000"),
    bad(sidco.threshold, X, 0.01, stages=1.5, error=TypeError, name="stages", value="1.5"),
    bad(sidco.threshold, X, 0.01, first_ratio=INF, error=ValueError, name="first_ratio",
        value="inf"),
    bad(sidco.sparsify, X, 0.5, 1.5, error=TypeError, name="capacity", value="1.5"),
    bad(sidco.sparsify, X, 0.5, True, error=TypeError, name="capacity", value="True"),
    bad(sidco.sparsify, X, "0.5", 4, error=TypeError, name="threshold", value="'0.5'"),
    bad(sidco.capacity, -5, 0.1, error=ValueError, name="size", value="-5"),
    bad(sidco.capacity, 10.5, 0.1, error=TypeError, name="size", value="10.5"),
    bad(sidco.capacity, 100, 0.1, capacity_factor=INF, error=ValueError,
        name="capacity_factor", value="inf"),
    bad(sidco.stats.max_stages, "0.1", error=TypeError, name="ratio", value="'0.1'"),
    # The cost model: a misspelt mode was priced as another, zero devices or bandwidth
    # divided by zero, negative or NaN inputs gave negative or NaN seconds.
    bad(sidco.costs.seconds, "sprase", 100, 10, 8, error=ValueError, name="mode",
        value="'sprase'"),
    bad(sidco.costs.seconds, "dense", 100, 10, 0, error=ValueError, name="devices", value="0"),
    bad(sidco.costs.seconds, "dense", 100, 10, 8, sidco.costs.Link(5e-6, 0.0),
        error=ValueError, name="link.bandwidth", value="0.0"),
    bad(sidco.costs.seconds, "sparse", 100, 10, 8, sidco.costs.Link(NAN, 1e9),
        error=ValueError, name="link.latency", value="nan"),
    bad(sidco.costs.received_bytes, "sparse", -5, 10, 8, error=ValueError, name="size",
        value="-5"),
    bad(sidco.costs.message_bytes, "sparse", 100, 10, 8, sidco.costs.Codec("int4"),
        error=ValueError, name="values", value="'int4'"),
    bad(sidco.costs.choose, 100, 10, 8, wire=sidco.costs.Codec(indices="int16"),
        error=ValueError, name="indices", value="'int16'"),
    bad(sidco.costs.message_bytes, "sparse", 100, 10, 8, "int8", error=TypeError,
        name="wire", value="'int8'"),
    bad(sidco.costs.hierarchical_seconds, "sparse", 100, 10, 2, 0, error=ValueError,
        name="local", value="0"),
    bad(sidco.costs.choose, 100, 10, 8, link=(5e-6, 1e9), error=TypeError, name="link",
        value="(5e-06, 1000000000.0)"),
    # Reading programs: None gave an AttributeError.
    bad(sidco.hlo.collectives, None, error=TypeError, name="compiled", value="NoneType"),
    bad(sidco.hlo.kernels, 3, error=TypeError, name="compiled", value="int"),
    # Wrappers: accumulate(None, k) gave an AttributeError.
    bad(sidco.accumulate, None, 2, error=TypeError, name="tx", value="NoneType"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "pattern"), CASES)
def test_bad_argument_raises_a_clear_error(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    ("name", "options", "unknown"),
    [
        ("topk", {"capacity_factor": 2.0}, "capacity_factor"),
        ("sidco-e", {"estimator": "gamma"}, "estimator"),  # the name already chose it
        ("dense", {"capacity_factor": 2.0}, "capacity_factor"),
    ],
)
def test_compressor_refuses_unknown_options_listing_the_known(name, options, unknown):
    pattern = rf"{re.escape(repr(name))} .*unknown option.*'{unknown}'.*allowed: \('"
    with pytest.raises(TypeError, match=pattern):
        sidco.compressor(name, 0.1, **options)


@pytest.mark.parametrize(
    ("build", "name", "low"),
    [
        (lambda n: sidco.compress(0.1, warmup_steps=n), "warmup_steps", 0),
        (lambda n: sidco.compress(0.1, period=n), "period", 1),
        (accumulate_dense, "every_k", 1),
    ],
)
def test_step_counts_name_their_int32_range(build, name, low):
    allowed = f"{name} must be an integer in [{low}, 2**31 - 1], got"
    for n in (2**31, low - 1):
        with pytest.raises(ValueError, match=re.escape(f"{allowed} {n}")):
            build(n)
    tx = build(2**31 - 1)  # the largest runs
    updates, _ = tx.update(X, tx.init(X), X)
    assert updates.shape == X.shape


@pytest.mark.parametrize(
    ("option", "allowed", "literal"),
    [
        ("adaptation", sidco.ADAPTATIONS, sidco.typing.Adaptation),
        ("communication", sidco.COMMUNICATIONS, sidco.typing.Communication),
        ("estimator", sidco.ESTIMATORS, sidco.typing.Estimator),
        ("granularity", sidco.GRANULARITIES, sidco.typing.Granularity),
        ("layout", sidco.LAYOUTS, sidco.typing.Layout),
        ("values", sidco.VALUE_CODECS, sidco.typing.ValueCodec),
        ("indices", sidco.INDEX_CODECS, sidco.typing.IndexCodec),
    ],
)
def test_each_option_tuple_holds_exactly_what_its_option_accepts(option, allowed, literal):
    assert typing.get_args(literal) == allowed
    for value in allowed:
        sidco.compress(0.01, axis_name="data", **{option: value})
    with pytest.raises(ValueError, match=rf"{option} must be .*{re.escape(str(allowed))}"):
        sidco.compress(0.01, axis_name="data", **{option: "bogus"})


@pytest.mark.slow
@pytest.mark.parametrize("name", sidco.COMPRESSORS)
def test_concrete_jax_and_numpy_scalars_work_under_jit(name):
    grads = jnp.asarray(np.random.default_rng(0).laplace(size=1000), jnp.float32)
    tx = sidco.compressor(name, jnp.float32(0.01))
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    sent = int(jnp.count_nonzero(updates))
    assert sent == 1000 if name == "dense" else 0 < sent < 40
    tx = sidco.compress(
        np.float64(0.01),
        capacity_factor=jnp.float32(2.0),
        stages=jnp.int32(2),
        period=np.int64(3),
        band=np.float32(0.3),
        first_ratio=jnp.asarray(0.2),
    )
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    assert 0 < int(jnp.count_nonzero(updates)) < 40


def test_traced_ratio_still_must_be_static():
    tx = optax.inject_hyperparams(sidco.compress)(0.05)
    with pytest.raises(ValueError, match="ratio sets the payload shape and must be static"):
        jax.jit(tx.update)(X, tx.init(X))


def test_approxk_recall_target_is_static_and_may_be_a_numpy_scalar():
    tx = optax.inject_hyperparams(sidco.approxk, static_args=("ratio",))(0.1, recall_target=0.9)
    with pytest.raises(ValueError, match="recall_target is a compile-time argument"):
        jax.jit(tx.update)(X, tx.init(X))
    tx = sidco.approxk(0.1, recall_target=np.float32(0.5))
    assert int(jnp.count_nonzero(jax.jit(tx.update)(X, tx.init(X))[0])) == 6


@pytest.mark.parametrize("ratio", [2.0, -1.0, 0.0, NAN])
def test_traced_ratio_out_of_range_selects_nothing(ratio):
    eta = jax.jit(lambda x, r: sidco.threshold(x, r, stages=3))(X, ratio)
    assert math.isnan(float(eta))
    assert int(sidco.sparsify(X, eta, 8).selected) == 0


def test_traced_first_ratio_out_of_range_selects_nothing():
    eta = jax.jit(lambda x, f: sidco.threshold(x, 0.01, stages=3, first_ratio=f))(X, 1.5)
    assert math.isnan(float(eta))


def test_traced_wrong_types_are_refused_at_trace_time():
    with pytest.raises(TypeError, match=r"ratio must be a real number .*float32\[2\]"):
        jax.jit(lambda x, r: sidco.threshold(x, r))(X, jnp.array([0.1, 0.2]))
    with pytest.raises(TypeError, match=r"stages must be an integer .*float32\[\]"):
        jax.jit(lambda x, m: sidco.threshold(x, 0.01, stages=m))(X, 2.0)


def test_traced_stages_are_clipped_to_the_ceiling():
    x = jnp.asarray(np.random.default_rng(1).standard_t(3, size=4000), jnp.float32)
    top = sidco.stats.max_stages(0.01)
    want = float(sidco.threshold(x, 0.01, stages=top))
    assert want != float(sidco.threshold(x, 0.01, stages=top - 1))  # the ceiling matters
    by_stages = jax.jit(lambda x, m: sidco.threshold(x, 0.01, stages=m))
    by_ratio = jax.jit(lambda x, r: sidco.threshold(x, r, stages=10**6))
    assert float(by_stages(x, jnp.int32(10**6))) == pytest.approx(want)
    assert float(by_ratio(x, 0.01)) == pytest.approx(want)
    assert float(by_stages(x, jnp.int32(-3))) == pytest.approx(float(sidco.threshold(x, 0.01)))


def test_a_bad_option_is_refused_after_a_good_one_of_equal_value_was_built():
    # The memo keyed a tuple by its value: Link(True, ...) equals Link(1, ...) and was
    # handed the transformation built for the good one.
    sidco.compress(0.1, link=sidco.costs.Link(1, 1e9))
    with pytest.raises(TypeError, match=r"link\.latency must be a real number"):
        sidco.compress(0.1, link=sidco.costs.Link(True, 1e9))


def test_an_axis_the_mesh_lacks_is_named_with_the_mesh_s_axes():
    # per_device and data_parallel_step gave KeyError: 'batch'.
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    tx = sidco.compress(0.1, axis_name="data")
    state = sidco.parallel.shard_init(tx, jnp.zeros(4), mesh, "data")
    calls = {
        "axis_name 'batch'": lambda: sidco.parallel.per_device(jnp.zeros(4), mesh, "batch"),
        "axis_name \\('data', 'batch'\\)": lambda: sidco.parallel.shard_init(
            tx, jnp.zeros(4), mesh, ("data", "batch")
        ),
        "state_axis 'batch'": lambda: sidco.parallel.data_parallel_step(
            lambda w, b: jnp.sum(w), tx, state, mesh, "data", state_axis="batch"
        ),
    }
    for named, call in calls.items():
        with pytest.raises(ValueError, match=rf"{named} names 'batch'.*axes are \('data',\)"):
            call()


def test_a_lowered_program_is_refused_where_a_compiled_one_is_read():
    # It returned [] for a program that all-reduces: the lowered text has no collectives yet.
    lowered = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i").lower(jnp.zeros((1, 4)))
    for read in (sidco.hlo.collectives, sidco.hlo.kernels, sidco.hlo.launches):
        with pytest.raises(TypeError, match=r"compiled program.*not the lowered one"):
            read(lowered)


def test_data_parallel_step_names_a_batch_leaf_that_does_not_split_over_the_devices():
    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.chain(sidco.compress(0.1, axis_name="data"), optax.sgd(0.1))
    params = sidco.parallel.place(np.zeros(3, np.float32), mesh)
    state = sidco.parallel.shard_init(tx, params, mesh, "data")
    step = sidco.parallel.data_parallel_step(
        lambda w, b: jnp.sum(b["x"] @ w), tx, state, mesh, "data"
    )
    message = (
        "batch['x'] must have a leading axis that splits evenly over the 8 devices along "
        "'data', got shape (12, 3)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        step(params, state, {"x": np.ones((12, 3), np.float32)})
