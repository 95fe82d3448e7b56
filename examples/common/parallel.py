"""What both trainers need around the data-parallel step: the mesh and reading results back.

The same code runs on forced CPU devices, on GPUs and across processes
(``jax.distributed``): the mesh spans ``jax.devices()`` and each device
computes the gradient of its shard of the batch. The step itself is written
out in each ``train.py`` (``create_train_step``); the library offers the same
step as :func:`sidco_jax.parallel.data_parallel_step`.
"""

from collections.abc import Callable

import jax
import numpy as np

import sidco_jax as sidco

AXIS = "data"
NODE, LOCAL = "node", "local"  # with --nodes: across the nodes, and a node's own devices


def mesh(devices: int, nodes: int = 1) -> jax.sharding.Mesh:
    """A mesh of the first ``devices`` of ``jax.devices()``, every axis splitting the batch.

    One axis (:data:`AXIS`), or with ``nodes > 1`` two, :data:`NODE` x
    :data:`LOCAL`: a node's devices follow each other in ``jax.devices()``, as
    each process's do across processes (``jax.distributed``, one per node).
    """
    if nodes == 1:
        return jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])
    shape = (nodes, devices // nodes)
    return jax.make_mesh(shape, (NODE, LOCAL), devices=jax.devices()[:devices])


def compressor_axes(mesh: jax.sharding.Mesh, shard_params: bool = False) -> dict:
    """The compressor's axis options on ``mesh``: the mean over every device of it.

    On a mesh of nodes the devices of a node average densely over their fast
    links and share the compression, each compressing its slice of the node's
    mean (``inner_shards``), or with ``shard_params`` its shard of the
    parameters (``inner_shards="params"``); only the compressed messages cross
    the nodes.
    """
    if mesh.axis_names == (AXIS,):
        return {"axis_name": AXIS}
    shards = "params" if shard_params else mesh.shape[LOCAL]
    return {"axis_name": NODE, "inner_axis": LOCAL, "inner_shards": shards}


def param_specs(params, mesh: jax.sharding.Mesh):
    """Each parameter split over a node's devices along its largest dimension that they
    divide evenly (FSDP within a node), as a tree of ``PartitionSpec`` like ``params``."""
    devices = mesh.shape[LOCAL]

    def spec(path, x):
        shape = np.shape(x)
        even = [d for d, size in enumerate(shape) if size % devices == 0]
        if not even:
            name = jax.tree_util.keystr(path)
            raise ValueError(f"parameter {name} of shape {shape} has no dimension {devices} divide")
        at = max(even, key=lambda d: shape[d])
        return jax.P(*[None] * at, LOCAL)

    return jax.tree_util.tree_map_with_path(spec, params)


def compile_step(step: Callable, mesh: jax.sharding.Mesh, *args) -> tuple[Callable, int]:
    """``step`` compiled for ``args``, and the bytes one device sends per call across nodes.

    Read from its HLO: every collective on a mesh of one axis; on a mesh of
    nodes only those whose device groups span several nodes (a node's own
    dense traffic stays on its fast links).
    """
    compiled = step.lower(*args).compile()
    # The program's device ids are positions in the mesh, across processes too: a row of
    # the mesh is a node's devices, or, on a mesh of one axis, one device.
    per_node = mesh.devices.size // len(mesh.devices)
    node = {position: position // per_node for position in range(mesh.devices.size)}

    def across(c) -> bool:
        return any(len({node[d] for d in group}) > 1 for group in c.groups) or not c.groups

    return compiled, sum(c.operand_bytes for c in sidco.hlo.collectives(compiled) if across(c))


def flat_gradient(loss: Callable, params, batch) -> np.ndarray:
    """The whole-model gradient of ``loss`` on ``batch`` as one float32 vector."""
    grads = jax.jit(jax.grad(loss))(params, batch)
    return np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)])


def first_residual(opt_state) -> np.ndarray | None:
    """Device 0's error-feedback residual as one flat vector, or None without one.

    The residual is a tree like the parameters; its leaves (device 0's rows of
    each) are concatenated in ``jax.tree.leaves`` order, like :func:`flat_gradient`.
    """
    marked = jax.tree.leaves(sidco.parallel.is_per_device(opt_state))
    leaves = [x for x, m in zip(jax.tree.leaves(opt_state), marked, strict=True) if m]
    if not leaves:
        return None
    return np.concatenate([np.ravel(np.asarray(x.addressable_shards[0].data)) for x in leaves])


def replicated_value(x) -> np.ndarray:
    """A global array, whole, as NumPy (works in every process): a replicated one as it is,
    a sharded one gathered first."""
    if not x.sharding.is_fully_replicated:
        whole = jax.sharding.NamedSharding(x.sharding.mesh, jax.P())
        x = jax.jit(lambda v: v, out_shardings=whole)(x)
    return np.asarray(x.addressable_data(0))


def device_bytes(tree) -> int:
    """Bytes the first device holds of every global array of ``tree``."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
