#!/usr/bin/env python3
"""Build the specfleet images on a local base and play the rendered `ci` overlay with podman.

There is no Kubernetes API server on a build machine, but podman builds the images and runs
the overlay's Deployments and ConfigMaps (`podman kube play`). This script is what
`make k8s-up` / `make k8s-down` and the k8s test tier (tests/k8s) run:

    python3 deploy/k8s/podman_play.py base     # the local stand-in base (debootstrap + podman import)
    python3 deploy/k8s/podman_play.py build    # build the images from deploy/images on that base
    python3 deploy/k8s/podman_play.py arm64    # the Jetson drafter image for linux/arm64, under qemu
    python3 deploy/k8s/podman_play.py up       # base + build + play the ci overlay; wait for /ready
    python3 deploy/k8s/podman_play.py down     # remove the pods, volumes, secrets and network

What podman lacks, and what `up` does about it:
  - Services and DaemonSets: skipped; the ci overlay names peers as podman does (<deployment>-pod-0),
    and the Jetson DaemonSet is not part of the ci overlay (no Jetson here).
  - StatefulSets: the Redis StatefulSet's pod template is played as a one-replica Deployment and its
    volumeClaimTemplates as PersistentVolumeClaims (podman named volumes), as a cluster would.
  - Secrets: each rendered Secret becomes a podman secret holding its data as JSON (key -> base64),
    which is what podman reads for `secretKeyRef`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "ci"
BASE_IMAGE = "localhost/specfleet-base:bookworm"
ARM64_BASE = "localhost/specfleet-base:bookworm-arm64"
IMAGES = ("coordinator", "verifier", "drafter")  # what the ci overlay runs (drafter-jetson: see build_jetson)
NETWORK = "specfleet-ci"


def _use_repository_store() -> None:
    """podman's and buildah's settings, images and networks in .specfleet/podman, not /etc or
    /var/lib (deploy/podman/configure.sh; the Makefile has done this already)."""
    if "CONTAINERS_STORAGE_CONF" not in os.environ:
        exports = subprocess.run(["bash", str(ROOT / "deploy" / "podman" / "configure.sh")], check=True,
                                 capture_output=True, text=True).stdout
        os.environ.update(item.split("=", 1) for item in exports.split()[1:])


_use_repository_store()
#: buildah's temporary files in the repository too, not /var/tmp
BUILD_ENV = {**os.environ, "TMPDIR": str(ROOT / ".specfleet" / "podman" / "tmp")}
STATE = ROOT / ".specfleet" / "k8s-ci"
PLAYED = STATE / "played.yaml"
PLAYABLE = {"Deployment", "ConfigMap", "PersistentVolumeClaim"}


class PlayError(RuntimeError):
    """A step failed; the message says which and what to look at."""


def run(cmd: list[str], *, check: bool = True, capture: bool = True, timeout: float = 900,
        env: dict[str, str] | None = None) -> str:
    try:
        out = subprocess.PIPE if capture else None
        proc = subprocess.run(cmd, check=False, text=True, timeout=timeout, stdout=out,
                              stderr=subprocess.STDOUT if capture else None, env=env)
    except FileNotFoundError:
        raise PlayError(f"{cmd[0]} not found; run scripts/ensure-k8s-tools.sh") from None
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").splitlines()[-40:])
        raise PlayError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{tail}")
    return proc.stdout or ""


def tool(name: str) -> str:
    """A binary from this interpreter's venv (kubectl, hadolint, ...) or else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise PlayError(f"{name} not found; run scripts/ensure-k8s-tools.sh")
    return found


def render(overlay: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of one overlay, as a list of objects (the overlay's secrets.env made if missing)."""
    run(["bash", str(ROOT / "deploy" / "k8s" / "make-secrets.sh"), str(overlay)])
    out = run([tool("kubectl"), "kustomize", str(overlay)])
    return [d for d in yaml.safe_load_all(out) if d]


# --- images ----------------------------------------------------------------------------------

def ensure_base(image: str = BASE_IMAGE, arch: str = "") -> None:
    env = {**os.environ, "ARCH": arch} if arch else None
    script = str(ROOT / "deploy" / "images" / "local-base.sh")
    if subprocess.run(["bash", script, image], env=env, timeout=1800).returncode != 0:
        raise PlayError(f"could not make the local base image {image} (deploy/images/local-base.sh, output above)")


def ensure_arm64_emulation() -> None:
    """qemu-user-static registered with binfmt_misc, so that arm64 binaries run on this host."""
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)])
    if not (binfmt / "qemu-aarch64").exists():
        conf = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
        if not conf.exists():
            raise PlayError("arm64 emulation needs qemu-user-static: apt-get install qemu-user-static binfmt-support")
        (binfmt / "register").write_text(conf.read_text().splitlines()[0])
    if "enabled" not in (binfmt / "qemu-aarch64").read_text():
        raise PlayError("binfmt_misc has qemu-aarch64 registered but disabled")


def pip_build_mounts(tmp: Path) -> list[str]:
    """Volumes that give the build the host's pip configuration: its config, local indexes, CA bundle.

    The host's effective settings (`pip config list`, files and PIP_* variables) go into one
    pip.conf mounted as /etc/pip.conf; local directories they name are mounted read-only at the
    same paths. On a plain machine this is just the CA bundle and pip talks to PyPI.
    """
    listing = run([sys.executable, "-m", "pip", "config", "list"], check=False)
    settings: dict[str, str] = {}
    # Files first, then PIP_* variables (":env:." entries), which win as they do for pip itself.
    lines = sorted(listing.splitlines(), key=lambda line: line.startswith(":env:"))
    for line in lines:
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        settings[key.split(".", 1)[1]] = value.strip().strip("'\"")
    mounts: list[str] = []
    for value in settings.values():
        for part in value.split():
            path = part[len("file://"):] if part.startswith("file://") else part
            if path.startswith("/") and Path(path).exists():
                top = Path(path)
                if top.name == "simple":  # a local index: mount its parent (files beside simple/)
                    top = top.parent
                mounts += ["-v", f"{top}:{top}:ro"]
    conf = tmp / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    mounts += ["-v", f"{conf}:/etc/pip.conf:ro"]
    ca = settings.get("cert") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(ca).exists():
        mounts += ["-v", f"{ca}:{ca}:ro"]
    return _dedupe_pairs(mounts)


def prebuilt_llama() -> list[str]:
    """The llama.cpp wheel `make install` built on this machine (.specfleet/wheels), mounted where the
    drafter image's build stage takes it instead of compiling llama.cpp again: the same pinned
    source, built for this CPU, which is where these images run. `make images` builds it portably."""
    wheels = ROOT / ".specfleet" / "wheels"
    return ["-v", f"{wheels}:/prebuilt:ro"] if any(wheels.glob("llama_cpp_python-*.whl")) else []


def _dedupe_pairs(mounts: list[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for flag, spec in zip(mounts[::2], mounts[1::2], strict=True):
        if spec not in seen:
            seen.add(spec)
            out += [flag, spec]
    return out


def build_images(names: tuple[str, ...] = IMAGES, platform: str = "", tag: str = "ci",
                 base: str = BASE_IMAGE, build_args: tuple[str, ...] = ()) -> None:
    """Build each image on the local base. The upstream bases' torch and Python are replaced by the
    base's Python 3.11 and the pinned CPU torch (KEEP_BASE_TORCH=0, no extra flags); ``build_args``
    ("NAME=VALUE") come on top."""
    ensure_base(base, platform.removeprefix("linux/"))
    with tempfile.TemporaryDirectory(prefix="specfleet-build-") as tmp:
        mounts = pip_build_mounts(Path(tmp)) + ([] if platform else prebuilt_llama())
        for name in names:
            started = time.monotonic()
            cmd = ["podman", "build", "--format", "docker", "-f", str(ROOT / "deploy" / "images" / name / "Dockerfile"),
                   "-t", f"localhost/specfleet-{name}:{tag}", "--build-arg", f"BASE_IMAGE={base}",
                   "--build-arg", "TORCH_INDEX=", "--build-arg", "KEEP_BASE_TORCH=0",
                   "--build-arg", "PROJECT_PIP_FLAGS=", *mounts]
            for arg in build_args:
                cmd += ["--build-arg", arg]
            if platform:
                cmd += ["--platform", platform]
            run([*cmd, str(ROOT)], timeout=1800, env=BUILD_ENV)
            print(f"built localhost/specfleet-{name}:{tag} in {time.monotonic() - started:.0f} s", flush=True)


# --- playing the ci overlay ------------------------------------------------------------------

def build_arm64() -> str:
    """The Jetson drafter's Dockerfile built for linux/arm64 on an arm64 local base, under qemu."""
    ensure_arm64_emulation()
    # the local base has no CUDA toolkit: llama.cpp is built for the arm64 CPU (install.sh's portable flags)
    build_images(("drafter-jetson",), platform="linux/arm64", tag="ci-arm64", base=ARM64_BASE,
                 build_args=("LLAMA_CMAKE_ARGS=",))
    return "localhost/specfleet-drafter-jetson:ci-arm64"


def statefulset_as_deployment(sts: dict[str, Any]) -> list[dict[str, Any]]:
    """A StatefulSet as podman can play it: its claims as PVCs, its pod template as a Deployment."""
    name = sts["metadata"]["name"]
    spec = sts["spec"]
    template = copy.deepcopy(spec["template"])
    out: list[dict[str, Any]] = []
    volumes = template["spec"].setdefault("volumes", [])
    for claim in spec.get("volumeClaimTemplates", []):
        claim_name = f"{claim['metadata']['name']}-{name}-0"  # the name a cluster gives replica 0's claim
        out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": {"name": claim_name}, "spec": claim["spec"]})
        volumes.append({"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}})
    out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": copy.deepcopy(sts["metadata"]),
                "spec": {"replicas": 1, "selector": spec["selector"], "template": template}})
    return out


def playable(objects: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(what `podman kube play` gets, the Secrets to create as podman secrets)."""
    docs: list[dict[str, Any]] = []
    secrets = [o for o in objects if o["kind"] == "Secret"]
    for obj in objects:
        if obj["kind"] == "StatefulSet":
            docs += statefulset_as_deployment(obj)
        elif obj["kind"] in PLAYABLE:
            docs.append(obj)
    # Redis (the queue) first, then the verifier, so that their peers find them on start.
    order = {"redis": 0, "verifier": 1, "coordinator": 2}
    docs.sort(key=lambda d: (d["kind"] == "Deployment", order.get(d["metadata"]["name"], 3)))
    return docs, secrets


def pod_ip(deployment: str) -> str:
    out = run(["podman", "pod", "inspect", f"{deployment}-pod-0"])
    info = json.loads(out)
    info = info[0] if isinstance(info, list) else info
    infra = info.get("InfraContainerID") or info["Containers"][0]["Id"]
    nets = json.loads(run(["podman", "inspect", infra]))[0]["NetworkSettings"]["Networks"]
    for net in nets.values():
        if net.get("IPAddress"):
            return str(net["IPAddress"])
    raise PlayError(f"pod {deployment}-pod-0 has no IP address on {NETWORK}")


def logs(deployment: str, container: str, lines: int = 30) -> str:
    return run(["podman", "logs", "--tail", str(lines), f"{deployment}-pod-0-{container}"], check=False)


def wait_http(url: str, timeout_s: float, what: str, deployment: str, container: str) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:300]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(1.0)
    raise PlayError(f"{what} at {url} not ready after {timeout_s:.0f} s ({last}); "
                    f"the end of its log:\n{logs(deployment, container)}")


def up(timeout_s: float = 300.0) -> dict[str, str]:
    """Play the ci overlay; wait until every pod answers its readiness endpoint. Returns pod IPs."""
    build_images()
    down(quiet=True)
    objects = render(OVERLAY)
    docs, secrets = playable(objects)
    STATE.mkdir(parents=True, exist_ok=True)
    if NETWORK not in run(["podman", "network", "ls", "--format", "{{.Name}}"]).split():
        run(["podman", "network", "create", NETWORK])
    for secret in secrets:
        path = STATE / f"{secret['metadata']['name']}.yaml"
        # podman reads a secretKeyRef's podman secret as a JSON map of key -> base64 value: the Secret's data.
        data = {k: "".join(v.split()) for k, v in (secret.get("data") or {}).items()}
        path.write_text(json.dumps(data))
        path.chmod(0o600)
        run(["podman", "secret", "create", secret["metadata"]["name"], str(path)])
        path.unlink()
    PLAYED.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    (STATE / "secrets.json").write_text(json.dumps([s["metadata"]["name"] for s in secrets]))
    run(["podman", "kube", "play", "--network", NETWORK, str(PLAYED)], timeout=600)
    pin_bridge_mac()
    ips = {name: pod_ip(name) for name in ("redis", "verifier", "coordinator", "drafter")}
    wait_http(f"http://{ips['verifier']}:8100/health", timeout_s, "the verifier", "verifier", "verifier")
    wait_http(f"http://{ips['drafter']}:9100/ready", timeout_s, "the drafter", "drafter", "drafter")
    wait_http(f"http://{ips['coordinator']}:8000/ready", timeout_s, "the coordinator", "coordinator", "coordinator")
    (STATE / "ips.json").write_text(json.dumps(ips))
    return ips


def pin_bridge_mac() -> None:
    """Keep the network's gateway MAC fixed while pods come and go.

    A Linux bridge whose MAC was never set takes the lowest MAC among its ports, so it changes
    when a pod stops or starts. Pods keep the old MAC for the gateway in their ARP cache and send
    their replies to the host into the void: a client's open connection to the coordinator hangs
    after an unrelated pod (Redis, a drafter) restarts. A cluster's CNI keeps its gateway stable;
    setting the bridge's MAC to its current value does the same here. Rootless podman keeps the
    bridge in its own namespace, out of reach and out of the host's way: nothing to do then."""
    bridge = run(["podman", "network", "inspect", NETWORK, "--format", "{{.NetworkInterface}}"]).strip()
    sysfs = Path("/sys/class/net") / bridge
    if not bridge or not (sysfs / "address").exists():
        return
    if (sysfs / "addr_assign_type").read_text().strip() == "3":  # NET_ADDR_SET: pinned already
        return
    mac = (sysfs / "address").read_text().strip()
    try:
        out = run(["ip", "link", "set", "dev", bridge, "address", mac], check=False)
    except PlayError as exc:  # no `ip` here
        out = str(exc)
    if (sysfs / "addr_assign_type").read_text().strip() != "3":
        print(f"warning: could not pin the MAC of bridge {bridge} ({out.strip() or 'no reason given'}); "
              "a client connection may hang after a pod restarts", file=sys.stderr)


def down(quiet: bool = False) -> None:
    """Remove what `up` made: pods and their volumes, the podman secrets, the network."""
    if PLAYED.exists():
        run(["podman", "kube", "down", str(PLAYED)], check=False)
        for doc in yaml.safe_load_all(PLAYED.read_text()):
            if doc and doc["kind"] == "PersistentVolumeClaim":
                run(["podman", "volume", "rm", "-f", doc["metadata"]["name"]], check=False)
    secrets_file = STATE / "secrets.json"
    if secrets_file.exists():
        for name in json.loads(secrets_file.read_text()):
            run(["podman", "secret", "rm", name], check=False)
    for name in ("redis", "verifier", "coordinator", "drafter"):
        run(["podman", "pod", "rm", "-f", f"{name}-pod-0"], check=False)
    run(["podman", "network", "rm", "-f", NETWORK], check=False)
    if STATE.exists():
        shutil.rmtree(STATE)
    if not quiet:
        print("specfleet ci pods, volumes, secrets and network removed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["base", "build", "arm64", "up", "down"])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the pods to be ready")
    args = parser.parse_args(argv)
    try:
        if args.command == "base":
            ensure_base()
        elif args.command == "build":
            build_images()
        elif args.command == "arm64":
            print(f"built {build_arm64()}")
        elif args.command == "up":
            ips = up(args.timeout)
            print("specfleet ci overlay is up under podman:")
            for name, ip in ips.items():
                print(f"  {name:12s} {ip}")
            print(f"  try: curl http://{ips['coordinator']}:8000/v1/models -H 'Authorization: Bearer <api-key>'")
            print(f"  (the api-key is in {OVERLAY / 'secrets.env'}); stop with make k8s-down")
        else:
            down()
    except PlayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
