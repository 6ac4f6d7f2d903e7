"""Operator tools from the installed package: doctor, prefixed logs, plot, checkpoint inspect/convert."""

import os
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch
from torch import nn

from ddpjob.checkpoint.formats import single_file
from ddpjob.tools import plot
from helpers import FAST, PY, clean_env, ddpjob, launched, ok

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs a private mount or network namespace (root)")


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def test_doctor_passes_with_a_reachable_endpoint(work, listener):
    proc = ddpjob(["doctor", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{listener}"], work)
    assert proc.returncode == 0, proc.stdout
    assert f"ok   reachable: TCP connect to 127.0.0.1:{listener} works" in proc.stdout
    assert "node 1 of 2" in proc.stdout and "/dev/shm" in proc.stdout and "devices:" in proc.stdout


@root_only
@pytest.mark.serial
@pytest.mark.alone  # it times the doctor
def test_doctor_fails_fast_on_an_unreachable_endpoint_with_the_fix(work):
    """In a network namespace of its own (no route to the endpoint), as on a node cut off from node 0."""
    start = time.monotonic()
    script = 'ip link set lo up && exec "$@"'
    proc = subprocess.run(
        [
            "unshare",
            "--net",
            "sh",
            "-c",
            script,
            "_",
            PY,
            "-m",
            "ddpjob",
            "doctor",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "198.19.255.254:29500",
        ],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout
    assert "FAIL reachable: 198.19.255.254:29500" in proc.stdout and "fix: open TCP port 29500" in proc.stdout
    assert time.monotonic() - start < 20


def test_doctor_fails_on_a_name_that_does_not_resolve(work):
    proc = ddpjob(["doctor", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "no-such-node.invalid"], work)
    assert proc.returncode == 1
    assert "does not resolve" in proc.stdout and "fix: use node 0's IP address" in proc.stdout


def test_doctor_names_a_missing_socket_interface(work):
    proc = ddpjob(["doctor"], work, GLOO_SOCKET_IFNAME="eth9")
    assert proc.returncode == 1
    assert (
        "GLOO_SOCKET_IFNAME=eth9, but this node has no eth9" in proc.stdout
        and "fix: unset GLOO_SOCKET_IFNAME" in proc.stdout
    )


def test_doctor_reports_missing_scheduler_env(work):
    proc = ddpjob(["doctor"], work, JOB_COMPLETION_INDEX="1", JOB_NAME="train")
    assert proc.returncode == 2 and "JOB_SERVICE is not set" in proc.stderr


@root_only
def test_doctor_fails_on_a_tiny_dev_shm_when_workers_need_it(work):
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "_", PY, "-m", "ddpjob", "doctor"]
    proc = subprocess.run([*cmd, "--num-workers", "2"], cwd=work, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 1
    assert "FAIL /dev/shm: 64 MiB, too small" in proc.stdout and "shm_size" in proc.stdout
    proc = subprocess.run(cmd, cwd=work, env=clean_env(), capture_output=True, text=True)  # no workers: fine
    assert proc.returncode == 0, proc.stdout


@pytest.mark.slow
def test_every_worker_line_names_its_node_and_rank_and_heartbeats_show_progress(work):
    out = ok(launched([*FAST, "--heartbeat", "0.05", "--log-every", "5"], work)).splitlines()
    ours = [ln for ln in out if "[ddpjob]" in ln and not ln.startswith("[ddpjob] launch: ")]  # not launch's own
    assert ours and all(ln.startswith(("[node 0 rank 0] ", "[node 0 rank 1] ")) for ln in ours)
    assert any(ln.startswith("[node 0 rank 1] [ddpjob] heartbeat: step") for ln in ours)
    assert any("samples/s eta" in ln for ln in ours)


@pytest.mark.slow
def test_plot_of_a_two_process_run_with_a_resume(work):
    ok(launched(["--epochs", "3", "--max-steps", "30", "--log-every", "5"], work))
    ok(launched(["--epochs", "3", "--log-every", "5"], work))
    run_dir = work / "runs/ddpjob"
    records = plot.read_metrics(run_dir / "metrics.jsonl")
    panels = plot.series(records)
    assert panels["loss"][0] == list(range(5, 35, 5)) + list(range(35, 70, 5)) + [66]
    assert len(panels["held-out accuracy"][0]) == 2 + 3  # epochs 0,1 + final; then epoch 2 + final ... of both runs
    assert plot.markers(records) == [(30, "resume")]
    out = ok(ddpjob(["plot", str(run_dir)], work))
    png = (run_dir / "metrics.png").read_bytes()
    assert "wrote" in out and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert struct.unpack(">II", png[16:24]) == (900, 900)


def tutorial_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))


@pytest.fixture
def saved_from_wrappers(work):
    """State dicts saved the way other code does: from a DataParallel, a DDP and a plain model."""
    import torch.distributed as dist

    model = tutorial_model()
    torch.save(model.state_dict(), work / "plain.pt")
    torch.save(nn.DataParallel(model).state_dict(), work / "dp.pt")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.save(nn.parallel.DistributedDataParallel(model).state_dict(), work / "ddp.pt")
    finally:
        dist.destroy_process_group()
    return model


@pytest.mark.parametrize("name, prefixed", [("plain", False), ("dp", True), ("ddp", True)])
def test_ckpt_inspect_reports_format_shapes_and_prefix(work, saved_from_wrappers, name, prefixed):
    out = ok(ddpjob(["ckpt", "inspect", f"{name}.pt"], work))
    assert "format:     plain state dict" in out and "integrity:  no manifest" in out
    assert ("prefix:     module." in out) == prefixed
    assert "0.weight                                 (10, 10)             float32" in out
    assert "weights:    4 tensors, 165 values" in out


@pytest.mark.parametrize("name", ["plain", "dp", "ddp"])
def test_ckpt_convert_strips_and_adds_the_prefix_and_exports(work, saved_from_wrappers, name):
    ok(ddpjob(["ckpt", "convert", f"{name}.pt", "stripped.pt"], work))
    plain = tutorial_model()
    plain.load_state_dict(torch.load(work / "stripped.pt", weights_only=True))  # strict: exact keys
    ok(ddpjob(["ckpt", "convert", f"{name}.pt", "wrapped.pt", "--add-prefix", "module."], work))
    nn.DataParallel(tutorial_model()).load_state_dict(torch.load(work / "wrapped.pt", weights_only=True))
    ok(ddpjob(["ckpt", "convert", f"{name}.pt", "w.safetensors", "--to", "safetensors"], work))
    from safetensors.torch import load_file

    exported = load_file(str(work / "w.safetensors"))
    for key, value in saved_from_wrappers.state_dict().items():
        assert torch.equal(exported[key], value)
    ok(ddpjob(["ckpt", "convert", "w.safetensors", "ours.pt", "--to", "ddpjob"], work))
    assert single_file.verify(work / "ours.pt") is None
    assert "format:     ddpjob checkpoint" in ok(ddpjob(["ckpt", "inspect", "ours.pt"], work))


@pytest.mark.slow
def test_tensorboard_gets_the_same_scalars_as_the_metrics_file(work):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ok(launched([*FAST, "--log-every", "5", "--tensorboard", "tb"], work))
    events = EventAccumulator(str(work / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "eval/accuracy", "final/accuracy"} <= tags
    records = plot.read_metrics(work / "runs/ddpjob/metrics.jsonl")
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert [round(e.value, 4) for e in events.Scalars("train/loss")] == [round(v, 4) for v in losses]


def doctor_within(cpus: set[int], args: list[str], work) -> subprocess.CompletedProcess[str]:
    """`ddpjob doctor ARGS` in a process whose CPU affinity is `cpus` (as a Slurm step's is)."""
    return subprocess.run(
        [PY, "-m", "ddpjob", "doctor", *args],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )


def test_doctor_warns_when_the_cpu_affinity_holds_fewer_cpus_than_the_processes(work):
    crowded = doctor_within({0}, ["--nproc-per-node", "2", "--num-workers", "1"], work)
    assert crowded.returncode == 0, crowded.stdout + crowded.stderr  # a warning: training still works
    assert "warn cpus: 1 in this process's affinity for 2 workers x (1 + 1 loaders): 4 processes share 1 CPU" in (
        crowded.stdout
    )
    assert "--cpus-per-task" in crowded.stdout
    fits = doctor_within({0}, ["--nproc-per-node", "1"], work)
    assert "ok   cpus: 1 in this process's affinity" in fits.stdout, fits.stdout


@root_only
def test_doctor_warns_when_the_run_dir_is_on_the_containers_own_layer(work):
    """A container's root is an overlay; a run dir there (no volume mounted, or an image's run dir
    that won over the job's) goes with the container. A mounted volume is fine."""
    for name in ("lower", "upper", "work", "root", "volume"):
        (work / name).mkdir()
    overlay = f"lowerdir={work}/lower,upperdir={work}/upper,workdir={work}/work"
    script = f'mount -t overlay overlay -o {overlay} {work}/root && mount -t tmpfs tmpfs {work}/volume && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "_", PY, "-m", "ddpjob", "doctor"]
    runs = {}
    for where in ("root", "volume"):
        proc = subprocess.run(
            [*cmd, "--run-dir", f"{work}/{where}/runs"], cwd=work, env=clean_env(), capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[where] = proc.stdout
    assert f"warn volume: run dir {work}/root/runs is on overlay at {work}/root" in runs["root"], runs["root"]
    assert "kubectl get pvc ddpjob-runs" in runs["root"]
    assert f"ok   volume: run dir {work}/volume/runs is on tmpfs at {work}/volume" in runs["volume"], runs["volume"]


# /proc/self/mountinfo as the kernel writes it inside each kind of container (id, parent, dev, the
# mount's root within its file system, mount point, options - type source options), and where the
# run dir is in each: (mountinfo, run dir, whether doctor must warn that it goes with the container).
ENROOT_ROOT = "601 560 259:1 /enroot-data/user-1000/pyxis_4242.0 / rw,nosuid,relatime - xfs /dev/nvme0n1p1 rw"
LUSTRE = "640 601 0:61 / /lustre rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,flock"
BOUND_LUSTRE = "641 601 0:61 /team/runs /lustre/team/runs rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw"
FUSE_OVERLAY = "900 850 0:77 / / rw,nodev,relatime - fuse.fuse-overlayfs fuse-overlayfs rw,user_id=0,allow_other"
HOST_ROOT = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw"
LAYERS = [
    ([ENROOT_ROOT], "/workspace/runs", True),  # enroot/Pyxis: the root is a host directory, bound
    ([ENROOT_ROOT, LUSTRE], "/lustre/team/runs", False),  # --container-mounts=/lustre:/lustre
    ([ENROOT_ROOT, BOUND_LUSTRE], "/lustre/team/runs", False),  # a bound subdirectory of the volume
    ([FUSE_OVERLAY], "/runs", True),  # rootless podman / docker with fuse-overlayfs
    ([HOST_ROOT], "/home/me/runs", False),  # no container: the host's own root
]


@pytest.mark.parametrize(("mountinfo", "run_dir", "warned"), LAYERS)
def test_doctor_knows_the_container_roots_that_are_not_a_volume(tmp_path, mountinfo, run_dir, warned):
    from ddpjob.tools import doctor

    table = tmp_path / "mountinfo"
    table.write_text("\n".join(mountinfo) + "\n")
    mount = doctor.mount_of(doctor.Path(run_dir), table)
    assert bool(doctor.container_layer(mount)) is warned, mount
