"""Kubernetes manifests (and compose.yaml's security settings): each variant renders with kustomize
and validates against the official schemas (and the Kubeflow / JobSet CRD schemas); security,
network and failure policies are as documented.

(The tests of test_k8s_manifests.py that run in this process.)
"""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_compose_gpu_override_gives_preflight_the_gpu_image_and_devices():
    services = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]
    assert services["preflight"] == services["node"]  # else `--profile preflight` measures the CPU image


def test_compose_drops_capabilities_forbids_new_privileges_and_runs_an_init():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert service["init"] is True, name
        assert not service.get("privileged") and not service.get("cap_add"), name
        assert "ports" not in service, f"{name}: the rendezvous port must stay on the private compose network"
