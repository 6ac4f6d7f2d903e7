"""The one config dataclass, each field's declaration, and how it is read: defaults < .env < DDPJOB_* < flags.

Every field ``foo_bar`` is the flag ``--foo-bar`` and the variable ``DDPJOB_FOO_BAR``. Each field is
declared once, next to its default, with its help, its kind (the values it takes: bounds, a path to a
folder or file, HOST:PORT, a plug-in spec, ...), its scope (read by each worker, or by the node agent
``ddpjob launch``) and its resume rule (a change on resume applies, is refused, or is node-level).
Validation, ``--help`` per command, ``.env.example``, the resume check and the tests' tables all come
from that declaration, so bad input fails here, in one line naming its source, before any network wait.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dotenv import dotenv_values

from ddpjob import log, optional
from ddpjob.errors import UsageError
from ddpjob.redact import redact

ENV_PREFIX = "DDPJOB_"
OPTIMIZER_NAMES = ("adamw", "adam", "sgd")  # built in (train/optim.py); anything else is a MODULE:CALLABLE factory
SCHEDULE_NAMES = ("cosine", "linear", "constant")  # built in (train/schedule.py)
INT_MAX = 2**31 - 1  # counts and sizes above this are typos, and overflow torch's int32 places
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.manual_seed takes (a negative one is its two's complement)
MAX_SECONDS = 366 * 24 * 3600  # a timeout longer than a year is a typo (and overflows the C++ clocks)


# ---- kinds: what values a field takes ------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """The values a field takes. ``problem(value)`` is "" for a good value, else what the value must be.

    ``bad``: values it refuses, the rows of the bad-value tests; ``{file}`` and ``{dir}`` in them stand
    for an existing file and folder. ``choices``: the values of a closed set (shown in --help)."""

    name: str
    problem: Callable[[Any], str]
    bad: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    low: float | None = None  # a range's minimum (``above``: values must exceed it)
    above: bool = False
    path: bool = False  # a local path, or (``urls``) also an object store URL (s3://...) where its library imports
    urls: bool = False


def _range(name: str, low: float, high: float, above: bool = False, unit: str = "") -> Kind:
    """Numbers from ``low`` (or above it) to ``high``; nan and inf refused. Its bad values: the one
    just below the minimum, -1 where that is below it, one past the maximum, text, nan and inf."""
    whole = isinstance(low, int) and isinstance(high, int)

    def said(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    bounds = (f"above {said(low)}" if above else f"from {said(low)}") + (
        f" to {said(high)}" if math.isfinite(high) else ""
    )
    must = f"must be {'a whole number' if whole else 'a finite number'}{unit} {bounds}"

    def problem(value: float) -> str:
        ok = math.isfinite(value) and (value > low if above else value >= low) and value <= high
        return "" if ok else must

    huge = str(high + 1) if whole else "1e30" if high < 1e30 else "1e400"
    below = str(low - 1) if whole else said(low) if above else f"{low - 1e-9:g}"
    minus_one = ["-1"] if low >= 0 and below != "-1" else []
    texts = ("x", "1.5", "nan") if whole else ("x", "nan", "inf")
    return Kind(name, problem, (below, *minus_one, huge, *texts), low=low, above=above)


COUNT_FROM_1 = _range("whole number >= 1", 1, INT_MAX)
COUNT = _range("whole number >= 0", 0, INT_MAX)
NUMBER_ABOVE_0 = _range("finite number > 0", 0.0, math.inf, above=True)
NUMBER = _range("finite number >= 0", 0.0, math.inf)
SECONDS = _range("seconds > 0", 0.0, float(MAX_SECONDS), above=True, unit=" of seconds")
SECONDS_OR_OFF = _range("seconds >= 0 (0: off)", 0.0, float(MAX_SECONDS), unit=" of seconds")
WHOLE_SECONDS = _range("whole seconds >= 1", 1, MAX_SECONDS)
SEED = _range("whole number (torch.manual_seed's range)", SEED_MIN, SEED_MAX)
NODE_RANK = Kind(
    "node rank >= -1",
    lambda v: "" if -1 <= v <= INT_MAX else "must be -1 (from the scheduler) or a node rank",
    ("-2", "x"),
)
BOOL = Kind("on or off", lambda v: "", ("maybe", "2"))
TEXT = Kind("text", lambda v: "")  # free text: every value is good


def choice(*values: str) -> Kind:
    return Kind(
        "one of " + "|".join(values),
        lambda v: "" if v in values else f"is not one of {', '.join(values)}",
        ("bogus",),
        values,
    )


def is_spec(spec: str) -> bool:
    """Whether ``spec`` looks like a plug-in, MODULE:CALLABLE[(k=v)] (plugins.py loads it)."""
    return ":" in spec and not spec.startswith(":") and not spec.endswith(":")


def spec_or(*names: str) -> Kind:
    """A plug-in MODULE:CALLABLE[(k=v,...)], or one of ``names``."""
    said = f"one of {', '.join(names)} or " if names else ""
    return Kind(
        "plug-in" + (" or " + "|".join(names) if names else ""),
        lambda v: "" if v in names or is_spec(v) else f"must be {said}a package.module:callable",
        ("bogus", ":fn", "pkg.mod:"),
    )


SHARD_MODULES = Kind(
    "class names (A,B) or plug-in",
    lambda v: (
        ""
        if not v or is_spec(v) or all(name.strip().isidentifier() for name in v.split(","))
        else "must be class names like Block,Embedding or a package.module:callable"
    ),
    ("1x", "pkg.mod:"),
)


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


def split_endpoint(raw: str, default_port: int) -> tuple[str, int]:
    """HOST[:PORT] (an IPv6 address in brackets: ``[::1]:29500``) -> (host, port), as torchrun parses
    it, the host also a valid host name or address; ValueError otherwise."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(raw, default_port)
    if not (0 < port < 65536 and (_HOSTNAME.match(host) or (":" in host and raw.startswith("[")))):
        raise ValueError(raw)
    return host, port


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_port(raw: str, need_port: bool) -> str:
    try:
        split_endpoint(raw, -1 if need_port else 1)
    except ValueError:
        return f"must be HOST{':PORT' if need_port else '[:PORT]'} with a port from 1 to 65535 ([ADDR] for IPv6)"
    return ""


ENDPOINT = Kind(
    "HOST[:PORT]",
    lambda v: _host_port(v, False) if v else "",
    ("host:abc", "127.0.0.1:99999", "host:0", ":29500", "tcp://127.0.0.1:29555", "host!:29500", "::1"),
)
INIT_METHOD = Kind(
    "env:// or tcp://HOST:PORT",
    lambda v: (
        ""
        if v == "env://" or (v.startswith("tcp://") and not _host_port(v[6:], True))
        else "must be env:// or tcp://HOST:PORT"
    ),
    ("file:///x", "tcp://host", "tcp://host:abc", "tcp://host:70000"),
)


def parse_nodes(raw: str, where: str) -> tuple[int, int]:
    """'N' -> (N, N); 'MIN:MAX' -> (MIN, MAX), as torchrun's --nnodes; UsageError otherwise."""
    low, _, high = raw.strip().partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1] <= INT_MAX:
        raise UsageError(f"{where}={raw!r} must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 or 1:4")
    return nodes


def parse_betas(raw: str, where: str = "--betas") -> tuple[float, float]:
    """'0.9,0.95' -> (0.9, 0.95); UsageError unless two numbers in [0, 1)."""
    try:
        b1, b2 = (float(part) for part in raw.split(","))
    except ValueError:
        b1 = b2 = -1.0
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise UsageError(f"{where}={raw!r} must be two numbers in [0, 1) as B1,B2, e.g. 0.9,0.95")
    return b1, b2


def _parsed_by(parse: Callable[[str, str], Any], must: str) -> Callable[[str], str]:
    def problem(raw: str) -> str:
        try:
            parse(raw, "")
        except UsageError:
            return must
        return ""

    return problem


NODES = Kind(
    "N or MIN:MAX",
    lambda v: _parsed_by(parse_nodes, "must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 or 1:4")(v) if v else "",
    ("0", "x", "3:2", "-1"),
)
BETAS = Kind(
    "B1,B2 in [0, 1)",
    _parsed_by(parse_betas, "must be two numbers in [0, 1) as B1,B2, e.g. 0.9,0.95"),
    ("0.9", "1,0.9", "nan,0.9", "x"),
)


def _nearest(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (what creating it would start from)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
NO_URLS = "is a URL: only --checkpoint-dir, --resume and --init-from take object storage URLs; give a local path"


def _writable(raw: str, folder: bool) -> str:
    """ "" when ``raw`` is (or can be created as) a writable folder (``folder``) or file."""
    if URL.match(raw):
        return NO_URLS
    if not raw:
        return ""
    path = Path(raw)
    if path.exists():
        if path.is_dir() != folder:
            return f"is a {'file' if folder else 'folder'}: give a {'folder' if folder else 'file'} path"
        return "" if os.access(path, os.W_OK) else "is not writable: fix its permissions or choose another path"
    base = _nearest(path.absolute().parent)
    if not base.is_dir():
        return f"cannot be created: {base} is a file; choose another path"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"cannot be created: {base} is not writable; choose another path"
    return ""


def _existing(raw: str) -> str:
    if URL.match(raw):
        return optional.url_problem(raw)  # whether it exists is asked of the store at start (checkpoint.choice)
    return "" if raw in ("auto", "never") or Path(raw).exists() else "does not exist: check the path"


URL_ROW = "s3://bucket/ckpt"  # each local path kind's URL row
BAD_URL = "nosuchprotocol://bucket/ckpt"  # each URL-taking kind's bad URL row
FOLDER = Kind("a writable folder", lambda v: _writable(v, True), ("{file}", "{file}/sub", URL_ROW), path=True)
STORE = Kind(  # a folder, or a prefix in an object store
    "a writable folder or an object store URL (s3://BUCKET/PREFIX)",
    lambda v: optional.url_problem(v) if URL.match(v) else _writable(v, True),
    ("{file}", "{file}/sub", BAD_URL),
    path=True,
    urls=True,
)
FILE = Kind("a writable file", lambda v: _writable(v, False), ("{dir}", "{file}/sub.jsonl", URL_ROW), path=True)
RESUME = Kind(
    "auto, never or an existing checkpoint (empty: auto)",
    _existing,
    ("/nonexistent/step-9.pt", BAD_URL),
    path=True,
    urls=True,
)
WEIGHTS = Kind(  # must exist when it starts a run; a resume ignores it (checked in validate)
    "a file or folder of weights, or its URL",
    lambda v: optional.url_problem(v) if URL.match(v) else "",
    (BAD_URL,),
    path=True,
    urls=True,
)


# ---- scope and resume rules ----------------------------------------------------------------------
WORKER_STARTS = ("auto", "fork", "exec")  # --worker-start (launch/worker_fork.py)
WORKER, NODE = "worker", "node"  # read by each `ddpjob train` process; by the node agent `ddpjob launch`
# What a change does on resume: applies; refused (one line, exit 2); fresh-start only (read only by a
# fresh start: on resume the checkpoint wins, a change or removal is ignored, a given value warned of);
# node-level (not part of the run).
APPLIES, REFUSED, FRESH_ONLY, NODE_LEVEL = "applies", "refused", "fresh-start only", "node"
RULES = (APPLIES, REFUSED, FRESH_ONLY, NODE_LEVEL)
# Refused only while the checkpoint holds a tracker run (which cannot move); applies otherwise.
TRACKER_RUN_FIELDS = ("tracker_project", "tracker_run_name")


def _opt(default: Any, help: str, kind: Kind, *, resume: str, why: str = "") -> Any:
    """A worker setting. ``resume``: APPLIES (a change on resume takes effect), REFUSED (a change
    on resume is one line and exit 2, saying ``why``) or FRESH_ONLY (ignored on resume: ``why``)."""
    assert resume in (APPLIES, REFUSED, FRESH_ONLY) and (resume != APPLIES) == bool(why), "a rule says why"
    meta = {"help": help, "kind": kind, "choices": kind.choices, "scope": WORKER, "resume": resume, "why": why}
    return field(default=default, metadata=meta)


def _node(default: Any, help: str, kind: Kind) -> Any:
    """A node-level setting, read by `ddpjob launch`: not part of the run, the worker ignores it."""
    meta = {"help": help, "kind": kind, "choices": kind.choices, "scope": NODE, "resume": NODE_LEVEL, "why": ""}
    return field(default=default, metadata=meta)


SEED_WHY = (
    "the data order comes from the seed: another seed mid-epoch would repeat some samples and skip others, "
    "and at any step the run would no longer be the one its checkpoints continue"
)
INIT_WHY = "--init-from only starts a run; a resume continues from its checkpoint, which holds trained weights"
TRACKER_WHY = "a tracker run can't move project/name, and the checkpoint holds one"
OPTIMIZER_WHY = "the checkpoint's optimizer state (moments, buffers) belongs to its optimizer"


@dataclass
class Config:
    # what to train
    model: str = _opt(
        "ddpjob.plugins:digits_mlp",
        "model factory MODULE:CALLABLE[(k=v,...)] returning an nn.Module",
        spec_or(),
        resume=APPLIES,  # the checkpoint's weights must fit it (checked on load)
    )
    data: str = _opt(
        "ddpjob.plugins:digits",
        "data factory MODULE:CALLABLE[(k=v,...)] returning train[, val] datasets",
        spec_or(),
        resume=APPLIES,  # of the checkpoint's size (checked on load: train.setup.Progress)
    )
    epochs: int = _opt(10, "epochs to train", COUNT_FROM_1, resume=APPLIES)
    max_steps: int = _opt(0, "stop after this many optimizer steps (0: no limit)", COUNT, resume=APPLIES)
    batch_size: int = _opt(32, "samples per process per micro-batch", COUNT_FROM_1, resume=APPLIES)
    grad_accum: int = _opt(
        1,
        "micro-batches per optimizer step (DDP syncs only on the last); derived when --global-batch-size is set",
        COUNT_FROM_1,
        resume=APPLIES,
    )
    global_batch_size: int = _opt(
        0,
        "samples per optimizer step over all processes; set, it fixes the run at any world size (grad accumulation "
        "= it / (batch size x processes)); 0: batch size x grad accum x processes",
        COUNT,
        resume=APPLIES,
    )
    loss: str = _opt(
        "auto",
        "auto: the model's own loss (a scalar, a dict with 'loss', an object with .loss), else cross-entropy on "
        "(input, label) batches; or MODULE:CALLABLE[(k=v,...)], fn(output, batch) -> scalar or (scalar, {name: value})",
        spec_or("auto"),
        resume=APPLIES,
    )
    optimizer: str = _opt(
        "adamw",
        "adamw, adam, sgd, or MODULE:CALLABLE[(k=v,...)], a factory given the model returning an optimizer",
        spec_or(*OPTIMIZER_NAMES),
        resume=REFUSED,
        why=OPTIMIZER_WHY,
    )
    lr: float = _opt(3e-3, "peak learning rate (see --schedule)", NUMBER_ABOVE_0, resume=APPLIES)
    weight_decay: float = _opt(
        0.0,
        "weight decay, not applied to biases and norm weights (parameters of < 2 dims)",
        NUMBER,
        resume=APPLIES,  # between values above 0; 0 <-> above 0 changes the optimizer's groups: refused (train/optim.py)
    )
    momentum: float = _opt(0.0, "sgd: momentum", NUMBER, resume=APPLIES)
    nesterov: bool = _opt(False, "sgd: Nesterov momentum (needs --momentum > 0)", BOOL, resume=APPLIES)
    betas: str = _opt("0.9,0.999", "adam, adamw: B1,B2", BETAS, resume=APPLIES)
    schedule: str = _opt(
        "cosine",
        "cosine or linear (to --min-lr over the run), constant, or MODULE:CALLABLE[(k=v,...)], "
        "fn(step, total_steps) -> factor of the base LR",
        spec_or(*SCHEDULE_NAMES),
        resume=APPLIES,
    )
    warmup_steps: int = _opt(0, "steps of linear LR warm-up before a built-in schedule", COUNT, resume=APPLIES)
    min_lr: float = _opt(0.0, "the LR cosine and linear schedules end at", NUMBER, resume=APPLIES)
    grad_clip: float = _opt(
        0.0, "clip the gradients' total norm to MAX_NORM, logging grad_norm (0: off)", NUMBER, resume=APPLIES
    )
    find_unused_parameters: bool = _opt(
        False,
        "ddp: let the model leave parameters out of a step's loss (DDP then searches the graph every step)",
        BOOL,
        resume=APPLIES,
    )
    compile: bool = _opt(
        False, "torch.compile the DDP-wrapped model (DDPOptimizer splits graphs at its buckets)", BOOL, resume=APPLIES
    )
    seed: int = _opt(0, "seed for weights, data order and every RNG", SEED, resume=REFUSED, why=SEED_WHY)
    strategy: str = _opt(
        "ddp",
        "ddp: one process per device; fsdp2: one process per device, parameters, gradients and optimizer state "
        "sharded over them (needs --checkpoint-format dcp); dp: nn.DataParallel in one process; none",
        choice("ddp", "fsdp2", "dp", "none"),
        resume=APPLIES,
    )
    shard_modules: str = _opt(
        "",
        "fsdp2: the blocks to shard one by one: class names (Block,Embedding), or MODULE:CALLABLE[(k=v,...)], "
        "fn(model) -> modules; empty: the children of the model's longest ModuleList/Sequential",
        SHARD_MODULES,
        resume=APPLIES,
    )
    activation_checkpointing: bool = _opt(
        False,
        "fsdp2: recompute each block's activations in backward instead of keeping them (less memory, ~1/3 more compute)",
        BOOL,
        resume=APPLIES,
    )
    device: str = _opt("auto", "auto: cuda if available, else cpu", choice("auto", "cpu", "cuda"), resume=APPLIES)
    precision: str = _opt("fp32", "bf16 enables autocast on CUDA", choice("fp32", "bf16"), resume=APPLIES)
    num_workers: int = _opt(0, "DataLoader worker processes per rank", COUNT, resume=APPLIES)
    init_method: str = _opt("env://", "process group init: env:// or tcp://HOST:PORT", INIT_METHOD, resume=APPLIES)
    startup_timeout: float = _opt(
        600.0,
        "seconds a collective may wait from joining the process group until the first step has finished (NCCL "
        "set-up, the DDP broadcast, the first step and its compilation)",
        SECONDS,
        resume=APPLIES,
    )
    collective_timeout: float = _opt(
        300.0,
        "seconds a collective of a later step may wait (a dead, hung or cut-off peer) before the job fails",
        SECONDS,
        resume=APPLIES,
    )
    eval_timeout: float = _opt(
        1800.0, "seconds an evaluation pass (and the end-of-run checks) may take", SECONDS, resume=APPLIES
    )
    save_timeout: float = _opt(
        1800.0,
        "seconds the ranks wait for a checkpoint save or load (slow storage) before failing the job",
        SECONDS,
        resume=APPLIES,
    )
    fs_timeout: float = _opt(
        120.0, "seconds a rank waits to see the checkpoint rank 0 chose (shared storage lag)", SECONDS, resume=APPLIES
    )
    # where results go
    run_dir: str = _opt(
        "runs/ddpjob", "directory for checkpoints, metrics and logs of this job", FOLDER, resume=APPLIES
    )
    checkpoint_dir: str = _opt(
        "", "checkpoint directory or s3://BUCKET/PREFIX (default: RUN_DIR/checkpoints)", STORE, resume=APPLIES
    )
    metrics: str = _opt("", "JSON-lines metrics file, appended (default: RUN_DIR/metrics.jsonl)", FILE, resume=APPLIES)
    save_every: int = _opt(100, "save a checkpoint every N optimizer steps (0: only at the end)", COUNT, resume=APPLIES)
    keep: int = _opt(3, "keep the newest K checkpoints", COUNT_FROM_1, resume=APPLIES)
    checkpoint_format: str = _opt(
        "file",
        "file: one step-N.pt; dcp: a torch.distributed.checkpoint folder step-N/, loadable at any world size",
        choice("file", "dcp"),
        resume=APPLIES,
    )
    save_mode: str = _opt(
        "sync",
        "async: the loop waits only for a copy into host memory (kept between saves), then a thread writes it",
        choice("sync", "async"),
        resume=APPLIES,
    )
    on_save_error: str = _opt(
        "fail",
        "fail: exit 3 when a checkpoint cannot be written; warn: log and go on",
        choice("fail", "warn"),
        resume=APPLIES,
    )
    resume: str = _opt(
        "auto",
        "auto (or empty): newest valid checkpoint in CHECKPOINT_DIR; never; or a checkpoint PATH",
        RESUME,
        resume=APPLIES,
    )
    init_from: str = _opt(
        "",
        "load model weights only from PATH (ddpjob checkpoint, any state dict, .safetensors, Hugging Face sharded dir)",
        WEIGHTS,
        resume=FRESH_ONLY,
        why=INIT_WHY,
    )
    load_mode: str = _opt(
        "mmap",
        "mmap: every rank maps the file; rank0: rank 0 reads and broadcasts (no shared fs)",
        choice("mmap", "rank0"),
        resume=APPLIES,
    )
    log_every: int = _opt(10, "log a line every N steps on rank 0", COUNT_FROM_1, resume=APPLIES)
    tensorboard: str = _opt(
        "",
        "also write the metrics as TensorBoard scalars to DIR (needs the tensorboard package)",
        FOLDER,
        resume=APPLIES,
    )
    tracker: str = _opt(
        "none",
        "also send the metrics to an experiment tracker, one run across restarts (needs the trackers extra)",
        choice("none", "mlflow", "wandb"),
        resume=APPLIES,
    )
    tracker_uri: str = _opt(
        "",
        "mlflow: tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db); "
        "wandb: server URL (default: $WANDB_BASE_URL, else W&B's)",
        TEXT,
        resume=APPLIES,
    )
    tracker_project: str = _opt(
        "",
        "MLflow experiment or W&B project (default: $MLFLOW_EXPERIMENT_NAME or $WANDB_PROJECT, else ddpjob)",
        TEXT,
        resume=APPLIES,  # refused while the checkpoint holds a tracker run (TRACKER_RUN_FIELDS)
    )
    tracker_run_name: str = _opt(
        "",
        "the tracker run's name (default: RUN_DIR's name)",
        TEXT,
        resume=APPLIES,  # as tracker_project
    )
    tracker_every: float = _opt(
        1.0,
        "seconds: the tracker gets at most one record per event (the newest) this often; metrics.jsonl keeps "
        "every record; 0: all",
        SECONDS_OR_OFF,
        resume=APPLIES,
    )
    tracker_timeout: float = _opt(
        30.0,
        "seconds the job waits at its end for the tracker to send what is queued (a dead server never hangs it)",
        SECONDS,
        resume=APPLIES,
    )
    stop_check_every: int = _opt(
        10, "steps between agreeing on a stop signal across ranks", COUNT_FROM_1, resume=APPLIES
    )
    straggler_factor: float = _opt(
        1.5,
        "warn when a rank's own step work is this many times the other ranks' median, --straggler-intervals in a row",
        NUMBER_ABOVE_0,
        resume=APPLIES,
    )
    straggler_intervals: int = _opt(
        3, "logging intervals in a row a rank must be slow before it is named", COUNT_FROM_1, resume=APPLIES
    )
    heartbeat: float = _opt(
        0.0,
        "every S seconds each rank logs its step, phase and time without progress (0: off); a rank without "
        "progress past its phase's timeout exits 1 in any case",
        SECONDS_OR_OFF,
        resume=APPLIES,
    )
    trace_after: float = _opt(
        120.0,
        "seconds without progress before each rank writes what it is doing (collectives in flight, Python "
        "stacks) to RUN_DIR/traces/ for `ddpjob diagnose` (0: off)",
        SECONDS_OR_OFF,
        resume=APPLIES,
    )
    # node level (ddpjob launch)
    nnodes: str = _node(
        "",
        "nodes in the job: N, or MIN:MAX for elastic training, where any node but node 0 (the rendezvous host) may "
        "leave or join (empty: from the scheduler, else 1)",
        NODES,
    )
    node_rank: int = _node(-1, "this node's rank (-1: from the scheduler, else 0)", NODE_RANK)
    nproc_per_node: int = _node(0, "worker processes per node (0: visible GPUs, else 1)", COUNT)
    rdzv_endpoint: str = _node(
        "", "HOST[:PORT] of the rendezvous (default: from the scheduler, else localhost)", ENDPOINT
    )
    rdzv_id: str = _node("", "rendezvous id shared by all nodes (default: the scheduler's job id)", TEXT)
    rdzv_timeout: int = _node(300, "seconds to wait for all nodes at rendezvous", WHOLE_SECONDS)
    elastic_wait: int = _node(
        10, "elastic (--nnodes MIN:MAX): seconds to wait for more nodes once MIN have joined", WHOLE_SECONDS
    )
    rdzv_retries: int = _node(
        3,
        "times in a row a rendezvous that never formed exits 69 (retried without counting); later ones, with "
        "nothing trained between, exit 1 (counted): a wrong endpoint or a blocked port never heals",
        COUNT,
    )
    max_restarts: int = _node(
        0,
        "restarts of the worker group after a failure, a lost node included (0: from PET_MAX_RESTARTS, else none)",
        COUNT,
    )
    shutdown_timeout: int = _node(
        120, "seconds torchrun waits after a stop signal for workers to checkpoint and exit", WHOLE_SECONDS
    )
    worker_start: str = _node(
        "auto",
        "how launch starts its workers: fork (from launch, which has torch loaded: about half the CPU of a "
        "start), exec (a new python each), auto (fork where no worker may use CUDA)",
        choice(*WORKER_STARTS),
    )

    def __post_init__(self) -> None:
        self.resume = self.resume or "auto"  # DDPJOB_RESUME= (empty) is the default, as for every setting

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
        """The settings as shown and stored (config line, checkpoint, tracker params): secrets redacted."""
        return {k: redact(v) if isinstance(v, str) else v for k, v in asdict(self).items()}


FIELDS = {f.name: f for f in fields(Config)}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def in_scope(name: str, scope: str) -> bool:
    return FIELDS[name].metadata["scope"] == scope


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one UsageError line instead of usage + exit."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message} (see --help)")


def add_config_flags(parser: argparse.ArgumentParser, shown: str = "") -> None:
    """Every setting as a flag; ``shown`` (WORKER or NODE): only that scope's appear in --help (the
    others are still accepted: `ddpjob launch` passes its flags on to the workers)."""
    parser.add_argument("--env-file", help="read DDPJOB_* settings from this file (default: ./.env if present)")
    for name, f in FIELDS.items():
        on_off: dict[str, Any] = (
            {"nargs": "?", "const": "true"} if isinstance(f.default, bool) else {}
        )  # --compile alone: on
        help = f.metadata["help"] if not shown or in_scope(name, shown) else argparse.SUPPRESS
        parser.add_argument(flag(name), dest=name, default=None, metavar=name.upper(), help=help, **on_off)


def make_parser(prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    return _Parser(prog=prog, description=description, epilog=epilog, allow_abbrev=False)


def _example(name: str) -> str:
    default = FIELDS[name].default
    return f"; e.g. {flag(name)} {default}" if default not in ("", None) and not isinstance(default, bool) else ""


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
        raise UsageError(f"{where}={raw!r} is not {noun}{_example(name)}") from None


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
    validate(cfg, {name: where for name, (_, where) in layered.items()})
    return cfg


def check_field(cfg: Config, name: str, where: str = "") -> None:
    """UsageError, naming ``where`` (the flag or variable it came from), unless the value is of its kind."""
    value = getattr(cfg, name)
    problem = FIELDS[name].metadata["kind"].problem(value)
    if problem:
        raise UsageError(f"{where or flag(name)}={str(value)!r} {problem}{'' if 'e.g.' in problem else _example(name)}")


def validate(cfg: Config, sources: Mapping[str, str] | None = None) -> None:
    """Each field against its kind, then the rules between fields. ``sources``: where each value came from."""
    sources = sources or {}
    for name in FIELDS:
        check_field(cfg, name, sources.get(name, ""))
    if cfg.nesterov and (cfg.optimizer != "sgd" or cfg.momentum <= 0):
        raise UsageError("--nesterov needs --optimizer sgd and --momentum above 0")
    if cfg.global_batch_size and cfg.global_batch_size % cfg.batch_size:
        raise UsageError(
            f"--global-batch-size {cfg.global_batch_size} is not a multiple of --batch-size {cfg.batch_size}; "
            "choose a global batch that splits into whole micro-batches"
        )
    max_nodes = cfg.node_range[1] if cfg.node_range else 0
    if max_nodes and cfg.node_rank >= max_nodes:
        raise UsageError(f"--node-rank {cfg.node_rank} is outside 0..{max_nodes - 1}")
    if cfg.init_from and not URL.match(cfg.init_from) and not Path(cfg.init_from).exists() and not may_resume(cfg):
        raise UsageError(f"--init-from {cfg.init_from} does not exist; check the path")
    if cfg.strategy == "fsdp2" and cfg.checkpoint_format != "dcp":
        raise UsageError(
            "--strategy fsdp2 saves each rank's shard of the state, which only the dcp format holds; "
            "add --checkpoint-format dcp"
        )
    for name in ("shard_modules", "activation_checkpointing"):
        if getattr(cfg, name) and cfg.strategy != "fsdp2":
            raise UsageError(f"{flag(name)} applies to --strategy fsdp2 only (this run is --strategy {cfg.strategy})")
    if cfg.checkpoint_format == "dcp" and cfg.load_mode == "rank0":
        raise UsageError("--checkpoint-format dcp is read by every rank; use --load-mode mmap")
    if cfg.tensorboard:
        optional.require("tensorboard", f"--tensorboard {cfg.tensorboard}")
    if cfg.tracker != "none":  # its package, named as the tracker; imported only by rank 0's tracker
        optional.check(cfg.tracker, f"--tracker {cfg.tracker}")


def may_resume(cfg: Config) -> bool:
    """Whether this start may resume a checkpoint (then --init-from is not read, and need not exist)."""
    if cfg.resume == "never":
        return False
    if URL.match(cfg.checkpoint_dir):  # an object store is asked once, at start (checkpoint.choice)
        return True
    return cfg.resume != "auto" or any(cfg.checkpoint_path.glob("step-*"))


def check_resume(cfg: Config, saved: Mapping[str, Any] | None, source: str, tracker_run: str = "") -> None:
    """On resume: UsageError when a REFUSED field differs from the checkpoint's config (a field the
    checkpoint does not record, written by an older ddpjob, is not compared); ``tracker_run``: the
    checkpoint's tracker run id, which makes TRACKER_RUN_FIELDS refused."""
    for name, f in FIELDS.items():
        refused = f.metadata["resume"] == REFUSED or (bool(tracker_run) and name in TRACKER_RUN_FIELDS)
        if not refused or not saved or name not in saved or saved[name] == getattr(cfg, name):
            continue
        old, why = saved[name], f.metadata["why"] or TRACKER_WHY
        given = f"{flag(name)} {shlex.quote(str(old))}" if old != "" else f"no {flag(name)}"
        raise UsageError(
            f"{flag(name)} {getattr(cfg, name)!r} differs from {old!r} of the checkpoint {source}: {why}; "
            f"resume with {given}, or start a new run (a new --run-dir, or --resume never)"
        )


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
    shown = cfg.to_dict()
    for name, f in FIELDS.items():
        if name in _SECTIONS:
            lines += ["", f"# --- {_SECTIONS[name]}"]
        choices = f" ({'|'.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
        lines += [f"# {f.metadata['help']}{choices}", f"DDPJOB_{name.upper()}={shown[name]}"]
    return "\n".join(lines) + "\n"


def resume_table() -> str:
    """The resume rules as a markdown table (docs/configuration.md shows it; a test keeps it in step)."""
    rules = {
        APPLIES: "applies",
        REFUSED: "refused",
        FRESH_ONLY: "fresh-start only (ignored)",
        NODE_LEVEL: "node-level (not part of the run)",
    }
    lines = ["| setting | kind | scope | a change on resume |", "|---|---|---|---|"]
    for name, f in FIELDS.items():
        m = f.metadata
        rule = rules[m["resume"]] + (", refused with a tracker run" if name in TRACKER_RUN_FIELDS else "")
        lines.append(f"| `{flag(name)}` | {m['kind'].name} | {m['scope']} | {rule} |")
    return "\n".join(lines) + "\n"


def print_config(cfg: Config) -> None:
    items = " ".join(f"{k}={v}" for k, v in cfg.to_dict().items())
    log.info(f"config: {items}")
