"""Resolution of rank, world and master from each launcher's real environment shape."""

import pytest

from ddpjob.distenv import first_host, resolve
from ddpjob.errors import UsageError


def test_nothing_set_is_one_process():
    env = resolve({})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "single")
    assert not env.is_distributed


def test_torchrun_variables_win():
    env = resolve(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (3, 1, 4, 2, 1)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.1", 1234, "torchrun")


def test_plain_env_without_local_rank_derives_it_one_process_per_node():
    env = resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (env.rank, env.local_rank, env.node_rank, env.source) == (1, 0, 1, "env")


def test_plain_env_derives_local_rank_from_visible_gpus():
    env = resolve({"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "m"}, cuda_devices=4)
    assert (env.local_rank, env.node_rank, env.local_world_size) == (1, 1, 4)


def test_slurm_srun_uses_first_node_of_the_nodelist_as_master():
    env = resolve(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
        }
    )
    assert (env.rank, env.local_rank, env.node_rank, env.local_world_size) == (3, 1, 1, 2)
    assert (env.master_addr, env.source) == ("gpu07", "slurm")


def test_slurm_master_addr_env_overrides_nodelist():
    env = resolve({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a,b", "MASTER_ADDR": "10.1.1.1"})
    assert env.master_addr == "10.1.1.1"


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node1", "node1"),
        ("node[1-4]", "node1"),
        ("gpu[03,05-07],cpu1", "gpu03"),
        ("a1,b2", "a1"),
        ("rack1-node[010-012]", "rack1-node010"),
    ],
)
def test_first_host_of_slurm_hostlists(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "m"}, ["RANK=2", "outside"]),
        ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "m"}, ["RANK=-1", "outside"]),
        ({"RANK": "zero", "WORLD_SIZE": "2", "MASTER_ADDR": "m"}, ["RANK='zero'", "not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "m"}, ["WORLD_SIZE='two'", "not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_ADDR", "not set"]),
        ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "m"}, ["at least 1"]),
        ({"RANK": "0"}, ["WORLD_SIZE", "not set"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "http"}, ["MASTER_PORT='http'"]),
        (
            {"RANK": "0", "LOCAL_RANK": "3", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "m"},
            ["LOCAL_RANK=3"],
        ),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"}, ["SLURM_PROCID=4", "outside"]),
    ],
)
def test_bad_values_name_the_variable(env, words):
    with pytest.raises(UsageError) as err:
        resolve(env)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message
