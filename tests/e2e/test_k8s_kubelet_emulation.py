"""Runs the rendered Kubernetes Indexed Job's pods as containers on a real Docker engine, doing
what the kubelet and the headless Service would: one container per completion index with
JOB_COMPLETION_INDEX, hostname <job>-<index>, DNS name <job>-<index>.<service>, the pod's env,
command (dumb-init as PID 1), args, user, capabilities, read-only root, /dev/shm and the checkpoint
volume. No API server exists here, so this emulates the kubelet; the job must complete."""

import subprocess

import pytest
import yaml

from e2e import REPO

pytestmark = pytest.mark.e2e


def parse_quantity(value: str) -> str:
    return value.replace("Gi", "g").replace("Mi", "m")


def docker_run_args(job: dict, index: int, network: str, volume: str) -> list[str]:
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    name = job["metadata"]["name"]
    labels = {"batch.kubernetes.io/job-name": name}
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:  # fieldRef: metadata.labels['...']
            key = item["valueFrom"]["fieldRef"]["fieldPath"].split("'")[1]
            env[item["name"]] = labels[key]
    sc, psc = container["securityContext"], pod["securityContext"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    args = [
        "docker",
        "run",
        "--detach",
        "--name",
        f"{name}-{index}",
        "--hostname",
        f"{name}-{index}",
        "--network",
        network,
        "--network-alias",
        f"{name}-{index}.{pod['subdomain']}",
        "--user",
        f"{psc['runAsUser']}:{psc['runAsGroup']}",
        "--cpus",
        container["resources"]["limits"]["cpu"],
        "--memory",
        parse_quantity(container["resources"]["limits"]["memory"]),
    ]
    if sc["capabilities"]["drop"] == ["ALL"]:
        args += ["--cap-drop", "ALL"]
    if sc["allowPrivilegeEscalation"] is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only"]
    for vol_name, path in mounts.items():
        vol = volumes[vol_name]
        if "persistentVolumeClaim" in vol:
            args += ["-v", f"{volume}:{path}"]
        elif vol["emptyDir"].get("medium") == "Memory" and path == "/dev/shm":
            args += ["--shm-size", parse_quantity(vol["emptyDir"]["sizeLimit"])]
        else:
            args += ["--tmpfs", f"{path}:uid={psc['runAsUser']}"]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    command = container.get("command", [])  # replaces the image's ENTRYPOINT, as in a pod
    if command:
        args += ["--entrypoint", command[0]]
    return [*args, container["image"], *command[1:], *container.get("args", [])]


def test_indexed_job_pods_complete_when_run_as_the_kubelet_would(docker_env):
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s/overlays/cpu")], capture_output=True, text=True, check=True
    ).stdout
    job = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Job")
    nodes = job["spec"]["completions"]
    network, volume = "ddpjob-e2e-k8s", "ddpjob-e2e-k8s-runs"
    names = [f"{job['metadata']['name']}-{i}" for i in range(nodes)]

    def docker(*args, check=False, timeout=60):
        return subprocess.run(
            ["docker", *args], env=docker_env, capture_output=True, text=True, check=check, timeout=timeout
        )

    docker("rm", "-f", *names)
    docker("network", "rm", network)
    docker("volume", "rm", volume)
    docker("network", "create", network, check=True)
    try:
        for i in range(nodes):
            subprocess.run(docker_run_args(job, i, network, volume), env=docker_env, check=True, capture_output=True)
        codes = [int(docker("wait", name, timeout=300).stdout.strip()) for name in names]
        logs = [docker("logs", name).stdout + docker("logs", name).stderr for name in names]
        assert codes == [0] * nodes, "\n".join(log[-2000:] for log in logs)
        assert "scheduler=kubernetes" in logs[0] and "ddpjob-0.ddpjob:29500" in logs[0]
        assert sum("done: step" in log for log in logs) == 1
        listing = docker(
            "run", "--rm", "-v", f"{volume}:/runs", "--entrypoint", "ls", "ddpjob:cpu", "/runs/ddpjob/checkpoints"
        ).stdout.split()
        assert "step-220.pt" in listing and "step-220.pt.sum" in listing
    finally:
        docker("rm", "-f", *names)
        docker("network", "rm", network)
        docker("volume", "rm", volume)
