"""Slurm detection in `ddpjob launch`: host lists with suffixes, `scontrol show hostnames`, and a
rendezvous port that jobs cannot silently share.

(The tests of test_slurm_launch.py that run in this process.)
"""

import socket

import pytest

from ddpjob.distenv import expand_hostlist, first_host
from ddpjob.errors import UsageError
from ddpjob.launch import agent
from launch_cases import SLURM_HEAD, config_and_plan


def free_slurm_job_id() -> tuple[int, int]:
    """A job id whose derived rendezvous port is free on this host, and that port."""
    for job in range(7000, 7000 + agent.SLURM_PORT_SPAN, 97):
        port = agent.slurm_rdzv_port({}, job)
        if not agent.port_in_use(port):
            return job, port
    raise AssertionError("no free port in the Slurm range")


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-02]-ib", ["node01-ib", "node02-ib"]),
        ("a[1-3,5],b-[01-02]-x", ["a1", "a2", "a3", "a5", "b-01-x", "b-02-x"]),
        ("gpu[03,05-07],cpu1", ["gpu03", "gpu05", "gpu06", "gpu07", "cpu1"]),
        ("rack1-node[010-012]", ["rack1-node010", "rack1-node011", "rack1-node012"]),
        ("r[1-2]n[1-2]-ib", ["r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("node-7,node-[2-3]", ["node-7", "node-2", "node-3"]),
        ("a1,b2", ["a1", "b2"]),
        ("solo", ["solo"]),
    ],
)
def test_host_lists_with_suffixes_and_several_ranges_expand_as_slurm_does(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", "a[1-2", "a]1[", "a[[1]]", "a[]", "a[3-1]", "a[x]", "a,,b", "a[1-]", ",a"])
def test_malformed_host_lists_are_one_line_naming_the_variable(nodelist):
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST="):
        expand_hostlist(nodelist)


def test_without_scontrol_the_parser_finds_the_suffixed_head_node(path):
    plan = config_and_plan({**SLURM_HEAD, "SLURM_NODEID": "1"})[1]
    assert plan.endpoint == "node1-ib:24242"  # not "node1", the name without its suffix
    assert "head node node1-ib" in plan.why


def test_jobs_ten_thousand_apart_no_longer_share_a_port_and_ports_stay_below_the_ephemeral_range():
    assert agent.slurm_rdzv_port({}, 4242) != agent.slurm_rdzv_port({}, 14242)
    ports = {agent.slurm_rdzv_port({}, job) for job in range(100_000, 100_000 + agent.SLURM_PORT_SPAN)}
    assert len(ports) == agent.SLURM_PORT_SPAN  # consecutive jobs never share one
    assert min(ports) >= 20000 and max(ports) < 32768  # 32768+: Linux hands those out to outgoing connections


def test_master_port_sets_the_slurm_rendezvous_port(path):
    assert config_and_plan({**SLURM_HEAD, "SLURM_NODEID": "1", "MASTER_PORT": "31001"})[1].endpoint == "node1-ib:31001"
    with pytest.raises(UsageError, match="MASTER_PORT=70000"):
        config_and_plan({**SLURM_HEAD, "SLURM_NODEID": "1", "MASTER_PORT": "70000"})[1]


def test_a_port_taken_on_the_head_node_is_one_line_naming_job_port_and_fix(path):
    job, port = free_slurm_job_id()
    other = job + agent.SLURM_PORT_SPAN  # the job whose store holds the same derived port
    assert agent.slurm_rdzv_port({}, other) == port
    with socket.socket() as store:  # the other job's rendezvous store on this head node
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        store.bind(("", port))
        store.listen()
        with pytest.raises(UsageError) as err:
            config_and_plan({**SLURM_HEAD, "SLURM_JOB_ID": str(other)})[1]
        message = str(err.value)
        assert "\n" not in message
        assert f"rendezvous port {port} of Slurm job {other}" in message
        assert "already in use" in message and "MASTER_PORT=" in message
        # Only node 0 binds the port; an explicit endpoint or MASTER_PORT avoids it.
        assert config_and_plan({**SLURM_HEAD, "SLURM_JOB_ID": str(other), "SLURM_NODEID": "1"})[1].endpoint.endswith(
            f":{port}"
        )
        assert (
            config_and_plan({**SLURM_HEAD, "SLURM_JOB_ID": str(other)}, ["--rdzv-endpoint", "h:1"])[1].endpoint == "h:1"
        )
        _, free = free_slurm_job_id()
        assert config_and_plan({**SLURM_HEAD, "SLURM_JOB_ID": str(other), "MASTER_PORT": str(free)})[
            1
        ].endpoint.endswith(f":{free}")


def test_a_port_taken_through_ipv6_only_is_seen_too(path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    _, port = free_slurm_job_id()
    try:
        store = socket.socket(socket.AF_INET6)
        store.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("::", port))
    except OSError:
        pytest.skip("IPv6 sockets cannot be bound here")
    with store:
        store.listen()
        assert agent.port_in_use(port)


def test_the_previous_attempts_time_wait_is_not_a_collision():
    """A requeued job binds its port again at once; a closed connection's TIME_WAIT must not stop it."""
    _, port = free_slurm_job_id()
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its end (local port = `port`) goes to TIME_WAIT
        client.close()
    assert not agent.port_in_use(port)
