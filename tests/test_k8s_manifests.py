"""Kubernetes manifests (and compose.yaml's security settings): each variant renders with kustomize
and validates against the official schemas (and the Kubeflow / JobSet CRD schemas); security,
network and failure policies are as documented."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kubeflow_operator import operator_env

REPO = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33.0"
VARIANTS = ["overlays/cpu", "overlays/gpu", "kubeflow", "kubeflow-elastic", "jobset", "overlays/preflight"]
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
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget" for r in rules)
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
    (preflight,) = [o for o in render("overlays/preflight") if o["kind"] == "Job"]
    (training,) = [o for o in render("overlays/cpu") if o["kind"] == "Job"]
    assert preflight["spec"]["backoffLimit"] == 0  # a named node fails the Job: a retry measures the same
    for job in (preflight, training):  # all but the command: the same pods, names and rendezvous
        job["spec"]["template"]["spec"]["containers"][0].pop("command")
        job["spec"].pop("backoffLimit")
    assert preflight == training


def test_compose_gpu_override_gives_preflight_the_gpu_image_and_devices():
    services = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]
    assert services["preflight"] == services["node"]  # else `--profile preflight` measures the CPU image


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


def test_compose_drops_capabilities_forbids_new_privileges_and_runs_an_init():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert service["init"] is True, name
        assert not service.get("privileged") and not service.get("cap_add"), name
        assert "ports" not in service, f"{name}: the rendezvous port must stay on the private compose network"


def launch_dry_run(container: dict, env: dict[str, str], cwd: Path) -> list[str]:
    """torchrun's arguments as `ddpjob launch --dry-run` derives them in that container's env (less
    the entries the kubelet fills in, valueFrom: NODE_NAME, which launch does not read)."""
    args = [*container["command"][container["command"].index("launch") + 1 :], *container.get("args", [])]
    env = (
        {"PATH": os.environ["PATH"], "HOME": str(cwd)}
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
