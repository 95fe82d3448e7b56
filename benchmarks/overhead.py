"""Compression overhead, measured side by side: kernels, whole updates, phases, training steps.

Every mode times its methods in one process on the same arrays, round-robin
within each repetition so that machine noise hits all alike, and reports the
median with its interquartile range and ratios taken in the same run.

* ``kernels``: SIDCo-E/P/GP threshold + fixed-capacity payload on one flat
  vector against ``lax.top_k`` (plus the same gather), the naive
  ``jnp.nonzero(size=capacity)`` payload and one ``sum(|x|)`` pass.
* ``updates``: the whole ``jax.jit(tx.update)`` of each of ``--compressors``
  (by default every registered compressor; top-k's always, the ratios' base)
  and of SIDCo-E/P with ``adaptation="paper"`` and SIDCo-E with its stage count
  fixed at ``max_stages(ratio)``, also with every stage reading every entry
  (the middle stages fit a sample otherwise) (error feedback, selection,
  write-back, metrics), on a gradient *tree* and on
  the same gradient as one flat leaf, with SIDCo-E's bare threshold + payload
  and one pass over the gradient for scale, and the compiled temporary bytes
  of each update (``Compiled.memory_analysis()``) in gradient sizes; SIDCo-E
  and top-k also jitted with the update returned first (see ``carried``).
* ``phases``: where each whole update's time goes. Each compressor of
  ``--compressors`` is jitted whole, its state donated and carried, and its
  calls traced with ``jax.profiler``: every thunk XLA runs is charged to the
  phase that the loop's named scopes give its instruction (error feedback,
  threshold, payload, aggregate, write-back; thunks running at once share the
  wall time), beside the same updates timed untraced.
* ``step``: the whole local training step of an example model (gradient +
  update + ``optax.apply_updates``), against the gradient alone, after
  ``--settle`` untimed training steps (SIDCo's stage count moves in training);
  with ``--whole`` each SIDCo compressor again with every stage reading every
  entry.
* ``axis``: the whole update over a 2-device mesh axis, under ``jax.shard_map``
  and under ``jax.pmap``, each device holding its own gradient already (run
  with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` on CPU), from
  the initial state on every call and with the state donated and carried.

Gradients (``--source``): ``flat:L`` is a Student-t(3) vector of 2^L entries
cut into two flat leaves; ``lm:large``, ``lm:default``, ``cnn:default`` ... are
real gradients of the examples' models (their parameter trees).

    python -m benchmarks.overhead kernels --sizes 20 22 24 --ratios 0.01 0.001
    python -m benchmarks.overhead updates --source lm:large flat:24 --ratios 0.001
    python -m benchmarks.overhead phases --source lm:large --compressors sidco-e topk dgc
    python -m benchmarks.overhead step --source lm:large cnn:default
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python -m benchmarks.overhead axis --source flat:24
    taskset -c 0 python -m benchmarks.overhead updates --source lm:large   # one core
"""

import argparse
import bisect
import contextlib
import functools
import gzip
import json
import math
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import sidco_jax as sidco
from benchmarks import harness
from benchmarks.harness import LABELS, compressor, measure, own_arguments, quartiles
from examples.common.training import example  # the examples' models, for real parameter trees
from sidco_jax._src.stats import thresholds

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {"sidco-e": "exponential", "sidco-p": "gpareto", "sidco-gp": "gamma"}
MODES = ("kernels", "updates", "phases", "step", "axis")
TIMED = ("dense", "sidco-e", "sidco-p", "sidco-gp", "topk", "dgc")  # --compressors' default


def one_pass(grads):
    """One ``sum(|x|)`` pass over every leaf: the floor for anything that reads the gradient."""
    return sum(jnp.sum(jnp.abs(g)) for g in jax.tree.leaves(grads))


def carried(update, state, state_first: bool = True, donate_gradient: bool = False):
    """``update(grads, state)`` as training runs it: the state donated and carried along.

    Donation lets the new residual reuse the old one's buffers, as in the examples' steps.
    JAX gives each donated buffer to the first output of the same shape and dtype: the
    update, shaped like the residual, when ``update`` is jitted as it is. A training step
    returns the new parameters first; ``state_first`` (default) returns the state first to
    do the same here. While the update's zero targets were constants (before 1649e2d),
    the update-first order made XLA copy the residual on every call; the rows that keep
    that order check that it no longer does. ``donate_gradient`` donates the gradient too,
    so that the update is written into its buffers instead of fresh ones, as a training
    step's gradient, dead after the update, lets XLA do; :func:`measure` then copies the
    gradient, untimed, before each call. Returns the call of ``grads`` and the jitted
    function.
    """
    donated = (0, 1) if donate_gradient else 1
    if state_first:
        jitted = jax.jit(lambda g, s: update(g, s)[::-1], donate_argnums=donated)
    else:
        jitted = jax.jit(update, donate_argnums=donated)
    box = [state]

    def call(grads):
        if state_first:
            box[0], out = jitted(grads, box[0])
        else:
            out, box[0] = jitted(grads, box[0])
        return out

    call.donates = donate_gradient
    return call, jitted


def temp_bytes(jitted, *args) -> int:
    """Compiled temporary bytes of the jitted function ``jitted(*args)``."""
    analysis = jitted.lower(*args).compile().memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0)) if analysis is not None else 0


# ----------------------------------------------------------------------------- gradients


def gradient(source: str):
    """The gradient tree named by ``source`` (see the module docstring), on the device."""
    if source.startswith("flat:"):
        n = 2 ** int(source.split(":")[1])
        x = np.random.default_rng(0).standard_t(3, size=n).astype(np.float32)
        return {"a": jnp.asarray(x[: n // 2]), "b": jnp.asarray(x[n // 2 :])}
    task, config = example(source)
    params = task.init(config.seed)
    batch = jax.tree.map(
        jnp.asarray, task.sample(np.random.default_rng(0), config.batch_per_device)
    )
    return jax.jit(jax.grad(task.loss))(params, batch)


def flat_copy(grads) -> jax.Array:
    """The same gradient as one flat float32 leaf (concatenated once, on the host)."""
    return jnp.asarray(np.concatenate([np.ravel(np.asarray(g)) for g in jax.tree.leaves(grads)]))


def size(grads) -> int:
    return sum(int(np.size(g)) for g in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------- modes


def kernels(n: int, ratio: float, stages: list[int], capacity_factor: float) -> dict:
    """Jitted functions of one flat gradient, each producing what would be sent."""
    k = max(math.floor(n * ratio), 1)
    cap = sidco.capacity(n, ratio, capacity_factor)

    def topk(x):
        _, idx = lax.top_k(jnp.abs(x), k)
        return x[idx], idx.astype(jnp.int32)

    def nonzero(x, eta):
        (idx,) = jnp.nonzero(jnp.abs(x) > eta, size=cap, fill_value=n)
        return x.at[idx].get(mode="fill", fill_value=0), idx

    out = {
        "one pass": jax.jit(lambda x: jnp.sum(jnp.abs(x))),
        "top_k": jax.jit(topk),
        "sidco-e M=1 nonzero payload": jax.jit(lambda x: nonzero(x, sidco.threshold(x, ratio))),
    }
    for name, estimator in VARIANTS.items():
        for m in stages:
            if m > 1 and m > sidco.stats.max_stages(ratio):
                continue

            def compress(x, estimator=estimator, m=m):
                eta = sidco.threshold(x, ratio, estimator=estimator, stages=m)
                return sidco.sparsify(x, eta, cap)

            out[f"{name} M={m}"] = jax.jit(compress)
    return out


def updates(grads, ratio: float, labels=LABELS) -> tuple[dict, dict]:
    """Whole updates of each of ``labels`` on ``grads``, with the one pass, SIDCo-E's kernel
    and the variants of SIDCo-E and others below.

    Returns the jitted calls of ``grads`` and each update's temporary bytes.
    """
    n = size(grads)
    cap = sidco.capacity(n, ratio)
    stages = min(3, sidco.stats.max_stages(ratio))

    def bare(g):
        eta = sidco.threshold(g, ratio, stages=stages)
        return sidco.sparsify(g, eta, cap)

    calls = {"one pass": jax.jit(one_pass), "sidco-e threshold+payload": jax.jit(bare)}
    memory = {}
    txs = {label: compressor(label, ratio) for label in labels}
    # Training moves SIDCo's stage count (see steps()): its update at the ceiling too.
    most = sidco.stats.max_stages(ratio)
    txs[f"sidco-e, {most} stages fixed"] = sidco.compress(ratio, stages=most, adaptation=None)
    for label, tx in txs.items():
        calls[label], jitted = carried(tx.update, tx.init(grads))
        memory[label] = temp_bytes(jitted, grads, tx.init(grads))
    # The same with the middle stages reading every entry, not a sample: compiled here,
    # inside the switch, by one call.
    label = f"sidco-e, {most} stages fixed, every stage whole"
    tx = txs[f"sidco-e, {most} stages fixed"]
    with thresholds.every_stage_whole():
        calls[label], jitted = carried(tx.update, tx.init(grads))
        memory[label] = temp_bytes(jitted, grads, tx.init(grads))
        jax.block_until_ready(calls[label](grads))
    # The pitfall of carried's docstring, measured: jax.jit(tx.update) donating the state.
    for name in ("sidco-e", "topk"):
        tx = sidco.compressor(name, ratio)
        label = f"{name}, update returned first"
        calls[label], jitted = carried(tx.update, tx.init(grads), state_first=False)
        memory[label] = temp_bytes(jitted, grads, tx.init(grads))
    # The update written into the gradient's buffers, not into fresh ones (see carried).
    for name in ("dense", "sidco-e", "sidco-p", "topk", "dgc"):
        tx = sidco.compressor(name, ratio)
        label = f"{name}, gradient donated"
        calls[label], jitted = carried(tx.update, tx.init(grads), donate_gradient=True)
        memory[label] = temp_bytes(jitted, grads, tx.init(grads))
    return calls, memory


# The update's phases, as the loop names them with jax.named_scope (its loop/sparsifier.py),
# in the order they run; "threshold" is what a rule's select does outside its payload.
PHASES = (
    "error_feedback",
    "threshold",
    "payload",
    "aggregate",
    "write_back",
    "other",
    "between thunks",
)
# "threshold": a rule's threshold work that runs inside its payload (SIDCo's refit).
_SCOPES = {"error_feedback", "select", "threshold", "payload", "aggregate", "write_back"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def phase_of(op_name: str) -> str:
    """The phase an HLO instruction's ``op_name`` falls in: its innermost phase scope."""
    for scope in reversed(op_name.split("/")):
        if scope in _SCOPES:
            return "threshold" if scope == "select" else scope
    return "other"


def instruction_phases(compiled_text: str) -> dict[str, str]:
    """Instruction name -> phase, for every instruction of a compiled module's text."""
    out = {}
    for m in _INSTRUCTION.finditer(compiled_text):
        op_name = _OP_NAME.search(m[2])
        out[m[1]] = phase_of(op_name[1] if op_name else "")
    return out


def own_stretches(events: list[dict]) -> list[tuple[float, float, dict]]:
    """The stretches ``(start, stop, event)`` (µs) in which each trace event runs itself.

    Events nest on one thread (a ``cond`` thunk runs its branch's thunks inside it):
    a nested event's time is cut out of the event around it.
    """
    out = []
    by_thread = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, its end, where its own time resumes]
        for e in [*thread, None]:
            while stack and (e is None or e["ts"] >= stack[-1][1]):
                done, stop, resume = stack.pop()
                out.append((resume, stop, done))
                if stack:
                    stack[-1][2] = max(stack[-1][2], stop)
            if e is None:
                break
            if stack:
                out.append((stack[-1][2], e["ts"], stack[-1][0]))
            stop = e["ts"] + e["dur"]
            stack.append([e, min(stop, stack[-1][1]) if stack else stop, e["ts"]])
    return [(a, b, e) for a, b, e in out if b > a]


def partition_tails(thunks: list[dict], events: list[dict]) -> list[tuple[float, float, dict]]:
    """The stretches ``(start, stop, thunk)`` (µs) a thunk runs past its own trace event.

    XLA's CPU runtime splits a large loop fusion into partitions run by several
    threads, and the trace event covers only the partition of the thread that
    started it. The thread that finishes the last partition records the instant
    ``"end: NAME"``, after running whatever thunks that completion made ready, so
    the last partition ended by the marker or by the start of that thread's next
    traced thunk, whichever is first. Each thunk is matched with the first unused
    marker of its name from its start on.
    """
    markers, starts = {}, {}
    for e in events:
        if e["name"].startswith("end: "):
            markers.setdefault(e["name"][len("end: ") :], []).append(e)
    for e in thunks:
        starts.setdefault(e["tid"], []).append(e["ts"])
    starts = {tid: sorted(ts) for tid, ts in starts.items()}
    out = []
    by_name = {}
    for e in thunks:
        by_name.setdefault(e["name"], []).append(e)
    for name, runs in by_name.items():
        ends = sorted(markers.get(name, []), key=lambda m: m["ts"])
        at = 0
        for e in sorted(runs, key=lambda e: e["ts"]):
            while at < len(ends) and ends[at]["ts"] < e["ts"]:
                at += 1
            if at == len(ends):
                break
            stop, mark = e["ts"] + e["dur"], ends[at]
            after = starts.get(mark["tid"], [])
            following = (
                after[bisect.bisect_right(after, stop)] if after and after[-1] > stop else None
            )
            done = min(mark["ts"], following) if following is not None else mark["ts"]
            if done > stop:
                out.append((stop, done, e))
            at += 1
    return out


def wall_shares(stretches, phase_of_event, start: float, stop: float) -> dict[str, float]:
    """The wall time (µs) of ``[start, stop)`` shared among the phases running in it.

    Where thunks run at once on several threads each gets an equal share; time in
    which none runs (dispatch, waits) is ``"between thunks"``. The shares add up to
    ``stop - start``.
    """
    edges = []
    for a, b, e in stretches:
        a, b = max(a, start), min(b, stop)
        if b > a:
            phase = phase_of_event(e)
            edges += [(a, 1, phase), (b, -1, phase)]
    edges.sort(key=lambda edge: (edge[0], edge[1]))
    shares = {}
    running = {}
    at = start
    for t, step, phase in [*edges, (stop, 0, None)]:
        span, total = t - at, sum(running.values())
        for name, count in running.items():
            shares[name] = shares.get(name, 0.0) + span * count / total
        if not total and span > 0:
            shares["between thunks"] = shares.get("between thunks", 0.0) + span
        at = t
        if phase is not None:
            running[phase] = running.get(phase, 0) + step
            if not running[phase]:
                del running[phase]
    return shares


def traced_phases(
    calls: dict, names: dict, args: tuple, repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Per labelled call, the ms of each phase on every call, read from a profiler trace.

    ``names`` maps each label to its compiled module's :func:`instruction_phases`. The
    calls run round-robin, each inside a trace annotation; every thunk XLA's runtime
    traced inside one is charged, by its own time (nested thunks apart, the other
    threads' partitions added: :func:`partition_tails`), to the phase of the
    instruction it runs. Also ``"traced call"``: each call's wall time.
    """
    for call in calls.values():
        jax.block_until_ready(call(*own_arguments(call, args)))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for i in range(repeats):
                for j, call in enumerate(calls.values()):
                    f_args = own_arguments(call, args)
                    with jax.profiler.TraceAnnotation(f"overhead-call {j} {i}"):
                        jax.block_until_ready(call(*f_args))
        trace = next(Path(directory).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    windows = sorted(
        (e["ts"], e["ts"] + e["dur"], *map(int, e["name"].split()[1:]))
        for e in events
        if e["name"].startswith("overhead-call ")
    )
    labels = list(calls)
    out = {label: {} for label in labels}
    for start, stop, j, i in windows:
        label = labels[j]
        # A thunk is traced under the name of its instruction, unique in its own module.
        mine = [e for e in events if start <= e["ts"] <= stop]
        thunks = [e for e in mine if e["name"] in names[label]]
        stretches = own_stretches(thunks) + partition_tails(thunks, mine)
        shares = wall_shares(stretches, lambda e, label=label: names[label][e["name"]], start, stop)
        for phase in (*PHASES, "traced call"):
            ms = (stop - start) if phase == "traced call" else shares.get(phase, 0.0)
            out[label].setdefault(phase, [0.0] * repeats)[i] = ms / 1e3
    return out


def phases(grads, ratio: float, labels: list[str], repeats: int) -> dict:
    """Each update's phases, timed inside the whole compiled update as training runs it.

    The update is jitted whole with its state donated and carried (:func:`carried`);
    a profiler trace of ``repeats`` calls per compressor, round-robin, gives each
    phase's share (:func:`traced_phases`). The same updates are also timed without
    the profiler, interleaved, beside one pass over the gradient.
    """
    calls, names = {}, {}
    for label in labels:
        tx = compressor(label, ratio)
        calls[label], jitted = carried(tx.update, tx.init(grads))
        names[label] = instruction_phases(jitted.lower(grads, tx.init(grads)).compile().as_text())
    plain = measure({"one pass": jax.jit(one_pass), **calls}, (grads,), repeats)
    traced = traced_phases(calls, names, (grads,), repeats)
    ms = {"one pass": plain["one pass"]}
    for label in labels:
        ms[f"{label}: whole update"] = plain[label]
        for phase, times in traced[label].items():
            if phase != "traced call" and not any(times):
                continue  # a phase this compressor does not have
            ms[f"{label}: {phase}"] = quartiles(times)
        # Call by call (a phase such as the threshold's refit may run in some calls only).
        summed = np.sum([traced[label][phase] for phase in PHASES if phase in traced[label]], 0)
        ms[f"{label}: phases summed"] = quartiles(list(summed))
    one = ms["one pass"]["median"]
    for label, t in ms.items():
        base = ms.get(f"{label.split(':')[0]}: whole update", ms["one pass"])
        ms[label] = {**t, "/ base": t["median"] / base["median"], "/ one pass": t["median"] / one}
    return ms


def stage_count(state) -> int | None:
    """The stage count of SIDCo's rule in an optimizer state; None for other compressors."""
    compress = lambda x: isinstance(x, sidco.CompressState)  # noqa: E731
    rules = [s.rule for s in jax.tree.leaves(state, is_leaf=compress) if compress(s)]
    return next((int(r.stages) for r in rules if hasattr(r, "stages")), None)


def steps(
    job: str, ratio: float, names: list[str], settle: int, whole: list[str] = ()
) -> tuple[dict, tuple, dict]:
    """The whole local training step of an example model, per compressor, and its arguments.

    Each compressor first trains ``settle`` untimed steps on fresh batches, so that its
    state is timed as training runs it: SIDCo's stage controller takes the stage count
    from 3 to 10 within 40 steps of ``lm:large`` at ratio 0.001, and every stage costs
    (a pass, or about a quarter of one for a sampled middle stage). The compressors of
    ``whole`` are timed again as ``<name>, every stage whole``, compiled with every
    threshold stage reading every entry. Returns the calls, their arguments and the
    stage count each reached (or None).
    """
    task, config = example(job)
    params = task.init(config.seed)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(jnp.asarray, task.sample(rng, config.batch_per_device))
    fresh = [
        jax.tree.map(jnp.asarray, task.sample(rng, config.batch_per_device)) for _ in range(settle)
    ]
    calls = {"gradient alone": jax.jit(lambda p, s, b: jax.grad(task.loss)(p, b))}
    stages = {}
    for name, label in [*((n, n) for n in names), *((n, f"{n}, every stage whole") for n in whole)]:
        tx = optax.chain(compressor(name, ratio), optax.sgd(config.learning_rate))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, batch, tx=tx):
            grads = jax.grad(task.loss)(params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        # As training runs it: parameters and state donated and carried along.
        box = [jax.tree.map(jnp.copy, params), tx.init(params)]

        def call(p, s, b, step=step, box=box):
            box[0], box[1] = step(box[0], box[1], b)
            return box[0]

        # The first call compiles the step, inside the switch for the all-whole rows.
        with thresholds.every_stage_whole() if label != name else contextlib.nullcontext():
            for b in fresh or [batch]:
                call(None, None, b)
        stages[label] = stage_count(box[1])
        calls[label] = call
    return calls, (params, None, batch), stages


def second_device(g: jax.Array) -> jax.Array:
    """The other device's gradient leaf: ``g`` negated and rolled by half its entries.

    The same magnitudes in other places, so both devices fit the same law and
    their payloads differ. (A shift such as ``0.5 - g`` turned a model's 1e-5
    gradients into a near-constant vector that sent nothing above its fitted
    threshold, and timed the starved-payload fill instead.)
    """
    flat = jnp.ravel(g)
    return -jnp.roll(flat, flat.shape[0] // 2).reshape(g.shape)


def over_axis(grads, ratio: float, names: list[str]) -> tuple[dict, tuple]:
    """Each compressor's update averaging over 2 devices, under shard_map and pmap.

    ``grads`` is one device's gradient; the other device gets
    :func:`second_device` of it, so the payloads differ. Each update runs twice: on the same
    initial state every call, and ", state donated", carrying its state along
    with the state donated as the examples' training steps do (see
    :func:`carried`), so the new residual is written into the old one's
    buffers instead of fresh ones. Returns the calls and their argument.
    """
    devices = jax.devices()[:2]
    if len(devices) < 2:
        raise SystemExit(
            "axis mode needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2"
        )
    mesh = jax.make_mesh((2,), ("data",), devices=devices)
    stacked = jax.tree.map(lambda g: jnp.stack([g, second_device(g)]), grads)
    sharded = jax.device_put(stacked, jax.NamedSharding(mesh, jax.P("data")))
    # An identity pmap leaves each device's gradient resident where pmap wants it.
    resident = jax.pmap(lambda g: g, devices=devices)(stacked)
    calls = {}
    for name in names:
        tx = compressor(name, ratio, axis_name="data")
        state = sidco.parallel.shard_init(tx, jax.tree.map(lambda g: g[0], stacked), mesh, "data")
        specs = sidco.parallel.state_specs(state, "data")

        def local(g, state, tx=tx):
            # The state first: donated, its buffers go to the first outputs of their shape.
            return tx.update(jax.tree.map(lambda x: x[0], g), state)[::-1]

        sharded_update = jax.shard_map(
            local, mesh=mesh, in_specs=(jax.P("data"), specs), out_specs=(specs, jax.P())
        )
        pmapped = functools.partial(jax.pmap, axis_name="data", devices=devices)
        per_device = jax.pmap(tx.init, axis_name="data", devices=devices)(stacked)
        for suffix, donated in (("", ()), (", state donated", (1,))):
            step = jax.jit(sharded_update, donate_argnums=donated)
            update = pmapped(lambda g, s, tx=tx: tx.update(g, s)[::-1], donate_argnums=donated)
            for how, fn, first in (
                ("shard_map", step, jax.tree.map(jnp.copy, state)),
                # pmap reads the gradient already resident on its devices.
                ("pmap", lambda _, s, u=update: u(resident, s), jax.tree.map(jnp.copy, per_device)),
            ):
                calls[f"{name} {how}{suffix}"] = _state_carried(fn, first, bool(donated))
    return calls, (sharded,)


def _state_carried(fn, state, carry: bool):
    """The call of the gradient running ``fn(grads, state) -> (state, update)``.

    With ``carry`` the returned state is passed to the next call (``fn``
    donates it); without, every call starts from ``state``.
    """
    box = [state]

    def call(grads):
        new, out = fn(grads, box[0])
        if carry:
            box[0] = new
        return out

    return call


# ----------------------------------------------------------------------------- output


def ratio_columns(ms: dict, base: str | None, floor: str | None) -> dict:
    out = {}
    for name, t in ms.items():
        out[name] = {
            **t,
            "/ base": t["median"] / ms[base]["median"] if base in ms else None,
            "/ one pass": t["median"] / ms[floor]["median"] if floor in ms else None,
        }
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | source | ratio | method | ms (median) | p25-p75 | / base | / one pass "
        "| temp bytes / gradient |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name, t in row["ms"].items():
            base = f"{t['/ base']:.3f}" if t["/ base"] is not None else ""
            floor = f"{t['/ one pass']:.1f}" if t["/ one pass"] is not None else ""
            memory = row.get("temp", {}).get(name)
            memory = f"{memory:.2f}" if memory is not None else ""
            lines.append(
                f"| {row['mode']} | {row['source']} | {row['ratio']} | {name} "
                f"| {t['median']:.2f} | {t['p25']:.2f}-{t['p75']:.2f} | {base} | {floor} "
                f"| {memory} |"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("mode", choices=MODES, help="what to time (see the module docstring)")
    parser.add_argument(
        "--source",
        nargs="+",
        default=["flat:24", "lm:large"],
        help="gradients for updates/phases/step: flat:L (2^L entries in two leaves) or an "
        "example job such as lm:large or cnn:default (default: %(default)s)",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[20, 22, 24], help="kernels: log2 of n"
    )
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.001], help="densities")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3], help="kernels: stages")
    parser.add_argument("--capacity-factor", type=float, default=1.0, help="kernels: headroom")
    parser.add_argument(
        "--compressors",
        nargs="+",
        choices=LABELS,
        help="compressors to time (default: every one for updates; for step, phases and "
        f"axis: {' '.join(TIMED)})",
    )
    parser.add_argument("--repeats", type=int, default=9, help="timed runs after warm-up")
    parser.add_argument(
        "--whole",
        action="store_true",
        help="step: time each SIDCo compressor again with every threshold stage reading "
        "every entry (the middle stages fit a sample otherwise)",
    )
    parser.add_argument(
        "--settle",
        type=int,
        default=50,
        help="step: untimed training steps on fresh batches before timing (default: "
        "%(default)s), so each compressor's state is timed as training runs it",
    )
    parser.add_argument(
        "--json", type=Path, help="where to write the results (default: benchmarks/results/)"
    )
    return parser


def _rows(args, ratio: float):
    """The rows of ``args.mode`` at ``ratio``, one at a time."""
    if args.mode == "kernels":
        rng = np.random.default_rng(0)
        for log2_n in args.sizes:
            x = jnp.asarray(rng.standard_t(3, size=2**log2_n).astype(np.float32))
            fns = kernels(x.size, ratio, args.stages, args.capacity_factor)
            ms = ratio_columns(measure(fns, (x,), args.repeats), "top_k", "one pass")
            yield {"mode": "kernels", "source": f"2^{log2_n}", "ratio": ratio, "ms": ms}
        return
    if args.compressors is None:
        args.compressors = list(LABELS if args.mode == "updates" else TIMED)
    for source in args.source:
        row = {"mode": args.mode, "source": source, "ratio": ratio}
        if args.mode == "step":
            whole = [c for c in args.compressors if c.startswith("sidco")] if args.whole else []
            calls, call_args, stages = steps(source, ratio, args.compressors, args.settle, whole)
            ms = ratio_columns(measure(calls, call_args, args.repeats), "dense", None)
            print(f"stage counts after {args.settle} steps: {stages}", flush=True)
            yield {**row, "settle": args.settle, "ms": ms, "stages": stages}
            continue
        grads = gradient(source)
        if args.mode == "axis":
            names = [c for c in args.compressors if c != "dense"] + ["dense"]
            calls, call_args = over_axis(grads, ratio, names)
            ms = ratio_columns(measure(calls, call_args, args.repeats), "topk shard_map", None)
            yield {**row, "ms": ms}
        elif args.mode == "phases":
            yield {**row, "ms": phases(grads, ratio, args.compressors, args.repeats)}
        else:
            labels = dict.fromkeys(["topk", *args.compressors])  # the ratios' base, first
            yield from _update_rows(grads, ratio, source, args.repeats, list(labels))


def _update_rows(grads, ratio: float, source: str, repeats: int, labels):
    """The ``updates`` mode's rows: the tree, and a real model's tree as one flat leaf."""
    leaves = len(jax.tree.leaves(grads))
    variants = {"tree": grads}
    if leaves > 1 and not source.startswith("flat:"):
        variants["one flat leaf"] = flat_copy(grads)
    for label, g in variants.items():
        calls, memory = updates(g, ratio, labels)
        yield {
            "mode": "updates",
            "source": f"{source} ({label})" if len(variants) > 1 else source,
            "ratio": ratio,
            "leaves": leaves,
            "ms": ratio_columns(measure(calls, (g,), repeats), "topk", "one pass"),
            "temp": {k: v / (4 * size(grads)) for k, v in memory.items()},
        }


def main(argv=None) -> list[dict]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.settle < 0:
        parser.error("--settle must be at least 0")
    rows = []
    for ratio in args.ratios:
        for row in _rows(args, ratio):
            rows.append(row)
            print(table([row]).split("\n", 2)[2], flush=True)
    print()
    print(table(rows))
    device = str(jax.devices()[0].device_kind)
    meta = harness.meta("benchmarks.overhead", argv, device=device, repeats=args.repeats)
    path = args.json or ROOT / "benchmarks" / "results" / f"overhead_{args.mode}.json"
    print(f"\nwrote {harness.write(path, {'meta': meta, 'rows': rows})}")
    return rows


if __name__ == "__main__":
    main()
