"""End-to-end step time of every compressor over a real, rate-limited network.

Two JAX processes (``jax.distributed``, gloo CPU collectives), one core and
``--local-devices`` CPU devices each (default 1), train an example model
data-parallel across a veth link between two network namespaces
(:mod:`virtual_link`), rate-limited with ``tc``. Needs root and iproute2;
without them it says so and exits cleanly. ``--hierarchical c`` adds run
``c/hier``: compressor ``c`` with ``inner_axis``, dense over each process's
devices and compressed across the link (one node per process). Its HLO bytes
include that in-process all-reduce, which never reaches the wire.

For every bandwidth, model and compressor it reports the step time and its
split (compute: forward and backward on the local batch; compression: the
compressor's update on one device, no communication; communication: the rest
of the step), the bytes each process put on the wire per step (the veth's own
counters) and in the compiled collectives (HLO), and speed-ups over dense,
top-k and DGC. It fits ``step = a + b / bandwidth`` to the median steps across the
bandwidths to give the crossover below which each compressor beats dense, and
can time runs to a target loss: ``--target-compressors`` at each of
``--target-bandwidth``, ``--target-rounds`` rounds in a rotated order, every
run training ``--target-steps`` steps on the same batches (the same samples).
A label ``name@H`` there trains with outer steps every ``H`` steps
(``sidco.diloco``: SGD with the job's momentum inside, DiLoCo's Nesterov
outside), exchanging the pseudo-gradients through compressor ``name``. Each
run reports the seconds, counted from the end of its first step (which
compiles), until its smoothed training loss first reaches the highest final
one among the job's runs, and its final validation figure.

How it is timed, so that machine noise (shared cores) hits every compressor
alike rather than deciding the result:

- Each process first sets up every (compressor, ratio) of the job: compiles its
  two-process step and its local-only step and warms both up.
- Then ``--rounds`` rounds each time ``--steps`` steps of every compressor in
  turn, in an order rotated per round (:func:`schedule`: round ``r`` starts at
  a different compressor), the same in both processes. A compressor's block
  starts with one untimed step, which also lines the two processes up; then
  its timed two-process steps; then, in the same block, its local-only timings
  alternating a gradient alone (compute) and the local step with the
  compressor and no collective (alone), on a copy of the compressor state
  the two-process steps have reached (:meth:`_Run.local_state`).
- Per compressor, over all ``rounds x steps`` samples: the median and the
  interquartile range (p25-p75) of the step and of each part, and the
  per-round medians of the step (the drift between rounds). The parts are
  per-step pairs: compression = alone - compute of the same (adjacent) pair
  of calls, communication = step - alone of the same index in the same block.
  So the parts' medians need not add up to the step's median exactly, and a
  part may come out slightly negative where it is within the noise.
- Speed-up of A over B: in each round, B's median step over A's (both ran
  within that round, under the same conditions, so drift between rounds
  cancels); reported as the median over rounds with the lowest and highest
  round, e.g. ``1.43x (1.38-1.49)``.

Every run of a job is held in memory at once (for ``lm:large``, 11.2M
parameters, roughly 0.2-0.3 GB of parameters, state and executable per run and
process), and a job takes ``rounds x steps x runs`` two-process steps plus
twice as many local-only timings: raise ``--timeout`` for long ones.

    sudo python -m benchmarks.network --bandwidths 100mbit 1gbit 10gbit \\
        --jobs lm:large cnn:default --ratios 0.01 0.001 --rounds 3 --steps 20 \\
        --json runs/network.json
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks import harness, host
from benchmarks.virtual_link import VirtualLink, bits_per_second, unavailable

ROOT = pathlib.Path(__file__).resolve().parent.parent

COMPRESSORS = ("dense", "topk", "dgc", "gaussiank", "redsync", "sidco-e", "sidco-p", "sidco-gp")
# (randomk is left out by default: it does not converge at these ratios, docs/benchmarks.md;
# approxk too: off a TPU it is top-k)
PORT = 4800  # free: the namespaces are new and hold nothing else
PARTS = ("step", "compute", "compression", "communication")


HIERARCHICAL = "/hier"  # a run label's suffix: dense inside each process, compressed across
OUTER = "@"  # "sidco-e@32": outer steps every 32 steps, pseudo-gradients through sidco-e


def compressor(label: str, ratio: float, axis_name: str | None):
    """The compressor of run ``label`` averaging over ``axis_name`` (None: no collective).

    ``name/hier`` is compressor ``name`` on the ``("node", "local")`` mesh: dense
    over each process's own devices, compressed across the processes (the link).
    The one place this benchmark gets compressors from.
    """
    from benchmarks.harness import compressor as named  # "sidco-e paper" too

    name = label.removesuffix(HIERARCHICAL)
    if label.endswith(HIERARCHICAL) and axis_name is not None:
        return named(name, ratio, axis_name="node", inner_axis="local")
    return named(name, ratio, axis_name=axis_name)


def schedule(count: int, rounds: int) -> list[list[int]]:
    """The order of ``count`` runs in each of ``rounds`` rounds (indices into the runs).

    Round ``r`` is the list rotated to start at ``r * count // min(rounds, count)``
    (mod ``count``): with at most as many rounds as runs the starts are spread
    evenly over the list, so each run is early in one round and late in another;
    with more rounds they step by one. Consecutive rounds differ whenever there
    are two runs or more. Deterministic, so both processes run the same sequence.
    """
    if count == 0:
        return [[] for _ in range(rounds)]
    starts = [r * count // min(rounds, count) % count for r in range(rounds)]
    return [[(start + i) % count for i in range(count)] for start in starts]


# ----------------------------------------------------------------------------- worker


def worker(spec: dict) -> None:
    """One process of the job: measures every (compressor, ratio) and writes its JSON."""
    import jax

    from examples.common.training import example

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_compilation_cache_dir", spec["cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.distributed.initialize(
        f"{spec['coordinator']}:{PORT}",
        coordinator_bind_address=f"{spec['coordinator']}:{PORT}",
        num_processes=2,
        process_id=spec["process"],
        initialization_timeout=120,
        heartbeat_timeout_seconds=10,
    )
    task, config = example(spec["job"])
    counter = pathlib.Path(f"/sys/class/net/{spec['device']}/statistics/tx_bytes")
    out = _measure(task, config, spec, counter)
    targets = spec["target_compressors"]
    out["traces"] = [
        _train(task, config, targets[i], spec["target_ratio"], spec["target_steps"]) | {"round": r}
        for r, order in enumerate(schedule(len(targets), spec["target_rounds"]))
        for i in order
    ]
    pathlib.Path(spec["out"]).write_text(json.dumps(out))
    jax.distributed.shutdown()


def _optimizer(name: str, ratio: float, config, axis_name):
    """SGD with the job's momentum after the compressor, or with outer steps for ``name@H``."""
    import optax

    import sidco_jax as sidco

    name, _, every = name.partition(OUTER)
    sgd = optax.sgd(config.learning_rate, momentum=config.momentum)
    if not every:
        return optax.chain(compressor(name, ratio, axis_name), sgd)
    outer = optax.sgd(config.outer_learning_rate, momentum=config.outer_momentum, nesterov=True)
    return sidco.diloco(sgd, outer, int(every), compressor(name, ratio, axis_name))


def _setup(task, config, name: str, ratio: float, batches: int):
    """The compiled two-process step, placed parameters, state and ``batches`` placed batches."""
    import types

    import jax
    import numpy as np

    import sidco_jax as sidco
    from examples.common import parallel

    devices = jax.device_count()  # every process's
    data = np.random.default_rng(config.seed)
    host = [task.sample(data, devices * config.batch_per_device) for _ in range(batches)]
    if name.endswith(HIERARCHICAL):  # one "node" per process
        mesh = jax.make_mesh((2, devices // 2), ("node", "local"))
        if any(len({d.process_index for d in row}) > 1 for row in mesh.devices):
            raise RuntimeError(f"a node of the mesh spans processes: {mesh.devices}")
        data_axes, state_axis = ("node", "local"), "node"
    else:
        mesh = parallel.mesh(devices)
        data_axes = state_axis = parallel.AXIS
    params = sidco.parallel.place(task.init(config.seed), mesh)
    placed = [sidco.parallel.place(b, mesh, jax.P(data_axes)) for b in host]
    tx = _optimizer(name, ratio, config, parallel.AXIS)
    opt_state = sidco.parallel.shard_init(tx, params, mesh, state_axis)
    local = OUTER in name  # outer steps: each device trains its own copy
    if local:
        params = sidco.parallel.per_device(task.init(config.seed), mesh, data_axes)
    step = sidco.parallel.data_parallel_step(
        task.loss,
        tx,
        opt_state,
        mesh,
        data_axes,
        state_axis=state_axis,
        donate_state=True,
        local_params=local,
    )
    step, sent = parallel.compile_step(step, mesh, params, opt_state, placed[0])
    trainer = types.SimpleNamespace(step=step, opt_state=opt_state, bytes_per_step=sent)
    return trainer, params, placed, host


def _seconds(fn, *args) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


class _Run:
    """One (compressor, ratio), set up and warm: its two-process step with its own parameters
    and state, and its local-only step (the same optimizer without the collective)."""

    def __init__(self, task, config, name: str, ratio: float, steps: int, local_params, batch):
        import jax
        import optax

        self.name, self.ratio = name, ratio
        self.trainer, self.params, self.batches, _ = _setup(
            task, config, name, ratio, max(steps, 2)
        )
        self.opt_state, self.loss, self.next = self.trainer.opt_state, None, 0
        for _ in range(2):  # warm-up
            self.step()
        self.tx = _optimizer(name, ratio, config, None)
        tx = self.tx

        @jax.jit
        def local_step(params, state, batch):
            loss, grads = jax.value_and_grad(task.loss)(params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        self.local_step = local_step
        state = tx.init(local_params)  # for the compilation; each block takes the run's own
        for _ in range(2):
            jax.block_until_ready(local_step(local_params, state, batch))

    def local_state(self):
        """A copy of this process's part of the two-process state as training left it.

        The local timings run on it, so they do what the step does now: a compressor
        state drifts as training goes (SIDCo's stage count climbs to 10 in the first 40
        steps of ``lm:large`` at ratio 0.001), and a fresh ``init`` would time 3 stages.
        """
        import jax
        import jax.numpy as jnp

        return jax.tree.map(lambda x: jnp.array(x.addressable_data(0), copy=True), self.opt_state)

    def step(self) -> float:
        """One two-process step on the next batch; its seconds."""
        import jax

        batch = self.batches[self.next % len(self.batches)]
        self.next += 1
        start = time.perf_counter()
        self.params, self.opt_state, self.loss = jax.block_until_ready(
            self.trainer.step(self.params, self.opt_state, batch)
        )
        return time.perf_counter() - start


def _measure(task, config, spec: dict, counter: pathlib.Path) -> dict:
    """Every run of ``spec``, interleaved round-robin: per-step seconds per run and round."""
    import jax
    import numpy as np

    from benchmarks.overhead import stage_count

    steps, rounds = spec["steps"], spec["rounds"]
    device = jax.local_devices()[0]
    local_batch = jax.device_put(
        task.sample(np.random.default_rng(config.seed), config.batch_per_device), device
    )
    local_params = jax.device_put(task.init(config.seed), device)
    gradient = jax.jit(jax.value_and_grad(task.loss))
    jax.block_until_ready(gradient(local_params, local_batch))

    runs = [
        _Run(task, config, name, ratio, steps, local_params, local_batch)
        for name, ratio in spec["runs"]
    ]
    samples = [{"step": [], "compute": [], "alone": []} for _ in runs]
    sent, started, stages = [0] * len(runs), [[] for _ in runs], [[] for _ in runs]
    executed = []  # what ran, in order: [[compressor, ratio], ...] per round
    for r, indices in enumerate(schedule(len(runs), rounds)):
        executed.append([])
        for i in indices:
            run, got = runs[i], samples[i]
            executed[-1].append([run.name, run.ratio])
            started[i].append(time.time())
            run.step()  # untimed: the other process may still be in its local timings
            before = int(counter.read_text())
            got["step"].append([run.step() for _ in range(steps)])
            sent[i] += int(counter.read_text()) - before
            state = run.local_state()
            stages[i].append(stage_count(state))
            jax.block_until_ready(run.local_step(local_params, state, local_batch))
            compute, alone = [], []
            for _ in range(steps):  # adjacent pairs: compression = alone - compute
                compute.append(_seconds(gradient, local_params, local_batch))
                alone.append(_seconds(run.local_step, local_params, state, local_batch))
            got["compute"].append(compute)
            got["alone"].append(alone)
            del state
            median = sorted(got["step"][-1])[steps // 2] * 1e3
            print(f"round {r} {run.name} {run.ratio}: {median:.0f} ms/step", flush=True)  # log
    rows = [
        {
            "compressor": run.name,
            "ratio": run.ratio,
            "samples_s": got,
            "started": started[i],  # wall clock at the start of each round's block
            "stages": stages[i],  # SIDCo's stage count after each round's steps, else None
            "wire_bytes": sent[i] / (rounds * steps),
            "hlo_bytes": run.trainer.bytes_per_step,
            "loss": float(run.loss.addressable_data(0)),
        }
        for i, (run, got) in enumerate(zip(runs, samples, strict=True))
    ]
    parameters = sum(int(x.size) for x in jax.tree.leaves(local_params))
    return {
        "rows": rows,
        "order": executed,
        "parameters": parameters,
        "local_devices": jax.local_device_count(),
    }


def _train(task, config, name: str, ratio: float, steps: int) -> dict:
    """Loss against wall-clock time over ``steps`` steps (time to a target loss)."""
    import jax
    import numpy as np

    trainer, params, batches, _ = _setup(task, config, name, ratio, steps)
    opt_state = trainer.opt_state
    seconds, losses, start = [], [], None
    for batch in batches:
        params, opt_state, loss = trainer.step(params, opt_state, batch)
        losses.append(float(jax.block_until_ready(loss).addressable_data(0)))
        now = time.perf_counter()
        start = now if start is None else start  # the clock starts once step 1 compiled
        seconds.append(now - start)
    # Device 0's parameters: with outer steps, the anchor after the last exchange.
    mine = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)
    if OUTER in name:
        mine = jax.tree.map(lambda x: x[0], mine)
    return {
        "compressor": name,
        "ratio": ratio,
        "seconds": seconds,
        "loss": losses,
        "final_eval": float(task.evaluate(mine)),
    }


# ----------------------------------------------------------------------------- parent


def run_job(link: VirtualLink, spec: dict, timeout: float, workdir: pathlib.Path) -> list[dict]:
    """Runs both processes of one job on ``link``; returns their results (process 0 first)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    # The caller's other XLA flags reach the workers (a test suite's faster code generation,
    # a dump directory); only the device count is the job's own.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={spec['local_devices']}")
    env["XLA_FLAGS"] = " ".join(flags)
    cores = os.cpu_count() or 1
    processes, logs = [], []
    try:  # interrupted while the second starts, the first is killed too (finally)
        for side in (0, 1):
            mine = dict(
                spec, process=side, device=link.devices[side], out=str(workdir / f"{side}.json")
            )
            argv = [sys.executable, "-m", "benchmarks.network", "--worker", json.dumps(mine)]
            if cores > 1:  # one core each, as two hosts would have
                argv = ["taskset", "-c", str(side % cores), *argv]
            log = open(workdir / f"{side}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            processes.append(
                subprocess.Popen(link.command(side, argv), env=env, stdout=log, stderr=log)
            )
        deadline = time.monotonic() + timeout
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"job {spec['job']} ran past {timeout} s; logs in {workdir}") from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    for side, process in enumerate(processes):
        if process.returncode:
            tail = (workdir / f"{side}.log").read_text()[-3000:]
            raise RuntimeError(f"process {side} of {spec['job']} failed:\n{tail}")
    return [json.loads((workdir / f"{side}.json").read_text()) for side in (0, 1)]


def merge(bandwidth: str, job: str, results: list[dict]) -> tuple[list[dict], list[dict], dict]:
    """One row per (compressor, ratio), summarized from process 0's times (a step ends for both
    processes together), with the two processes' mean wire bytes; the traces; and the order
    each process ran the runs in (which must be the same)."""
    orders = [result["order"] for result in results]
    if orders[0] != orders[1]:
        raise RuntimeError(f"the processes of {job} ran different orders: {orders}")
    rows = []
    for first, second in zip(results[0]["rows"], results[1]["rows"], strict=True):
        row = dict(first, bandwidth=bandwidth, job=job, parameters=results[0]["parameters"])
        row["local_devices"] = results[0]["local_devices"]
        row["wire_bytes"] = (first["wire_bytes"] + second["wire_bytes"]) / 2
        rows.append(summarize(row))
    traces = [dict(t, bandwidth=bandwidth, job=job) for t in results[0]["traces"]]
    return rows, traces, {"bandwidth": bandwidth, "job": job, "orders": orders}


def _describe(per_round: list[list[float]]) -> dict:
    """Median, p25, p75 over all samples and the median of each round, in ms."""
    import numpy as np

    flat = np.concatenate([np.asarray(r, float) for r in per_round]) * 1e3
    p25, median, p75 = np.percentile(flat, [25, 50, 75])
    rounds = [float(np.median(r)) * 1e3 for r in per_round]
    return {"median": float(median), "p25": float(p25), "p75": float(p75), "rounds": rounds}


def summarize(row: dict) -> dict:
    """Adds ``<part>_ms`` (median), ``<part>_p25_ms``, ``<part>_p75_ms`` and
    ``<part>_rounds_ms`` (per-round medians) for each of :data:`PARTS` to a row with
    ``samples_s`` (per round, per step seconds of step, compute and alone).

    compression = alone - compute of the same pair of calls; communication = step - alone
    of the same index in the same round (the samples stay paired, so each part gets a
    spread of its own).
    """
    import numpy as np

    got = row["samples_s"]
    pairs = {
        "step": got["step"],
        "compute": got["compute"],
        "compression": np.subtract(got["alone"], got["compute"]),  # rounds x steps
        "communication": np.subtract(got["step"], got["alone"]),
    }
    for part in PARTS:
        summary = _describe(pairs[part])
        row[f"{part}_ms"] = summary["median"]
        row[f"{part}_p25_ms"], row[f"{part}_p75_ms"] = summary["p25"], summary["p75"]
        row[f"{part}_rounds_ms"] = summary["rounds"]
    row["rounds"], row["steps"] = len(got["step"]), len(got["step"][0])
    return row


def speedup(base: dict, row: dict) -> dict:
    """``base``'s step over ``row``'s, round by round (both ran in each round): the median over
    rounds, the lowest and the highest round, and every round's."""
    import numpy as np

    per_round = [b / x for b, x in zip(base["step_rounds_ms"], row["step_rounds_ms"], strict=True)]
    return {
        "median": float(np.median(per_round)),
        "low": min(per_round),
        "high": max(per_round),
        "rounds": per_round,
    }


# Speed-ups are reported over these runs: dense, and the two sparsifiers SIDCo is measured
# against (top-k and DGC at the same ratio).
BASELINES = {"vs_dense": "dense", "vs_topk": "topk", "vs_dgc": "dgc"}


def speedups(rows: list[dict]) -> None:
    """Adds speed-ups over each of :data:`BASELINES` (same job and bandwidth; same ratio but
    for dense) to each row (:func:`speedup`; None where there is no such run)."""
    for row in rows:
        same = [r for r in rows if (r["job"], r["bandwidth"]) == (row["job"], row["bandwidth"])]
        for key, name in BASELINES.items():
            base = next(
                (
                    r
                    for r in same
                    if r["compressor"] == name and (name == "dense" or r["ratio"] == row["ratio"])
                ),
                None,
            )
            row[key] = speedup(base, row) if base else None


def crossovers(rows: list[dict]) -> list[dict]:
    """Fits ``step_ms = a + b * 8e3 / bits_per_second`` per compressor; returns the bandwidth
    below which each compressor's fitted step is shorter than dense's."""
    import numpy as np

    fits = {}
    for key in {(r["job"], r["compressor"], r["ratio"]) for r in rows}:
        points = [r for r in rows if (r["job"], r["compressor"], r["ratio"]) == key]
        if len({p["bandwidth"] for p in points}) < 2:
            continue
        inverse = np.array([8e3 / bits_per_second(p["bandwidth"]) for p in points])  # ms/byte
        design = np.stack([np.ones_like(inverse), inverse], 1)
        (a, b), *_ = np.linalg.lstsq(design, np.array([p["step_ms"] for p in points]), rcond=None)
        fits[key] = (a, b)
    out = []
    for (job, compressor, ratio), (a, b) in sorted(fits.items()):
        if compressor == "dense":
            continue
        dense = next((f for k, f in fits.items() if k[:2] == (job, "dense")), None)
        if dense is None:
            continue
        extra_fixed, saved_bytes = a - dense[0], dense[1] - b
        crossover = None
        if saved_bytes > 0:
            # a + b x < a_d + b_d x  <=>  x > extra_fixed / saved_bytes, x = 8e3 / bandwidth
            crossover = float("inf") if extra_fixed <= 0 else 8e3 * saved_bytes / extra_fixed
        out.append(
            dict(job=job, compressor=compressor, ratio=ratio, fixed_ms=a, crossover_bits=crossover)
        )
    return out


def time_to_target(traces: list[dict], window: int = 10) -> list[dict]:
    """Seconds and steps until the running-mean loss first reaches the highest final running
    mean among the traces of a job (a target every run reaches), one row per trace."""
    import numpy as np

    def smooth(loss):
        loss = np.asarray(loss)
        return np.convolve(loss, np.ones(window) / window, "valid") if len(loss) >= window else loss

    out = []
    for job in sorted({t["job"] for t in traces}):
        group = [t for t in traces if t["job"] == job]
        target = max(smooth(t["loss"])[-1] for t in group)
        for t in group:
            smoothed = smooth(t["loss"])
            hit = int(np.argmax(smoothed <= target)) + len(t["loss"]) - len(smoothed)
            reached = {"target_loss": float(target), "steps": hit + 1, "seconds": t["seconds"][hit]}
            kept = ("job", "bandwidth", "compressor", "ratio", "round", "final_eval")
            out.append({k: t.get(k) for k in kept} | reached)
    return out


def target_summary(targets: list[dict], base: str = "sidco-e") -> list[dict]:
    """Per (job, bandwidth, run): median seconds to the target over rounds, with the range,
    and the speed-up over ``base`` (per round, that round's ``base`` over the run's seconds)."""
    import numpy as np

    out = []
    for key in dict.fromkeys((t["job"], t["bandwidth"], t["compressor"]) for t in targets):
        mine = [t for t in targets if (t["job"], t["bandwidth"], t["compressor"]) == key]
        same = {
            (t["job"], t["bandwidth"], t["round"]): t for t in targets if t["compressor"] == base
        }
        ratios = [
            same[(t["job"], t["bandwidth"], t["round"])]["seconds"] / t["seconds"]
            for t in mine
            if (t["job"], t["bandwidth"], t["round"]) in same
        ]
        seconds = [t["seconds"] for t in mine]
        out.append(
            dict(zip(("job", "bandwidth", "compressor"), key, strict=True))
            | {
                "ratio": mine[0]["ratio"],
                "target_loss": mine[0]["target_loss"],
                "steps": int(np.median([t["steps"] for t in mine])),
                "seconds": float(np.median(seconds)),
                "low": min(seconds),
                "high": max(seconds),
                "final_eval": float(np.median([t["final_eval"] for t in mine])),
                "vs_base": (
                    {"median": float(np.median(ratios)), "low": min(ratios), "high": max(ratios)}
                    if ratios
                    else None
                ),
            }
        )
    return out


def _rate(bits: float | None) -> str:
    if bits is None:
        return "never"
    if bits == float("inf"):
        return "any"
    return f"{bits / 1e9:.2f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.0f} Mbit/s"


def _ms(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _spread(row: dict, part: str) -> str:
    """``median (p25-p75)`` in ms."""
    return f"{_ms(row[f'{part}_ms'])} ({_ms(row[f'{part}_p25_ms'])}-{_ms(row[f'{part}_p75_ms'])})"


def _times(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.2f}x ({s['low']:.2f}-{s['high']:.2f})"


def tables(rows: list[dict], fits: list[dict], targets: list[dict]) -> str:
    """Markdown tables of the measurements."""
    lines = []
    for job in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == job]
        first = mine[0]
        lines += [
            f"\n{job} ({first['parameters']:,} parameters), 2 processes x "
            f"{first['local_devices']} CPU device{'s' * (first['local_devices'] != 1)};"
            f" {first['rounds']} round{'s' * (first['rounds'] != 1)} x {first['steps']} steps"
            " per compressor, interleaved."
            " Times in ms: median (p25-p75); per round: the step's median in each round;"
            " speed-ups: median over rounds of the per-round ratio (lowest-highest round)\n",
            "| bandwidth | ratio | compressor | step | step per round | compute | compression"
            " | communication | wire bytes/step | HLO bytes | vs dense | vs top-k | vs DGC |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mine:
            ratio = "-" if r["compressor"] == "dense" else f"{r['ratio']:g}"
            per_round = " / ".join(_ms(x) for x in r["step_rounds_ms"])
            parts = " | ".join(_spread(r, p) for p in PARTS[1:])
            lines.append(
                f"| {r['bandwidth']} | {ratio} | {r['compressor']} | {_spread(r, 'step')} | "
                f"{per_round} | {parts} | {r['wire_bytes']:,.0f} | {r['hlo_bytes']:,} | "
                f"{_times(r['vs_dense'])} | {_times(r['vs_topk'])} | {_times(r['vs_dgc'])} |"
            )
    if fits:
        lines += [
            "\nCrossover: the bandwidth below which a compressor's median step, fitted as"
            " a + b / bandwidth, is shorter than dense's\n",
            "| job | ratio | compressor | fixed ms | crossover |",
            "|---|---:|---|---:|---:|",
        ]
        lines += [
            f"| {f['job']} | {f['ratio']:g} | {f['compressor']} | {f['fixed_ms']:.0f} | "
            f"{_rate(f['crossover_bits'])} |"
            for f in fits
        ]
    if targets:
        lines += [
            "\nTime to a target loss: median over rounds (lowest-highest round); speed-up over"
            " sidco-e every step, per round; the final validation figure after the same samples\n",
            "| job | bandwidth | run | ratio | target loss | steps | seconds | vs sidco-e |"
            " final validation |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {t['job']} | {t['bandwidth']} | {t['compressor']} | {t['ratio']:g} | "
            f"{t['target_loss']:.3f} | {t['steps']} | {t['seconds']:.1f} ({t['low']:.1f}-"
            f"{t['high']:.1f}) | {_times(t['vs_base'])} | {t['final_eval']:.4g} |"
            for t in target_summary(targets)
        ]
    return "\n".join(lines)


def plots(rows: list[dict], traces: list[dict], folder: pathlib.Path) -> None:
    """Median step time (bars: p25-p75) against bandwidth per job and ratio, and loss
    against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    for job in dict.fromkeys(r["job"] for r in rows):
        ratios = sorted(
            {r["ratio"] for r in rows if r["job"] == job and r["compressor"] != "dense"}
        )
        figure, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 4), squeeze=False)
        for axis, ratio in zip(axes[0], ratios, strict=True):
            for name in dict.fromkeys(r["compressor"] for r in rows):
                points = [
                    r
                    for r in rows
                    if (r["job"], r["compressor"]) == (job, name)
                    and (name == "dense" or r["ratio"] == ratio)
                ]
                if points:
                    x = [bits_per_second(p["bandwidth"]) / 1e6 for p in points]
                    y = [p["step_ms"] for p in points]
                    iqr = [
                        [m - p["step_p25_ms"] for m, p in zip(y, points, strict=True)],
                        [p["step_p75_ms"] - m for m, p in zip(y, points, strict=True)],
                    ]
                    axis.errorbar(x, y, yerr=iqr, fmt="o-", capsize=2, label=name)
            axis.set(xscale="log", yscale="log", xlabel="bandwidth (Mbit/s)", ylabel="step (ms)")
            axis.set_title(f"{job}, ratio {ratio:g}")
            axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / f"network_{job.replace(':', '_')}.png", dpi=100)
        plt.close(figure)
    for bandwidth in dict.fromkeys(t["bandwidth"] for t in traces):  # the first round's
        figure, axis = plt.subplots(figsize=(5, 4))
        for t in traces:
            if t["bandwidth"] == bandwidth and t.get("round", 0) == 0:
                axis.plot(t["seconds"], t["loss"], label=f"{t['job']} {t['compressor']}")
        axis.set(xlabel="seconds", ylabel="training loss", title=f"at {bandwidth}")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / f"network_time_to_loss_{bandwidth}.png", dpi=100)
        plt.close(figure)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--bandwidths",
        nargs="+",
        default=["100mbit", "1gbit", "10gbit"],
        help="tc rates of the link to measure at, one job run per rate and model",
    )
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netem)")
    parser.add_argument(
        "--jobs", nargs="+", default=["lm:large", "cnn:default"], help="example:config pairs"
    )
    parser.add_argument(
        "--compressors", nargs="+", default=list(COMPRESSORS), help="compressors to time"
    )
    parser.add_argument(
        "--local-devices",
        type=_at_least_one,
        default=1,
        help="forced CPU devices per process (all on its one core)",
    )
    parser.add_argument(
        "--hierarchical",
        nargs="*",
        default=[],
        metavar="COMPRESSOR",
        help="also run these hierarchically (name/hier): dense over each process's devices, "
        "compressed across the link; needs --local-devices 2 or more",
    )
    parser.add_argument(
        "--ratios",
        nargs="+",
        type=float,
        default=[0.01, 0.001],
        help="target densities; every compressor but dense runs at each",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least_one,
        default=3,
        help="rounds over all compressors, each round in a rotated order",
    )
    parser.add_argument(
        "--steps",
        type=_at_least_one,
        default=20,
        help="timed steps per compressor per round (and as many local-only timings)",
    )
    parser.add_argument(
        "--target-bandwidth",
        nargs="+",
        default=["1gbit"],
        help="bandwidths of the time-to-loss runs (each among --bandwidths)",
    )
    parser.add_argument(
        "--target-compressors",
        nargs="*",
        default=["dense", "sidco-e"],
        help="compressors of the time-to-loss runs; name@H: outer steps every H steps",
    )
    parser.add_argument(
        "--target-rounds",
        type=_at_least_one,
        default=1,
        help="rounds of the time-to-loss runs, each in a rotated order",
    )
    parser.add_argument(
        "--target-ratio", type=float, default=0.01, help="ratio of the time-to-loss runs"
    )
    parser.add_argument(
        "--target-steps", type=int, default=0, help="steps of each time-to-loss run; 0: none"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds per job (one model at one bandwidth: set-up, all rounds, time-to-loss)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write every result here")
    parser.add_argument("--plots", type=pathlib.Path, help="write plots into this folder")
    return parser


def _jobs(args) -> tuple[list[dict], list[dict], list[dict]]:
    """Every job at every bandwidth over the link: rows, traces and each job's run order."""
    runs = [("dense", args.ratios[0])] if "dense" in args.compressors else []
    runs += [(c, r) for r in args.ratios for c in args.compressors if c != "dense"]
    runs += [(c + HIERARCHICAL, r) for r in args.ratios for c in args.hierarchical]
    rows, traces, orders = [], [], []
    with VirtualLink() as link, tempfile.TemporaryDirectory() as scratch:
        cache = pathlib.Path(scratch) / "cache"
        for bandwidth in args.bandwidths:
            link.shape(bandwidth, args.delay_ms)
            for job in args.jobs:
                targets = bandwidth in args.target_bandwidth and args.target_steps > 0
                spec = {
                    "job": job,
                    "runs": runs,
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "local_devices": args.local_devices,
                    "cache": str(cache),
                    "coordinator": link.addresses[0],
                    "target_compressors": args.target_compressors if targets else [],
                    "target_ratio": args.target_ratio,
                    "target_steps": args.target_steps,
                    "target_rounds": args.target_rounds,
                }
                print(f"{bandwidth} {job} ...", flush=True)
                results = run_job(link, spec, args.timeout, pathlib.Path(scratch))
                more_rows, more_traces, order = merge(bandwidth, job, results)
                rows += more_rows
                traces += more_traces
                orders.append(order)
    return rows, traces, orders


def _report(args, rows: list[dict], traces: list[dict], orders: list[dict]) -> None:
    """Speed-ups, crossovers and time to loss: printed, and written where asked."""
    speedups(rows)
    fits = crossovers(rows)
    targets = time_to_target(traces)
    print(tables(rows, fits, targets))
    if args.json:
        record = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "host": host.describe(),
            "rows": rows,
            "orders": orders,
            "crossovers": fits,
            "time_to_target": targets,
            "traces": traces,
        }
        harness.write(args.json, record)
    if args.plots:
        plots(rows, traces, args.plots)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    for rate in [*args.bandwidths, *args.target_bandwidth]:
        bits_per_second(rate)  # a bad rate fails here, before anything is created
    from benchmarks.harness import LABELS, parse_label

    for label in {*args.compressors, *args.hierarchical, *args.target_compressors}:
        label, _, every = label.partition(OUTER)
        if every and not (every.isdigit() and int(every) >= 1):
            parser.error(f"{label}{OUTER}{every}: H must be a whole number of steps, at least 1")
        if parse_label(label)[0] not in LABELS:  # and a bad name here
            parser.error(f"unknown compressor {label!r}; allowed: {', '.join(LABELS)}")
    reason = unavailable()
    if reason:
        print(f"network benchmark skipped: {reason}")
        return 0
    if args.hierarchical and args.local_devices < 2:
        parser.error("--hierarchical needs --local-devices 2 or more")
    _report(args, *_jobs(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
