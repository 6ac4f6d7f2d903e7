"""Runs the rendered Kubernetes Indexed Job's pods as containers on a real Docker engine, doing
what the kubelet and the headless Service would: one container per completion index with
JOB_COMPLETION_INDEX, hostname <job>-<index>, DNS name <job>-<index>.<service>, the pod's env,
command (dumb-init as PID 1), args, user, capabilities, read-only root, /dev/shm and the checkpoint
volume. No API server exists here, so this emulates the kubelet; the job must complete."""

import socket
import subprocess
from collections.abc import Sequence

import pytest
import yaml

from e2e import REPO, jsonl, volume_dir, wait_for
from kubeflow_operator import operator_env

pytestmark = pytest.mark.e2e


def parse_quantity(value: str) -> str:
    return value.replace("Gi", "g").replace("Mi", "m")


def pod_run_args(
    pod: dict, name: str, labels: dict, added_env: dict, network: str, volume: str, extra: Sequence[str] = ()
) -> list[str]:
    """`docker run` of a pod's one container as the kubelet would run it: hostname `name`, the pod's
    env (then `added_env`, what the controller adds), command, args, user, limits, capabilities,
    read-only root, /dev/shm and the checkpoint volume; `extra`: more docker run options."""
    (container,) = pod["containers"]
    env = {}
    for item in container["env"]:
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if "value" in item:
            env[item["name"]] = item["value"]
        elif field == "spec.nodeName":  # every emulated pod runs on this host, as on one node
            env[item["name"]] = socket.gethostname()
        else:  # fieldRef: metadata.labels['...']
            env[item["name"]] = labels[field.split("'")[1]]
    env |= added_env
    sc, psc = container["securityContext"], pod["securityContext"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    args = [
        "docker",
        "run",
        "--detach",
        "--name",
        name,
        "--hostname",
        name,
        "--network",
        network,
        "--user",
        f"{psc['runAsUser']}:{psc['runAsGroup']}",
        "--cpus",
        container["resources"]["limits"]["cpu"],
        "--memory",
        parse_quantity(container["resources"]["limits"]["memory"]),
        *extra,
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


def docker_run_args(job: dict, index: int, network: str, volume: str) -> list[str]:
    """Pod `index` of an Indexed Job, named <job>-<index>.<subdomain> as the headless Service would."""
    pod, name = job["spec"]["template"]["spec"], job["metadata"]["name"]
    labels = {"batch.kubernetes.io/job-name": name}
    alias = ["--network-alias", f"{name}-{index}.{pod['subdomain']}"]
    return pod_run_args(pod, f"{name}-{index}", labels, {"JOB_COMPLETION_INDEX": str(index)}, network, volume, alias)


LM_ARGS = ["--model", "examples.lm:tiny_lm", "--data", "examples.lm:stdlib_text", "--epochs", "1"]


@pytest.mark.parametrize(
    ("args", "final_step"),
    [([], 220), ([*LM_ARGS, "--max-steps", "10", "--batch-size", "4", "--save-every", "0"], 10)],
    ids=["as-rendered", "lm"],
)
def test_indexed_job_pods_complete_when_run_as_the_kubelet_would(docker_env, args, final_step):
    """`args`: appended to the container's args, as a user's overlay would (the LM: the image's examples/
    import under the pod's read-only root and non-root user)."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s/overlays/cpu")], capture_output=True, text=True, check=True
    ).stdout
    job = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container["args"] = [*container.get("args", []), *args]
    if args:  # one torch thread per pod: both share this host's 2 cores
        container["env"].append({"name": "OMP_NUM_THREADS", "value": "1"})
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
        assert sum(f"done: step {final_step} " in log for log in logs) == 1
        listing = docker(
            "run", "--rm", "-v", f"{volume}:/runs", "--entrypoint", "ls", "ddpjob:cpu", "/runs/ddpjob/checkpoints"
        ).stdout.split()
        assert f"step-{final_step}.pt" in listing and f"step-{final_step}.pt.sum" in listing
    finally:
        docker("rm", "-f", *names)
        docker("network", "rm", network)
        docker("volume", "rm", volume)


def test_elastic_pytorchjob_pods_resize_and_complete_as_the_operator_and_kubelet_would(docker_env):
    """k8s/kubeflow-elastic's pods as containers, each with the env the training-operator adds
    (PET_NNODES=1:4, PET_RDZV_ENDPOINT at the Master, PET_NODE_RANK, ...) and named as its per-pod
    Services name them: Master + 1 Worker train at world size 2; `kubectl scale --replicas=2` adds
    ddpjob-worker-1 (3); scaling back to 1 deletes that pod (SIGTERM, its grace period) (2). The
    Master, which hosts the rendezvous, completes the run at the final step."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s/kubeflow-elastic")], capture_output=True, text=True, check=True
    ).stdout
    job = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "PyTorchJob")
    name, specs = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    network, volume = "ddpjob-e2e-kf", "ddpjob-e2e-kf-runs"
    labels = {"training.kubeflow.org/job-name": name}
    # The test's only additions: a data plug-in that sleeps per sample (~1.5 s a step at 2 nodes),
    # mounted read-only, and a short run.
    extra = ["-v", f"{REPO}/tests/e2e/plugins:/plugins:ro"]
    settings = {"PYTHONPATH": "/plugins", "DDPJOB_DATA": "slow_digits:digits(delay=0.03)", "DDPJOB_EPOCHS": "4"}
    settings |= {"DDPJOB_LOG_EVERY": "1", "DDPJOB_STOP_CHECK_EVERY": "2"}
    final = 4 * (1437 // 96)  # digits: 1437 training samples, 14 steps of the global batch 96 an epoch
    pods = {"Master": ["ddpjob-master-0"], "Worker": ["ddpjob-worker-0", "ddpjob-worker-1"]}
    names = [pod for group in pods.values() for pod in group]

    def docker(*args, check=False, timeout=60):
        return subprocess.run(
            ["docker", *args], env=docker_env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def start(rtype, index, workers):
        scaled = {**job, "spec": {**job["spec"], "pytorchReplicaSpecs": {**specs, "Worker": {**specs["Worker"]}}}}
        scaled["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = workers
        env = operator_env(scaled, rtype, index) | settings
        pod = specs[rtype]["template"]["spec"]
        args = pod_run_args(pod, f"{name}-{rtype.lower()}-{index}", labels, env, network, volume, extra)
        subprocess.run(args, env=docker_env, check=True, capture_output=True)

    def records():
        runs = volume_dir(docker_env, volume)
        return jsonl(runs / "ddpjob/metrics.jsonl") if runs else []

    def started(world):
        return [r for r in records() if r["event"] == "start" and r["world_size"] == world]

    def logs():
        return "\n".join(f"--- {n}\n" + (docker("logs", n).stdout + docker("logs", n).stderr)[-2500:] for n in names)

    docker("rm", "-f", *names)
    docker("network", "rm", network)
    docker("volume", "rm", volume)
    docker("network", "create", network, check=True)
    try:
        start("Master", 0, workers=1)
        start("Worker", 0, workers=1)
        try:
            wait_for(lambda: started(2), 180, "a start at world size 2 (Master + 1 Worker)")
            start("Worker", 1, workers=2)  # kubectl scale pytorchjob/ddpjob --replicas=2
            wait_for(lambda: started(3), 180, "a start at world size 3 after the scale-up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        grace = specs["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"]
        docker("stop", "-t", str(grace), "ddpjob-worker-1", timeout=grace + 30)  # --replicas=1: the pod is deleted
        master = docker("wait", "ddpjob-master-0", timeout=400).stdout.strip()
        codes = {n: docker("wait", n, timeout=60).stdout.strip() for n in names}
        assert master == "0" and codes == {"ddpjob-master-0": "0", "ddpjob-worker-0": "0", "ddpjob-worker-1": "75"}, (
            codes,
            logs(),
        )
        master_log = docker("logs", "ddpjob-master-0").stdout
        assert "scheduler=kubeflow" in master_log and "--rdzv-endpoint=ddpjob-master-0:23456" in master_log
        recs = records()
        resizes = [(r["old_world_size"], r["world_size"]) for r in recs if r["event"] == "resize"]
        assert (2, 3) in resizes and resizes[-1] == (3, 2), resizes
        assert {r["global_batch"] for r in recs if r["event"] in ("start", "resize")} == {96}
        assert max(r["step"] for r in recs if r["event"] == "train") == final
        assert (volume_dir(docker_env, volume) / f"ddpjob/checkpoints/step-{final}.pt").is_file()
    finally:
        docker("rm", "-f", *names)
        docker("network", "rm", network)
        docker("volume", "rm", volume)
