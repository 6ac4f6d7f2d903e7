"""Which exits spend a retry: one of torchrun's ``--max-restarts``, or the scheduler's (backoffLimit).
Only failures a retry can cure.

Bad input (a worker's exit 2) is the same on every restart: the agent ends the job at once.

When a node is drained or preempted, every rank agrees on a step, checkpoints and exits
EXIT_PREEMPTED (75), also on the nodes that got no signal. torchrun's agent counts that as a
failed worker group and spends a restart on it. Here the agent's view of its workers is wrapped:
a group whose failed workers all exited 75 is a stop, not a failure.
- Fixed size: the agent ends at once with 75, spending nothing; the scheduler starts the node
  again free of charge (the Job's podFailurePolicy Ignore rule, JobSet's restart rule that ignores
  maxRestarts, Slurm's requeue), and the new nodes resume from the checkpoint.
- Elastic (``--nnodes MIN:MAX``): the group re-forms at the new size as before, and the restart
  is given back, as torchrun already does for a node that joins.

A rendezvous that never formed (EXIT_NO_RENDEZVOUS, 69) is free too, but only --rdzv-retries times
in a row per node (no_rendezvous_exit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ddpjob.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NO_RENDEZVOUS, EXIT_PREEMPTED, UsageError
from ddpjob.train.metrics import read_attempts


def stopped_with_checkpoint(result: Any) -> bool:
    """A torch RunResult of a failed group whose failed workers all exited 75."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    failures = getattr(result, "failures", None) or {}
    return (
        result.state == WorkerState.FAILED
        and bool(failures)
        and all(f.exitcode == EXIT_PREEMPTED for f in failures.values())
    )


def bad_input(result: Any) -> bool:
    """A torch RunResult of a failed group in which some worker exited 2 (bad input)."""
    failures = getattr(result, "failures", None) or {}
    return any(f.exitcode == EXIT_BAD_INPUT for f in failures.values())


def reported_failure(exc: Any) -> tuple[int, Any]:
    """The (global rank, ProcessFailure) a failed launch reports, from torch's ChildFailedError: a
    worker's own exit 2 where any worker made one, else torch's first failure (the earliest by clock).
    Every rank finds the same bad input, but one may still be exiting when another's exit 2 makes the
    agent SIGTERM it; that rank's error was recorded first, so torch's choice read -15 (exit 143, which
    a scheduler retries) for bad input."""
    bad = [(rank, failure) for rank, failure in sorted(exc.failures.items()) if failure.exitcode == EXIT_BAD_INPUT]
    return bad[0] if bad else exc.get_first_failure()


@contextlib.contextmanager
def restart_policy(elastic: bool) -> Iterator[None]:
    """While torchrun's agent runs in this process: a checkpointed stop spends no restart, and bad
    input ends the job at once (--max-restarts is for lost nodes and crashed workers)."""
    import torch
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent.__dict__.get("_monitor_workers")
    if not callable(original):
        raise UsageError(
            f"torch {torch.__version__}'s LocalElasticAgent has no _monitor_workers; ddpjob launch cannot keep "
            "a checkpointed stop from spending a restart: use a torch that ddpjob is tested with"
        )

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        if stopped_with_checkpoint(result):
            if elastic:
                agent._remaining_restarts += 1  # the agent takes one off as it re-forms the group
            else:
                agent._remaining_restarts = 0  # stop now with 75: the scheduler restarts the node for free
        elif bad_input(result):
            agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


def no_rendezvous_exit(run_dir: str, node_rank: int | None, host: str, limit: int) -> tuple[int, str]:
    """The exit code of this node's rendezvous that never formed, and a line to add to its reason.

    69 is retried without counting (the Job's podFailurePolicy): right for nodes that were not all
    placed yet, wrong for a cause that never heals (a wrong endpoint, a DNS mismatch, a port a
    NetworkPolicy blocks), which would loop for ever. The Job cannot count 69 apart, so the node does:
    RUN_DIR/attempts.jsonl holds its earlier attempts, and once `limit` of them in a row failed to
    rendezvous, with nothing trained between, this one exits 1 and the scheduler's retry budget
    (backoffLimit) counts from here on."""
    before = 0
    for record in reversed(read_attempts(run_dir)):
        mine = record.get("node_rank") == node_rank and (node_rank is not None or record.get("host") == host)
        if not mine or record.get("event") != "end":
            continue
        if not record.get("no_rendezvous"):
            break  # it trained (or failed otherwise) since
        before += 1
    if before < limit:
        return EXIT_NO_RENDEZVOUS, ""
    return EXIT_FAILED, (
        f"; {before + 1} in a row with nothing trained between, more than --rdzv-retries {limit}: exit "
        f"{EXIT_FAILED}, counted by the scheduler, as a cause that does not heal would loop for ever"
    )
