"""Command line of the example trainers: a config module plus one flag per config field.

Parsing happens before JAX is imported, so that ``--devices`` can force that
many CPU devices (``XLA_FLAGS``); on GPU/TPU the flag only limits the mesh.
"""

import argparse
import dataclasses
import importlib
import os
import sys
import typing


def _kind(annotation):
    """The element type of ``int``, ``int | None`` or ``tuple[int, ...]``."""
    args = [a for a in typing.get_args(annotation) if a not in (type(None), Ellipsis)]
    return args[0] if args else annotation


def _flag(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    name = "--" + field.name.replace("_", "-")
    if field.type is bool:
        parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None)
    elif typing.get_origin(field.type) is tuple:
        parser.add_argument(name, nargs="+", type=_kind(field.type), default=None)
    else:
        parser.add_argument(name, type=_kind(field.type), default=None)


def parse(configs: str, argv=None, description: str = ""):
    """Returns ``(config, workdir)`` from the command line.

    Args:
      configs: package of the config modules (each with ``get_config()``).
      argv: arguments (default ``sys.argv[1:]``).
      description: the ``--help`` text.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="default")
    known, _ = pre.parse_known_args(argv)
    config = importlib.import_module(f"{configs}.{known.config}").get_config()

    parser = argparse.ArgumentParser(description=description, parents=[pre])
    parser.add_argument("--workdir", default=None, help="where results and plots go")
    for field in dataclasses.fields(config):
        _flag(parser, field)
    args = parser.parse_args(argv)
    changes = {
        f.name: tuple(v) if isinstance(v, list) else v
        for f in dataclasses.fields(config)
        if (v := getattr(args, f.name)) is not None
    }
    config = dataclasses.replace(config, **changes)
    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            count = f"--xla_force_host_platform_device_count={config.devices}"
            os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()
    workdir = args.workdir or os.path.join("runs", configs.split(".")[1])
    return config, workdir
