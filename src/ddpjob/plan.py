"""What ``ddpjob launch`` found out about this node's place in the job: the detection result.

``launch`` fills it in (scheduler detection, then flags); ``doctor`` checks the node against it.
It lives here, apart from both, so that neither of them imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Plan:
    scheduler: str
    why: str
    nnodes: int
    node_rank: int | None  # None: assigned at rendezvous (replicated compose service)
    endpoint: str  # host:port of the rendezvous, "" for a standalone single node
    rdzv_id: str
    nproc_per_node: int
