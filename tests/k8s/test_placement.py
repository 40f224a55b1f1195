"""Where each workload can land: the scheduler's node-filtering rules (nodeSelector, required node
affinity, taints and tolerations, extended resources) applied to fake Node objects."""

from __future__ import annotations

from typing import Any

import pytest

from tests.k8s.manifests import pod_spec, workloads

pytestmark = pytest.mark.k8s


def node(name: str, labels: dict[str, str], taints: list[dict[str, str]], gpus: int = 0) -> dict[str, Any]:
    allocatable = {"cpu": "16", "memory": "64Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **labels}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"taints": taints}, "status": {"allocatable": allocatable}}


NODES = [
    node("gpu-1", {"kubernetes.io/arch": "amd64", "specfleet.io/pool": "gpu"},
         [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}], gpus=8),
    node("jetson-1", {"kubernetes.io/arch": "arm64", "specfleet.io/pool": "jetson"},
         [{"key": "specfleet.io/jetson", "value": "true", "effect": "NoSchedule"}], gpus=1),
    node("edge-1", {"kubernetes.io/arch": "amd64", "specfleet.io/pool": "edge"},
         [{"key": "specfleet.io/edge", "value": "true", "effect": "NoSchedule"}]),
    node("plain-1", {"kubernetes.io/arch": "amd64"}, []),
    node("plain-arm", {"kubernetes.io/arch": "arm64"}, []),
]


def _expression_ok(labels: dict[str, str], expr: dict[str, Any]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        return key in labels and (int(labels[key]) > int(values[0])) == (op == "Gt")
    raise AssertionError(f"unknown operator {op}")


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value") == taint.get("value"):
            return True
    return False


def _quantity(v: Any) -> float:
    return float(v)


def fits(spec: dict[str, Any], n: dict[str, Any]) -> bool:
    labels = n["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = (spec.get("affinity", {}).get("nodeAffinity", {})
                .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms"))
    if required and not any(all(_expression_ok(labels, e) for e in term.get("matchExpressions", []))
                            for term in required):
        return False
    for taint in n["spec"].get("taints", []):
        if taint["effect"] in ("NoSchedule", "NoExecute") and not _tolerates(spec.get("tolerations", []), taint):
            return False
    for c in spec["containers"]:
        for res, amount in c.get("resources", {}).get("limits", {}).items():
            if "/" in res and _quantity(amount) > _quantity(n["status"]["allocatable"].get(res, 0)):
                return False
    return True


def placement(overlay: str) -> dict[str, set[str]]:
    return {w["metadata"]["name"]: {n["metadata"]["name"] for n in NODES if fits(pod_spec(w), n)}
            for w in workloads(overlay)}


def test_predicate_itself() -> None:
    """The rules bite: no toleration, no tainted node; a GPU request needs GPUs; arch is a label."""
    plain = {"containers": [{"name": "c"}]}
    assert {n["metadata"]["name"] for n in NODES if fits(plain, n)} == {"plain-1", "plain-arm"}
    gpu = {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}],
           "tolerations": [{"operator": "Exists"}]}
    assert {n["metadata"]["name"] for n in NODES if fits(gpu, n)} == {"gpu-1", "jetson-1"}
    affinity = {"containers": [{"name": "c"}], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}]}}}}
    assert {n["metadata"]["name"] for n in NODES if fits(affinity, n)} == {"plain-arm"}


def test_production_placement() -> None:
    assert placement("production") == {
        "verifier": {"gpu-1"},          # only the GPU pool: selector + toleration + GPU request
        "drafter-jetson": {"jetson-1"},  # only Jetsons: arm64 + pool label + toleration
        "drafter": {"edge-1"},           # only x86 edge boxes
        "coordinator": {"plain-1", "plain-arm"},  # ordinary nodes, never the tainted pools
        "redis": {"plain-1", "plain-arm"},
    }


@pytest.mark.parametrize("overlay", ["cpu-demo", "ci"])
def test_cpu_overlays_run_on_ordinary_nodes(overlay: str) -> None:
    places = placement(overlay)
    assert set(places) == {"verifier", "drafter", "coordinator", "redis"}
    for name, nodes in places.items():
        assert nodes == {"plain-1", "plain-arm"}, f"{overlay}/{name} -> {nodes}"
