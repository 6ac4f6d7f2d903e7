"""`ddpjob doctor --all-nodes`: the verdict from measured figures, and the real check on three
"nodes" (network namespaces on a bridge) with one node's link rate-limited by tc."""

from ddpjob.launch.plan import Plan
from ddpjob.tools.doctor_all_nodes import assess, exclusion, matmul_turn, preflight_plan, render, round_robin

GB = 1e9


def figures(node, matmul=50 * GB, links=None, local_rank=0, host=None, rank=None, slurm_name="", k8s_name=""):
    return {
        "rank": node if rank is None else rank,
        "node": node,
        "local_rank": local_rank,
        "host": host or f"host-{node}",
        "slurm_name": slurm_name,
        "k8s_name": k8s_name,
        "matmul": matmul,
        "allreduce": {8: 1e-4, 1 << 20: 1e-3},
        "links": {f"{a}-{b}": [1e-4, bw] for (a, b), bw in (links or {}).items()},
    }


def test_round_robin_meets_every_pair_once_with_disjoint_pairs_per_round():
    for n in range(2, 9):
        rounds = round_robin(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for r in rounds:
            ends = [x for p in r for x in p]
            assert len(ends) == len(set(ends))
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_a_node_with_only_slow_links_is_named_and_its_peers_are_not():
    links = {(0, 1): 1.0 * GB, (0, 2): 0.006 * GB, (1, 2): 0.006 * GB, (0, 3): 1.1 * GB, (1, 3): 0.9 * GB}
    links[(2, 3)] = 0.006 * GB
    v = assess([figures(0, links=links), figures(1), figures(2), figures(3)], 0.5, 0)
    assert list(v.slow) == [2] and "best link" in v.slow[2][0]
    assert v.slow_links == [] and v.exit_code == 1


def test_a_slow_link_between_two_healthy_nodes_is_named_as_a_link():
    links = {(0, 1): 0.01 * GB, (0, 2): 1.0 * GB, (1, 2): 1.0 * GB}
    v = assess([figures(0, links=links), figures(1), figures(2)], 0.5, 0)
    assert v.slow == {} and v.slow_links and v.slow_links[0].startswith("link node 0 - node 1")
    assert v.exit_code == 1


def test_two_nodes_name_both_ends_only_below_the_absolute_floor():
    records = [figures(0, links={(0, 1): 0.006 * GB}), figures(1)]
    unflagged = assess(records, 0.5, 0)
    assert unflagged.slow == {} and unflagged.exit_code == 0 and "2 nodes" in unflagged.notes[0]
    floored = assess(records, 0.5, 100e6)
    assert sorted(floored.slow) == [0, 1] and "either end" in floored.slow[0][0]


def test_a_slow_rank_names_its_node_by_matmul():
    records = [figures(0), figures(1), figures(2, matmul=5 * GB), figures(3)]
    assert list(assess(records, 0.5, 0).slow) == [2]
    assert assess(records, 0.05, 0).slow == {}  # within a looser factor


def test_an_elastic_plan_is_checked_at_its_full_size():
    elastic = Plan("plain", "flags", 4, 0, "node-a:29500", "job", 1, min_nodes=1, max_restarts=3)
    plan = preflight_plan(elastic)
    assert plan.nodes == "4" and not plan.elastic  # torchrun --nnodes=4: no start on a subset
    assert plan.rdzv_id == "job-preflight" and plan.max_restarts == 0


def test_slow_gpu_on_an_fqdn_host_is_excluded_by_its_slurm_name_and_named_by_local_rank():
    """8 ranks per node, hosts named h<n>.cluster and Slurm nodes h<n>: node 1's GPU 5 is slow."""
    records = [
        figures(
            node,
            matmul=5 * GB if (node, local) == (1, 5) else 50 * GB,
            rank=8 * node + local,
            local_rank=local,
            host=f"h{node}.cluster",
            slurm_name=f"h{node}",
        )
        for node in range(3)
        for local in range(8)
    ]
    v = assess(records, 0.5, 0)
    assert list(v.slow) == [1] and "on rank 13 (local rank 5)" in v.slow[1][0]
    out = render(v, "nccl on cuda", "slurm")
    assert "SLOW node 1 (h1.cluster): matmul 5.0 GFLOP/s on rank 13 (local rank 5)" in "\n".join(out)
    assert "Slurm: leave them out with  sbatch --exclude=h1 ..." in out
    assert not any("kubectl" in line for line in out)


def test_the_exclusion_line_follows_the_detected_scheduler():
    records = [figures(0), figures(1, matmul=5 * GB, k8s_name="gpu-node-7"), figures(2)]
    named = assess(records, 0.5, 0).nodes[1:2]
    assert exclusion(named, "kubeflow") == [
        "Kubernetes: kubectl cordon gpu-node-7  (or a nodeAffinity: kubernetes.io/hostname NotIn [gpu-node-7])"
    ]
    plain = exclusion(named, "plain")  # compose, by hand: both, as hints
    assert plain[0] == "Slurm: leave them out with  sbatch --exclude=host-1 ..." and "cordon gpu-node-7" in plain[1]
    pod = assess([figures(0), figures(1, matmul=5 * GB), figures(2)], 0.5, 0).nodes[1:2]
    assert "set NODE_NAME from spec.nodeName" in exclusion(pod, "kubernetes")[-1]


def test_cpu_ranks_of_one_machine_measure_matmul_in_turns_and_machines_and_gpus_at_once():
    def ranks(kernels, device="cpu"):
        return [{"rank": r, "kernel": k, "device": device} for r, k in enumerate(kernels)]

    two_machines = ranks(["a", "a", "a", "b", "b"])
    assert [matmul_turn(two_machines, r) for r in range(5)] == [(0, 3), (1, 3), (2, 3), (0, 3), (1, 3)]
    one_each = ranks(["a", "b", "c"])
    assert [matmul_turn(one_each, r) for r in range(3)] == [(0, 1)] * 3
    unknown = ranks(["", ""])  # no boot id to read: taken as one machine
    assert [matmul_turn(unknown, r) for r in range(2)] == [(0, 2), (1, 2)]
    gpus = ranks(["a", "a", "b", "b"], device="cuda")
    assert [matmul_turn(gpus, r) for r in range(4)] == [(0, 1)] * 4
