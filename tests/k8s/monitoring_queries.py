"""Every PromQL query the monitoring component runs (``deploy/k8s/components/monitoring``): the
alerts' and the Grafana panels'. The tests parse each one and check that every metric it selects
is exported by the running services, so that dashboards and alerts cannot drift from the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "components" / "monitoring"
#: metrics Prometheus makes itself rather than scraping
SYNTHETIC = {"up"}
_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_CHILDREN = ("lhs", "rhs", "expr", "args", "vector_selector", "param")


def alert_rules() -> list[dict[str, Any]]:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return data


def queries() -> dict[str, str]:
    """``{where: PromQL}`` for every alert and panel target, Grafana's variables filled in."""
    out = {f"alert {r['alert']}": str(r["expr"]) for r in alert_rules()}
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in _GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out[f"panel {panel['title']!r} {target['refId']}"] = expr
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a query selects (parsing it: a ValueError says why it does not parse)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if type(node).__name__ == "VectorSelector" and node.name:
            names.add(node.name)
        for attr in _CHILDREN:
            child = getattr(node, attr, None)
            for item in child if isinstance(child, list) else [child]:
                if item is not None and not isinstance(item, str | int | float):
                    walk(item)

    walk(promql_parser.parse(expr))
    return names
