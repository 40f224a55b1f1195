"""Static checks of the images and manifests: hadolint, kubernetes-validate, and the rendered YAML's structure."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.k8s.manifests import (
    IMAGES,
    K8S,
    OVERLAYS,
    ROOT,
    named,
    objects,
    pod_labels,
    pod_spec,
    rendered,
    runner,
    workloads,
)

pytestmark = pytest.mark.k8s

KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest minor versions this deployment targets
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
PROBE_PATHS = {"coordinator": {"/health", "/ready"}, "verifier": {"/health"}, "drafter": {"/health", "/ready"}}


def test_every_image_has_a_dockerfile() -> None:
    assert {p.parent.name for p in DOCKERFILES} == {"coordinator", "verifier", "drafter", "drafter-jetson"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint(dockerfile: Path) -> None:
    proc = subprocess.run([runner().tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, f"hadolint {dockerfile}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get install curl\n")
    assert subprocess.run([runner().tool("hadolint"), str(bad)], capture_output=True).returncode != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_contract(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and ("/" in base.group(1) or ":" in base.group(1)), "ARG BASE_IMAGE=<upstream image> missing"
    assert not base.group(1).startswith("localhost/"), "the default base must be the real upstream image"
    assert text.index("ARG BASE_IMAGE") < text.index("FROM ${BASE_IMAGE}")
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0"), "the image must end as a non-root user"
    assert re.search(r"^EXPOSE \d+$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD", text, re.M)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_kubernetes_validate_strict(overlay: str, version: str, tmp_path: Path) -> None:
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(yaml.safe_dump_all(rendered(overlay)))
    proc = subprocess.run([runner().tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{overlay} against Kubernetes {version}:\n{proc.stdout}{proc.stderr}"


def test_kubernetes_validate_rejects_an_unknown_field(tmp_path: Path) -> None:
    svc = dict(named("ci", "Service", "coordinator"))
    svc["spec"] = {**svc["spec"], "selectr": {"a": "b"}}
    out = tmp_path / "bad.yaml"
    out.write_text(yaml.safe_dump(svc))
    proc = subprocess.run([runner().tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBE_VERSIONS[-1],
                           str(out)], capture_output=True, text=True)
    assert proc.returncode != 0


def test_no_remote_bases_and_no_committed_secret() -> None:
    for kfile in K8S.rglob("kustomization.yaml"):
        doc = yaml.safe_load(kfile.read_text())
        for ref in [*doc.get("resources", []), *doc.get("components", [])]:
            assert "://" not in ref and "?ref=" not in ref and not ref.startswith("github.com"), f"{kfile}: {ref}"
            assert (kfile.parent / ref).exists(), f"{kfile}: {ref} does not exist"
        for gen in doc.get("secretGenerator", []):
            assert not gen.get("literals"), f"{kfile}: a secret literal is committed"
            assert gen.get("envs") == ["secrets.env"], f"{kfile}: secrets come from the git-ignored secrets.env"
    tracked = subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "secrets.env" not in tracked
    ignored = subprocess.run(["git", "check-ignore", "deploy/k8s/overlays/production/secrets.env"], cwd=ROOT)
    assert ignored.returncode == 0, "secrets.env must be git-ignored"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_ports(overlay: str) -> None:
    pods = workloads(overlay)
    for svc in objects(overlay, "Service"):
        selector = svc["spec"]["selector"]
        matches = [w for w in pods if selector.items() <= pod_labels(w).items()]
        assert len(matches) == 1, f"{overlay}: Service {svc['metadata']['name']} selects {len(matches)} workloads"
        ports = {p["name"]: p["containerPort"] for c in pod_spec(matches[0])["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports or target in ports.values(), f"{overlay}: {svc['metadata']['name']} -> {target}"
    for w in pods:  # and every workload's selector matches its own pod template
        assert w["spec"]["selector"]["matchLabels"].items() <= pod_labels(w).items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_exist(overlay: str) -> None:
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objects(overlay, "ConfigMap")}
    secrets = {o["metadata"]["name"]: o.get("data", {}) for o in objects(overlay, "Secret")}
    claims = {o["metadata"]["name"] for o in objects(overlay, "PersistentVolumeClaim")}
    for w in workloads(overlay):
        spec = pod_spec(w)
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{overlay}: PVC {v}"
        for c in spec["containers"]:
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, f"{overlay}: ConfigMap {ref}"
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]], f"{overlay}: Secret {ref}"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, f"{overlay}: mount {mount}"
    hpa = named(overlay, "HorizontalPodAutoscaler", "coordinator")["spec"]["scaleTargetRef"]
    assert named(overlay, hpa["kind"], hpa["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmaps_name_real_settings(overlay: str) -> None:
    """Every SPECFLEET_* key a service reads is one of its config's fields (a typo would be silently ignored)."""
    from services.coordinator.config import CoordinatorConfig
    from services.drafter.config import DrafterConfig
    from services.verifier.config import VerifierConfig
    from shared.config import env_name, leaves

    fields = {name: {env_name(f) for f in leaves(cls)}
              for name, cls in (("coordinator", CoordinatorConfig), ("verifier", VerifierConfig),
                                ("drafter", DrafterConfig))}
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objects(overlay, "ConfigMap")}
    for w in workloads(overlay):
        service = w["metadata"]["name"].removesuffix("-jetson")
        if service not in fields:
            continue
        for c in pod_spec(w)["containers"]:
            keys: set[str] = {e["name"] for e in c.get("env", [])}
            own: set[str] = set()
            for ref in c.get("envFrom", []):
                name = ref["configMapRef"]["name"]
                (keys if name.startswith("specfleet-common") else own).update(configmaps[name])
            assert own <= fields[service], f"{overlay}/{service}: unknown settings {own - fields[service]}"
            assert keys & fields[service], f"{overlay}/{service} reads none of its settings"
    common = next(v for k, v in configmaps.items() if k.startswith("specfleet-common"))
    assert set(common) <= set().union(*fields.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_resources_and_scraping(overlay: str) -> None:
    for w in workloads(overlay):
        spec, name = pod_spec(w), w["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        for c in spec["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{overlay}/{name}: {kind}"
            assert "readinessProbe" in c and "livenessProbe" in c, f"{overlay}/{name}: probes"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                http = c.get(probe, {}).get("httpGet")
                if http:
                    assert http["path"] in PROBE_PATHS[name.removesuffix("-jetson")], f"{name} {probe} {http}"
                    assert http["port"] in ports
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        if name != "redis":
            assert ann.get("prometheus.io/scrape") == "true", name
            assert int(ann["prometheus.io/port"]) in ports.values() and ann["prometheus.io/path"] == "/metrics"


def test_verifier_gets_a_gpu_and_tolerates_its_taint() -> None:
    spec = pod_spec(named("production", "Deployment", "verifier"))
    res = spec["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"]["specfleet.io/pool"] == "gpu"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    pdb = named("production", "PodDisruptionBudget", "verifier")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(named("production", "Deployment",
                                                                               "verifier")).items()


def test_jetson_drafters() -> None:
    ds = named("production", "DaemonSet", "drafter-jetson")
    spec = pod_spec(ds)
    assert spec["nodeSelector"] == {"kubernetes.io/arch": "arm64", "specfleet.io/pool": "jetson"}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "specfleet.io/jetson" for t in spec["tolerations"])


def test_redis_persists_its_queue() -> None:
    sts = named("production", "StatefulSet", "redis")
    args = pod_spec(sts)["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--dir") + 1] == "/data"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_models_volume_is_read_only() -> None:
    pvc = named("production", "PersistentVolumeClaim", "specfleet-models")["spec"]
    assert pvc["accessModes"] == ["ReadWriteMany"]  # the loader fills it; serving pods mount it read-only
    assert pvc["storageClassName"]  # the production overlay's CHANGE line sets it
    for w in workloads("production"):
        for v in pod_spec(w).get("volumes", []):
            if v["name"] == "models":
                assert v["persistentVolumeClaim"]["readOnly"] is True
        for c in pod_spec(w)["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] == "models":
                    assert m["readOnly"] is True and m["mountPath"] == "/models"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_only_drafters_and_coordinators(overlay: str) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in objects(overlay, "NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    roles = {pod_labels(w)["app.kubernetes.io/name"]: pod_labels(w).get("specfleet.io/role")
             for w in workloads(overlay)}
    for name, target in (("verifier-ingress", "verifier"), ("redis-ingress", "redis")):
        spec = policies[name]
        assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": target}
        peers = [p for rule in spec["ingress"] for p in rule["from"] if "podSelector" in p]
        allowed = {v for p in peers for e in p["podSelector"]["matchExpressions"] for v in e["values"]}
        assert allowed == {"drafter", "coordinator"}
        admitted = {n for n, role in roles.items() if role in allowed}
        assert admitted == {n for n in roles if n.startswith(("drafter", "coordinator"))}
        others = [p for rule in spec["ingress"] for p in rule["from"] if "podSelector" not in p]
        assert all(p["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
                   for p in others)
