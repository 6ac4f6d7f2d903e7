"""``ddpjob launch``: the node agent that every launcher (compose, Slurm, Kubernetes) calls.

It detects where it runs, derives torchrun's arguments (nodes, node rank, rendezvous endpoint and
id, processes per node), and runs ``torch.distributed.run`` in-process with ``-m ddpjob train``
and the same flags. Launch files never compute ranks or master addresses themselves.

Detection, first match wins; explicit flags / DDPJOB_* settings override any detected value:
- Kubeflow PyTorchJob / Trainer: ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_RDZV_ENDPOINT``, else
  ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (Trainer v2 sets only these, port 29400), else
  ``MASTER_ADDR``/``MASTER_PORT`` (training-operator v1 sets both pairs).
- Slurm, one task per node under srun: ``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_NODEID``,
  first host of ``SLURM_JOB_NODELIST`` (its NodeAddr, via scontrol) as the endpoint.
- Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX``; endpoint ``$JOB_NAME-0.$JOB_SERVICE``; nodes from
  ``DDPJOB_NNODES`` (the manifest sets all three).
- Plain (compose, hand launch): ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeGuard

from torch.utils.data import IterableDataset

from ddpjob import config, log
from ddpjob.checkpoint import stop_record, storage
from ddpjob.checkpoint.storage import Where
from ddpjob.config import parse_nodes
from ddpjob.distenv import DEFAULT_MASTER_PORT, first_host
from ddpjob.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NO_RENDEZVOUS,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    UsageError,
    first_line,
)
from ddpjob.launch import worker_fork
from ddpjob.launch.plan import Plan
from ddpjob.launch.rendezvous_watch import RendezvousWatch
from ddpjob.launch.restarts import no_rendezvous_exit, reported_failure, restart_policy
from ddpjob.plugins import build_data, load_callable, load_function
from ddpjob.redact import redact
from ddpjob.tools import doctor
from ddpjob.train.metrics import append_attempt
from ddpjob.train.sampling import Batching
from ddpjob.train.stop_signal import STOP_SIGNALS

ENDPOINT_FROM = {  # where detect() takes each scheduler's rendezvous endpoint from
    "kubeflow": "PET_RDZV_ENDPOINT, else MASTER_ADDR:MASTER_PORT",
    "slurm": "the head node of SLURM_JOB_NODELIST, MASTER_PORT",
    "kubernetes": "JOB_NAME, JOB_SERVICE",
    "plain": "none",
}
# What torchrun forwards to the workers: the signals they stop on (torchrun's default misses USR1).
HANDLED_SIGNALS = ",".join(sig.name for sig in STOP_SIGNALS)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not an integer; check the scheduler environment") from None


SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 12768  # 20000..32767: below Linux's ephemeral ports (32768+)


def _scontrol(*args: str) -> str:
    """scontrol's output, or "" where there is no scontrol or it fails (then callers parse themselves)."""
    if not shutil.which("scontrol"):
        return ""
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def slurm_first_host(nodelist: str) -> str:
    """First host of a Slurm host list: `scontrol show hostnames` where there is one, else our parser."""
    hosts = _scontrol("show", "hostnames", nodelist).split()
    return hosts[0] if hosts else first_host(nodelist)


def slurm_node_addr(name: str) -> str:
    """The address Slurm knows for node `name` (NodeAddr), else the name itself."""
    for word in _scontrol("show", "node", name, "-o").split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    return name


def slurm_rdzv_port(env: Mapping[str, str], job: int) -> int:
    """MASTER_PORT when set, else one derived from the job id (jobs SLURM_PORT_SPAN apart share it)."""
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise UsageError(f"MASTER_PORT={port} is not a TCP port; use 1..65535")
        return port
    return SLURM_PORT_BASE + job % SLURM_PORT_SPAN


def port_in_use(port: int) -> bool:
    """True when something on this host listens on (or holds) TCP `port` on any address.

    SO_REUSEADDR, as torch's store sets it, so that a previous attempt's TIME_WAIT does not count."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((addr, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def check_slurm_port(plan: Plan, env: Mapping[str, str]) -> None:
    """On the head node, before torchrun binds it: a port that is taken is one clear line, not a hang."""
    port = int(plan.endpoint.rpartition(":")[2])
    if port_in_use(port):
        job = env.get("SLURM_JOB_ID", "?")
        origin = (
            "set by MASTER_PORT"
            if env.get("MASTER_PORT")
            else f"{SLURM_PORT_BASE} + job id mod {SLURM_PORT_SPAN}, shared by jobs {SLURM_PORT_SPAN} ids apart"
        )
        raise UsageError(
            f"rendezvous port {port} of Slurm job {job} ({origin}) is already in use on head node "
            f"{socket.gethostname()}, by another job or service; export MASTER_PORT=<a free port> "
            "(or pass --rdzv-endpoint HOST:PORT) and submit again"
        )


def with_port(endpoint: str, port: int) -> str:
    """HOST[:PORT] with ``port`` where it has none (``[::1]`` -> ``[::1]:29500``); as given if malformed
    (resolve_plan then says so)."""
    try:
        return config.join_endpoint(*config.split_endpoint(endpoint, port))
    except ValueError:
        return endpoint


def detect(env: Mapping[str, str], cuda_devices: int) -> Plan:
    if "PET_NNODES" in env:
        nproc = env.get("PET_NPROC_PER_NODE", "auto")
        # Worker-only elastic jobs set neither: the rank is assigned at rendezvous, and torchrun
        # tells the store's host by matching the endpoint against this pod's names.
        node_rank = next((_int(env, k) for k in ("PET_NODE_RANK", "RANK") if k in env), None)
        # Trainer v2 sets only PET_MASTER_*; the v1 training-operator sets both pairs.
        addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR", "")
        port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or DEFAULT_MASTER_PORT
        endpoint = env.get("PET_RDZV_ENDPOINT") or f"{addr}:{port}"
        low, high = parse_nodes(env["PET_NNODES"], "PET_NNODES")
        return Plan(
            "kubeflow",
            "PET_NNODES is set (Kubeflow PyTorchJob/Trainer)",
            high,
            node_rank,
            endpoint,
            env.get("PET_RDZV_ID", "ddpjob"),
            int(nproc) if nproc.isdigit() else cuda_devices or 1,
            low,
            _int(env, "PET_MAX_RESTARTS") if env.get("PET_MAX_RESTARTS") else 0,
        )
    if "SLURM_JOB_ID" in env and "SLURM_NNODES" in env and "SLURM_NODEID" in env:
        job = _int(env, "SLURM_JOB_ID")
        head = slurm_first_host(env.get("SLURM_JOB_NODELIST", "") or env.get("SLURMD_NODENAME", "localhost"))
        return Plan(
            "slurm",
            f"SLURM_JOB_ID={job} under srun; head node {head}",
            _int(env, "SLURM_NNODES"),
            _int(env, "SLURM_NODEID"),
            f"{slurm_node_addr(head)}:{slurm_rdzv_port(env, job)}",
            f"slurm-{job}",
            cuda_devices or 1,
        )
    if "JOB_COMPLETION_INDEX" in env:
        for name in ("JOB_NAME", "JOB_SERVICE"):
            if not env.get(name):
                raise UsageError(f"{name} is not set in the Indexed Job's pod env; the manifest must set it")
        head = f"{env['JOB_NAME']}-0.{env['JOB_SERVICE']}"
        return Plan(
            "kubernetes",
            f"JOB_COMPLETION_INDEX is set (Indexed Job); head pod {head}",
            parse_nodes(env["DDPJOB_NNODES"], "DDPJOB_NNODES")[1] if env.get("DDPJOB_NNODES") else 1,
            _int(env, "JOB_COMPLETION_INDEX"),
            f"{head}:{DEFAULT_MASTER_PORT}",
            env["JOB_NAME"],
            cuda_devices or 1,
        )
    return Plan(
        "plain", "no scheduler env found; using flags / DDPJOB_* settings", 1, None, "", "ddpjob", cuda_devices or 1
    )


def resolve_plan(cfg: config.Config, env: Mapping[str, str], cuda_devices: int, probe_data: bool = True) -> Plan:
    """This node's plan from the scheduler's variables and the flags, checked. probe_data: an elastic
    plan calls the data factory to check its data (not on --dry-run, which runs no user code)."""
    plan = detect(env, cuda_devices)
    if cfg.node_range:
        plan.min_nodes, plan.nnodes = cfg.node_range
    plan.max_restarts = cfg.max_restarts or plan.max_restarts
    if cfg.node_rank >= 0:
        plan.node_rank = cfg.node_rank
    if cfg.rdzv_endpoint:
        plan.endpoint = with_port(cfg.rdzv_endpoint, DEFAULT_MASTER_PORT)
    if cfg.rdzv_id:
        plan.rdzv_id = cfg.rdzv_id
    if cfg.nproc_per_node:
        plan.nproc_per_node = cfg.nproc_per_node
    if plan.node_rank is None and plan.nnodes == 1:
        plan.node_rank = 0
    if plan.node_rank is not None and not 0 <= plan.node_rank < plan.nnodes:
        raise UsageError(f"node rank {plan.node_rank} is outside the {plan.nnodes} nodes; check --node-rank / --nnodes")
    if plan.scheduler == "slurm" and plan.node_rank == 0 and plan.endpoint and not cfg.rdzv_endpoint:
        check_slurm_port(plan, env)  # node 0 hosts the store: a port taken by another job fails here, clearly
    if plan.elastic:
        check_elastic(cfg, plan, probe_data)
    if plan.endpoint and (problem := config.ENDPOINT.problem(plan.endpoint)):
        origin = (
            "--rdzv-endpoint"
            if cfg.rdzv_endpoint
            else f"{plan.scheduler}'s variables ({ENDPOINT_FROM[plan.scheduler]})"
        )
        raise UsageError(
            f"rendezvous endpoint {plan.endpoint!r} from {origin} {problem}; fix it, or pass --rdzv-endpoint"
        )
    if plan.nnodes > 1 and not plan.endpoint.split(":")[0]:
        raise UsageError(
            f"{plan.nnodes} nodes need a rendezvous endpoint; set --rdzv-endpoint HOST[:PORT] (node 0's address)"
        )
    return plan


def check_elastic(cfg: config.Config, plan: Plan, probe_data: bool = True) -> None:
    """An elastic job must survive a lost node and keep one global batch at every size of its range;
    its data must be map-style (with probe_data, the data factory is called here, once)."""
    if probe_data:
        check_resizable_data(cfg, plan)
    if not plan.max_restarts:
        raise UsageError(
            f"--nnodes {plan.nodes} with --max-restarts 0: the first lost node would end the job instead of the "
            "others going on without it; set --max-restarts N (each lost node costs one restart)"
        )
    if not cfg.global_batch_size:
        log.failure(
            f"launch: warning: --nnodes {plan.nodes} without --global-batch-size: the global batch, and with "
            "it the run, changes with the number of nodes; set --global-batch-size to keep it"
        )
        return
    for nodes in range(plan.min_nodes, plan.nnodes + 1):
        Batching.of(cfg, nodes * plan.nproc_per_node)  # UsageError naming the size it cannot split over


def check_resizable_data(cfg: config.Config, plan: Plan) -> None:
    """UsageError for a stream (IterableDataset) as the training data of an elastic job: its per-rank
    positions do not carry over to another world size (train/feeds.py), so the first membership change
    would end the job. The factory runs as rank 0 of 1 would (RANK, WORLD_SIZE, LOCAL_RANK set for
    the call); one that fails here is a warning that the data could not be checked, and is left to
    the workers, which report it."""
    probe = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {name: os.environ.get(name) for name in probe}
    os.environ.update(probe)
    try:
        train, _ = build_data(cfg.data)
    except Exception as exc:
        log.warning(
            f"launch: could not check whether --data {cfg.data} is a stream, which an elastic job "
            f"cannot resize ({first_line(exc)}); the workers will build it"
        )
        return
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if isinstance(train, IterableDataset):
        raise UsageError(
            f"--nnodes {plan.nodes} with an IterableDataset ({type(train).__name__}, --data {cfg.data}): a stream's "
            "positions do not carry over when nodes join or leave; use a fixed --nnodes N, or map-style data"
        )


def node_name(plan: Plan) -> str:
    return f"{plan.node_rank if plan.node_rank is not None else '?'} ({socket.gethostname()})"


def torchrun_args(
    cfg: config.Config, plan: Plan, train_argv: Sequence[str], worker: Sequence[str] = ("-m", "ddpjob", "train")
) -> list[str]:
    log_dir = os.path.join(cfg.run_dir, "logs", socket.gethostname())
    args = [
        f"--nproc-per-node={plan.nproc_per_node}",
        f"--max-restarts={plan.max_restarts}",
        f"--log-dir={log_dir}",
        f"--signals-to-handle={HANDLED_SIGNALS}",
        f"--shutdown-timeout={cfg.shutdown_timeout}",
    ]
    if plan.nnodes == 1 and not plan.endpoint:
        args += ["--standalone"]
    else:
        # Node 0 hosts the rendezvous store. With no node rank known (replicated compose service),
        # torchrun matches the endpoint against this host's names and addresses instead.
        host = "" if plan.node_rank is None else f"is_host={int(plan.node_rank == 0)},"
        args += [
            f"--nnodes={plan.nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={plan.endpoint}",
            f"--rdzv-id={plan.rdzv_id}",
            f"--rdzv-conf={host}join_timeout={cfg.rdzv_timeout},read_timeout={cfg.rdzv_timeout}"
            + (f",last_call_timeout={cfg.elastic_wait}" if plan.elastic else ""),
        ]
    return [*args, *worker, *train_argv]


def main(argv: Sequence[str], worker: worker_fork.Worker) -> int:
    """``worker``: what a forked worker runs (cli.ForkedTrain), where launch forks them (worker_fork.py)."""
    parser = config.make_parser(
        "ddpjob launch",
        "Start this node's training workers with torchrun.",
        "Every `ddpjob train` flag is accepted too and passed on to the workers (see ddpjob train --help).",
    )
    config.add_config_flags(parser, shown=config.NODE)
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and why, then exit")
    args = parser.parse_args(argv)
    cfg = config.load(args)

    import torch

    cuda_devices = torch.cuda.device_count()
    forked = worker_fork.forks(cfg.worker_start, cfg.device, cuda_devices > 0)
    # where workers are forks of launch, the user's code runs in forks of its own (worker_fork.py)
    users_code = worker_fork.checked_apart if forked and not args.dry_run else worker_fork.run_here
    plan = users_code(checked_plan, cfg, cuda_devices, not args.dry_run)
    train_argv = [a for a in argv if a != "--dry-run"]
    cmd = torchrun_args(cfg, plan, train_argv)
    log.info(
        f"launch: scheduler={plan.scheduler} ({plan.why}); node {plan.node_rank}/{plan.nodes}, "
        f"{plan.nproc_per_node} proc/node ({'forked' if forked else 'exec'}), rendezvous {plan.endpoint or 'standalone'}"
    )
    log.info("launch: torchrun " + redact(shlex.join(cmd)))
    if args.dry_run:
        return 0
    if not users_code(preflight, cfg, plan):
        raise UsageError("preflight check failed (see the fix above); `ddpjob doctor` shows every check")
    record_attempt(cfg, plan, event="start")
    with worker_fork.forking(worker) if forked else contextlib.nullcontext():
        code, reason = run_torchrun(cmd, plan, cfg)
    outcome: dict[str, object] = {}
    if code == EXIT_NO_RENDEZVOUS:
        code, more = no_rendezvous_exit(cfg.run_dir, plan.node_rank, socket.gethostname(), cfg.rdzv_retries)
        reason, outcome = reason + more, {"no_rendezvous": True}
    record_attempt(cfg, plan, event="end", exit_code=code, reason=reason, **outcome)
    if code:
        log.failure(f"launch: node {node_name(plan)}: {reason}")
    return code


def checked_plan(cfg: config.Config, cuda_devices: int, probe_data: bool) -> Plan:
    """The user's plug-ins imported (a bad one fails here, not after rendezvous) and this node's plan."""
    for spec in (cfg.model, cfg.data):
        load_callable(spec)
    for spec in (cfg.optimizer, cfg.schedule, cfg.loss):
        if config.is_spec(spec):
            load_function(spec)  # imports it and checks its keywords (it is called by the workers)
    return resolve_plan(cfg, os.environ, cuda_devices, probe_data=probe_data)


def preflight(cfg: config.Config, plan: Plan) -> bool:
    """doctor's brief checks of this node: False (their fixes printed) when one fails."""
    return doctor.report(doctor.run(cfg, plan, brief=True), brief=True)


class AgentSignals:
    """Launch's side of a stop signal, while torchrun's agent runs in this process.

    The agent's handler raises ``SignalException`` for every handled signal, also while the agent
    waits for its workers to stop after the first one. Slurm signals every process of a step
    (``scancel``, preemption), train.sbatch forwards TERM again and a preemption follows USR1, so a
    later signal would end launch (and, through the workers' watch on their parent, the workers)
    before they had checkpointed. Here only the first signal raises, as torchrun expects: the agent
    forwards it and waits up to --shutdown-timeout, then SIGKILLs. Later ones are counted, and
    ignored once torchrun has returned (a late TERM must not turn launch's 75 into a death by signal). The
    exit code then comes from the disk: 75 when the checkpoint of the step where the workers
    stopped is verified (stop_record.py), whatever the workers' exit codes; 0 when they all finished.
    """

    def __init__(
        self, shutdown_timeout: float, run_dir: str | Path | None, checkpoint_dir: Where, fs_timeout: float = 0.0
    ) -> None:
        self.shutdown_timeout, self.fs_timeout = shutdown_timeout, fs_timeout
        self.run_dir, self.checkpoint_dir = run_dir, checkpoint_dir  # run_dir None: workers that do not train
        self.stale: stop_record.Mark = None  # the record there as the agent last started workers (mark)
        self.agreed: stop_record.Stop | None = None  # the one there as the agent first stopped them, unasked
        self.stopping = False  # the agent has stopped the workers it last started
        self.first: signal.Signals | None = None
        self.count = 0
        self.done = False  # torchrun has returned
        self.holding = False  # the agent starts or stops its workers: a first signal is held (held)
        self.pcontext: Any = None  # the agent's latest worker processes (a torch PContext)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.first is None and not self.done:
            self.first = signal.Signals(signum)
            if not self.holding:
                raise_stop(self.first)

    def held(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """One of the agent's starts or stops of its workers, with a first stop signal held until it
        has returned, then raised.

        - Start: the agent records its workers only as the start returns (``self._pcontext =
          start_processes(...)``). A signal raised inside it, while the last worker's ``Popen`` waits
          for its exec, would leave the workers already started unknown to the agent's shutdown:
          orphaned, ending by themselves after launch's last line. Held, it is raised once they are
          recorded, and they are stopped as on any stop (the signal, then SIGKILL after
          --shutdown-timeout).
        - Stop (``_shutdown``, also on the way out after the rendezvous store went away): a signal
          raised inside it would cut short the closing of the workers, which would outlive launch.
          Held, it is raised once they are closed.

        A start or stop that fails still raises the held signal, with the failure as its cause."""
        before = self.first
        self.holding = True
        try:
            result = method(*args, **kwargs)
        except BaseException as exc:
            self.holding = False  # before the check: a signal from here on raises by itself
            if before is None and self.first is not None:
                raise_stop(self.first, exc)
            raise
        self.holding = False
        if before is None and self.first is not None:
            raise_stop(self.first)
        return result

    def recorded(self, saved: bool) -> stop_record.Outcome | None:
        """Where the workers last started stopped, and whether its checkpoint is verified (stop_record.py);
        None for workers that do not train. saved: the stop's checkpoint was reported saved (this
        node's workers all exited 75); then wait up to --fs-timeout for this node's view of shared
        storage to show what rank 0, maybe on another node, sealed."""
        if self.run_dir is None:
            return None
        return stop_record.outcome(self.run_dir, self.checkpoint_dir, self.fs_timeout if saved else 0.0, self.stale)

    def stopped_before_the_agent(self) -> stop_record.Outcome | None:
        """The stop on a signal that the workers had recorded before the agent stopped them of its own
        accord (on its way out, after the rendezvous store went away), and whether its checkpoint is
        verified, looking for up to --fs-timeout (their exit codes say nothing: the agent killed them).
        None when they had not: then they stopped, if at all, because the agent stopped them."""
        if self.agreed is None or not self.agreed.signal:
            return None
        return stop_record.checked(self.agreed, self.checkpoint_dir, self.fs_timeout)

    @contextlib.contextmanager
    def installed(self, names: str) -> Iterator[None]:
        """Our handler for `names` now (a signal during rendezvous is a stop too) and wherever the
        agent installs its own; the agent's worker processes recorded as it starts them; and its
        rendezvous handlers, whose keep-alive threads are stopped on the way out (stop_heartbeats)."""
        import torch
        from torch.distributed.elastic.agent.server import local_elastic_agent
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.rendezvous import registry

        original_handler = getattr(api, "_terminate_process_handler", None)
        original_start = getattr(local_elastic_agent, "start_processes", None)
        agent_class = local_elastic_agent.LocalElasticAgent
        held: dict[str, Any] = {name: agent_class.__dict__.get(name) for name in ("_start_workers", "_shutdown")}
        if not (callable(original_handler) and callable(original_start) and all(map(callable, held.values()))):
            raise UsageError(
                f"torch {torch.__version__}'s elastic agent has no _terminate_process_handler, start_processes, "
                "_start_workers or _shutdown; "
                "ddpjob launch cannot tell checkpointed workers from failed ones: use a torch that ddpjob is tested with"
            )

        original_handler_of = registry.get_rendezvous_handler
        handlers: list[Any] = []

        def start_processes(*args: Any, **kwargs: Any) -> Any:
            self.pcontext = original_start(*args, **kwargs)
            return self.pcontext

        def start_workers(*args: Any, **kwargs: Any) -> Any:
            if self.run_dir is not None:  # a record from before (an earlier attempt, or round) is not theirs
                self.stale = stop_record.mark(self.run_dir)
            self.agreed, self.stopping = None, False
            return self.held(held["_start_workers"], *args, **kwargs)

        def shutdown(*args: Any, **kwargs: Any) -> Any:
            return self.held(read_then_shut_down, *args, **kwargs)

        def read_then_shut_down(*args: Any, **kwargs: Any) -> Any:  # held: a signal cannot come between
            # What the workers had agreed as the agent first stops them, unasked (not on a stop signal
            # to this node): read once per start; after a restart's stop, the exit's shutdown does not
            # read again what they recorded because of it.
            if not self.stopping and self.first is None and self.run_dir is not None:
                self.agreed = stop_record.read(self.run_dir, self.stale)
            self.stopping = True
            return held["_shutdown"](*args, **kwargs)

        def get_rendezvous_handler(*args: Any, **kwargs: Any) -> Any:
            handlers.append(original_handler_of(*args, **kwargs))
            return handlers[-1]

        for name in names.split(","):
            signal.signal(getattr(signal, name), self.handle)
        api._terminate_process_handler, local_elastic_agent.start_processes = self.handle, start_processes
        agent_class._start_workers, agent_class._shutdown = start_workers, shutdown  # type: ignore[method-assign]
        registry.get_rendezvous_handler = get_rendezvous_handler
        try:
            yield
        finally:
            # First: CPython puts back the default action of every signal it handled as it exits, so a
            # late TERM (Slurm, train.sbatch's forward) would kill launch on its way to exit 75.
            self.done = True
            for name in names.split(","):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
            api._terminate_process_handler, local_elastic_agent.start_processes = original_handler, original_start
            for name, method in held.items():
                setattr(agent_class, name, method)
            registry.get_rendezvous_handler = original_handler_of
            for handler in handlers:  # see stop_heartbeats
                stop_heartbeats(handler)

    def exit_codes(self) -> dict[int, int | None] | None:
        """Local rank -> the worker's exit code (None: still running or unknown); None: no workers."""
        handlers = getattr(self.pcontext, "subprocess_handlers", None)
        if not handlers:
            return None
        return {rank: handler.proc.poll() for rank, handler in sorted(handlers.items())}

    def outcome(self, sig: signal.Signals) -> tuple[int, str]:
        """Launch's exit code and last line after a stop signal: 75 only when the checkpoint of the
        step where training stopped is verified on disk; otherwise what was lost."""
        got = sig.name + (
            f" (and {self.count - 1} more stop signals while the workers stopped)" if self.count > 1 else ""
        )
        codes = self.exit_codes()
        before = f"nothing had trained in this attempt, so nothing is lost, and there is no new checkpoint (exit {128 + sig})"
        if codes is None:
            return 128 + sig, f"got {got} before any worker started: {before}"
        shown = {rank: "running" if c is None else str(c if c >= 0 else 128 - c) for rank, c in codes.items()}
        by_rank = f"exit codes by local rank: {', '.join(shown.values())}"
        if all(code == 0 for code in codes.values()):
            return 0, f"got {got} as the workers finished (exit 0)"
        found = self.recorded(all(code == EXIT_PREEMPTED for code in codes.values()))
        if found is not None and found.saved:
            return EXIT_PREEMPTED, f"got {got}; {stopped_at(found)} (exit {EXIT_PREEMPTED}); {by_rank}"
        if found is None and all(code == -sig for code in codes.values()):  # killed by the signal itself:
            return 128 + sig, f"got {got} while the workers were setting up: {before}"  # before their handler
        failed = {rank: code for rank, code in codes.items() if code not in (EXIT_PREEMPTED, 0)}
        rank, raw = next(iter(failed.items())) if failed else (0, EXIT_PREEMPTED)
        code = EXIT_FAILED if raw is None else EXIT_STORAGE if raw == EXIT_PREEMPTED else raw if raw >= 0 else 128 - raw
        lost = not_saved(found, self.checkpoint_dir)
        why = (
            f"SIGKILL: it did not stop within --shutdown-timeout ({self.shutdown_timeout:g} s), or the OOM killer; {lost}"
            if raw == -signal.SIGKILL
            else worker_error(getattr(self.pcontext, "error_files", {}).get(rank, "")) or f"its log says why; {lost}"
        )
        return code, f"got {got}; worker local rank {rank} exited with {shown[rank]}: {why}; {by_rank}"


def raise_stop(sig: signal.Signals, cause: BaseException | None = None) -> None:
    """The exception torchrun's agent takes for a stop signal: it forwards the signal to its workers."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig) from cause


HEARTBEAT_STOP_WAIT_S = 5.0  # a heartbeat to a live store takes milliseconds


def stop_heartbeats(handler: Any, wait_s: float = HEARTBEAT_STOP_WAIT_S) -> None:
    """Stop a rendezvous handler's keep-alive thread, from a thread other than that one. After a
    stop signal torchrun drops its handler without shutting it down (other nodes may re-form), and
    the thread stops when the handler is freed: if the keep-alive thread itself held the last
    reference (inside a heartbeat), it would try to join itself and print a half traceback ("cannot
    join current thread") after launch's last line. Stopping it first disarms that. The stop waits
    for a heartbeat under way, which can hang on a store whose host vanished: launch waits for it at
    most wait_s, then goes on to its exit code. torch's own method where it has one (2.x)."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        stopper = threading.Thread(target=stop, name="ddpjob-heartbeat-stop", daemon=True)
        stopper.start()
        stopper.join(wait_s)


def stopped_saved(found: stop_record.Outcome | None) -> TypeGuard[stop_record.Outcome]:
    """A stop on a signal whose checkpoint is verified: exit 75, whatever the exit codes."""
    return found is not None and bool(found.stop.signal) and found.saved


def stopped_at(found: stop_record.Outcome) -> str:
    """Why a stop is 75: its step and its verified checkpoint."""
    how = f"stopped on {signal.Signals(found.stop.signal).name}" if found.stop.signal else "finished"
    return f"training {how} at step {found.stop.step}, and its checkpoint {found.checkpoint} is verified"


def not_saved(found: stop_record.Outcome | None, checkpoint_dir: Where) -> str:
    """What a stop without a verified checkpoint of its step lost, in words."""
    if found is None:
        return "no checkpoint of the stop: the steps since the newest checkpoint are lost"
    step = found.stop.step
    return f"no verified checkpoint of step {step}, where training stopped ({found.why}): {stop_record.lost(step, checkpoint_dir)}"


def worker_error(error_file: str) -> str:
    """The error line a worker left for the agent (errors.tell_agent), or ""."""
    try:
        with open(error_file) as f:
            message = json.load(f).get("message", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return message if isinstance(message, str) else ""


def run_torchrun(cmd: list[str], plan: Plan, cfg: config.Config, training: bool = True) -> tuple[int, str]:
    """Run torchrun in this process; (exit code, reason in one line). ``training``: the workers are
    ``ddpjob train``, whose stop record (stop_record.py) decides a stop's exit code."""
    rdzv_timeout = cfg.rdzv_timeout
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # elastic restarts after a SIGKILLed worker
    watch = RendezvousWatch(plan.endpoint, plan.rdzv_id, plan.min_nodes or plan.nnodes, rdzv_timeout)
    checkpoint_dir = storage.checkpoint_dir(cfg)
    stops = AgentSignals(cfg.shutdown_timeout, cfg.run_dir if training else None, checkpoint_dir, cfg.fs_timeout)
    try:
        with (
            stops.installed(HANDLED_SIGNALS),
            restart_policy(plan.elastic),
            watch if plan.endpoint else contextlib.nullcontext(),
        ):
            try:
                torchrun.run(torchrun.parse_args(cmd))
            finally:  # the outcome is the workers' now: a signal as the watch and the policy end is counted
                stops.done = True
    except ChildFailedError as exc:
        rank, failure = reported_failure(exc)
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        line = worker_error(failure.error_file)
        found = stops.recorded(all(f.exitcode == EXIT_PREEMPTED for f in exc.failures.values()))
        if stopped_saved(found):
            return EXIT_PREEMPTED, f"worker rank {rank} exited with {code}; {stopped_at(found)} (exit {EXIT_PREEMPTED})"
        if code == EXIT_PREEMPTED:  # exit 75 without a verified checkpoint of the stop: not 75
            return EXIT_STORAGE, f"worker rank {rank} exited with {code}, but {not_saved(found, checkpoint_dir)}"
        if code == EXIT_BAD_INPUT:
            return (
                code,
                f"worker rank {rank} exited with {code} (bad input: not restarted): {line or 'its log says why'}",
            )
        return code, f"worker rank {rank} exited with {code}" + (f": {line}" if line else "")
    except SignalException as exc:
        return stops.outcome(exc.sigval)
    except RendezvousError as exc:
        detail = first_line(exc)
        if stops.pcontext is not None:  # workers ran: the rendezvous had formed, and its store went away
            # Node 0 may stop with the others and leave first (its store with it), while these workers
            # still exit: a stop, not a failure, when they had agreed on it before the agent stopped them.
            found = stops.stopped_before_the_agent()
            if stopped_saved(found):
                return EXIT_PREEMPTED, (
                    f"the rendezvous at {plan.endpoint} ended as the nodes stopped ({detail}); "
                    f"{stopped_at(found)} (exit {EXIT_PREEMPTED})"
                )
            return EXIT_FAILED, (
                f"the rendezvous store at {plan.endpoint} (node 0) is gone after the job had started ({detail}): "
                "node 0 left or died, and the other nodes cannot re-form without it (an elastic job survives "
                "any node but node 0); start the job again: it resumes from the newest checkpoint"
            )
        return EXIT_NO_RENDEZVOUS, (  # nothing ran: not a failure of the job (half-scheduled, or a node late)
            f"rendezvous at {plan.endpoint} for {plan.nodes} nodes failed ({detail}): {watch.summary()} "
            f"within the {rdzv_timeout} s rendezvous timeout; check that every node started and can reach "
            f"{plan.endpoint} (node 0 hosts the store)"
        )
    return 0, "finished"


def record_attempt(cfg: config.Config, plan: Plan, **fields: object) -> None:
    """One line per node and attempt in RUN_DIR/attempts.jsonl."""
    append_attempt(
        cfg.run_dir,
        node_rank=plan.node_rank,
        scheduler=plan.scheduler,
        requeue=int(os.environ.get("SLURM_RESTART_COUNT", 0)),
        **fields,
    )
