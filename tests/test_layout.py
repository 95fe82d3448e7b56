"""The loop's two layouts: the same result, the state each keeps, and what each compiles to.

``layout="tree"`` works leaf by leaf (small leaves packed together) and keeps
the residual as a tree like the parameters; ``layout="buckets"`` packs the
leaves into a few flat buckets and keeps the residual so. Both order the
entries alike, so they must agree on every update, residual and figure.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    AXIS,
    DEVICES,
    mesh_of,
    one_of_each_kind,
    per_device_step,
    quick_first,
    require_libtpu,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from sidco_jax._src.loop import layout as layout_lib
from sidco_jax._src.loop import residuals

# Every kind of leaf the layouts treat apart: one large enough to stay alone in the
# tree layout, small float32 leaves packed together, bf16 (cast into a float32
# bucket), a scalar, a zero-size leaf and an integer leaf between them.
LEAVES = {
    "a_big": ((256, 256), np.float32),
    "b_bias": ((40,), np.float32),
    "c_int": ((3,), np.int32),
    "d_half": ((24,), jnp.bfloat16),
    "e_empty": ((0, 3), np.float32),
    "f_scalar": ((), np.float32),
    "g_w": ((48, 40), np.float32),
    "h_v": ((300,), np.float32),
}
SMALL = {k: v for k, v in LEAVES.items() if k != "a_big"}  # for 8 devices
BUCKET_BYTES = 4 * 1000  # several buckets: g_w is one of its own, the rest packed


def params_of(leaves):
    return {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in leaves.items()}


def gradients(rng, leaves, steps, devices=None):
    """Multiples of 1/64 (sums stay exact), with a leading device axis if ``devices``."""

    def draw(shape, dtype):
        shape = shape if devices is None else (devices, *shape)
        if np.issubdtype(dtype, np.integer):
            return rng.integers(-5, 5, shape).astype(dtype)
        value = np.round(rng.standard_t(3, size=shape) * 8) / 64
        return value.clip(-4, 4).astype(dtype)

    return [{k: draw(*spec) for k, spec in leaves.items()} for _ in range(steps)]


def build(name, layout, **options):
    return sidco.compressor(name, 0.05, layout=layout, bucket_bytes=BUCKET_BYTES, **options)


def flat(residual, devices=1) -> np.ndarray:
    """Each device's residual as one row, the entries in leaf order (either layout)."""
    rows = [np.asarray(r, np.float32).reshape(devices, -1) for r in jax.tree.leaves(residual)]
    return np.concatenate(rows, axis=1)


def assert_same(tree_run, bucket_run, devices=1):
    for step, ((u1, s1), (u2, s2)) in enumerate(zip(tree_run, bucket_run, strict=True)):
        for k in u1:
            np.testing.assert_allclose(
                np.asarray(u1[k], np.float32),
                np.asarray(u2[k], np.float32),
                rtol=1e-6,
                err_msg=f"step {step}: {k}",
            )
        if s1.residual is not None:
            np.testing.assert_allclose(
                flat(s1.residual, devices),
                flat(s2.residual, devices),
                rtol=1e-6,
                atol=1e-7,
                err_msg=f"step {step}",
            )
        for k, v in sidco.metrics(s1).items():
            np.testing.assert_allclose(
                np.asarray(v),
                np.asarray(sidco.metrics(s2)[k]),
                rtol=1e-5,
                err_msg=f"step {step}: {k}",
            )


def run_local(name, layout, stream, **options):
    tx = build(name, layout, **options)
    state = tx.init(params_of(LEAVES))
    update = jax.jit(tx.update)
    out = []
    for grads in stream:
        u, state = update(grads, state)
        out.append((u, state))
    return out


# The layouts are the loop's: one compressor of each kind of rule (a kind's rules read
# the packed vectors alike and differ in their formulas only).
@pytest.mark.parametrize("name", quick_first(one_of_each_kind(sidco.COMPRESSORS)))
def test_both_layouts_give_the_same_result(name, rng):
    stream = gradients(rng, LEAVES, 4)
    tree, buckets = (run_local(name, layout, stream) for layout in ("tree", "buckets"))
    assert not isinstance(tree[0][1].residual, residuals.Buckets)
    assert name == "dense" or isinstance(buckets[0][1].residual, residuals.Buckets)
    assert_same(tree, buckets)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sidco-e", "topk", "randomk"])
def test_both_layouts_agree_per_leaf_and_with_warmup(name, rng):
    stream = gradients(rng, LEAVES, 4)
    options = {"granularity": "leaf", "warmup_steps": 1}
    assert_same(*(run_local(name, layout, stream, **options) for layout in ("tree", "buckets")))


def run_mesh(name, layout, stream, **options):
    """On 8 devices under shard_map, or on 2 x 4 with an inner axis; per-device updates."""
    inner = options.get("inner_axis")
    mesh = jax.make_mesh((2, 4), (AXIS, inner)) if inner else mesh_of(DEVICES)
    axes = (AXIS, inner) if inner else AXIS
    tx = build(name, layout, axis_name=AXIS, **options)
    state = sidco.parallel.shard_init(tx, params_of(SMALL), mesh, AXIS)
    step = per_device_step(tx, mesh, state, axes)
    out = []
    for grads in stream:
        u, state = step(state, jax.device_put(grads, NamedSharding(mesh, P(axes))))
        out.append((u, state))
    return out


MESH_CASES = [
    ("sidco-e", {"communication": "sparse"}),
    ("sidco-e", {"communication": "dense"}),
    ("sidco-e", {"communication": "sparse_allreduce"}),
    ("topk", {"communication": "sparse_allreduce"}),
    ("dgc", {"communication": "sparse"}),
    ("randomk", {}),
    ("dense", {}),
    ("sidco-e", {"inner_axis": "local"}),
    ("sidco-gp", {"warmup_steps": 2, "communication": "sparse"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "options"), MESH_CASES)
def test_both_layouts_agree_on_8_devices(name, options, rng):
    stream = gradients(rng, SMALL, 4, devices=DEVICES)
    runs = [run_mesh(name, layout, stream, **options) for layout in ("tree", "buckets")]
    rows = DEVICES // 4 if "inner_axis" in options else DEVICES
    assert_same(*runs, devices=rows)


@pytest.mark.slow
def test_both_layouts_agree_under_accumulation(rng):
    stream = gradients(rng, LEAVES, 6)
    runs = []
    for layout in ("tree", "buckets"):
        tx = sidco.accumulate(build("sidco-e", layout), every_k=3)
        state = tx.init(params_of(LEAVES))
        update = jax.jit(tx.update)
        run = []
        for grads in stream:
            u, state = update(grads, state)
            run.append(u)
        runs.append(run)
    for u1, u2 in zip(*runs, strict=True):
        for k in u1:
            np.testing.assert_allclose(
                np.asarray(u1[k], np.float32), np.asarray(u2[k], np.float32), rtol=1e-6
            )


def test_auto_is_the_tree_on_cpu_and_buckets_elsewhere(monkeypatch):
    params = params_of(SMALL)
    assert isinstance(sidco.compress(0.1).init(params).residual, dict)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    # Arrays on CPU devices keep the tree whatever the default backend says...
    assert isinstance(sidco.compress(0.1).init(params).residual, dict)
    # ...which decides only for leaves that name no devices.
    host = jax.tree.map(np.asarray, params)
    assert isinstance(sidco.compress(0.1).init(host).residual, residuals.Buckets)


def test_auto_follows_the_platform_of_an_abstract_mesh():
    tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh(
        (4,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=tpu
    )
    tx = sidco.compress(0.01, axis_name=AXIS)
    bare = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    placed = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=NamedSharding(mesh, P()))}
    in_map = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
    with jax.sharding.use_abstract_mesh(mesh):
        in_context = jax.eval_shape(tx.init, bare)
    for state in jax.eval_shape(tx.init, placed), jax.eval_shape(in_map, bare), in_context:
        assert isinstance(state.residual, residuals.Buckets)
    assert isinstance(jax.eval_shape(tx.init, bare).residual, dict)  # no mesh: the CPU


def tpu_topology_mesh(monkeypatch, axis: str) -> jax.sharding.Mesh:
    """A mesh of the 4 chips of a TPU v5e 2x2 topology, for compiling without a TPU.

    Skipped where libtpu is not installed, except under CI, where it must be.
    """
    require_libtpu()
    from jax.experimental import topologies

    # Compiling needs no TPU, so no claim on one: another process of the machine
    # may hold libtpu's lock file.
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    return topologies.make_mesh(topology, (4,), (axis,))


@pytest.mark.slow
def test_auto_takes_the_buckets_for_a_tpu_program_compiled_on_a_cpu_host(monkeypatch):
    mesh = tpu_topology_mesh(monkeypatch, AXIS)
    assert jax.default_backend() == "cpu"
    params = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=NamedSharding(mesh, P()))}
    tx = sidco.compress(0.01, axis_name=AXIS)
    in_map = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()))
    for state in jax.eval_shape(tx.init, params), in_map.trace(params).out_info:
        assert isinstance(state.residual, residuals.Buckets)

    # Without a residual, the update decides from the gradient's devices.
    planned, plan = [], layout_lib.plan

    def spy(floats, layout, *rest):
        planned.append(layout)
        return plan(floats, layout, *rest)

    monkeypatch.setattr(layout_lib, "plan", spy)
    tx = sidco.compress(0.01, axis_name=AXIS, error_feedback=False)
    state = jax.eval_shape(tx.init, params)
    step = jax.shard_map(tx.update, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()))
    jax.jit(step).trace(params, state).lower()
    assert planned == ["buckets"]


def test_buckets_hold_at_most_bucket_bytes_of_one_dtype_in_leaf_order():
    with jax.enable_x64(True):
        params = {
            "a": jnp.zeros(300),
            "b": jnp.zeros(200, jnp.float32),
            "c": jnp.zeros(800, jnp.float32),
            "d": jnp.zeros(2000, jnp.float32),
            "e": jnp.zeros(5, jnp.int32),
        }
        state = sidco.compress(0.1, layout="buckets", bucket_bytes=4000).init(params)
        shapes = [(b.shape, b.dtype) for b in state.residual.buckets]
    # a is float64 (its own dtype); b and c share 4000 bytes; d is larger than a bucket.
    assert shapes == [((300,), np.float64), ((200 + 800,), np.float32), ((2000,), np.float32)]


def test_a_state_of_the_other_layout_is_refused_naming_both():
    params = params_of(SMALL)
    state = sidco.compress(0.1, layout="tree").init(params)
    with pytest.raises(ValueError, match=r"'tree' layout.*layout='buckets'"):
        sidco.compress(0.1, layout="buckets").update(params, state)


def test_a_single_device_residual_converts_both_ways(rng):
    params = params_of(LEAVES)
    tree = {
        k: jnp.asarray(rng.normal(size=np.shape(v) or (1,)), jnp.float32)
        if jnp.issubdtype(v.dtype, jnp.floating)
        else jnp.zeros(0)
        for k, v in params.items()
    }
    buckets = residuals.convert(tree, params, "buckets", BUCKET_BYTES)
    # b, d and f packed (e has no entries); the large g alone; h after it.
    assert [b.shape for b in buckets.buckets] == [(65536,), (40 + 24 + 1,), (1920,), (300,)]
    np.testing.assert_array_equal(flat(buckets), flat(tree))
    back = residuals.convert(buckets, params, "tree")
    jax.tree.map(np.testing.assert_array_equal, back, tree)


# Whether the launches grow with the leaves is the buckets' (the loop's): a rule runs over
# the same few buckets whatever the leaf count, so SIDCo-E stands for the fitted rules.
LAUNCHED = ["sidco-e", "topk", "dgc", "dense"]


def leaves_of(count, total=2**22):
    sizes = [total // count] * count
    sizes[0] += total - sum(sizes)
    return {f"l{i:03d}": jax.ShapeDtypeStruct((s,), jnp.float32) for i, s in enumerate(sizes)}


def launches(name, count) -> int:
    """Kernels one update launches on a GPU, counted from XLA:CPU's optimized HLO."""
    params = leaves_of(count)
    tx = sidco.compressor(name, 0.01, layout="buckets")
    compiled = jax.jit(tx.update).lower(params, jax.eval_shape(tx.init, params)).compile()
    return sum(sidco.hlo.launches(compiled).values())


def unpacking(count) -> int:
    """Launches of cutting one computed flat bucket into ``count`` leaves, and nothing else.

    XLA:CPU writes every output leaf with a fusion of its own, however the cut
    is written (slices, ``jnp.split``, ``lax.slice``); XLA:GPU's horizontal
    loop fusion merges such small independent fusions into few kernels.
    """
    params = leaves_of(count)
    parts = layout_lib.plan(list(params.values()), "buckets", 2**31, by_leaf=False)
    like = list(params.values())
    cut = jax.jit(lambda x: layout_lib.unpack(parts, [x + 1], like))
    return sum(sidco.hlo.launches(cut.lower(jnp.zeros(2**22)).compile()).values())


@pytest.mark.slow
@pytest.mark.parametrize("name", LAUNCHED)
def test_bucketed_launches_do_not_grow_with_the_leaf_count(name):
    # 2^22 entries in 161 leaves (ResNet-50's count) against one leaf: beyond the
    # writing of each output leaf, at most twice the kernels.
    one, many = launches(name, 1), launches(name, 161)
    cut = unpacking(161) - unpacking(1)
    assert many - cut <= 2 * one, (one, many, cut)


@pytest.mark.slow
def test_data_parallel_step_trains_alike_in_both_layouts(rng):
    # The sharding helpers lay out a bucketed residual as they do a tree: per device.
    mesh = mesh_of(DEVICES)
    x = rng.normal(size=(64, 300)).astype(np.float32)
    y = x @ rng.normal(size=300).astype(np.float32)

    def loss(params, batch):
        inputs, targets = batch
        return jnp.mean((inputs @ params["w"] + params["b"] - targets) ** 2)

    results = []
    for layout in ("tree", "buckets"):
        tx = optax.chain(build("sidco-e", layout, axis_name=AXIS), optax.sgd(0.05))
        params = sidco.parallel.place(
            {"w": np.zeros(300, np.float32), "b": np.zeros(1, np.float32)}, mesh
        )
        state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
        step = sidco.parallel.data_parallel_step(loss, tx, state, mesh, AXIS, donate_state=True)
        batch = sidco.parallel.place((x, y), mesh, P(AXIS))
        for _ in range(5):
            params, state, value = step(params, state, batch)
        results.append((params, float(value)))
    (p1, v1), (p2, v2) = results
    assert v1 < 0.9 * float(np.mean(y**2))  # it trained
    assert v2 == pytest.approx(v1, rel=1e-6)
    for k in p1:
        np.testing.assert_allclose(np.asarray(p1[k]), np.asarray(p2[k]), rtol=1e-6, atol=1e-8)
