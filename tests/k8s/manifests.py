"""Shared helpers of the k8s tier: the podman runner module, rendered overlays, pod specs."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
IMAGES = ROOT / "deploy" / "images"
OVERLAYS = ("production", "cpu-demo", "ci")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


@functools.cache
def runner() -> ModuleType:
    """deploy/k8s/podman_play.py, imported as a module."""
    spec = importlib.util.spec_from_file_location("specfleet_podman_play", K8S / "podman_play.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(runner().render(K8S / "overlays" / overlay))


def objects(overlay: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [o for o in rendered(overlay) if kind is None or o["kind"] == kind]


def named(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects(overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def workloads(overlay: str) -> list[dict[str, Any]]:
    return [o for o in rendered(overlay) if o["kind"] in WORKLOADS]
