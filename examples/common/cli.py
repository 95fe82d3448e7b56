"""Command line of the example trainers: a config module plus one flag per config field.

Each flag takes its help text, choices and least value from the field's
metadata (see :mod:`examples.common.config`) and its default from the chosen
config. Mistakes end in argparse errors (exit status 2) that name the bad value
and what is allowed. ``XLA_FLAGS`` is set before JAX starts its backends, so
that ``--devices`` can force that many CPU devices; on GPU/TPU the flag only
limits the mesh.
"""

import argparse
import dataclasses
import importlib
import math
import os
import pkgutil
import typing
from collections.abc import Callable

import sidco_jax as sidco


def force_cpu_devices(count: int) -> None:
    """Asks XLA for ``count`` CPU devices, unless ``XLA_FLAGS`` already names a count.

    The flags already set stay: a test suite's code generation flags, say, which
    the processes started from here inherit. Only takes effect before JAX starts
    its backends.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        count_flag = f"--xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = f"{flags} {count_flag}".strip()


def _kind(annotation):
    """The element type of ``int``, ``int | None`` or ``tuple[int, ...]``."""
    args = [a for a in typing.get_args(annotation) if a not in (type(None), Ellipsis)]
    return args[0] if args else annotation


def _checked(kind: type, meta: dict) -> Callable[[str], typing.Any]:
    """``kind`` parsed from a flag's text, within the field's ``min``, ``above`` and ``max``;
    a float must be finite."""

    def parse(text: str):
        value = kind(text)  # a ValueError here is reported by argparse as "invalid value"
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if "min" in meta and value < meta["min"]:
            raise argparse.ArgumentTypeError(f"{text} is below {meta['min']}, the least allowed")
        if "above" in meta and value <= meta["above"]:
            raise argparse.ArgumentTypeError(f"{text} must be above {meta['above']}")
        if "max" in meta and value > meta["max"]:
            raise argparse.ArgumentTypeError(f"{text} is above {meta['max']}, the most allowed")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def _flag(parser: argparse.ArgumentParser, field: dataclasses.Field, default) -> None:
    name = "--" + field.name.replace("_", "-")
    meta = dict(field.metadata)
    shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
    shown = "none" if shown in ("", None) else shown
    options = {"help": meta.get("help", ""), "default": default}
    if field.name == "compressors":
        meta["choices"] = sidco.COMPRESSORS
    if "choices" in meta:
        options["choices"] = meta["choices"]
        if len(meta["choices"]) > 4:  # a long list reads better in the help than in the usage
            options["metavar"] = "NAME"
            options["help"] += f"; any of {', '.join(meta['choices'])}"
    options["help"] += f" (default: {shown})"
    kind = _kind(field.type)
    if field.type is bool:
        parser.add_argument(name, action=argparse.BooleanOptionalAction, **options)
        return
    options["type"] = _checked(kind, meta) if kind in (int, float) else kind
    if typing.get_origin(field.type) is tuple:
        options["nargs"] = "+" if field.name == "compressors" else "*"
    parser.add_argument(name, **options)


def _check(config) -> str | None:
    """The error for shared flags that do not go together, or None."""
    if config.checkpoint_dir is not None and config.capture_steps:
        return (
            "--capture-steps does not go with --checkpoint-dir: a resumed run would miss the "
            "captures before its checkpoint; pass one of them"
        )
    if config.devices % config.nodes:
        return f"--nodes {config.nodes} must divide --devices {config.devices}"
    if config.capture_steps and (config.nodes > 1 or config.outer_every):
        return (
            "--capture-steps needs --nodes 1 and no --outer-every: a device's residual is then "
            "a slice, or its pseudo-gradient's"
        )
    if config.coordinator is not None and config.process_id >= config.nodes:
        return f"--process-id {config.process_id} must be below --nodes {config.nodes}"
    return None


def _join(config) -> None:
    """Joins the job of ``config.nodes`` processes, one per node, at ``config.coordinator``."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        config.coordinator,
        num_processes=config.nodes,
        process_id=config.process_id,
        coordinator_bind_address=config.coordinator,  # process 0 listens there only
    )


def parse(
    configs: str,
    argv: list[str] | None = None,
    description: str = "",
    check: Callable[[typing.Any], str | None] | None = None,
):
    """Returns ``(config, workdir)`` from the command line.

    Args:
      configs: package of the config modules (each with ``get_config()``).
      argv: arguments (default ``sys.argv[1:]``).
      description: the ``--help`` text, printed as written.
      check: ``check(config)`` returns an error message for a combination of
        flags that is not allowed, or None.
    """
    names = sorted(m.name for m in pkgutil.iter_modules(importlib.import_module(configs).__path__))
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="default")
    known, _ = pre.parse_known_args(argv)
    # An unknown name falls back to the default here; the full parser below rejects it.
    name = known.config if known.config in names else "default"
    config = importlib.import_module(f"{configs}.{name}").get_config()

    parser = argparse.ArgumentParser(
        prog=f"python -m {configs.rsplit('.', 1)[0]}.main",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default="default",
        choices=names,
        help="the configuration to start from (default: default)",
    )
    parser.add_argument("--workdir", help="where results and plots go (default: runs/<example>)")
    for field in dataclasses.fields(config):
        _flag(parser, field, getattr(config, field.name))
    args = parser.parse_args(argv)
    changes = {
        f.name: tuple(v) if isinstance(v, list) else v
        for f in dataclasses.fields(config)
        if (v := getattr(args, f.name)) is not None
    }
    config = dataclasses.replace(config, **changes)
    for rule in (_check, check):
        if rule is not None and (message := rule(config)):
            parser.error(message)
    force_cpu_devices(config.devices // config.nodes if config.coordinator else config.devices)
    import jax  # only now: XLA_FLAGS is read when the backends start

    if config.coordinator is not None:
        _join(config)
    if config.devices > jax.device_count():
        parser.error(f"--devices {config.devices}: only {jax.device_count()} devices are here")
    workdir = args.workdir or os.path.join("runs", configs.split(".")[1])
    return config, workdir
