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
    nnodes: int  # the most nodes (MAX of an elastic MIN:MAX)
    node_rank: int | None  # None: assigned at rendezvous (replicated compose service)
    endpoint: str  # host:port of the rendezvous, "" for a standalone single node
    rdzv_id: str
    nproc_per_node: int
    min_nodes: int = 0  # elastic: fewest nodes to train with (0: nnodes, a fixed size)
    max_restarts: int = 0  # worker group restarts after a failure (Kubeflow's elasticPolicy sets it)

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes

    @property
    def nodes(self) -> str:
        """torchrun's --nnodes: N, or MIN:MAX when elastic."""
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)
