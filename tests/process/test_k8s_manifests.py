"""Kubernetes manifests (and compose.yaml's security settings): each variant renders with kustomize
and validates against the official schemas (and the Kubeflow / JobSet CRD schemas); security,
network and failure policies are as documented."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ddpjob import errors
from helpers import PYTHONPATH
from k8s_controllers import Job, JobSet, PodFailure
from kubeflow_operator import TRAINER_V2_PORT, operator_env, trainer_v2_env

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"
VARIANTS = [
    "overlays/cpu",
    "overlays/gpu",
    "kubeflow",
    "kubeflow-elastic",
    "jobset",
    "overlays/preflight",
    "overlays/kueue",
    "jobset-kueue",
    "overlays/s3",
]
OBJECT_STORE = {"overlays/s3"}  # variants whose checkpoints go to a bucket: no shared volume
QUEUED = {"overlays/kueue": "overlays/cpu", "jobset-kueue": "jobset"}  # Kueue variant: the variant it queues
CRDS = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "JobSet": "jobset.x-k8s.io_jobsets.yaml"}
# The label each controller puts on every pod of a workload, with the workload's name as its value.
POD_LABEL = {
    "Job": "batch.kubernetes.io/job-name",
    "JobSet": "jobset.sigs.k8s.io/jobset-name",
    "PyTorchJob": "training.kubeflow.org/job-name",
}


def render(variant: str) -> list[dict]:
    assert shutil.which("kubectl"), "kubectl (with kustomize) is needed to render k8s/; install the kubectl client"
    out = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s" / variant)], capture_output=True, text=True, check=True
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def crd_schema(kind: str, version: str) -> dict:
    crd = yaml.safe_load((REPO / "tests/data/crds" / CRDS[kind]).read_text())
    return next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)


def pod_specs(obj: dict) -> list[dict]:
    spec = obj["spec"]
    if obj["kind"] == "Job":
        return [spec["template"]["spec"]]
    if obj["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in spec["pytorchReplicaSpecs"].values()]
    if obj["kind"] == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in spec["replicatedJobs"]]
    return []


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates_against_its_schema(variant):
    objects = render(variant)
    assert objects
    for obj in objects:
        if obj["kind"] in CRDS:
            jsonschema.validate(obj, crd_schema(obj["kind"], obj["apiVersion"].split("/")[1]))
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_run_as_non_root_without_privilege(variant):
    pods = [p for obj in render(variant) for p in pod_specs(obj)]
    assert pods
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc.get("privileged") is not True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"] and c["resources"]["limits"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("variant", ["overlays/cpu", "overlays/gpu"])
def test_indexed_job_names_its_nodes_through_a_headless_service(variant):
    objects = {obj["kind"]: obj for obj in render(variant)}
    job, service = objects["Job"], objects["Service"]
    assert job["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert int(env["DDPJOB_NNODES"]["value"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"] == env["JOB_SERVICE"]["value"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}


def test_job_fails_fast_on_bad_input_and_retries_preemption():
    job = next(o for o in render("overlays/cpu") if o["kind"] == "Job")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "ddpjob", "operator": "In", "values": [2]}} in rules
    disrupted = [{"type": "DisruptionTarget", "status": "True"}]
    assert any(r["action"] == "Ignore" and r.get("onPodConditions") == disrupted for r in rules)
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_gpu_overlay_requests_gpus_and_the_cuda_image():
    job = next(o for o in render("overlays/gpu") if o["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["image"] == "ddpjob:cuda"


def test_schema_validation_rejects_a_broken_manifest():
    job = next(o for o in render("overlays/cpu") if o["kind"] == "Job")
    job["spec"]["completionMode"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pytorchjob = next(o for o in render("kubeflow") if o["kind"] == "PyTorchJob")
    pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pytorchjob, crd_schema("PyTorchJob", "v1"))
    policy = next(o for o in render("overlays/cpu") if o["kind"] == "NetworkPolicy")
    policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabel"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_get_no_service_account_token_and_no_host_namespaces(variant):
    pods = [p for obj in render(variant) for p in pod_specs(obj)]
    assert pods
    for pod in pods:
        assert pod["automountServiceAccountToken"] is False
        assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_run_launch_under_an_init_that_reaps_zombies(variant):
    pods = [p for obj in render(variant) for p in pod_specs(obj)]
    ddpjob = ["ddpjob", "doctor", "--all-nodes"] if variant == "overlays/preflight" else ["ddpjob", "launch"]
    for pod in pods:
        (container,) = pod["containers"]
        command = container["command"]
        assert command[0] == "dumb-init" and command[command.index("--") + 1 :] == ddpjob, command
        assert "--single-child" in command  # SIGTERM goes to launch, which stops its workers in order


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_know_their_kubernetes_node_for_the_preflight_cordon_line(variant):
    pods = [p for obj in render(variant) for p in pod_specs(obj)]
    assert pods
    for pod in pods:
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_preflight_job_is_the_training_job_checking_nodes_without_retries():
    """A named node, and a node that cannot reach the rendezvous (what the check is for), fail the
    preflight Job at once: no retry, none free of charge, and a deadline of its own."""
    (preflight,) = [o for o in render("overlays/preflight") if o["kind"] == "Job"]
    (training,) = [o for o in render("overlays/cpu") if o["kind"] == "Job"]
    assert preflight["spec"]["backoffLimit"] == 0  # a named node fails the Job: a retry measures the same
    for code in EXIT_CODES.values():  # the training Job's free exit codes (69, 75) are failures here
        job = Job(preflight["spec"])
        job.pod_failed(PodFailure("ddpjob-1", code))
        assert job.condition, code
    assert 0 < preflight["spec"]["activeDeadlineSeconds"] <= 3600  # pods that are never all placed
    for job in (preflight, training):  # all but these: the same pods, names and rendezvous
        job["spec"]["template"]["spec"]["containers"][0].pop("command")
        for key in ("backoffLimit", "podFailurePolicy", "activeDeadlineSeconds"):
            job["spec"].pop(key, None)
    assert preflight == training


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_lets_only_the_jobs_own_pods_in(variant):
    objects = render(variant)
    (workload,) = [o for o in objects if o["kind"] in POD_LABEL]
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    own_pods = {"matchLabels": {POD_LABEL[workload["kind"]]: workload["metadata"]["name"]}}
    spec = policy["spec"]
    assert spec["podSelector"] == own_pods  # it applies to the job's pods (and only them)
    assert "Ingress" in spec["policyTypes"]
    assert spec["ingress"], "an empty ingress list would shut the pods off from each other"
    for rule in spec["ingress"]:
        # every rule names its sources: no rule without `from` (that admits everyone), no
        # namespaceSelector or ipBlock, only the job's own pods
        assert rule["from"] == [{"podSelector": own_pods}], rule
    if workload["kind"] == "Job":  # the headless Service that names the pods selects the same pods
        service = next(o for o in objects if o["kind"] == "Service")
        assert service["spec"]["selector"] == own_pods["matchLabels"]


def launch_dry_run(container: dict, env: dict[str, str], cwd: Path) -> list[str]:
    """torchrun's arguments as `ddpjob launch --dry-run` derives them in that container's env (less
    the entries the kubelet fills in, valueFrom: NODE_NAME, which launch does not read)."""
    args = [*container["command"][container["command"].index("launch") + 1 :], *container.get("args", [])]
    env = (
        {"PATH": os.environ["PATH"], "HOME": str(cwd), "PYTHONPATH": PYTHONPATH}
        | {e["name"]: e["value"] for e in container["env"] if "value" in e}
        | env
    )
    launch = [sys.executable, "-m", "ddpjob", "launch", "--dry-run"]
    proc = subprocess.run([*launch, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[ddpjob] launch: torchrun "))
    return line.removeprefix("[ddpjob] launch: torchrun ").split()


def test_elastic_pytorchjob_resizes_around_the_master_with_a_global_batch(tmp_path):
    """The elastic variant: an elasticPolicy the operator turns into PET_NNODES=MIN:MAX with a c10d
    rendezvous at the Master, which hosts it (node rank 0) and must stay up while Workers come and
    go; every world size in MIN..MAX trains the same run (--global-batch-size splits at each)."""
    (job,) = [o for o in render("kubeflow-elastic") if o["kind"] == "PyTorchJob"]
    policy, replicas = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]
    low, high = policy["minReplicas"], policy["maxReplicas"]
    assert 1 <= low < high and policy["rdzvBackend"] == "c10d" and policy["maxRestarts"] > 0
    assert replicas["Master"]["replicas"] == 1 and low <= 1 + replicas["Worker"]["replicas"] <= high
    assert "metrics" not in policy  # no autoscaler: it would scale Workers up to maxReplicas, one node too many

    pods = [("Master", 0), ("Worker", 0), ("Worker", high - 2)]  # the last: a Worker a scale-up adds
    runs = {}
    for rtype, index in pods:
        (container,) = replicas[rtype]["template"]["spec"]["containers"]
        assert "--nnodes" not in container.get("args", []) and not any(
            e["name"] == "DDPJOB_NNODES" for e in container["env"]
        ), "the node range must come from the operator's PET_NNODES, not the manifest"
        env = operator_env(job, rtype, index)
        assert env["PET_NNODES"] == f"{low}:{high}"
        runs[rtype, index] = launch_dry_run(container, env, tmp_path)

    for (rtype, index), cmd in runs.items():
        opts = dict(a.removeprefix("--").split("=", 1) for a in cmd[: cmd.index("-m")])
        assert opts["nnodes"] == f"{low}:{high}" and opts["rdzv-backend"] == "c10d"
        assert opts["rdzv-endpoint"] == f"{job['metadata']['name']}-master-0:{policy['rdzvPort']}"
        conf = dict(kv.split("=") for kv in opts["rdzv-conf"].split(","))
        assert conf["is_host"] == str(int(rtype == "Master")), (rtype, index, conf)  # the Master hosts the store
        assert "last_call_timeout" in conf
        assert int(opts["max-restarts"]) == policy["maxRestarts"], "maxRestarts must reach torchrun (PET_MAX_RESTARTS)"
        train = cmd[cmd.index("train") + 1 :]
        flags = dict(zip(train[::2], train[1::2], strict=True))
        assert "--global-batch-size" in flags, f"without it a resize changes the run: {train}"
        global_batch, batch = int(flags["--global-batch-size"]), int(flags["--batch-size"])
        nproc = int(opts["nproc-per-node"])
        for nodes in range(low, high + 1):  # else a resize to that many nodes exits 2
            assert global_batch % (batch * nodes * nproc) == 0, f"{global_batch} does not split on {nodes} nodes"


def test_pods_start_with_kubeflow_trainer_v2s_environment(tmp_path):
    """Trainer v2 (TrainJob on a JobSet) gives each node's container only PET_* variables, its
    master at <trainjob>-node-0-0.<trainjob>:29400: the PyTorchJob's container, run with exactly
    that env, derives the endpoint and node rank from them, and node 0 hosts the store."""
    (job,) = [o for o in render("kubeflow") if o["kind"] == "PyTorchJob"]
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    for index in range(2):
        cmd = launch_dry_run(container, trainer_v2_env("mnist", 2, index), tmp_path)
        opts = dict(a.removeprefix("--").split("=", 1) for a in cmd[: cmd.index("-m")])
        assert opts["nnodes"] == "2" and opts["rdzv-endpoint"] == f"mnist-node-0-0.mnist:{TRAINER_V2_PORT}"
        assert f"is_host={int(index == 0)}" in opts["rdzv-conf"]


# Every exit code ddpjob names, and what each scheduler's retry budget must make of it: bad input
# fails the job at once; a stop with a checkpoint and a rendezvous that never formed are retried
# without counting (launch bounds the second: --rdzv-retries); the rest count.
EXIT_CODES = {name: code for name, code in vars(errors).items() if name.startswith("EXIT_") and code}
FREE = {errors.EXIT_PREEMPTED, errors.EXIT_NO_RENDEZVOUS}


def drain(job: Job, pods: int, drained: int) -> None:
    """A drain of pod `drained`'s node: it is evicted (DisruptionTarget) and exits 75 with the
    checkpoint; every rank stops at the same step, so the pods that got no signal exit 75 too."""
    for index in range(pods):
        evicted = ("DisruptionTarget",) if index == drained else ()
        job.pod_failed(PodFailure(f"ddpjob-{index}", errors.EXIT_PREEMPTED, evicted))


def test_three_drains_in_a_row_on_a_three_pod_job_use_none_of_its_retries():
    (spec,) = [o["spec"] for o in render("overlays/cpu") if o["kind"] == "Job"]
    spec |= {"completions": 3, "parallelism": 3}
    job = Job(spec)
    for drained in (0, 1, 2):
        drain(job, 3, drained)
    assert job.condition is None and job.failed == 0 and job.ignored == 9


@pytest.mark.parametrize(("name", "code"), EXIT_CODES.items(), ids=EXIT_CODES)
def test_the_jobs_retry_budget_counts_only_real_failures(name, code):
    (spec,) = [o["spec"] for o in render("overlays/cpu") if o["kind"] == "Job"]
    job = Job(spec)
    job.pod_failed(PodFailure("ddpjob-1", code))
    if code == errors.EXIT_BAD_INPUT:
        assert job.condition and job.condition[0] == "PodFailurePolicy", name
    else:
        assert (job.failed, job.condition) == (int(code not in FREE), None), name


@pytest.mark.parametrize("variant", ["overlays/cpu", "overlays/gpu", "overlays/kueue"])
def test_no_deadline_ends_a_long_training_run(variant):
    """activeDeadlineSeconds bounds the Job's whole run, training included: the variants set none
    (docs/clusters.md: a knob). What is retried without counting is bounded without it: a checkpointed
    stop (75) is progress, and launch turns the rendezvous failures past --rdzv-retries into exit 1."""
    (job,) = [o for o in render(variant) if o["kind"] == "Job"]
    assert "activeDeadlineSeconds" not in job["spec"]


@pytest.mark.parametrize(
    ("name", "code", "conditions"),
    [*((name, code, ()) for name, code in EXIT_CODES.items()), ("evicted", 137, ("DisruptionTarget",))],
)
def test_jobset_restarts_a_stopped_node_without_counting_and_fails_on_bad_input(name, code, conditions):
    (jobset,) = [o for o in render("jobset") if o["kind"] == "JobSet"]
    (child,) = [r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]]
    job = Job(child)
    job.pod_failed(PodFailure("ddpjob-node-0-1", code, conditions))
    assert job.condition, f"{name}: the child Job (backoffLimit 0) fails at its first failed pod"
    action = JobSet(jobset["spec"]).child_failed(*job.condition)
    if code == errors.EXIT_BAD_INPUT:
        assert action == "FailJobSet"
    elif code == errors.EXIT_PREEMPTED or conditions:
        assert action == "RestartJobSetAndIgnoreMaxRestarts", (name, job.condition)
    else:  # JobSet has no deadline over its restarts: maxRestarts bounds a rendezvous that never formed
        assert action == "RestartJobSet", (name, job.condition)


def test_three_drains_in_a_row_restart_a_jobset_without_counting():
    (jobset,) = [o for o in render("jobset") if o["kind"] == "JobSet"]
    (child,) = [r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]]
    js = JobSet(jobset["spec"])
    for drained in (0, 1, 2):
        job = Job(child)  # a restart recreates the child Jobs
        drain(job, child["completions"], drained % child["completions"])
        js.child_failed(*job.condition)
    assert (js.restarts, js.counted, js.failed) == (3, 0, False), js.actions


def compose_command() -> list[str] | None:
    """Docker Compose: the docker CLI plugin, else a docker-compose binary on PATH or beside this Python."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    found = shutil.which("docker-compose") or shutil.which("docker-compose", path=str(Path(sys.executable).parent))
    return [found] if found else None


def rendered_compose(*files: str, env: dict[str, str]) -> dict:
    """The merged config of compose `files`, as Compose renders it where it is installed, else as
    this file's merge of the `services` (an override's keys replace the base's, maps merge)."""
    command = compose_command()
    if command:
        args = [
            *command,
            *(a for f in files for a in ("-f", f)),
            "--profile",
            "preflight",
            "config",
        ]
        out = subprocess.run(args, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        return yaml.safe_load(out.stdout)

    def merge(base: dict, over: dict) -> dict:
        return {
            k: merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
            for k, v in {**base, **over}.items()
        }

    merged: dict = {}
    for f in files:
        text = (REPO / f).read_text()
        for key, value in env.items():
            text = text.replace(f"${{{key}:-2}}", value)
        merged = merge(merged, yaml.safe_load(text))
    return merged


def test_compose_gpu_override_reserves_each_gpu_for_one_container():
    """`count: all` (or a device_ids list) is per container: two replicas on the one host would
    each hold every GPU and run a rank on each, twice the memory and TCP between them."""
    config = rendered_compose("compose.yaml", "compose.gpu.yaml", env={"DDPJOB_NNODES": "2"})
    gpu_services = {
        name: s
        for name, s in config["services"].items()
        if any("gpu" in d.get("capabilities", []) for d in s["deploy"]["resources"]["reservations"]["devices"])
    }
    assert set(gpu_services) == {"node", "preflight"}
    for name, service in gpu_services.items():
        assert int(service["deploy"]["replicas"]) == 1, name
        assert str(service["environment"]["DDPJOB_NNODES"]) == "1", name  # the job knows it is one node


def test_the_checkpoint_claim_is_applied_once_apart_from_every_job_variant():
    """`kubectl delete -k <variant>` deletes what the variant renders: a claim among it would go,
    and with it (reclaim policy Delete) the checkpoints. And a claim for ReadWriteMany names a
    class that provides it: the clouds' default classes are ReadWriteOnce, and it would stay Pending."""
    (claim,) = render("storage")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["labels"] == {"app.kubernetes.io/name": "ddpjob"}  # as every other object
    assert claim["spec"]["storageClassName"]
    for variant in VARIANTS:
        objects = render(variant)
        assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"], variant
        for pod in (p for o in objects for p in pod_specs(o) if variant not in OBJECT_STORE):
            runs = next(v for v in pod["volumes"] if v["name"] == "runs")
            assert runs["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], variant


@pytest.mark.parametrize("variant", sorted(OBJECT_STORE))
def test_object_store_variants_take_credentials_from_a_secret_and_mount_no_claim(variant):
    """A cluster without ReadWriteMany: checkpoints to s3://, the key pair from a Secret (never in
    the manifest or a flag), the run dir on the pod's own emptyDir."""
    for pod in (p for o in render(variant) for p in pod_specs(o)):
        (container,) = pod["containers"]
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v], variant
        runs = next(v for v in pod["volumes"] if v["name"] == "runs")
        assert "emptyDir" in runs
        env = {e["name"]: e for e in container["env"]}
        assert env["DDPJOB_CHECKPOINT_DIR"]["value"].startswith("s3://")
        secret_refs = [s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s]
        assert secret_refs == ["ddpjob-s3"]
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env), "credentials written in the manifest"
        args = " ".join(container.get("args", []) + container["command"])
        assert "AWS_" not in args and "--checkpoint-dir" not in args


@pytest.mark.parametrize("variant", VARIANTS)
def test_home_is_writable_under_the_read_only_root(variant):
    """Libraries cache under ~ (Hugging Face hub and datasets, torch.hub): HOME on an emptyDir."""
    pods = [p for obj in render(variant) for p in pod_specs(obj)]
    for pod in pods:
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        home = Path(next(e["value"] for e in container["env"] if e["name"] == "HOME"))
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        mounts = [Path(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in empty_dirs]
        assert any(home == m or m in home.parents for m in mounts), (variant, home, mounts)


@pytest.mark.parametrize(("queued", "plain"), QUEUED.items())
def test_kueue_variants_queue_the_whole_job_suspended_and_change_nothing_else(queued, plain):
    """Created suspended with the queue label on the Job or JobSet itself (not on its pods or child
    Jobs): Kueue admits the workload whole and unsuspends it, so no node starts alone."""
    (workload,) = [o for o in render(queued) if o["kind"] in ("Job", "JobSet")]
    (original,) = [o for o in render(plain) if o["kind"] == workload["kind"]]
    assert workload["metadata"]["labels"].pop("kueue.x-k8s.io/queue-name")
    assert workload["spec"].pop("suspend") is True
    assert workload == original
    assert "kueue.x-k8s.io/queue-name" not in json.dumps(workload)


def test_the_cluster_docs_state_every_exit_code_and_each_resource_knob():
    """docs/clusters.md: each exit code's fate under each scheduler, the batch scripts' resource
    requests, the storage class, the registry, gang admission."""
    docs = (REPO / "docs/clusters.md").read_text()
    for name, code in EXIT_CODES.items():
        assert f"\n| {code} |" in docs, name
    script = (REPO / "slurm/train.sbatch").read_text().splitlines()
    requested = [line.split()[1].split("=")[0] for line in script if line.startswith("#SBATCH ")]
    resources = ("--gpus-per-node", "--exclusive")  # the batch script's requests
    assert set(resources) <= set(requested)
    for knob in (*resources, "--cpus-per-task"):  # and srun's, the way to share nodes
        assert f"`{knob}" in docs, knob
    for words in ("storageClassName", "ReadWriteMany", "docker push", "newName:", "kueue.x-k8s.io/queue-name"):
        assert words in docs, words
    for words in ("schedulingPolicy", "activeDeadlineSeconds", "PET_MASTER_ADDR"):
        assert words in docs, words
    for words in ("`--rdzv-retries`", "sbatch --gpus-per-node=0 slurm/train.sbatch", "JobSet 0.10 or later"):
        assert words in docs, words  # the bound on 69; CPU-only Slurm; the JobSet that reads the rules
