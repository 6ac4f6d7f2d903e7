"""Experiment trackers (``--tracker mlflow|wandb``): rank 0's metrics records as one tracker run
across restarts, sent from a background thread so that no step ever waits on the network.

The loop hands records only at logging intervals (through Metrics.write) to a bounded queue; a
full queue drops the record and counts it. Every --tracker-every seconds the thread sends what is
queued, in one batch thinned to the newest record per event: a local SQLite store costs about 6 ms
of CPU per call and 0.1 ms per value, taken from rank 0's core and GIL, which a job logging many
times a second would otherwise pay on every record (metrics.jsonl keeps them all). Work that holds
the GIL (importing mlflow or wandb, building a local store) is done in start(), before the first
step; a remote run is started in the thread, whose work during training is network I/O.
close() lets the thread send what is queued for at most
--tracker-timeout seconds, so a dead tracking server can neither hang the job nor its exit. A
tracker that cannot start, or a server that goes away, is a warning: training goes on.

One run per checkpoint lineage: the run id is checkpointed (this object is attached to the
checkpointer) and kept in RUN_DIR/tracker.json with the checkpoint lineage and the highest step
sent per event. A torchrun restart, a Slurm requeue or a pod retry that resumes a checkpoint
continues the run it names (with tracker.json's steps when it names the same run); a checkpoint
that names no run (saved before the tracker ran) continues tracker.json's run when tracker.json
is of the same lineage. Only steps beyond those the run already holds are sent: no step is logged
twice, none goes backwards. A start that resumes no checkpoint is a new run, whatever
tracker.json holds. The URI is used only to connect: what is shown or stored of it
(tracker.json, warnings, the config sent as params) is redacted (redact.py).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddpjob import log, optional
from ddpjob.errors import EXIT_OK, EXIT_PREEMPTED, first_line
from ddpjob.redact import redact

if TYPE_CHECKING:
    from ddpjob.config import Config

QUEUE_SIZE = 1000  # records waiting for the thread; more are dropped, never waited for
SENDERS: list[threading.Thread] = []  # every sender this process started, in order


def senders_alive(since: int = 0) -> bool:
    """Whether a sender started after the first ``since`` is still running: one that close() gave up
    on (a server that never answers) or that no close() ended. The process must then end without
    finalizing the interpreter (os._exit): tearing it down beside a thread inside mlflow or wandb can
    abort the process (SIGABRT) after the job has done its work."""
    return any(thread.is_alive() for thread in SENDERS[since:])


def warn(message: str) -> None:
    log.warning(f"tracker: {redact(message)}")


class Backend(Protocol):
    where: str
    local: bool  # the store is on this machine (no network): started before the first step

    def start(self, run_id: str, params: dict[str, Any]) -> tuple[str, bool]:
        """Resume run_id when it exists here, else create a run with params; (its id, resumed)."""

    def held(self) -> dict[str, int]:
        """The highest step the run holds per record kind, as far as the tracker can tell."""

    def log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        """Send (step, values) records, in step order."""

    def finish(self, exit_code: int) -> None: ...


class MLflow:
    """An MLflow run through MlflowClient (no process-global active run)."""

    def __init__(self, uri: str, experiment: str, name: str) -> None:
        mlflow = optional.require("mlflow", "--tracker mlflow")
        if redact(uri) != uri:  # MLflow prints the run's URL, secret included, when the run ends
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self.entities = mlflow.entities
        self.where, self.experiment, self.name, self.run_id = redact(uri), experiment, name, ""
        self.local = is_local_store(uri)

    def start(self, run_id: str, params: dict[str, Any]) -> tuple[str, bool]:
        if run_id:
            try:
                self.client.get_run(run_id)
            except Exception as exc:  # only a run that is not there starts another: not a server that is down
                if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warn(f"mlflow run {run_id} is not in {self.where} ({first_line(exc)}); starting a new run")
            else:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                return run_id, True
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.name, tags={"ddpjob.host": socket.gethostname()})
        self.run_id = run.info.run_id
        try:
            self.client.log_batch(self.run_id, params=[self.entities.Param(k, str(v)) for k, v in params.items()])
        except Exception:
            self.client.set_terminated(self.run_id, status="FAILED")  # no run left RUNNING that no one continues
            raise
        return self.run_id, False

    def held(self) -> dict[str, int]:
        """The highest step the run holds per record kind (its metrics are named kind/name)."""
        steps: dict[str, int] = {}
        for key in self.client.get_run(self.run_id).data.metrics:
            kind = key.partition("/")[0]
            if kind not in steps:
                steps[kind] = max(m.step for m in self.client.get_metric_history(self.run_id, key))
        return steps

    def log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        stamp = int(time.time() * 1000)
        metrics = [self.entities.Metric(k, v, stamp, step) for step, values in records for k, v in values.items()]
        for first in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[first : first + 1000])

    def finish(self, exit_code: int) -> None:
        status = {EXIT_OK: "FINISHED", EXIT_PREEMPTED: "KILLED"}.get(exit_code, "FAILED")
        self.client.set_terminated(self.run_id, status=status)


REMOTE_NAMES = ("databricks", "databricks-uc", "uc")  # tracking URIs with no scheme that are servers


def is_local_store(uri: str) -> bool:
    """Whether an MLflow tracking URI is a store on this machine: a SQLite file, a file: URI or a
    plain path; not a server (http, a database, databricks, which has no scheme)."""
    scheme = urllib.parse.urlparse(uri).scheme
    return scheme in ("sqlite", "file") or (not scheme and uri not in REMOTE_NAMES)


class WandB:
    """A W&B run; resumed with ``wandb.init(id=..., resume="allow")``. WANDB_MODE, WANDB_DIR and the
    other WANDB_* variables apply as usual; without WANDB_DIR its files go to RUN_DIR. W&B records
    the command line in the run: it is given the redacted one."""

    def __init__(self, url: str, project: str, name: str, run_dir: str) -> None:
        self.wandb = optional.require("wandb", "--tracker wandb")
        self.url, self.project, self.name, self.run_dir = url, project, name, run_dir
        mode = os.environ.get("WANDB_MODE", "")
        self.local = mode in ("offline", "disabled", "dryrun")
        where = url or os.environ.get("WANDB_BASE_URL", "") or (f"WANDB_MODE={mode}" if mode else "W&B's server")
        self.where = redact(where)
        self.run: Any = None

    def start(self, run_id: str, params: dict[str, Any]) -> tuple[str, bool]:
        kwargs: dict[str, Any] = {"dir": None if os.environ.get("WANDB_DIR") else self.run_dir}
        if self.url:
            kwargs["settings"] = self.wandb.Settings(base_url=self.url)
        argv, sys.argv = sys.argv, [redact(arg) for arg in sys.argv]  # W&B stores the command line
        try:
            self.run = self.wandb.init(
                project=self.project,
                name=self.name,
                id=run_id or uuid.uuid4().hex[:12],
                resume="allow",
                config=None if run_id else params,  # params once, with the run
                **kwargs,
            )
        finally:
            sys.argv = argv
        return str(self.run.id), bool(self.run.resumed) or bool(run_id and self.local)

    def held(self) -> dict[str, int]:
        return {}  # W&B itself refuses a step below the run's current one

    def log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in records:
            self.run.log(values, step=step)

    def finish(self, exit_code: int) -> None:
        if exit_code == EXIT_PREEMPTED:
            self.run.mark_preempting()  # W&B shows it preempted, to be resumed, not crashed
        self.run.finish(exit_code=exit_code)


class Tracker:
    """Rank 0 sends; every rank carries the run id through checkpoints (state_dict/load_state_dict)."""

    def __init__(
        self,
        kind: str,
        enabled: bool,
        run_dir: str,
        uri: str = "",
        project: str = "",
        run_name: str = "",
        timeout: float = 30.0,
        every: float = 1.0,
        params: dict[str, Any] | None = None,
        lineage: str = "",
        resuming: bool = False,
    ) -> None:
        self.kind, self.enabled = kind, enabled and kind != "none"
        self.run_dir, self.uri, self.timeout, self.params = Path(run_dir), uri, timeout, params or {}
        self.every = every
        self.lineage, self.resuming = lineage, resuming  # the checkpoint lineage this job writes; resumed?
        self.project = project or os.environ.get("MLFLOW_EXPERIMENT_NAME" if kind == "mlflow" else "WANDB_PROJECT", "")
        self.project = self.project or "ddpjob"
        self.run_name = run_name or self.run_dir.resolve().name
        self.run_id = ""  # set once the run has started
        self.saved: dict[str, Any] = {}  # the resumed checkpoint's run: none on a fresh start
        self.logged: dict[str, int] = {}  # event -> highest step the run holds
        self.queue: queue.Queue[tuple[str, int, dict[str, float]]] = queue.Queue(QUEUE_SIZE)
        self.dropped, self.dead = 0, False
        self.closing = threading.Event()
        self.exit_code = EXIT_OK
        self.thread: threading.Thread | None = None

    @classmethod
    def of(cls, cfg: Config, is_main: bool, lineage: str, resuming: bool) -> Tracker:
        """The job's tracker: sends from rank 0 only; params are the job's config. lineage: the
        checkpoints' run (manager.py); resuming: this start resumes one of them."""
        names = ("uri", "project", "run_name", "timeout", "every")
        settings = {name: getattr(cfg, f"tracker_{name}") for name in names}
        return cls(
            cfg.tracker, is_main, cfg.run_dir, params=cfg.to_dict(), lineage=lineage, resuming=resuming, **settings
        )

    @property
    def state_path(self) -> Path:
        return self.run_dir / "tracker.json"

    # ---- checkpointed ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "run_id": self.run_id or self.saved.get("run_id", "")}

    def load_state_dict(self, state: dict[str, str]) -> None:
        if state.get("kind") == self.kind and state.get("run_id"):
            self.saved = dict(state)

    # ---- the loop's side: never waits ------------------------------------------------------------
    def start(self) -> None:
        """Rank 0, before the first step: choose the run to continue, import the tracker and, for a
        local store, start the run here; then start the thread that sends."""
        if not self.enabled:
            return
        run_id = self.saved.get("run_id", "")  # a fresh start (no checkpoint resumed): a new run
        stored = self._read_state() if run_id or self.resuming else {}
        if not run_id and self.lineage and stored.get("lineage") == self.lineage:
            run_id = stored["run_id"]  # the checkpoint predates the tracker run of its own lineage
        if run_id and stored.get("run_id") == run_id:
            self.logged = stored["logged"]
        self.uri = self.uri or self._default_uri()
        try:
            backend = self._backend()
        except Exception as exc:
            return self._give_up(exc)
        if backend.local and not self._start_run(backend, run_id):
            return
        self.thread = threading.Thread(target=self._work, args=(backend, run_id), name="ddpjob-tracker", daemon=True)
        self.thread.start()
        SENDERS.append(self.thread)

    def log(self, event: str, step: int, values: dict[str, float]) -> None:
        """A record's numeric fields at its step: queued for the thread, or dropped (and counted) when full."""
        if not self.enabled or self.dead or not values:
            return
        try:
            self.queue.put_nowait((event, step, values))
        except queue.Full:
            self.dropped += 1

    def close(self, exit_code: int) -> None:
        """Let the thread send what is queued and end the run, for at most the timeout."""
        if self.thread is None:
            return
        self.exit_code = exit_code
        self.closing.set()
        self.thread.join(self.timeout)
        if self.thread.is_alive():
            stuck = (
                f"run {self.run_id}" if self.run_id else f"{self.kind} at {self.uri or 'its default'} never answered:"
            )
            warn(
                f"{stuck} {self.queue.qsize()} record(s) not sent within --tracker-timeout {self.timeout:g} s; exiting"
            )
        if self.dropped:
            warn(f"{self.dropped} record(s) dropped while the tracker was behind (queue of {QUEUE_SIZE} full)")
        self.thread = None

    # ---- the run and the thread ------------------------------------------------------------------
    def _backend(self) -> Backend:
        if self.kind == "mlflow":
            return MLflow(self.uri, self.project, self.run_name)
        return WandB(self.uri, self.project, self.run_name, str(self.run_dir))

    def _give_up(self, exc: Exception) -> None:
        self.dead = True
        warn(f"{self.kind} cannot start a run at {self.uri or 'its default'} ({first_line(exc)}); training goes on")

    def _start_run(self, backend: Backend, run_id: str) -> bool:
        """Continue run_id (or start a new run) and record it in tracker.json; False: it cannot."""
        try:
            self.run_id, resumed = backend.start(run_id, self.params)
        except Exception as exc:
            self._give_up(exc)
            return False
        if not resumed:
            self.logged = {}
        elif not self.logged:  # continued from the checkpoint's id alone: ask the run what it holds
            self.logged = backend.held()
        self._write_state()
        verb = "continues" if resumed else "started"
        log.info(f"tracker: {self.kind} run {self.run_id} {verb} at {redact(backend.where)}")
        return True

    def _work(self, backend: Backend, run_id: str) -> None:
        """Start a remote run (when start() has not), then send records until close()."""
        if not backend.local and not self._start_run(backend, run_id):
            return
        failing = False
        while True:
            closing = self.closing.wait(self.every or 0.1)  # at once when closing: what is queued goes now
            batch, logged = self._new_records()
            if batch:
                try:
                    backend.log([(step, values) for _, step, values in batch])
                except Exception as exc:
                    if not failing:
                        where = f"steps {batch[0][1]}-{batch[-1][1]}"
                        warn(f"{self.kind} cannot log {where} ({first_line(exc)}); dropping records until it answers")
                    failing = True
                else:
                    if failing:
                        log.info(f"tracker: {self.kind} answers again at step {batch[0][1]}")
                    failing = False
                    self.logged = logged
                    self._write_state()
            if closing and self.queue.empty():
                break
        try:
            backend.finish(self.exit_code)
        except Exception as exc:
            warn(f"{self.kind} cannot end run {self.run_id} ({first_line(exc)})")

    def _new_records(self) -> tuple[list[tuple[str, int, dict[str, float]]], dict[str, int]]:
        """What is queued, less the steps the run holds already (sent before a restart) and, with
        --tracker-every, less all but the newest record per event; and the highest step per event
        once those are sent."""
        logged, batch = dict(self.logged), list[tuple[str, int, dict[str, float]]]()
        while True:
            try:
                event, step, values = self.queue.get_nowait()
            except queue.Empty:
                return batch, logged
            if step <= logged.get(event, -1) or step < max(logged.values(), default=-1):
                continue
            if self.every:
                batch = [record for record in batch if record[0] != event]
            batch.append((event, step, values))
            logged[event] = step

    def _default_uri(self) -> str:
        """MLflow: $MLFLOW_TRACKING_URI, else a SQLite store in RUN_DIR. W&B: its own settings."""
        if self.kind != "mlflow":
            return ""
        default = f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
        return os.environ.get("MLFLOW_TRACKING_URI", "") or default

    def _read_state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text())
            state["logged"] = {str(k): int(v) for k, v in state.get("logged", {}).items()}
            state["run_id"] = str(state.get("run_id", ""))
            state["lineage"] = str(state.get("lineage", ""))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            if self.state_path.exists():
                warn(f"{self.state_path} is unreadable ({first_line(exc)}); a new run starts")
            return {}
        return state if state.get("kind") == self.kind else {}

    def _write_state(self) -> None:
        """RUN_DIR/tracker.json, atomically: the run and the highest step sent per event."""
        state: dict[str, Any] = {"kind": self.kind, "run_id": self.run_id, "lineage": self.lineage}
        state.update(uri=redact(self.uri), logged=self.logged)
        tmp = self.state_path.with_name(f".tracker.json.tmp-{os.getpid()}")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.state_path)
        except OSError as exc:  # the checkpoints still name the run
            warn(f"cannot write {self.state_path} ({first_line(exc)})")
