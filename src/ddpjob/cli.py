"""The ``ddpjob`` command: subcommands, and how errors become exit codes.

- ``train``: the worker; runs under torchrun, srun, a plain RANK/WORLD_SIZE env, or alone.
- ``launch``: the node agent every launcher calls; starts torchrun with derived arguments.
- ``doctor``: preflight checks with a fix for each problem (``launch`` runs them briefly too);
  ``doctor --all-nodes`` measures every node through the launcher and names the slow ones.
- ``plot``, ``ckpt``: look at a run's metrics; inspect and convert checkpoints.
- ``config``: the resolved config as a .env file (``.env.example`` is its output with defaults).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence

from ddpjob import config, log, versions
from ddpjob.errors import EXIT_FAILED, EXIT_OK, UsageError, run_guarded
from ddpjob.train import trackers


def _train(argv: Sequence[str]) -> int:
    parser = config.make_parser(
        "ddpjob train",
        "Run the training worker (one process of the job).",
        "The node-level flags of `ddpjob launch` are accepted too and ignored (see ddpjob launch --help).",
    )
    config.add_config_flags(parser, shown=config.WORKER)
    # bad values end here, before torch loads (only a rendezvous endpoint is parsed by torch itself)
    cfg = config.load(parser.parse_args(argv))
    versions.check_torch()  # before the worker's own imports, which need a recent torch
    import torch

    from ddpjob import distenv
    from ddpjob.train import loop, output_prefix

    env = distenv.resolve(os.environ, torch.cuda.device_count())
    if env.is_distributed:
        output_prefix.prefix_output(env)
    return loop.run(cfg, env)


def _config(argv: Sequence[str]) -> int:
    parser = config.make_parser("ddpjob config", "Print the resolved config as a .env file.")
    config.add_config_flags(parser)
    print(config.render_env(config.load(parser.parse_args(argv))), end="")
    return 0


def _doctor(argv: Sequence[str]) -> int:
    import torch

    from ddpjob.launch import agent
    from ddpjob.tools import doctor, doctor_all_nodes

    parser = config.make_parser("ddpjob doctor", "Check this node before (or instead of) joining the job.")
    config.add_config_flags(parser)
    doctor_all_nodes.add_flags(parser)
    args = parser.parse_args(argv)
    doctor_all_nodes.check_flags(args)
    cfg = config.load(args)
    plan = agent.resolve_plan(cfg, os.environ, torch.cuda.device_count())
    if args.all_nodes:
        return doctor_all_nodes.run_all_nodes(cfg, plan, argv)
    return EXIT_OK if doctor.report(doctor.run(cfg, plan)) else EXIT_FAILED


def _plot(argv: Sequence[str]) -> int:
    from pathlib import Path

    from ddpjob.tools import plot

    parser = config.make_parser("ddpjob plot", "Plot loss, accuracy and throughput of a run as a PNG.")
    parser.add_argument("run_dir", type=Path, help="run dir (or its metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    log.info(f"plot: wrote {plot.plot(args.run_dir, args.out)}")
    return EXIT_OK


def _ckpt(argv: Sequence[str]) -> int:
    from ddpjob.checkpoint.storage import argument
    from ddpjob.tools import ckpt

    parser = config.make_parser("ddpjob ckpt", "Inspect or convert checkpoints (ddpjob's or any state dict).")
    sub = parser.add_subparsers(dest="action", required=True)
    inspect = sub.add_parser("inspect", help="format, step, keys, shapes, dtypes, size, integrity, prefix")
    inspect.add_argument("path", type=argument, help="a file or folder, or its URL (s3://BUCKET/KEY)")
    inspect.add_argument("--all", action="store_true", help="list every tensor")
    convert = sub.add_parser(
        "convert", help="strip/add the module. prefix; plain, ddpjob, dcp or safetensors (one file or sharded)"
    )
    convert.add_argument("src", type=argument)
    convert.add_argument("dst", type=argument)
    convert.add_argument("--to", choices=ckpt.TARGETS, default="plain")
    convert.add_argument("--add-prefix", default="", metavar="PREFIX", help="e.g. module. (default: strip prefixes)")
    convert.add_argument(
        "--max-shard-size",
        default="",
        metavar="SIZE",
        help="with --to safetensors: write DST as a Hugging Face folder of shards of at most SIZE (e.g. 2GB, 500MB, "
        "1GiB) and model.safetensors.index.json",
    )
    args = parser.parse_args(argv)
    if args.action == "inspect":
        print("\n".join(ckpt.inspect(args.path, show=10**9 if args.all else 50)))
    else:
        print(ckpt.convert(args.src, args.dst, args.to, args.add_prefix, args.max_shard_size))
    return EXIT_OK


def _diagnose(argv: Sequence[str]) -> int:
    from pathlib import Path

    from ddpjob.tools import diagnose

    parser = config.make_parser("ddpjob diagnose", "Which rank stopped a stuck or failed job, from RUN_DIR/traces.")
    parser.add_argument("run_dir", type=Path, help="the job's --run-dir")
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: from metrics.jsonl)")
    args = parser.parse_args(argv)
    print(diagnose.diagnose(args.run_dir, args.world_size))
    return EXIT_OK


def _launch(argv: Sequence[str]) -> int:
    # The agent's C++ store warnings (a peer's store closing) come with a frame dump each; the
    # failure is reported in one line instead. c10 reads the level once, when torch loads, so the
    # workers still get the user's setting. TORCH_CPP_LOG_LEVEL=INFO shows everything again.
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = user_level or "ERROR"
    try:
        versions.check_torch()  # loads torch, under the level above
        from ddpjob.launch import agent
    finally:
        if user_level is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    return agent.main(argv, ForkedTrain())


class ForkedTrain:
    """What launch's forked workers run (launch/worker_fork.py): ``ddpjob train``, with what every worker
    imports before its first step preloaded in launch, which itself never imports the loop."""

    @staticmethod
    def preload() -> None:
        import torch._dynamo  # noqa: F401 - DDP's constructor imports it: about 1.3 s a worker

        from ddpjob import distenv  # noqa: F401
        from ddpjob.train import loop, output_prefix  # noqa: F401

    @staticmethod
    def run(argv: Sequence[str]) -> int:
        return main(["train", *argv])


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (_train, "run the training worker (under torchrun, srun, or alone)"),
    "launch": (_launch, "start this node's workers with torchrun (what every launcher calls)"),
    "doctor": (
        _doctor,
        "checks of this node; --all-nodes: bandwidth, latency and speed of every node, slow ones named",
    ),
    "plot": (_plot, "PNG of loss, accuracy and throughput of a run, marking restarts and resumes"),
    "diagnose": (_diagnose, "which rank stopped a stuck job, in which collective, from RUN_DIR/traces"),
    "ckpt": (_ckpt, "inspect or convert checkpoints (module. prefix, plain, safetensors, sharded safetensors)"),
    "config": (_config, "print the resolved config (defaults < .env < DDPJOB_* < flags) as a .env file"),
}


def usage() -> str:
    lines = ["usage: ddpjob COMMAND [flags]   (ddpjob COMMAND --help for flags)", "", "commands:"]
    lines += [f"  {name:<8} {help}" for name, (_, help) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:  # inherited: the kernel would reap the workers
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # of launch (their exit codes lost) and our own children
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        return run_guarded(_unknown, argv)
    return run_to_the_end(command[0], argv[1:])


def run_to_the_end(command: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """run_guarded; but when a tracker sender this command started is still running (a tracking
    server that never answers), end the process here with os._exit, on every way out (an error's
    traceback is printed first): finalizing the interpreter beside that thread can abort it."""
    started = len(trackers.SENDERS)
    try:
        code = run_guarded(command, argv)
    except BaseException as exc:
        if not trackers.senders_alive(started):
            raise
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else EXIT_FAILED
        else:
            traceback.print_exception(exc)
            code = EXIT_FAILED
    if trackers.senders_alive(started):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code


def _unknown(argv: Sequence[str]) -> int:
    raise UsageError(f"unknown command {argv[0]!r}; use one of {', '.join(COMMANDS)}")
