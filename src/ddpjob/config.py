"""The one config dataclass and how it is read: defaults < .env < DDPJOB_* env vars < CLI flags.

Every field ``foo_bar`` is the flag ``--foo-bar`` and the variable ``DDPJOB_FOO_BAR``. Values from
every source are parsed and validated here, so bad input fails before any network wait.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dotenv import dotenv_values

from ddpjob import optional
from ddpjob.errors import UsageError

ENV_PREFIX = "DDPJOB_"
OPTIMIZER_NAMES = ("adamw", "adam", "sgd")  # built in (optim.py); anything else is a MODULE:CALLABLE factory
SCHEDULE_NAMES = ("cosine", "linear", "constant")  # built in (schedule.py)


def _opt(default: Any, help: str, choices: Sequence[str] = ()) -> Any:
    return field(default=default, metadata={"help": help, "choices": tuple(choices)})


@dataclass
class Config:
    # what to train
    model: str = _opt("ddpjob.plugins:digits_mlp", "model factory MODULE:CALLABLE[(k=v,...)] returning an nn.Module")
    data: str = _opt("ddpjob.plugins:digits", "data factory MODULE:CALLABLE[(k=v,...)] returning train[, val] datasets")
    epochs: int = _opt(10, "epochs to train")
    max_steps: int = _opt(0, "stop after this many optimizer steps (0: no limit)")
    batch_size: int = _opt(32, "samples per process per micro-batch")
    grad_accum: int = _opt(
        1, "micro-batches per optimizer step (DDP syncs only on the last); derived when --global-batch-size is set"
    )
    global_batch_size: int = _opt(
        0,
        "samples per optimizer step over all processes; set, it fixes the run at any world size (grad accumulation "
        "= it / (batch size x processes)); 0: batch size x grad accum x processes",
    )
    loss: str = _opt(
        "auto",
        "auto: the model's own loss (a scalar, a dict with 'loss', an object with .loss), else cross-entropy on "
        "(input, label) batches; or MODULE:CALLABLE[(k=v,...)], fn(output, batch) -> scalar or (scalar, {name: value})",
    )
    optimizer: str = _opt(
        "adamw", "adamw, adam, sgd, or MODULE:CALLABLE[(k=v,...)], a factory given the model returning an optimizer"
    )
    lr: float = _opt(3e-3, "peak learning rate (see --schedule)")
    weight_decay: float = _opt(0.0, "weight decay, not applied to biases and norm weights (parameters of < 2 dims)")
    momentum: float = _opt(0.0, "sgd: momentum")
    nesterov: bool = _opt(False, "sgd: Nesterov momentum (needs --momentum > 0)")
    betas: str = _opt("0.9,0.999", "adam, adamw: B1,B2")
    schedule: str = _opt(
        "cosine",
        "cosine or linear (to --min-lr over the run), constant, or MODULE:CALLABLE[(k=v,...)], "
        "fn(step, total_steps) -> factor of the base LR",
    )
    warmup_steps: int = _opt(0, "steps of linear LR warm-up before a built-in schedule")
    min_lr: float = _opt(0.0, "the LR cosine and linear schedules end at")
    grad_clip: float = _opt(0.0, "clip the gradients' total norm to MAX_NORM, logging grad_norm (0: off)")
    find_unused_parameters: bool = _opt(
        False, "ddp: let the model leave parameters out of a step's loss (DDP then searches the graph every step)"
    )
    compile: bool = _opt(False, "torch.compile the DDP-wrapped model (DDPOptimizer splits graphs at its buckets)")
    seed: int = _opt(0, "seed for weights, data order and every RNG")
    strategy: str = _opt(
        "ddp", "ddp: one process per device; dp: nn.DataParallel in one process; none", ("ddp", "dp", "none")
    )
    device: str = _opt("auto", "auto: cuda if available, else cpu", ("auto", "cpu", "cuda"))
    precision: str = _opt("fp32", "bf16 enables autocast on CUDA", ("fp32", "bf16"))
    num_workers: int = _opt(0, "DataLoader worker processes per rank")
    init_method: str = _opt("env://", "process group init: env:// or tcp://HOST:PORT")
    startup_timeout: float = _opt(
        600.0,
        "seconds a collective may wait from joining the process group until the first step has finished (NCCL "
        "set-up, the DDP broadcast, the first step and its compilation)",
    )
    collective_timeout: float = _opt(
        300.0, "seconds a collective of a later step may wait (a dead, hung or cut-off peer) before the job fails"
    )
    eval_timeout: float = _opt(1800.0, "seconds an evaluation pass (and the end-of-run checks) may take")
    save_timeout: float = _opt(
        1800.0, "seconds the ranks wait for a checkpoint save or load (slow storage) before failing the job"
    )
    fs_timeout: float = _opt(120.0, "seconds a rank waits to see the checkpoint rank 0 chose (shared storage lag)")
    # where results go
    run_dir: str = _opt("runs/ddpjob", "directory for checkpoints, metrics and logs of this job")
    checkpoint_dir: str = _opt("", "checkpoint directory (default: RUN_DIR/checkpoints)")
    metrics: str = _opt("", "JSON-lines metrics file, appended (default: RUN_DIR/metrics.jsonl)")
    save_every: int = _opt(100, "save a checkpoint every N optimizer steps (0: only at the end)")
    keep: int = _opt(3, "keep the newest K checkpoints")
    checkpoint_format: str = _opt(
        "file",
        "file: one step-N.pt; dcp: a torch.distributed.checkpoint folder step-N/, loadable at any world size",
        ("file", "dcp"),
    )
    save_mode: str = _opt(
        "sync",
        "async: the loop waits only for a copy into host memory (kept between saves), then a thread writes it",
        ("sync", "async"),
    )
    on_save_error: str = _opt(
        "fail", "fail: exit 3 when a checkpoint cannot be written; warn: log and go on", ("fail", "warn")
    )
    resume: str = _opt("auto", "auto: newest valid checkpoint in CHECKPOINT_DIR; never; or a checkpoint PATH")
    init_from: str = _opt(
        "",
        "load model weights only from PATH (ddpjob checkpoint, any state dict, .safetensors, Hugging Face sharded dir)",
    )
    load_mode: str = _opt(
        "mmap", "mmap: every rank maps the file; rank0: rank 0 reads and broadcasts (no shared fs)", ("mmap", "rank0")
    )
    log_every: int = _opt(10, "log a line every N steps on rank 0")
    tensorboard: str = _opt("", "also write the metrics as TensorBoard scalars to DIR (needs the tensorboard package)")
    tracker: str = _opt(
        "none",
        "also send the metrics to an experiment tracker, one run across restarts (needs the trackers extra)",
        ("none", "mlflow", "wandb"),
    )
    tracker_uri: str = _opt(
        "",
        "mlflow: tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db); "
        "wandb: server URL (default: $WANDB_BASE_URL, else W&B's)",
    )
    tracker_project: str = _opt(
        "", "MLflow experiment or W&B project (default: $MLFLOW_EXPERIMENT_NAME or $WANDB_PROJECT, else ddpjob)"
    )
    tracker_run_name: str = _opt("", "the tracker run's name (default: RUN_DIR's name)")
    tracker_every: float = _opt(
        1.0,
        "seconds: the tracker gets at most one record per event (the newest) this often; metrics.jsonl keeps "
        "every record; 0: all",
    )
    tracker_timeout: float = _opt(
        30.0, "seconds the job waits at its end for the tracker to send what is queued (a dead server never hangs it)"
    )
    stop_check_every: int = _opt(10, "steps between agreeing on a stop signal across ranks")
    straggler_factor: float = _opt(
        1.5,
        "warn when a rank's own step work is this many times the other ranks' median, --straggler-intervals in a row",
    )
    straggler_intervals: int = _opt(3, "logging intervals in a row a rank must be slow before it is named")
    heartbeat: float = _opt(
        0.0,
        "every S seconds each rank logs its step, phase and time without progress (0: off); a rank without "
        "progress past its phase's timeout exits 1 in any case",
    )
    trace_after: float = _opt(
        120.0,
        "seconds without progress before each rank writes what it is doing (collectives in flight, Python "
        "stacks) to RUN_DIR/traces/ for `ddpjob diagnose` (0: off)",
    )
    # node level (ddpjob launch)
    nnodes: str = _opt(
        "",
        "nodes in the job: N, or MIN:MAX for elastic training, where any node but node 0 (the rendezvous host) may "
        "leave or join (empty: from the scheduler, else 1)",
    )
    node_rank: int = _opt(-1, "this node's rank (-1: from the scheduler, else 0)")
    nproc_per_node: int = _opt(0, "worker processes per node (0: visible GPUs, else 1)")
    rdzv_endpoint: str = _opt("", "HOST[:PORT] of the rendezvous (default: from the scheduler, else localhost)")
    rdzv_id: str = _opt("", "rendezvous id shared by all nodes (default: the scheduler's job id)")
    rdzv_timeout: int = _opt(300, "seconds to wait for all nodes at rendezvous")
    elastic_wait: int = _opt(10, "elastic (--nnodes MIN:MAX): seconds to wait for more nodes once MIN have joined")
    max_restarts: int = _opt(
        0, "restarts of the worker group after a failure, a lost node included (0: from PET_MAX_RESTARTS, else none)"
    )
    shutdown_timeout: int = _opt(120, "seconds torchrun waits after a stop signal for workers to checkpoint and exit")

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.run_dir) / "checkpoints")

    @property
    def metrics_path(self) -> Path:
        return Path(self.metrics or Path(self.run_dir) / "metrics.jsonl")

    @property
    def node_range(self) -> tuple[int, int] | None:
        """(MIN, MAX) nodes from --nnodes (N: (N, N)); None when not given."""
        return parse_nodes(self.nnodes, flag("nnodes")) if self.nnodes else None

    @property
    def beta_pair(self) -> tuple[float, float]:
        """--betas as (B1, B2)."""
        return parse_betas(self.betas)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FIELDS = {f.name: f for f in fields(Config)}


def parse_nodes(raw: str, where: str) -> tuple[int, int]:
    """'N' -> (N, N); 'MIN:MAX' -> (MIN, MAX), as torchrun's --nnodes; UsageError otherwise."""
    low, _, high = raw.strip().partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1]:
        raise UsageError(f"{where}={raw!r} must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 or 1:4")
    return nodes


def parse_betas(raw: str) -> tuple[float, float]:
    """'0.9,0.95' -> (0.9, 0.95); UsageError unless two numbers in [0, 1)."""
    try:
        b1, b2 = (float(part) for part in raw.split(","))
    except ValueError:
        b1 = b2 = -1.0
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise UsageError(f"--betas {raw!r} must be two numbers in [0, 1) as B1,B2, e.g. 0.9,0.95")
    return b1, b2


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one UsageError line instead of usage + exit."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message} (see --help)")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", help="read DDPJOB_* settings from this file (default: ./.env if present)")
    for f in FIELDS.values():
        on_off: dict[str, Any] = (
            {"nargs": "?", "const": "true"} if isinstance(f.default, bool) else {}
        )  # --compile alone: on
        parser.add_argument(
            flag(f.name), dest=f.name, default=None, metavar=f.name.upper(), help=f.metadata["help"], **on_off
        )


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return _Parser(prog=prog, description=description, allow_abbrev=False)


def _convert(name: str, raw: str, where: str) -> Any:
    f = FIELDS[name]
    if f.metadata["choices"] and raw not in f.metadata["choices"]:
        raise UsageError(f"{where}={raw!r} is not one of {', '.join(f.metadata['choices'])}")
    kind: type = type(f.default)
    if kind is bool:
        if raw.strip().lower() not in TRUE + FALSE:
            raise UsageError(f"{where}={raw!r} is not on or off; give true or false")
        return raw.strip().lower() in TRUE
    try:
        return kind(raw)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise UsageError(f"{where}={raw!r} is not {noun}; give e.g. {flag(name)} {f.default}") from None


def _env_layer(values: Mapping[str, str | None], where: str) -> dict[str, tuple[str, str]]:
    layer = {}
    for key, raw in values.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "ENV_FILE":
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in FIELDS:
            raise UsageError(f"unknown setting {key} in {where}; valid keys are listed in .env.example")
        layer[name] = (raw or "", f"{key} ({where})" if where != "environment" else key)
    return layer


def load(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """Build the Config from parsed flags, the .env file and the environment."""
    environ = os.environ if environ is None else environ
    env_file = args.env_file or environ.get(ENV_PREFIX + "ENV_FILE")
    dotenv: dict[str, str | None] = {}
    if env_file:
        if not Path(env_file).is_file():
            raise UsageError(f"--env-file {env_file}: no such file; pass an existing .env file")
        dotenv = dotenv_values(env_file)
    elif Path(".env").is_file():
        env_file, dotenv = ".env", dotenv_values(".env")
    if isinstance(environ, os._Environ):  # non-DDPJOB keys (NCCL_*, ...) reach the process, env wins
        for key, value in dotenv.items():
            if not key.startswith(ENV_PREFIX) and value is not None:
                os.environ.setdefault(key, value)

    layered: dict[str, tuple[str, str]] = {}
    layered.update(_env_layer(dotenv, str(env_file)))
    layered.update(_env_layer(environ, "environment"))
    for name in FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            layered[name] = (value, flag(name))
    cfg = Config(**{name: _convert(name, raw, where) for name, (raw, where) in layered.items()})
    validate(cfg)
    return cfg


def is_spec(spec: str) -> bool:
    """Whether ``spec`` looks like a plug-in, MODULE:CALLABLE[(k=v)] (plugins.py loads it)."""
    return ":" in spec and not spec.startswith(":") and not spec.endswith(":")


def validate(cfg: Config) -> None:
    positive = (
        "epochs",
        "batch_size",
        "grad_accum",
        "keep",
        "log_every",
        "elastic_wait",
        "straggler_intervals",
        "stop_check_every",
        "rdzv_timeout",
        "shutdown_timeout",
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UsageError(f"{flag(name)} must be at least 1, got {getattr(cfg, name)}")
    for name in (
        "max_steps",
        "save_every",
        "num_workers",
        "max_restarts",
        "nproc_per_node",
        "heartbeat",
        "trace_after",
        "momentum",
        "warmup_steps",
        "min_lr",
        "grad_clip",
        "tracker_every",
    ):
        if getattr(cfg, name) < 0:
            raise UsageError(f"{flag(name)} must be 0 or more, got {getattr(cfg, name)}")
    parse_betas(cfg.betas)
    for name, built_in in (("optimizer", OPTIMIZER_NAMES), ("schedule", SCHEDULE_NAMES)):
        spec = getattr(cfg, name)
        if spec not in built_in and not is_spec(spec):
            raise UsageError(f"{flag(name)} {spec!r} is not one of {', '.join(built_in)} or a package.module:callable")
    if cfg.nesterov and (cfg.optimizer != "sgd" or cfg.momentum <= 0):
        raise UsageError("--nesterov needs --optimizer sgd and --momentum above 0")
    if cfg.loss != "auto" and not is_spec(cfg.loss):
        raise UsageError(f"--loss {cfg.loss!r} must be auto or look like package.module:callable")
    for name in (
        "lr",
        "startup_timeout",
        "collective_timeout",
        "eval_timeout",
        "save_timeout",
        "fs_timeout",
        "straggler_factor",
        "tracker_timeout",
    ):
        if getattr(cfg, name) <= 0:
            raise UsageError(f"{flag(name)} must be positive, got {getattr(cfg, name)}")
    if cfg.global_batch_size < 0:
        raise UsageError(f"--global-batch-size must be 0 or more, got {cfg.global_batch_size}")
    if cfg.global_batch_size and cfg.global_batch_size % cfg.batch_size:
        raise UsageError(
            f"--global-batch-size {cfg.global_batch_size} is not a multiple of --batch-size {cfg.batch_size}; "
            "choose a global batch that splits into whole micro-batches"
        )
    max_nodes = cfg.node_range[1] if cfg.node_range else 0
    if cfg.node_rank < -1 or (max_nodes and cfg.node_rank >= max_nodes):
        raise UsageError(f"--node-rank {cfg.node_rank} is outside 0..{max(max_nodes, 1) - 1}")
    for name in ("model", "data"):
        spec = getattr(cfg, name)
        if not is_spec(spec):
            raise UsageError(f"{flag(name)} {spec!r} must look like package.module:callable")
    if cfg.checkpoint_format == "dcp" and cfg.load_mode == "rank0":
        raise UsageError("--checkpoint-format dcp is read by every rank; use --load-mode mmap")
    if cfg.tensorboard:
        optional.require("tensorboard", f"--tensorboard {cfg.tensorboard}")
    if cfg.tracker != "none":  # its package, named as the tracker; imported only by rank 0's tracker
        optional.check(cfg.tracker, f"--tracker {cfg.tracker}")
    if not (cfg.init_method == "env://" or cfg.init_method.startswith("tcp://")):
        raise UsageError(f"--init-method {cfg.init_method!r} must be env:// or tcp://HOST:PORT")
    for name in ("resume", "init_from"):
        path = getattr(cfg, name)
        if path and path not in ("auto", "never") and not Path(path).exists():
            raise UsageError(f"{flag(name)} {path}: no such checkpoint file; check the path")


_SECTIONS = {
    "model": "What to train",
    "run_dir": "Where results go (checkpoints, metrics, logs)",
    "nnodes": "Node level: read by `ddpjob launch`",
}


def render_env(cfg: Config) -> str:
    """cfg as a commented .env file (`ddpjob config` prints it; .env.example is its defaults)."""
    lines = [
        "# ddpjob settings. Copy to .env and edit: defaults < .env < DDPJOB_* environment < command-line flags.",
        "# Each DDPJOB_FOO_BAR is also the flag --foo-bar. Other keys here (NCCL_*, GLOO_SOCKET_IFNAME, ...)",
        "# are exported to the job unless already set in the environment.",
    ]
    for name, f in FIELDS.items():
        if name in _SECTIONS:
            lines += ["", f"# --- {_SECTIONS[name]}"]
        choices = f" ({'|'.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
        lines += [f"# {f.metadata['help']}{choices}", f"DDPJOB_{name.upper()}={getattr(cfg, name)}"]
    return "\n".join(lines) + "\n"


def print_config(cfg: Config) -> None:
    items = " ".join(f"{k}={v}" for k, v in cfg.to_dict().items())
    print(f"[ddpjob] config: {items}", flush=True)
