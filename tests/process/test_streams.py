"""IterableDataset training data (train/feeds.py) with real processes and 2 DataLoader workers per rank:
a stop signal mid-epoch and a resume train the same batches as an uninterrupted run, bitwise; ranks
whose shares end at different steps stop together; what cannot resume exactly is refused in one line.

The plug-in (tests/plugins/shards.py) streams 8 files of 90-130 digits samples. Batch 16, 2 workers:
at 1 process an epoch is 54 steps; at 2, rank 0's share makes 25 batches and rank 1's 29, so an
epoch is 25 steps (the shorter share), and rank 1 drops its last 4.
"""

import signal
import time
from pathlib import Path

import pytest

from ddpjob.checkpoint import catalogue
from ddpjob.checkpoint.formats import dcp_folder, single_file
from helpers import assert_bitwise_equal, ddpjob, ok, records, spawn, trained_steps, wait_until
from plugins.shards import write_shards

pytestmark = pytest.mark.slow

SIZES = [100, 130, 90, 120, 110, 95, 105, 125]
EPOCH = {1: 54, 2: 25}  # steps per epoch at 1 and 2 processes
STEPS = {1: 70, 2: 40}  # into the second epoch
DATA = "tests.plugins.shards:sharded"
JOB = ["--batch-size", "16", "--num-workers", "2", "--epochs", "2", "--save-every", "0", "--stop-check-every", "1"]


def job(world: int, *extra: str) -> list[str]:
    return ["launch", "--nproc-per-node", str(world), *JOB, "--max-steps", str(STEPS[world]), *extra]


def work_with_shards(path: Path) -> Path:
    write_shards(path / "shards", SIZES)
    return path


def model_state(run_dir: Path) -> dict:
    newest = catalogue.list_steps(run_dir / "checkpoints")[0][1]
    return dcp_folder.read_model(newest) if newest.is_dir() else single_file.read(newest)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """(world, extra flags) -> the run dir of an uninterrupted run, made once."""
    done: dict = {}

    def get(world: int, *extra: str) -> Path:
        if (world, extra) not in done:
            work = work_with_shards(tmp_path_factory.mktemp("whole"))
            ok(ddpjob([*job(world, *extra), "--data", DATA, "--log-every", "1000"], work, timeout=300))
            done[world, extra] = work / "runs/ddpjob"
        return done[world, extra]

    return get


@pytest.mark.parametrize(
    "world, extra",
    [(1, ()), (2, ()), (2, ("--checkpoint-format", "dcp", "--grad-accum", "2", "--stop-check-every", "5"))],
    ids=["1-process", "2-processes", "2-processes-dcp-accum2-check5"],  # check5: positions kept every 5th step
)
def test_a_stream_stopped_mid_epoch_resumes_bitwise_equal_with_workers(tmp_path, uninterrupted, world, extra):
    whole = uninterrupted(world, *extra)
    epoch_steps = EPOCH[world] // (2 if "--grad-accum" in extra else 1)
    first_eval = next(r for r in records(whole) if r["event"] == "eval")
    assert first_eval["step"] == epoch_steps  # every rank stopped at the shorter share's end, none hung

    slow = [*extra, "--data", f"{DATA}(delay=0.01, until='acted')", "--log-every", "1"]  # until the stop
    work = work_with_shards(tmp_path)
    run_dir = work / "runs/ddpjob"
    agent = spawn(job(world, *slow), work)
    wait_until(lambda: trained_steps(run_dir) >= 6, 180, "training to start")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75, out[-3000:]
    (work / "acted").touch()  # the resume, at full speed
    (stop,) = [r for r in records(run_dir) if r["event"] == "preempted"]
    assert stop["step"] % epoch_steps, stop  # mid-epoch: the workers' stream positions matter

    ok(ddpjob(job(world, *slow), work, timeout=300))
    assert [r for r in records(run_dir) if r["event"] == "start"][-1]["step"] == stop["step"]
    assert_bitwise_equal(model_state(whole), model_state(run_dir))


@pytest.mark.serial  # against torch's 5 s join of each DataLoader worker
def test_a_stream_job_ends_with_its_loader_workers_not_after_torchs_join_timeout(tmp_path):
    """Training stops mid-epoch with the loader's workers mid-stream: they end with it (feeds.end_workers),
    not when torch gives up on each after 5 s and kills it (a stop signal's exit came 10 s late)."""
    work = work_with_shards(tmp_path)
    proc = spawn(["train", *JOB, "--data", DATA, "--max-steps", "30", "--log-every", "1000"], work)  # epoch: 54
    assert proc.stdout is not None
    try:
        done = next((time.monotonic() for line in proc.stdout if "] done:" in line), None)
        out = proc.communicate(timeout=120)[0]  # the rest, up to the end of the output: the workers hold it too
    finally:
        proc.kill()
    ended = time.monotonic()
    assert proc.returncode == 0 and done is not None, out[-3000:]
    assert ended - done < 4, f"{ended - done:.1f} s from the last line to the end"


@pytest.mark.parametrize(
    "first, then, words",
    [
        (job(2), ["train", *JOB], "the checkpoint holds the stream positions of 2 ranks, this run has 1"),
        (
            ["train", *JOB],
            ["train", *JOB, "--num-workers", "1"],
            "of 2 DataLoader workers per rank, this run has --num-workers 1",
        ),
    ],
    ids=["world-size", "workers"],
)
def test_a_stream_resumed_with_other_shares_is_refused_in_one_line(tmp_path, first, then, words):
    work = work_with_shards(tmp_path)
    ok(ddpjob([*first, "--data", DATA, "--max-steps", "5"], work, timeout=300))
    proc = ddpjob([*then, "--data", DATA, "--max-steps", "10"], work)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert words in last and "or start anew with --resume never" in last, last


def test_an_endless_stream_trains_to_max_steps_and_needs_them_and_a_stream_validates(tmp_path):
    work = work_with_shards(tmp_path)
    endless = ["train", *JOB, "--data", f"{DATA}(endless=True, val_stream=True)", "--epochs", "1"]
    ok(ddpjob([*endless, "--max-steps", "60"], work))  # past the 54 steps of one pass over the files
    events = [r for r in records(work / "runs/ddpjob") if r["event"] in ("eval", "final")]
    assert [(r["event"], r["step"]) for r in events] == [("final", 60)]  # the epoch never ended
    assert events[0]["accuracy"] > 0.5  # evaluated on a validation stream (230 samples)

    proc = ddpjob(endless, work_with_shards(work / "other"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "it has no length to make epochs and an LR schedule of; give --max-steps N" in proc.stderr


def test_a_validation_stream_gives_every_evaluation_pass_its_samples_again(tmp_path):
    write_shards(tmp_path / "shards", [40, 40, 40, 40])  # 10 steps of 16; the validation stream: 2 files, 80 samples
    data = f"{DATA}(val_stream=True)"
    ok(ddpjob(["train", "--data", data, "--batch-size", "16", "--epochs", "1", "--max-steps", "100"], tmp_path))
    evals = [r for r in records(tmp_path / "runs/ddpjob") if r["event"] in ("eval", "final")]
    assert [(r["event"], r["step"]) for r in evals] == [("eval", 10), ("final", 10)]  # two passes, the same weights
    scores = [{k: r.get(k) for k in ("val_loss", "accuracy")} for r in evals]  # an empty pass: no accuracy
    assert scores[0]["val_loss"] > 0 and scores[1] == scores[0]


def test_set_rank_is_called_once_so_a_stream_may_drop_the_other_ranks_files(tmp_path):
    work = work_with_shards(tmp_path)
    args = ["launch", "--nproc-per-node", "2", "--batch-size", "16", "--epochs", "3", "--max-steps", "1000"]
    ok(ddpjob([*args, "--save-every", "0", "--data", f"{DATA}(narrowing=True)"], work, timeout=300))
    ends = [r["step"] for r in records(work / "runs/ddpjob") if r["event"] == "eval"]
    assert ends[0] > 0 and ends == [ends[0], 2 * ends[0], 3 * ends[0]]  # every epoch as long: nothing narrowed twice


def test_a_validation_stream_that_yields_nothing_is_one_line_and_exit_2(tmp_path):
    write_shards(tmp_path / "shards", [40, 40])
    data = "tests.plugins.shards:empty_validation"
    proc = ddpjob(["train", "--data", data, "--batch-size", "16", "--epochs", "1", "--max-steps", "100"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "the validation data yielded no samples on any rank" in proc.stderr.strip().splitlines()[-1]


def test_an_iterable_dataset_without_set_rank_is_refused_on_two_processes(tmp_path):
    work = work_with_shards(tmp_path)
    proc = ddpjob([*job(2), "--data", "tests.plugins.shards:unranked"], work, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "the IterableDataset Unranked has no set_rank(rank, world_size), so each of the 2 processes" in proc.stderr


@pytest.mark.parametrize("data", [f"{DATA}(delay=0.01)", "tests.plugins.recording:digits(delay=0.01)"])
def test_a_stop_signal_to_the_process_group_leaves_workers_to_their_rank_which_exits_75(tmp_path, data):
    # torchrun signals each rank's process group, DataLoader workers included; a worker killed by it
    # failed its rank (exit 1) before the rank could checkpoint. Map-style data and streams alike.
    work, run_dir = work_with_shards(tmp_path), tmp_path / "runs/ddpjob"
    agent = spawn([*job(1), "--data", data, "--log-every", "1"], work, TEST_SAMPLES_DIR=str(tmp_path))
    wait_until(lambda: trained_steps(run_dir) >= 3, 180, "training to start")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=180)[0]
    assert agent.returncode == 75, out[-3000:]
    assert "exited unexpectedly" not in out and "killed by signal" not in out


def test_an_elastic_node_range_with_a_stream_is_refused_at_launch_in_one_line(tmp_path):
    """A stream's per-rank positions do not carry over to another world size, so a membership change
    would end the job: refused before any rendezvous, not at the first change."""
    work = work_with_shards(tmp_path)
    elastic = ["--nnodes", "1:2", "--max-restarts", "2", "--rdzv-endpoint", "127.0.0.1:29999", "--node-rank", "0"]
    proc = ddpjob(["launch", *elastic, *JOB, "--data", DATA], work, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "launch: torchrun" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert "--nnodes 1:2" in line and "IterableDataset" in line and "--nnodes N" in line, line
