"""What the launch tests of both tiers share: schedulers' environments and the plan launch derives from them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpjob import config
from ddpjob.launch import agent

SLURM_HEAD = {  # node 0 of a 2-node job under srun: the node that hosts the rendezvous store
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "node[1-2]-ib",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
}
SLURM = {  # node 1 of the same shape of job
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
    "SLURMD_NODENAME": "node2",
}
INDEXED = {"JOB_COMPLETION_INDEX": "1", "JOB_NAME": "ddpjob", "JOB_SERVICE": "ddpjob-nodes", "DDPJOB_NNODES": "2"}


def config_and_plan(env: Mapping[str, str], argv: Sequence[str] = ()) -> tuple[config.Config, Any]:
    """The config launch reads from ``argv`` and ``env``, and the plan it derives (no GPUs)."""
    parser = config.make_parser("t", "t")
    config.add_config_flags(parser)
    cfg = config.load(parser.parse_args(list(argv)), env)
    return cfg, agent.resolve_plan(cfg, env, cuda_devices=0)
