"""examples/k8s: the Deployment and Service validate against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown or misspelt field fails), and the InferencePool points at those pods. No cluster needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "examples" / "k8s"
K8S_VERSION = "1.33.0"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_deployment_and_service_validate_against_the_kubernetes_schemas():
    docs = _docs("inferlab.yaml")
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError naming the field


def test_the_validator_rejects_a_misspelt_probe():
    deployment = _docs("inferlab.yaml")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["paht"] = container["readinessProbe"]["httpGet"].pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_probes_serve_and_pool_point_at_the_inferlab_container():
    deployment, service = _docs("inferlab.yaml")
    (pool,) = _docs("inferencepool.yaml")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["command"] == ["inferlab", "serve"] and str(port) in container["args"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    # the drain (--shutdown-grace) fits in the pod's termination grace period
    grace = float(container["args"][container["args"].index("--shutdown-grace") + 1])
    assert grace < pod["spec"]["terminationGracePeriodSeconds"]


def test_the_example_flags_parse_as_inferlab_serve_flags():
    import argparse

    from inferlab.scaleout.cli import add_arguments

    (container,) = _docs("inferlab.yaml")[0]["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"])
    assert args.port == 8000 and args.host == "0.0.0.0" and args.replicas is None
