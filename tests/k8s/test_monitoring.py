"""Static checks of the monitoring component: the PrometheusRule and PodMonitor against the
Prometheus Operator's schema (the part they use, strictly), every query parses as PromQL, the
Grafana dashboard is well formed, and the production overlay renders all of it. kubernetes-validate
has no schema for the operator's kinds, so these checks stand in for it. That every metric a query
names is exported by the running services is checked against a live fleet (tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest
import yaml

from tests.k8s.manifests import named, objects
from tests.k8s.monitoring_queries import MONITORING, alert_rules, dashboard, metric_names, queries

pytestmark = pytest.mark.k8s
DURATION = r"^([0-9]+(ms|s|m|h|d|w|y))+$"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "labels": _STR_MAP,
                                                                    "annotations": _STR_MAP}}
RULE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rules"], "properties": {
                    "name": {"type": "string"}, "interval": {"type": "string", "pattern": DURATION},
                    "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["alert", "expr", "labels",
                                                                                      "annotations"],
                        "properties": {
                            "alert": {"type": "string", "pattern": "^[A-Z][A-Za-z]+$"}, "expr": {"type": "string"},
                            "for": {"type": "string", "pattern": DURATION},
                            "labels": {"type": "object", "required": ["severity"], "properties": {
                                "severity": {"enum": ["warning", "critical"]}}, "additionalProperties":
                                {"type": "string"}},
                            "annotations": {"type": "object", "required": ["summary", "description"],
                                            "additionalProperties": {"type": "string"}}}}}}}}}}},
}
POD_MONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": _METADATA,
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                 "properties": {
                     "selector": {"type": "object", "required": ["matchLabels"], "properties": {
                         "matchLabels": _STR_MAP}, "additionalProperties": False},
                     "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "required": ["port"], "properties": {
                             "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                             "interval": {"type": "string", "pattern": DURATION}}}}}}},
}


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((MONITORING / name).read_text())
    return data


def test_the_rule_and_the_pod_monitor_match_the_operators_schema() -> None:
    jsonschema.validate(_load("prometheusrule.yaml"), RULE_SCHEMA)
    jsonschema.validate(_load("podmonitor.yaml"), POD_MONITOR_SCHEMA)


@pytest.mark.parametrize(("path", "value"), [(("spec", "groupz"), []), (("spec", "groups", 0, "rules", 0, "for"), "5"),
                                             (("spec", "groups", 0, "rules", 0, "labels", "severity"), "page")])
def test_the_schema_rejects_a_broken_rule(path: tuple[Any, ...], value: Any) -> None:
    rule = copy.deepcopy(_load("prometheusrule.yaml"))
    node = rule
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, RULE_SCHEMA)


def test_the_alerts_an_operator_needs() -> None:
    """No drafter, low acceptance, p99 TPOT over the SLO, 429s, KV memory, a replica down."""
    assert {r["alert"] for r in alert_rules()} >= {
        "SpecfleetNoDrafterConnected", "SpecfleetLowAcceptance", "SpecfleetTpotAboveSlo", "SpecfleetRequestsRefused",
        "SpecfleetKvMemoryNearlyFull", "SpecfleetReplicaDown"}


@pytest.mark.parametrize("where", sorted(queries()))
def test_every_query_parses(where: str) -> None:
    assert metric_names(queries()[where]), f"{where} selects no metric"


def test_a_broken_query_does_not_parse() -> None:
    with pytest.raises(ValueError):
        metric_names("sum(rate(specfleet_verifier_generated_tokens_total[5m])")


def test_the_grafana_dashboard_is_well_formed() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in panels)
    for shown in ("tokens/s", "acceptance per drafter", "queue depth", "time per output token", "first token",
                  "kv memory", "step time"):
        assert shown in titles, shown  # what the coordinator's page shows


def test_the_production_overlay_renders_the_component() -> None:
    cm = named("production", "ConfigMap", "specfleet-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["specfleet.json"]) == dashboard()
    rule = named("production", "PrometheusRule", "specfleet")
    assert rule["metadata"]["namespace"] == "specfleet"
    monitor = named("production", "PodMonitor", "specfleet")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "specfleet"}
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    container_ports = {p["name"] for kind in ("Deployment", "StatefulSet", "DaemonSet")
                       for name in ("coordinator", "verifier", "drafter", "drafter-jetson")
                       for o in _workloads(kind, name) for c in o["spec"]["template"]["spec"]["containers"]
                       for p in c.get("ports", [])}
    assert ports <= container_ports | {"metrics"} and {"http", "ws", "metrics"} <= ports


def _workloads(kind: str, name: str) -> list[dict[str, Any]]:
    return [o for o in objects("production", kind) if o["metadata"]["name"] == name]

