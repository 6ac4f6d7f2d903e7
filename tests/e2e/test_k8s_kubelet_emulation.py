"""Runs the rendered Kubernetes Indexed Job's pods as containers on a real Docker engine, doing
what the kubelet and the headless Service would: one container per completion index with
JOB_COMPLETION_INDEX, hostname <job>-<index>, DNS name <job>-<index>.<service>, the pod's env
(envFrom Secrets resolved from data the test gives, as the kubelet reads them from the API),
command (dumb-init as PID 1), args, user, capabilities, read-only root, /dev/shm and the checkpoint
volume. No API server exists here, so this emulates the kubelet; the job must complete."""

import socket
import subprocess
from collections.abc import Mapping, Sequence

import pytest
import s3fs
import yaml

from ddpjob.checkpoint import catalogue, storage
from e2e import IMAGE, REPO, jsonl, volume_dir, wait_for
from k8s_controllers import Job, PodFailure
from kubeflow_operator import operator_env, trainer_v2_env
from s3server import S3Server

pytestmark = pytest.mark.e2e
# The image a node pulls for the name the manifests give (k8s/overlays/cpu's images:): the build under test.
PULLED = {"ddpjob:cpu": IMAGE}


def parse_quantity(value: str) -> str:
    return value.replace("Gi", "g").replace("Mi", "m")


def container_env(container: dict, labels: dict, secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """A container's environment as the kubelet builds it: every envFrom source first (a Secret's keys,
    with its prefix), then env, which wins (values, the downward API's fieldRefs).
    `secrets`: the namespace's Secrets, name -> data; a missing one that is not optional fails the pod
    (CreateContainerConfigError)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["secretRef"]  # the manifests use no configMapRef: a new source fails here, visibly
        optional = ref.get("optional", False)
        assert ref["name"] in secrets or optional, f"CreateContainerConfigError: secret {ref['name']!r} not found"
        data = secrets.get(ref["name"], {})
        env |= {source.get("prefix", "") + key: value for key, value in data.items()}
    for item in container.get("env", []):
        field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if "value" in item:
            env[item["name"]] = item["value"]
        elif field == "spec.nodeName":  # every emulated pod runs on this host, as on one node
            env[item["name"]] = socket.gethostname()
        else:  # fieldRef: metadata.labels['...']
            env[item["name"]] = labels[field.split("'")[1]]
    return env


def pod_run_args(
    pod: dict,
    name: str,
    labels: dict,
    added_env: dict,
    network: str,
    volume: str,
    extra: Sequence[str] = (),
    secrets: Mapping[str, Mapping[str, str]] = {},
) -> list[str]:
    """`docker run` of a pod's one container as the kubelet would run it: hostname `name`, the pod's
    env (container_env, from `secrets`; then `added_env`, what the controller adds), command, args,
    user, limits, capabilities, read-only root, /dev/shm and the checkpoint volume; `extra`: more
    docker run options."""
    (container,) = pod["containers"]
    env = container_env(container, labels, secrets)
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
    image = PULLED.get(container["image"], container["image"])
    return [*args, image, *command[1:], *container.get("args", [])]


def docker_run_args(
    job: dict,
    index: int,
    network: str,
    volume: str,
    extra: Sequence[str] = (),
    secrets: Mapping[str, Mapping[str, str]] = {},
) -> list[str]:
    """Pod `index` of an Indexed Job, named <job>-<index>.<subdomain> as the headless Service would."""
    pod, name = job["spec"]["template"]["spec"], job["metadata"]["name"]
    labels = {"batch.kubernetes.io/job-name": name}
    alias = ["--network-alias", f"{name}-{index}.{pod['subdomain']}", *extra]
    added = {"JOB_COMPLETION_INDEX": str(index)}
    return pod_run_args(pod, f"{name}-{index}", labels, added, network, volume, alias, secrets)


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


class Cluster:
    """One Docker network and checkpoint volume for a test's pods, removed afterwards."""

    def __init__(self, docker_env: dict[str, str], name: str) -> None:
        self.env, self.network, self.volume, self.pods = docker_env, f"ddpjob-e2e-{name}", f"ddpjob-e2e-{name}-runs", []

    def docker(self, *args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def run(self, name: str, args: list[str]) -> None:
        self.docker("rm", "-f", name)
        subprocess.run(args, env=self.env, check=True, capture_output=True)
        self.pods.append(name)

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n" + (self.docker("logs", n).stdout + self.docker("logs", n).stderr)[-2500:]
            for n in dict.fromkeys(self.pods)
        )

    def __enter__(self) -> "Cluster":
        self.__exit__()
        self.docker("network", "create", self.network, check=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pods:
            self.docker("rm", "-f", *dict.fromkeys(self.pods))
        self.docker("network", "rm", self.network)
        self.docker("volume", "rm", self.volume)


def test_pods_complete_with_kubeflow_trainer_v2s_environment(docker_env):
    """Trainer v2 runs a TrainJob as a JobSet (replicated job "node") and gives the trainer container
    only PET_* variables, its master at <trainjob>-node-0-0.<trainjob>:29400 (no MASTER_ADDR/PORT).
    The JobSet variant's pods, run with exactly that env and those DNS names, train to the end."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s/jobset")], capture_output=True, text=True, check=True
    ).stdout
    jobset = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "JobSet")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    train_job, nodes = "mnist", 2
    labels = {"batch.kubernetes.io/job-name": f"{train_job}-node-0"}
    with Cluster(docker_env, "trainer-v2") as cluster:
        names = [f"{train_job}-node-0-{i}" for i in range(nodes)]
        for i, name in enumerate(names):
            alias = ["--network-alias", f"{name}.{train_job}"]
            env = trainer_v2_env(train_job, nodes, i) | {"DDPJOB_EPOCHS": "1"}
            cluster.run(name, pod_run_args(pod, name, labels, env, cluster.network, cluster.volume, alias))
        codes = [cluster.docker("wait", n, timeout=300).stdout.strip() for n in names]
        assert codes == ["0"] * nodes, cluster.logs()
        log = cluster.docker("logs", names[0]).stdout
        assert "scheduler=kubeflow" in log and f"--rdzv-endpoint={train_job}-node-0-0.{train_job}:29400" in log


def test_three_drains_in_a_row_do_not_fail_a_three_pod_job(docker_env):
    """The Indexed Job's 3 pods run as the kubelet would, and what the Job controller does with each
    failed pod emulated (tests/k8s_controllers.py: podFailurePolicy, backoffLimit, replacement).
    Three times a node is drained: its pod gets the DisruptionTarget condition and SIGTERM (its
    grace period); every rank checkpoints and stops, the other pods too. Every pod that failed is
    judged by the Job's podFailurePolicy and, unless the Job failed, started again. The Job must
    not fail, count no failure, and complete from its checkpoints."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s/overlays/cpu")], capture_output=True, text=True, check=True
    ).stdout
    job = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Job")
    nodes = 3
    job["spec"] |= {"completions": nodes, "parallelism": nodes}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    settings = {"DDPJOB_NNODES": str(nodes), "PYTHONPATH": "/plugins", "DDPJOB_DATA": "slow_digits:digits(delay=0.02)"}
    settings |= {"DDPJOB_EPOCHS": "3", "DDPJOB_LOG_EVERY": "1", "DDPJOB_STOP_CHECK_EVERY": "2", "OMP_NUM_THREADS": "1"}
    container["env"] = [e for e in container["env"] if e["name"] not in settings]
    container["env"] += [{"name": k, "value": v} for k, v in settings.items()]
    extra = ["-v", f"{REPO}/tests/e2e/plugins:/plugins:ro"]
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    controller = Job(job["spec"])
    names = [f"{job['metadata']['name']}-{i}" for i in range(nodes)]

    with Cluster(docker_env, "drains") as cluster:

        def start(index: int) -> None:
            cluster.run(names[index], docker_run_args(job, index, cluster.network, cluster.volume, extra))

        def steps() -> list[int]:
            runs = volume_dir(docker_env, cluster.volume)
            recs = jsonl(runs / "ddpjob/metrics.jsonl") if runs else []
            return [r["step"] for r in recs if r["event"] == "train"]

        for i in range(nodes):
            start(i)
        for drained in (1, 0, 2):  # node 0 hosts the rendezvous store: its drain is one of them
            trained = len(steps())
            try:
                wait_for(lambda t=trained: len(steps()) > t + 2, 300, "training to go on")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{cluster.logs()}") from None
            cluster.docker("stop", "-t", str(grace), names[drained], timeout=grace + 30)  # kubectl drain
            failed = []
            for i, name in enumerate(names):
                code = int(cluster.docker("wait", name, timeout=grace + 120).stdout.strip())
                if code:  # the Job controller sees a Failed pod
                    evicted = ("DisruptionTarget",) if i == drained else ()
                    controller.pod_failed(PodFailure(name, code, evicted))
                    failed.append(i)
                    assert not controller.failed, (
                        f"the drain of pod {drained}: pod {i} exited {code}, which the Job counts as a failure\n"
                        + cluster.logs()
                    )
            assert controller.condition is None, (controller, cluster.logs())
            assert failed == list(range(nodes)), "a drain stops every rank"
            for i in failed:  # the controller replaces each pod that failed
                start(i)
        codes = [cluster.docker("wait", n, timeout=600).stdout.strip() for n in names]
        assert codes == ["0"] * nodes, cluster.logs()
        assert (controller.failed, controller.condition) == (0, None), controller
        assert controller.ignored >= 3 * nodes  # each drain stopped every pod, none of it counted
        assert max(steps()) == 3 * (1437 // (32 * nodes))


def test_indexed_job_with_the_s3_overlay_checkpoints_to_the_bucket_with_credentials_from_its_secret(
    tmp_path, docker_env, monkeypatch
):
    """k8s/overlays/s3 as documented: no PersistentVolumeClaim anywhere in it; the Secret ddpjob-s3
    (created here as `kubectl create secret` would: the key pair and the endpoint of a real S3 server,
    SeaweedFS on the Docker bridge's address) reaches the pods only through envFrom, as the kubelet
    resolves it. Both pods complete with nothing shared but the bucket, which holds a complete
    checkpoint of the final step, and the secret key is in no pod's log."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s/overlays/s3")], capture_output=True, text=True, check=True
    ).stdout
    assert "persistentvolumeclaim" not in rendered.lower()
    job = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    checkpoints = next(e["value"] for e in container["env"] if e["name"] == "DDPJOB_CHECKPOINT_DIR")
    bucket, final_step = checkpoints.removeprefix("s3://").split("/")[0], 6
    # The test's only additions, as a user's overlay would: a short run, one torch thread per pod.
    container["env"] += [
        {"name": "DDPJOB_MAX_STEPS", "value": str(final_step)},
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]
    bridge = subprocess.run(
        ["docker", "network", "inspect", "bridge", "-f", "{{(index .IPAM.Config 0).Gateway}}"],
        env=docker_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    server = S3Server(tmp_path / "s3", ip=bridge).start()
    try:
        creds = server.env()
        for key, value in creds.items():  # for this process's look at the bucket
            monkeypatch.setenv(key, value)
        s3 = s3fs.S3FileSystem(
            key=creds["AWS_ACCESS_KEY_ID"],
            secret=creds["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=creds["AWS_ENDPOINT_URL"],
            skip_instance_cache=True,
        )
        s3.mkdir(bucket)  # the user's bucket, named in the overlay
        keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")
        secrets = {"ddpjob-s3": {k: creds[k] for k in keys}}
        nodes = job["spec"]["completions"]
        names = [f"{job['metadata']['name']}-{i}" for i in range(nodes)]
        with Cluster(docker_env, "k8s-s3") as cluster:
            for i, name in enumerate(names):
                args = docker_run_args(job, i, cluster.network, cluster.volume, secrets=secrets)
                assert "-v" not in args  # no volume: each pod's run dir is its own emptyDir
                cluster.run(name, args)
            codes = [cluster.docker("wait", n, timeout=300).stdout.strip() for n in names]
            logs = [cluster.docker("logs", n).stdout + cluster.docker("logs", n).stderr for n in names]
            assert codes == ["0"] * nodes, cluster.logs()
            assert sum(f"done: step {final_step} " in log for log in logs) == 1, cluster.logs()
            assert all(creds["AWS_SECRET_ACCESS_KEY"] not in log for log in logs)
        # The server must outlive the pods; if it did not, its own log says why (a CI run once found
        # its port closed here, after both pods had completed).
        assert server.process is not None and server.process.poll() is None and server.answers(), server.log_tail()
        assert [s for s, _ in catalogue.complete(storage.location(checkpoints))] == [final_step]
    finally:
        server.stop()
