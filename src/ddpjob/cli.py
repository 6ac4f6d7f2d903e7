"""The ``ddpjob`` command: subcommands, and how errors become exit codes.

- ``train``: the worker; runs under torchrun, srun, a plain RANK/WORLD_SIZE env, or alone.
- ``launch``: the node agent every launcher calls; starts torchrun with derived arguments.
- ``config``: the resolved config as a .env file (``.env.example`` is its output with defaults).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from ddpjob import config
from ddpjob.errors import StorageError, UsageError, exit_code_for


def _train(argv: Sequence[str]) -> int:
    import torch

    from ddpjob import distenv, train

    parser = config.make_parser("ddpjob train", "Run the training worker (one process of the job).")
    config.add_config_flags(parser)
    cfg = config.load(parser.parse_args(argv))
    env = distenv.resolve(__import__("os").environ, torch.cuda.device_count())
    return train.run(cfg, env)


def _config(argv: Sequence[str]) -> int:
    parser = config.make_parser("ddpjob config", "Print the resolved config as a .env file.")
    config.add_config_flags(parser)
    print(config.render_env(config.load(parser.parse_args(argv))), end="")
    return 0


def _launch(argv: Sequence[str]) -> int:
    from ddpjob import launch

    return launch.main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (_train, "run the training worker (under torchrun, srun, or alone)"),
    "launch": (_launch, "start this node's workers with torchrun (what every launcher calls)"),
    "config": (_config, "print the resolved config (defaults < .env < DDPJOB_* < flags) as a .env file"),
}


def usage() -> str:
    lines = ["usage: ddpjob COMMAND [flags]   (ddpjob COMMAND --help for flags)", "", "commands:"]
    lines += [f"  {name:<8} {help}" for name, (_, help) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise UsageError(f"unknown command {argv[0]!r}; use one of {', '.join(COMMANDS)}")
        return command[0](argv[1:])
    except (UsageError, StorageError) as exc:
        print(f"ddpjob: error: {exc}", file=sys.stderr, flush=True)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130
