"""End-to-end step time of every compressor over a real, rate-limited network.

Two JAX processes (``jax.distributed``, gloo CPU collectives), one CPU device
and one core each, train an example model data-parallel across a veth link
between two network namespaces (:mod:`virtual_link`), rate-limited with ``tc``.
Needs root and iproute2; without them it says so and exits cleanly.

For every bandwidth, model and compressor it reports the median step time and
its split (compute: forward and backward on the local batch; compression: the
compressor's update on one device, no communication; communication: the rest
of the step), the bytes each process put on the wire per step (the veth's own
counters) and in the compiled collectives (HLO), and speed-ups over dense and
over top-k. It fits ``step = a + b / bandwidth`` per compressor across the
bandwidths to give the crossover below which each compressor beats dense, and
can time dense and SIDCo to a target loss.

    sudo python benchmarks/network.py --bandwidths 100mbit 1gbit 10gbit \\
        --jobs lm:large cnn:default --ratios 0.01 0.001 --json runs/network.json
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from virtual_link import VirtualLink, bits_per_second, unavailable  # noqa: E402

COMPRESSORS = ("dense", "topk", "dgc", "gaussiank", "redsync", "sidco-e", "sidco-p", "sidco-gp")
PORT = 4800  # free: the namespaces are new and hold nothing else


# ----------------------------------------------------------------------------- worker


def worker(spec: dict) -> None:
    """One process of the job: measures every (compressor, ratio) and writes its JSON."""
    import importlib

    import jax

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
    model, name = spec["job"].split(":")
    config = importlib.import_module(f"examples.{model}.configs.{name}").get_config()
    task = importlib.import_module(f"examples.{model}.train").task(config)
    counter = pathlib.Path(f"/sys/class/net/{spec['device']}/statistics/tx_bytes")
    rows = []
    for compressor, ratio in spec["runs"]:
        rows.append(_measure(task, config, compressor, ratio, spec["steps"], counter))
        print(f"{compressor} {ratio}: {rows[-1]['step_ms']:.0f} ms/step", flush=True)  # to the log
    traces = [
        _train(task, config, compressor, spec["target_ratio"], spec["target_steps"])
        for compressor in spec["target_compressors"]
    ]
    out = {"rows": rows, "traces": traces, "parameters": rows[0]["parameters"] if rows else 0}
    pathlib.Path(spec["out"]).write_text(json.dumps(out))
    jax.distributed.shutdown()


def _median(times: list[float]) -> float:
    import numpy as np

    return float(np.median(times)) * 1e3


def _timed(fn, *args, repeats: int) -> list[float]:
    import jax

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def _optimizer(compressor: str, ratio: float, config, axis_name):
    import optax

    from examples.common import parallel

    return optax.chain(
        parallel.compressor(compressor, ratio, axis_name),
        optax.sgd(config.learning_rate, momentum=config.momentum),
    )


def _setup(task, config, compressor: str, ratio: float, batches: int):
    """The compiled two-process step, placed parameters, state and ``batches`` placed batches."""
    import numpy as np

    from examples.common import parallel

    data = np.random.default_rng(config.seed)
    host = [task.sample(data, 2 * config.batch_per_device) for _ in range(batches)]
    params = task.init(config.seed)
    tx = _optimizer(compressor, ratio, config, parallel.AXIS)
    trainer = parallel.build(task.loss, params, host[0], tx, devices=2)
    placed = [parallel.place(trainer.mesh, b, parallel.P(parallel.AXIS)) for b in host]
    params = parallel.place(trainer.mesh, params, parallel.P())
    return trainer, params, placed, host


def _measure(task, config, compressor: str, ratio: float, steps: int, counter) -> dict:
    import jax
    import optax

    trainer, params, batches, host = _setup(task, config, compressor, ratio, steps + 2)
    opt_state = trainer.opt_state
    for batch in batches[:2]:  # warm-up
        params, opt_state, loss = jax.block_until_ready(trainer.step(params, opt_state, batch))
    sent = int(counter.read_text())
    step_times = []
    for batch in batches[2:]:
        start = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(trainer.step(params, opt_state, batch))
        step_times.append(time.perf_counter() - start)
    wire = (int(counter.read_text()) - sent) / steps

    # The same work on this process's device alone: no collective, nothing to wait for.
    device = jax.local_devices()[0]
    local = jax.device_put(jax.tree.map(lambda x: x[: config.batch_per_device], host[0]), device)
    local_params = jax.device_put(task.init(config.seed), device)
    tx = _optimizer(compressor, ratio, config, None)

    @jax.jit
    def local_step(params, state, batch):
        loss, grads = jax.value_and_grad(task.loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    gradient = jax.jit(jax.value_and_grad(task.loss))
    state = tx.init(local_params)
    _timed(gradient, local_params, local, repeats=2)
    _timed(local_step, local_params, state, local, repeats=2)
    compute = _median(_timed(gradient, local_params, local, repeats=steps))
    alone = _median(_timed(local_step, local_params, state, local, repeats=steps))
    step = _median(step_times)
    return {
        "compressor": compressor,
        "ratio": ratio,
        "step_ms": step,
        "compute_ms": compute,
        "compression_ms": max(alone - compute, 0.0),
        "communication_ms": max(step - alone, 0.0),
        "wire_bytes": wire,
        "hlo_bytes": trainer.bytes_per_step,
        "parameters": sum(int(x.size) for x in jax.tree.leaves(params)),
        "loss": float(loss.addressable_data(0)),
    }


def _train(task, config, compressor: str, ratio: float, steps: int) -> dict:
    """Loss against wall-clock time over ``steps`` steps (time to a target loss)."""
    import jax

    trainer, params, batches, _ = _setup(task, config, compressor, ratio, steps)
    opt_state = trainer.opt_state
    seconds, losses, start = [], [], time.perf_counter()
    for batch in batches:
        params, opt_state, loss = trainer.step(params, opt_state, batch)
        losses.append(float(jax.block_until_ready(loss).addressable_data(0)))
        seconds.append(time.perf_counter() - start)
    return {"compressor": compressor, "ratio": ratio, "seconds": seconds, "loss": losses}


# ----------------------------------------------------------------------------- parent


def run_job(link: VirtualLink, spec: dict, timeout: float, workdir: pathlib.Path) -> list[dict]:
    """Runs both processes of one job on ``link``; returns their results (process 0 first)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    cores = os.cpu_count() or 1
    processes, logs = [], []
    for side in (0, 1):
        mine = dict(
            spec, process=side, device=link.devices[side], out=str(workdir / f"{side}.json")
        )
        argv = [sys.executable, __file__, "--worker", json.dumps(mine)]
        if cores > 1:  # one core each, as two hosts would have
            argv = ["taskset", "-c", str(side % cores), *argv]
        log = open(workdir / f"{side}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        processes.append(
            subprocess.Popen(link.command(side, argv), env=env, stdout=log, stderr=log)
        )
    try:
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


def merge(bandwidth: str, job: str, results: list[dict]) -> tuple[list[dict], list[dict]]:
    """One row per measurement: process 0's times, the two processes' mean wire bytes."""
    rows = []
    for first, second in zip(results[0]["rows"], results[1]["rows"], strict=True):
        row = dict(first, bandwidth=bandwidth, job=job, parameters=results[0]["parameters"])
        row["wire_bytes"] = (first["wire_bytes"] + second["wire_bytes"]) / 2
        rows.append(row)
    traces = [dict(t, bandwidth=bandwidth, job=job) for t in results[0]["traces"]]
    return rows, traces


def speedups(rows: list[dict]) -> None:
    """Adds speed-up over dense and over top-k (same job, bandwidth and ratio) to each row."""
    for row in rows:
        same = [r for r in rows if (r["job"], r["bandwidth"]) == (row["job"], row["bandwidth"])]
        dense = next((r for r in same if r["compressor"] == "dense"), None)
        topk = next(
            (r for r in same if r["compressor"] == "topk" and r["ratio"] == row["ratio"]), None
        )
        row["vs_dense"] = dense["step_ms"] / row["step_ms"] if dense else None
        row["vs_topk"] = topk["step_ms"] / row["step_ms"] if topk else None


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
    mean among the traces of a job (a target every run reaches)."""
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
            out.append({k: t[k] for k in ("job", "bandwidth", "compressor", "ratio")} | reached)
    return out


def _rate(bits: float | None) -> str:
    if bits is None:
        return "never"
    if bits == float("inf"):
        return "any"
    return f"{bits / 1e9:.2f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.0f} Mbit/s"


def tables(rows: list[dict], fits: list[dict], targets: list[dict]) -> str:
    """Markdown tables of the measurements."""
    lines = []
    for job in dict.fromkeys(r["job"] for r in rows):
        params = next(r["parameters"] for r in rows if r["job"] == job)
        lines += [
            f"\n{job} ({params:,} parameters), 2 processes x 1 CPU device\n",
            "| bandwidth | ratio | compressor | step ms | compute | compression | communication"
            " | wire bytes/step | HLO bytes | vs dense | vs top-k |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r["job"] == job):
            ratio = "-" if r["compressor"] == "dense" else f"{r['ratio']:g}"
            times = " | ".join(
                f"{r[k]:.0f}"
                for k in ("step_ms", "compute_ms", "compression_ms", "communication_ms")
            )
            topk = f"{r['vs_topk']:.2f}" if r["vs_topk"] else "-"
            lines.append(
                f"| {r['bandwidth']} | {ratio} | {r['compressor']} | {times} | "
                f"{r['wire_bytes']:,.0f} | {r['hlo_bytes']:,} | {r['vs_dense']:.2f} | {topk} |"
            )
    if fits:
        lines += [
            "\nCrossover: the bandwidth below which a compressor's step, fitted as"
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
            "\nTime to a target loss\n",
            "| job | bandwidth | compressor | ratio | target loss | steps | seconds |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {t['job']} | {t['bandwidth']} | {t['compressor']} | {t['ratio']:g} | "
            f"{t['target_loss']:.3f} | {t['steps']} | {t['seconds']:.1f} |"
            for t in targets
        ]
    return "\n".join(lines)


def plots(rows: list[dict], traces: list[dict], folder: pathlib.Path) -> None:
    """Step time against bandwidth per job and ratio, and loss against time."""
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
                    axis.plot(x, [p["step_ms"] for p in points], "o-", label=name)
            axis.set(xscale="log", yscale="log", xlabel="bandwidth (Mbit/s)", ylabel="step (ms)")
            axis.set_title(f"{job}, ratio {ratio:g}")
            axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / f"network_{job.replace(':', '_')}.png", dpi=100)
        plt.close(figure)
    if traces:
        figure, axis = plt.subplots(figsize=(5, 4))
        for t in traces:
            axis.plot(t["seconds"], t["loss"], label=f"{t['job']} {t['compressor']}")
        axis.set(xlabel="seconds", ylabel="training loss", title=f"at {traces[0]['bandwidth']}")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / "network_time_to_loss.png", dpi=100)
        plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidths", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netem)")
    parser.add_argument(
        "--jobs", nargs="+", default=["lm:large", "cnn:default"], help="example:config pairs"
    )
    parser.add_argument("--compressors", nargs="+", default=list(COMPRESSORS))
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.01, 0.001])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--target-bandwidth", default="1gbit")
    parser.add_argument("--target-compressors", nargs="*", default=["dense", "sidco-e"])
    parser.add_argument("--target-ratio", type=float, default=0.01)
    parser.add_argument("--target-steps", type=int, default=0, help="0: no time-to-loss run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--plots", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    for rate in [*args.bandwidths, args.target_bandwidth]:
        bits_per_second(rate)  # a bad rate fails here, before anything is created
    reason = unavailable()
    if reason:
        print(f"network benchmark skipped: {reason}")
        return 0
    runs = [("dense", args.ratios[0])] if "dense" in args.compressors else []
    runs += [(c, r) for r in args.ratios for c in args.compressors if c != "dense"]
    rows, traces = [], []
    with VirtualLink() as link, tempfile.TemporaryDirectory() as scratch:
        cache = pathlib.Path(scratch) / "cache"
        for bandwidth in args.bandwidths:
            link.shape(bandwidth, args.delay_ms)
            for job in args.jobs:
                targets = bandwidth == args.target_bandwidth and args.target_steps > 0
                spec = {
                    "job": job,
                    "runs": runs,
                    "steps": args.steps,
                    "cache": str(cache),
                    "coordinator": link.addresses[0],
                    "target_compressors": args.target_compressors if targets else [],
                    "target_ratio": args.target_ratio,
                    "target_steps": args.target_steps,
                }
                print(f"{bandwidth} {job} ...", flush=True)
                results = run_job(link, spec, args.timeout, pathlib.Path(scratch))
                more_rows, more_traces = merge(bandwidth, job, results)
                rows += more_rows
                traces += more_traces
    speedups(rows)
    fits = crossovers(rows)
    targets = time_to_target(traces)
    print(tables(rows, fits, targets))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": rows,
            "crossovers": fits,
            "time_to_target": targets,
            "traces": traces,
        }
        args.json.write_text(json.dumps(record, indent=1))
    if args.plots:
        plots(rows, traces, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
