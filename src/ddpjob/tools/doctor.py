"""Preflight checks: is this node ready to join the job, and if not, what to change.

Run alone (``ddpjob doctor``, inside any launcher) or briefly by ``ddpjob launch`` before
rendezvous. Each check prints ok / warn / FAIL with the detail, and a fix for each problem.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpjob import log
from ddpjob.checkpoint import storage
from ddpjob.config import Config
from ddpjob.errors import Retriable, UsageError
from ddpjob.launch.plan import Plan

MIN_SHM = 256 << 20  # DataLoader workers and NCCL's shared-memory transport need more than Docker's 64 MB
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclass
class Finding:
    level: str  # "ok", "warn" or "FAIL" (blocking)
    check: str
    detail: str
    fix: str = ""


def interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for the interfaces that have one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def check_endpoint(plan: Plan, timeout: float, brief: bool) -> list[Finding]:
    if not plan.endpoint:
        return [Finding("ok", "rendezvous", "standalone (single node, local port)")]
    host, _, port_text = plan.endpoint.rpartition(":")
    port = int(port_text)
    try:
        addrs = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)})
    except socket.gaierror as exc:  # at start-up (a pod's DNS record may lag) only a warning
        return [
            Finding(
                "warn" if brief else "FAIL",
                "rendezvous",
                f"{host} does not resolve: {exc.strerror}",
                f"use node 0's IP address in --rdzv-endpoint, or add {host} to DNS / /etc/hosts",
            )
        ]
    findings = [Finding("ok", "rendezvous", f"{plan.endpoint} -> {', '.join(addrs)}")]
    if plan.nnodes > 1 and all(a.startswith("127.") for a in addrs) and host not in ("localhost", "127.0.0.1"):
        findings.append(
            Finding(
                "warn",
                "rendezvous",
                f"{host} resolves to loopback on this node",
                "other nodes cannot reach a loopback address: give node 0's real IP or fix /etc/hosts",
            )
        )
    try:
        with socket.create_connection((addrs[0], port), timeout=timeout):
            findings.append(Finding("ok", "reachable", f"TCP connect to {addrs[0]}:{port} works"))
    except ConnectionRefusedError:
        level = "ok" if plan.node_rank == 0 or brief else "warn"
        findings.append(
            Finding(
                level,
                "reachable",
                f"{addrs[0]}:{port} refused the connection (nothing listening yet)",
                "" if level == "ok" else "start node 0 first, or check that --rdzv-endpoint names node 0",
            )
        )
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        findings.append(
            Finding(
                "warn" if brief else "FAIL",
                "reachable",
                f"{addrs[0]}:{port}: {reason}",
                f"open TCP port {port} between nodes (firewall, security group, NetworkPolicy)",
            )
        )
    return findings


def check_interfaces(plan: Plan) -> list[Finding]:
    nics = interfaces()
    findings = []
    host = plan.endpoint.rpartition(":")[0]
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(host), 9))  # no packet is sent; picks the route
                local = s.getsockname()[0]
            name = next((n for n, a in nics.items() if a == local), "?")
            findings.append(Finding("ok", "interface", f"traffic to {host} leaves via {name} ({local})"))
        except OSError:
            pass
    for var in IFNAME_VARS:
        value = os.environ.get(var)
        if not value:
            continue
        names = [n.lstrip("^=") for n in value.split(",")]
        missing = [n for n in names if not value.startswith("^") and not any(i.startswith(n) for i in nics)]
        if missing:
            findings.append(
                Finding(
                    "FAIL",
                    "interface",
                    f"{var}={value}, but this node has no {', '.join(missing)} (it has {', '.join(nics)})",
                    f"unset {var} or set it to one of {', '.join(nics)}",
                )
            )
        else:
            findings.append(Finding("ok", "interface", f"{var}={value}"))
    return findings


def check_shm(cfg: Config, plan: Plan) -> Finding:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return Finding("warn", "/dev/shm", "missing", "mount a tmpfs at /dev/shm")
    size = stat.f_frsize * stat.f_blocks
    needs = cfg.num_workers > 0 or (torch.cuda.is_available() and plan.nproc_per_node > 1)
    detail = f"{size / 2**20:.0f} MiB"
    if size >= MIN_SHM or not needs:
        return Finding("ok", "/dev/shm", detail)
    return Finding(
        "FAIL",
        "/dev/shm",
        f"{detail}, too small for DataLoader workers / NCCL (need {MIN_SHM >> 20} MiB)",
        "docker run --shm-size=8g / compose shm_size / k8s emptyDir medium: Memory on /dev/shm",
    )


def check_devices() -> Finding:
    if not torch.cuda.is_available():
        return Finding("ok", "devices", f"no CUDA device; CPU with gloo (torch {torch.__version__})")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Finding(
        "ok",
        "devices",
        f"{torch.cuda.device_count()} x CUDA ({names}); CUDA {torch.version.cuda}, "
        f"NCCL {nccl}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}",
    )


def check_store(url: str) -> Finding:
    """A checkpoint dir in an object store: the start-up probe (the bucket, a list, a write and a delete)."""
    where = storage.location(url)
    try:
        storage.of(where).probe(where)
    except (UsageError, Retriable) as exc:
        return Finding("FAIL", "checkpoints", str(exc), "fix the bucket, the credentials or AWS_ENDPOINT_URL")
    return Finding("ok", "checkpoints", f"{url}: listed, written and deleted a probe object")


def check_disk(cfg: Config) -> Finding:
    if storage.is_url(cfg.checkpoint_dir):
        return check_store(cfg.checkpoint_dir)
    directory = cfg.checkpoint_path
    probe = next((p for p in [directory, *directory.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if not os.access(probe, os.W_OK):
        return Finding("FAIL", "checkpoints", f"{probe} is not writable", "choose a writable --checkpoint-dir")
    try:
        from ddpjob.plugins import build_model

        with torch.device("meta"):
            model = build_model(cfg.model)
        size = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + AdamW moments
    except Exception:  # a model that cannot be built on meta: skip the estimate
        size = 0
    need = (cfg.keep + 1) * size
    detail = f"{free / 2**30:.1f} GiB free at {probe}; about {size / 2**20:.1f} MiB per checkpoint"
    if free < need:
        return Finding(
            "FAIL",
            "checkpoints",
            detail + f", {cfg.keep + 1} needed at once",
            "free space, lower --keep, or point --checkpoint-dir at larger storage",
        )
    return Finding("ok", "checkpoints", detail)


def check_cpus(cfg: Config, plan: Plan) -> Finding:
    """Enough CPUs in this process's affinity for every worker and its DataLoader workers: a Slurm
    step gets one CPU per task unless srun asks for more (srun no longer inherits --cpus-per-task)."""
    cpus = len(os.sched_getaffinity(0))
    need = plan.nproc_per_node * (1 + cfg.num_workers)
    detail = f"{cpus} in this process's affinity for {plan.nproc_per_node} workers x (1 + {cfg.num_workers} loaders)"
    if cpus >= need:
        return Finding("ok", "cpus", detail)
    return Finding(
        "warn",
        "cpus",
        f"{detail}: {need} processes share {cpus} CPU{'s' if cpus > 1 else ''}",
        "Slurm: sbatch --cpus-per-task=N or --exclusive, and srun --cpus-per-task=$SLURM_CPUS_PER_TASK "
        "(slurm/train.sbatch passes it); Kubernetes: resources cpu; or fewer --num-workers",
    )


@dataclass(frozen=True)
class Mount:
    point: str  # where it is mounted
    fstype: str
    root: str  # the directory of its file system mounted there ("/": all of it; else a bind mount)


def mount_of(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> Mount:
    """The mount that holds `path`, from the kernel's mountinfo table (the deepest mount point above it)."""
    path = path.resolve()
    best = Mount("/", "?", "/")
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        root, point = (f.replace("\\040", " ") for f in fields[3:5])
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best.point):
            best = Mount(point, fields[fields.index("-") + 1], root)
    return best


OVERLAYS = ("overlay", "fuse.fuse-overlayfs", "aufs")  # the writable layers of container roots


def container_layer(mount: Mount) -> str:
    """Why a run dir on `mount` goes with the container, or "" when it does not seem to."""
    if mount.fstype in OVERLAYS:
        return f"{mount.fstype}: the container's own writable layer"
    if mount.point == "/" and mount.root != "/" and mount.fstype != "btrfs":  # btrfs: a host's root subvolume
        return f"the container's root, the host's directory {mount.root}, as enroot/Pyxis unpack an image"
    return ""


def check_volume(cfg: Config) -> Finding:
    """The run dir on a volume, not on the container's own root, which goes with the container:
    a volume that is not mounted (a missing mount, Pyxis or apptainer without the run dir mounted, an
    image's DDPJOB_RUN_DIR that won over the job's). What it recognises (container_layer): an
    overlay-type root (docker, containerd, CRI-O: overlay; rootless podman: fuse-overlayfs; aufs),
    and a root that is a bound directory of the host (enroot/Pyxis, and runtimes that unpack an
    image into a directory). Not recognised: a root on a btrfs subvolume (docker's btrfs driver),
    which looks like a host's own btrfs root. A Kubernetes claim that stays Pending keeps the pod
    Pending, so no check inside the pod sees it: the fix names where to look."""
    probe = next((p for p in [Path(cfg.run_dir), *Path(cfg.run_dir).absolute().parents] if p.exists()), Path("/"))
    mount = mount_of(probe)
    detail = f"run dir {cfg.run_dir} is on {mount.fstype} at {mount.point}"
    if not (why := container_layer(mount)):
        return Finding("ok", "volume", detail)
    return Finding(
        "warn",
        "volume",
        f"{detail} ({why}), not a mounted volume; checkpoints and records go with the container",
        "mount the shared volume there (compose: runs:/runs; Pyxis: --container-mounts; Kubernetes: the claim "
        "ddpjob-runs; pods that stay Pending with it: `kubectl get pvc ddpjob-runs` shows it Pending when no "
        "ReadWriteMany storage class serves it) or point --run-dir at a mounted one",
    )


def run(cfg: Config, plan: Plan, brief: bool = False) -> list[Finding]:
    node = "?" if plan.node_rank is None else plan.node_rank
    findings = [
        Finding(
            "ok",
            "topology",
            f"scheduler {plan.scheduler} ({plan.why}); node {node} of {plan.nodes}, "
            f"{plan.nproc_per_node} processes per node, host {socket.gethostname()}",
        )
    ]
    findings += check_endpoint(plan, timeout=1.0 if brief else 3.0, brief=brief)
    findings += check_interfaces(plan)
    findings += [check_shm(cfg, plan), check_cpus(cfg, plan), check_devices(), check_disk(cfg), check_volume(cfg)]
    return findings


def report(findings: list[Finding], brief: bool = False) -> bool:
    """Print the findings (only problems when brief); True if nothing blocks."""
    for f in findings:
        if brief and f.level == "ok":
            continue
        log.info(f"doctor: {f.level:<4} {f.check}: {f.detail}")
        if f.fix:
            log.info(f"doctor:      fix: {f.fix}")
    return not any(f.level == "FAIL" for f in findings)
