"""The documentation cannot rot: the generated pages are current, and every flag, make target,
endpoint, environment variable and relative link the docs name exists."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import bench.__main__ as bench_main
from shared import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("services/*/README.md"),
               ROOT / "deploy" / "k8s" / "README.md", ROOT / "deploy" / "images" / "README.md"})
SPECFLEET = ["up", "status", "verifier", "drafter", "coordinator", "make-tiny-models", "fetch-model", "import-gguf",
             "wisp-train"]
#: flags of other tools the docs show (pip, podman/docker/buildx, kubernetes-validate, redis-server)
#: and the placeholder the configuration page explains flags with
OTHER_TOOLS = {"--build-arg", "--daemonize", "--ignore-requires-python", "--index-url", "--install", "--manifest",
               "--name", "--network", "--platform", "--privileged", "--push", "--rm", "--strict", "--use",
               "--variant", "--some-flag", "--no-index", "--find-links"}
#: paths other programs serve (Prometheus' own, the PyTorch index, ...) that the docs mention
OTHER_PATHS = {"/whl/cpu"}
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def _help(run: Callable[[], object]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        run()
    return out.getvalue()


def known_flags() -> set[str]:
    texts = [_help(lambda c=c: cli.main([c, "--help"])) for c in SPECFLEET]  # type: ignore[misc]
    for module in [*bench_main.COMMANDS.values(), "services.verifier.profile"]:
        main = importlib.import_module(module).main
        texts.append(_help(lambda main=main: main(["--help"])))  # type: ignore[misc]
    from training.__main__ import build_parser

    texts.append(build_parser().format_help())
    for script in ("deploy/k8s/podman_play.py", "scripts/gpu_wheelhouse.py", "scripts/gen_docs.py"):
        texts.append(subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                                    text=True).stdout)
    texts.append((ROOT / "bench" / "gpu_check.py").read_text())  # bench gpu-check's flags
    texts.append((ROOT / "tests" / "conftest.py").read_text())  # pytest's --device
    return {f for t in texts for f in FLAG.findall(t)}


def _named(pattern: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for name in set(re.findall(pattern, doc.read_text())):
            found.setdefault(name, []).append(str(doc.relative_to(ROOT)))
    return found


def test_the_generated_pages_are_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_front_page_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_flag_the_docs_name_exists() -> None:
    known = known_flags() | OTHER_TOOLS
    missing = {f: where for f, where in _named(FLAG.pattern).items() if f not in known}
    assert not missing, f"flags no command has: {missing}"


def test_every_make_target_the_docs_name_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    missing = {t: where for t, where in _named(r"`make ([a-z][a-z0-9-]*)").items() if t not in targets}
    assert not missing, f"make targets the Makefile lacks: {missing}"


def test_every_environment_variable_the_docs_name_exists() -> None:
    code = "\n".join(p.read_text() for d in ("shared", "services", "bench", "training", "tests", "deploy", "scripts")
                     for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".env", ".yaml"))
    code += (ROOT / "Makefile").read_text() + (ROOT / "docs" / "flags.md").read_text()
    named = _named(r"\b(SPECFLEET_[A-Z0-9_]*[A-Z0-9])\b")
    missing = {v: where for v, where in named.items() if v not in code}
    assert not missing, f"environment variables nothing reads: {missing}"


def test_every_endpoint_the_docs_name_is_served() -> None:
    from services.coordinator.app import create_app  # noqa: F401  (routes register on import)
    from services.coordinator.fleet_routes import router as fleet
    from services.coordinator.routes import router
    from services.verifier.server import PATH_ROLES

    served = {r.path for r in [*router.routes, *fleet.routes]}  # type: ignore[attr-defined]
    served |= set(PATH_ROLES) | {"/health", "/metrics", "/status", "/fleet", "/ready", "/internal/queue",
                                 "/dashboard/dashboard.js", "/dashboard/dashboard.css"}
    pattern = r"`(?:GET |POST )?(/(?:v1|health|ready|metrics|status|fleet|dashboard|internal)[a-z0-9/_.-]*)"

    def is_served(path: str) -> bool:  # a path ending in / is a prefix: `/v1/*`
        return path.rstrip("/") in served | OTHER_PATHS or (path.endswith("/") and any(s.startswith(path)
                                                                                      for s in served))

    missing = {p: where for p, where in _named(pattern).items() if not is_served(p)}
    assert not missing, f"endpoints nothing serves: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    links = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text())
    broken = [link for link in links if not re.match(r"[a-z]+:", link) and not (doc.parent / link).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to nothing: {broken}"
