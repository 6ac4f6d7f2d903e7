"""One checkpoint dir, several runs, ranks and file systems: nothing of another run is deleted,
overwritten or mixed in; rank 0's choice of checkpoint holds on every rank, late storage is waited
for; a second live job is stopped; workers die with their agent; slow saves are not dead peers."""

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from test_faults import JOB

from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import dcp_folder, single_file
from helpers import (
    Process,
    alive,
    assert_bitwise_equal,
    ddpjob,
    final_params,
    launched,
    ok,
    plain_env_ranks,
    records,
    spawn,
    torchrun,
    trained_steps,
    wait_until,
    workers_of,
)
from ports import free_port

# Two at a time, but for the two tests that race a deadline (`serial`, apart from the others).
pytestmark = pytest.mark.slow
SHORT = ["--epochs", "3", "--log-every", "1000"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name.startswith("step-")}


def test_fresh_start_in_a_dir_holding_another_runs_checkpoints_is_refused_and_changes_nothing(work):
    ck = work / "runs/ddpjob/checkpoints"
    ok(ddpjob(["train", *SHORT, "--max-steps", "40", "--save-every", "10", "--keep", "3"], work))
    before = snapshot(ck)
    assert sorted(before) == [
        "step-20.pt",
        "step-20.pt.sum",
        "step-30.pt",
        "step-30.pt.sum",
        "step-40.pt",
        "step-40.pt.sum",
    ]
    proc = ddpjob(["train", *SHORT, "--resume", "never", "--max-steps", "20", "--save-every", "10"], work)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpjob: error")]
    assert len(error) == 1 and "holds 3 later checkpoint(s) (step-20.pt … step-40.pt)" in error[0]
    assert "--resume auto" in error[0] and "another --checkpoint-dir" in error[0]
    assert snapshot(ck) == before and "Traceback" not in proc.stderr
    # The old run is still the one that --resume auto continues, and it prunes only its own.
    ok(ddpjob(["train", *SHORT, "--max-steps", "50", "--save-every", "10", "--keep", "3"], work))
    starts = [r for r in records(work / "runs/ddpjob") if r["event"] == "start"]
    assert starts[-1]["resumed_from"].endswith("step-40.pt")
    assert sorted(snapshot(ck))[::2] == ["step-30.pt", "step-40.pt", "step-50.pt"]


def test_resuming_an_older_checkpoint_of_the_run_is_refused_instead_of_overwriting_later_ones(work):
    ck = work / "runs/ddpjob/checkpoints"
    ok(ddpjob(["train", *SHORT, "--max-steps", "30", "--save-every", "10"], work))
    proc = ddpjob(["train", *SHORT, "--resume", str(ck / "step-10.pt"), "--max-steps", "30"], work)
    assert proc.returncode == 2 and "resuming from step-10.pt (step 10) would overwrite" in proc.stderr


def test_a_rank_waits_for_the_checkpoint_rank_0_chose_until_its_storage_shows_it(work):
    """Ranks with separate checkpoint dirs stand in for NFS clients: rank 1's copy of rank 0's
    newest checkpoint appears only after rank 1 has started waiting for it (file first, manifest
    last, as a lagging client sees them)."""
    flags = ["--log-every", "1000", "--epochs", "3", "--save-every", "0", "--fs-timeout", "60"]

    def ranks(prefix: str, max_steps: int) -> list[tuple[Process, Path]]:
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        procs = []
        for r in (0, 1):
            log = work / f"{prefix}{r}.log"
            with open(log, "w") as out:
                args = ["train", *flags, "--max-steps", str(max_steps)]
                proc = spawn(args, work, stdout=out, **env, RANK=str(r), DDPJOB_RUN_DIR=f"{prefix}{r}")
            procs.append((proc, log))
        return procs

    def finish(procs: list[tuple[Process, Path]]) -> list[str]:
        codes = [p.wait(timeout=180) for p, _ in procs]
        outs = [log.read_text() for _, log in procs]
        assert codes == [0, 0], outs[1][-2000:]
        return outs

    finish(ranks("whole", 25))
    finish(ranks("split", 9))
    src, dst = work / "split0/checkpoints/step-9.pt", work / "split1/checkpoints/step-9.pt"
    assert not dst.exists()
    procs = ranks("split", 25)
    wait_until(
        lambda: "waiting up to 60 s to see split1/checkpoints/step-9.pt" in procs[1][1].read_text(),
        120,
        "rank 1 to wait",
    )
    shutil.copyfile(src, dst)
    time.sleep(1)
    shutil.copyfile(single_file.manifest_path(src), single_file.manifest_path(dst))
    outs = finish(procs)
    assert "every rank holds the weights of step-9.pt" in outs[0]
    assert_bitwise_equal(final_params(work / "whole0"), final_params(work / "split0"))


def test_a_second_job_on_a_live_jobs_checkpoint_dir_stops_at_once_in_one_line(work):
    first = spawn(["train", *JOB, "--epochs", "100"], work)
    try:
        wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 5, 120, "the first job to train")
        second = ddpjob(["train", *JOB], work, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "is in use by another live job (host" in second.stderr and "own --checkpoint-dir" in second.stderr
        assert first.poll() is None  # the first job trains on
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)  # reads its output: a full pipe would block it before its exit
        assert first.returncode == 75


@pytest.mark.serial  # the orphans must be gone within 10 s
def test_workers_die_with_their_sigkilled_agent_and_the_next_job_takes_over(work):
    agent = spawn(["launch", "--nproc-per-node", "2", *JOB, "--epochs", "100"], work)
    wait_until(lambda: trained_steps(work / "runs/ddpjob") >= 5, 120, "training to start")
    workers = workers_of(agent.pid)
    assert len(workers) == 2
    agent.send_signal(signal.SIGKILL)
    agent.wait(timeout=10)

    wait_until(lambda: not any(alive(pid) for pid in workers), 10, "the orphaned workers to exit")
    ok(ddpjob(["train", *JOB, "--max-steps", "10"], work, timeout=120))  # the dir's lock went with them


@pytest.mark.serial  # a 16 s save against a 3 s --collective-timeout
def test_a_save_slower_than_the_collective_timeout_is_not_a_dead_peer(work):
    out = ok(
        torchrun(
            [
                "--model",
                "tests.plugins.slow_save:model(seconds=16)",
                *SHORT,
                "--max-steps",
                "20",
                "--save-every",
                "10",
                "--collective-timeout",
                "3",
            ],
            work,
            timeout=240,
        )
    )
    assert "saved runs/ddpjob/checkpoints/step-20.pt" in out and "done: step 20" in out


def test_init_from_a_dcp_folder_under_ddp_and_dp_equals_init_from_its_file_form(work):
    ok(ddpjob(["train", *SHORT, "--max-steps", "10", "--checkpoint-format", "dcp", "--run-dir", "src"], work))
    folder = work / "src/checkpoints/step-10"
    ok(ddpjob(["ckpt", "convert", str(folder), str(work / "w.pt")], work))
    for name, source in (("from-dcp", folder), ("from-file", work / "w.pt")):
        ok(launched([*SHORT, "--max-steps", "10", "--init-from", str(source), "--run-dir", name], work))
    assert_bitwise_equal(final_params(work / "from-dcp"), final_params(work / "from-file"))
    for name, source in (("dp-dcp", folder), ("dp-file", work / "w.pt")):  # nn.DataParallel's module. keys
        ok(
            ddpjob(
                [
                    "train",
                    "--strategy",
                    "dp",
                    *SHORT,
                    "--max-steps",
                    "5",
                    "--init-from",
                    str(source),
                    "--run-dir",
                    name,
                ],
                work,
            )
        )
    assert_bitwise_equal(final_params(work / "dp-dcp"), final_params(work / "dp-file"))


def test_dcp_checksums_catch_a_flipped_byte_that_keeps_the_size(work):
    ok(ddpjob(["train", *SHORT, "--max-steps", "10", "--checkpoint-format", "dcp"], work))
    folder = work / "runs/ddpjob/checkpoints/step-10"
    assert dcp_folder.verify(folder) is None
    part = next(folder.glob("*.distcp"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    assert "fails its checksum" in dcp_folder.verify(folder)
    assert catalogue.latest_valid(folder.parent) is None


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EVIL_MARK']}",))


def test_a_crafted_dcp_folder_runs_no_code_on_resume(work, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from ddpjob.plugins import digits_mlp

    mark = work / "pwned"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    model = digits_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1)  # the loop's param groups carry initial_lr
    state = dcp_folder._state(model, optimizer, {"step": 1})
    state["extra"] = Evil()  # DCP pickles any non-tensor value into its byte items
    tmp, folder = work / ".step-1.tmp", work / "step-1"
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    dcp_folder._finish(tmp, folder, "")
    assert dcp_folder.verify(folder) is None  # a well-formed folder: only the pickle is hostile
    proc = ddpjob(["train", "--resume", str(folder), *SHORT, "--max-steps", "12"], work, EVIL_MARK=str(mark))
    assert proc.returncode == 2 and "weights_only" in proc.stderr, proc.stderr[-2000:]
    assert not mark.exists()


def test_init_from_a_corrupt_checkpoint_is_refused_before_training(work):
    ok(ddpjob(["train", *SHORT, "--max-steps", "10", "--run-dir", "src"], work))
    source = work / "src/checkpoints/step-10.pt"
    data = bytearray(source.read_bytes())
    data[len(data) // 2] ^= 0x01
    source.write_bytes(bytes(data))
    proc = ddpjob(["train", *SHORT, "--max-steps", "10", "--init-from", str(source)], work)
    assert proc.returncode == 2 and "failed its integrity check: checksum mismatch" in proc.stderr, proc.stderr[-2000:]


def run_two(args: list[str], work: Path, how: str) -> str:
    if how == "torchrun":
        return ok(torchrun(args, work))
    procs = plain_env_ranks(args, work, free_port())  # only RANK and WORLD_SIZE: no LOCAL_* to trust
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[1][-2000:]
    return "".join(outs)


@pytest.mark.parametrize("how", ["torchrun", "plain-env"])
def test_ranks_verifying_together_skip_a_corrupt_newest_checkpoint_of_the_same_size(work, how):
    ck = work / "runs/ddpjob/checkpoints"
    run_two([*SHORT, "--max-steps", "30", "--save-every", "10"], work, how)
    newest = ck / "step-30.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 3] ^= 0x01  # same size: only a checksum, checked by one of the two ranks, can see it
    newest.write_bytes(bytes(data))
    out = run_two([*SHORT, "--max-steps", "40", "--save-every", "10", "--keep", "1"], work, how)
    assert f"skipping checkpoint {newest.relative_to(work)}: checksum mismatch in block" in out
    starts = [r for r in records(work / "runs/ddpjob") if r["event"] == "start"]
    assert starts[-1]["resumed_from"].endswith("step-20.pt")
    # 30 rewritten, then pruned with --keep 1; 20, which this run resumed from and still maps, is
    # spared until the next start (pruning a mapped file risks SIGBUS on NFS)
    assert [s for s, _ in catalogue.list_steps(ck)] == [40, 20]
