"""What the Kubeflow training-operator does to a PyTorchJob's pods that a test needs without a
cluster: the environment it adds to each replica's container."""


def operator_env(job: dict, rtype: str, index: int) -> dict[str, str]:
    """The variables the Kubeflow training-operator adds to a PyTorchJob pod's container, as its
    release-1.9 controller does (pkg/controller.v1/pytorch: envvar.go setPodEnv, master.go,
    elastic.go), after its defaulting (pytorch_defaults.go: port 23456 named pytorchjob-port)."""
    spec, default_port = job["spec"], 23456
    replicas = {name: r.get("replicas", 1) for name, r in spec["pytorchReplicaSpecs"].items()}
    nproc = spec.get("nprocPerNode", "auto")
    env = {"PYTHONUNBUFFERED": "1"}
    if "Master" in replicas:
        rank = index + 1 if rtype == "Worker" else index
        master = f"{job['metadata']['name']}-master-0"
        env |= {"MASTER_PORT": str(default_port), "PET_MASTER_PORT": str(default_port)}
        env |= {"MASTER_ADDR": master, "PET_MASTER_ADDR": master}
        world = sum(replicas.values()) * (int(nproc) if nproc.isdigit() else 1)
        env |= {"WORLD_SIZE": str(world), "RANK": str(rank), "PET_NODE_RANK": str(rank)}
    env["PET_NPROC_PER_NODE"] = nproc
    policy = spec.get("elasticPolicy")
    if policy is None:
        return env | {"PET_NNODES": str(sum(replicas.values()))}
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    env["PET_RDZV_ENDPOINT"] = f"{host}:{policy.get('rdzvPort', default_port)}"
    env["PET_RDZV_BACKEND"] = policy.get("rdzvBackend", "c10d")
    low = policy.get("minReplicas", policy.get("maxReplicas", replicas["Worker"]))
    high = policy.get("maxReplicas", low)
    env["PET_NNODES"] = f"{low}:{high}"
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    return env


TRAINER_V2_PORT = 29400  # Kubeflow Trainer v2's constants.ContainerTrainerPort


def trainer_v2_env(train_job: str, nodes: int, index: int, nproc: str = "auto") -> dict[str, str]:
    """The variables Kubeflow Trainer v2's torch plugin (pkg/runtime/framework/plugins/torch/torch.go,
    EnforceMLPolicy) gives the trainer container of node `index` of TrainJob `train_job`: PET_* only,
    no MASTER_ADDR/MASTER_PORT. The pods are a JobSet's (replicated job "node"), so the Job
    controller adds JOB_COMPLETION_INDEX, which PET_NODE_RANK is read from."""
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": f"{train_job}-node-0-0.{train_job}",
        "PET_MASTER_PORT": str(TRAINER_V2_PORT),
        "JOB_COMPLETION_INDEX": str(index),
    }
