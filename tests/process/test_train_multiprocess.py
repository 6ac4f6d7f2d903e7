"""The training worker as real processes: torchrun, several agents as nodes, plain env, resume."""

import json
import subprocess

import pytest
import torch
from torch import nn

from helpers import (
    FAST,
    PY,
    assert_bitwise_equal,
    clean_env,
    ddpjob,
    final_params,
    launched,
    ok,
    plain_env_ranks,
    spawn,
    torchrun,
)
from ports import free_port

pytestmark = pytest.mark.slow


def test_default_job_on_two_processes_reaches_95_percent_on_digits_with_equal_replicas(work):
    out = ok(torchrun(["--log-every", "1000"], work))
    done = [ln for ln in out.splitlines() if "done:" in ln]
    assert len(done) == 1  # rank 0 reports, after checking every rank's parameter fingerprint
    final = [json.loads(ln) for ln in (work / "runs/ddpjob/metrics.jsonl").read_text().splitlines()][-2]
    assert final["event"] == "final" and final["accuracy"] >= 0.95, final
    assert final["params"] in done[0]


def test_two_torchrun_agents_as_two_nodes_complete(work):
    port = free_port()
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=t",
        "-m",
        "ddpjob",
        "train",
        *FAST,
    ]
    agents = [
        subprocess.Popen(cmd, cwd=work, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outs = [a.communicate(timeout=180)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert sum("done:" in o for o in outs) == 1


@pytest.mark.parametrize("init", ["env://", "tcp"])
def test_plain_env_processes_without_torchrun_complete(work, init):
    port = free_port()
    init_method = "env://" if init == "env://" else f"tcp://127.0.0.1:{port}"
    procs = plain_env_ranks([*FAST, "--init-method", init_method], work, port)
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "done:" in outs[0] and "world_size=" not in outs[1]


def test_slurm_task_env_shape_without_srun_completes(work):
    port = str(free_port())
    slurm = {"SLURM_NTASKS": "2", "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}
    procs = [
        spawn(["train", *FAST], work, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), MASTER_PORT=port, **slurm)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs


@pytest.mark.parametrize("world, load_mode", [(1, "mmap"), (2, "mmap"), (2, "rank0")])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(work, world, load_mode):
    args = ["--log-every", "1000", "--epochs", "3", "--grad-accum", "2", "--save-every", "0", "--load-mode", load_mode]

    def run(run_dir, max_steps):
        if world == 1:
            return ok(ddpjob(["train", *args, "--run-dir", run_dir, "--max-steps", str(max_steps)], work))
        return ok(launched([*args, "--run-dir", run_dir, "--max-steps", str(max_steps)], work))

    run("whole", 25)
    run("split", 9)  # stops mid-epoch: the epoch has 11 (ws 2) or 22 (ws 1) steps
    out = run("split", 25)
    assert ("DDP start-up broadcast skipped" in out) == (world > 1)
    start = [json.loads(ln) for ln in (work / "split/metrics.jsonl").read_text().splitlines() if '"start"' in ln]
    assert start[-1]["step"] == 9 and start[-1]["resumed_from"].endswith("step-9.pt")
    assert_bitwise_equal(final_params(work / "whole"), final_params(work / "split"))


def test_rank0_load_mode_resumes_bitwise_without_a_shared_filesystem(work):
    """Each rank has a run dir of its own, as nodes with local disks: only rank 0 holds checkpoints."""
    args = ["--log-every", "1000", "--epochs", "3", "--save-every", "0", "--fs-timeout", "3"]

    def ranks(prefix: str, max_steps: int, load_mode: str = "rank0") -> tuple[list[int], list[str]]:
        port, flags = free_port(), [*args, "--max-steps", str(max_steps), "--load-mode", load_mode]
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [spawn(["train", *flags], work, RANK=str(r), DDPJOB_RUN_DIR=f"{prefix}{r}", **env) for r in (0, 1)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        return [p.returncode for p in procs], outs

    assert ranks("whole", 25)[0] == [0, 0]
    assert ranks("split", 9)[0] == [0, 0]
    assert not list((work / "split1").glob("checkpoints/step-*"))
    codes, outs = ranks("split", 25, load_mode="mmap")  # rank 1 never sees rank 0's choice: retriable
    assert codes == [1, 1], outs[1][-2000:]
    assert "rank 1: checkpoint split1/checkpoints/step-9.pt that rank 0 chose is not visible here after" in outs[1]
    assert "--load-mode rank0" in outs[1]
    codes, outs = ranks("split", 25)
    assert codes == [0, 0] and "DDP start-up broadcast skipped" in outs[0], outs[0][-2000:]
    assert_bitwise_equal(final_params(work / "whole0"), final_params(work / "split0"))


@pytest.mark.parametrize("strategy", ["dp", "none"])
def test_single_process_strategies_complete(work, strategy):
    out = ok(ddpjob(["train", *FAST, "--strategy", strategy], work))
    assert "done:" in out
    assert all(not k.startswith("module.") for k in final_params(work / "runs/ddpjob"))


def test_tutorial_model_runs_unchanged_as_a_plugin(work):
    out = ok(torchrun([*FAST, "--model", "examples.tutorial:model", "--data", "examples.tutorial:data"], work))
    assert "done:" in out
    assert set(final_params(work / "runs/ddpjob")) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_init_from_a_dataparallel_state_dict_under_ddp(work):
    torch.manual_seed(1)
    src = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    torch.save(nn.DataParallel(src).state_dict(), work / "dp.pt")  # keys carry "module."
    out = ok(
        torchrun(
            [
                "--model",
                "examples.tutorial:model",
                "--data",
                "examples.tutorial:data",
                "--epochs",
                "1",
                "--max-steps",
                "1",
                "--lr",
                "1e-9",
                "--init-from",
                "dp.pt",
                "--resume",
                "never",
            ],
            work,
        )
    )
    assert "done:" in out
    loaded = final_params(work / "runs/ddpjob")
    assert torch.allclose(loaded["0.weight"], src[0].weight, atol=1e-6)
