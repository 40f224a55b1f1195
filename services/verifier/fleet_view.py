"""``GET /fleet`` on a verifier: what a coordinator's dashboard shows of it, as JSON.

One reading of the verifier and its drafters: the engine (backend, model, dtype, policies), KV
memory, cumulative counts (a reader turns two readings into rates: tokens/s, step time, tokens per
forward), the step-time estimator's coefficients (its eq. 19, and its line for a forward feeding
every session one token: target-only's), and one row per connected drafter: its node, model,
trust, when it connected, the WebSocket ping's round-trip time, its live sessions with their mean
acceptance estimate α̂ and mean draft budget, and its drafted and accepted tokens since start. It
reads only what the core publishes (``VerifierCore.status``/``kv_stats``) and the hub's peers:
nothing here touches the engine. The endpoint takes a frontend's credentials, as ``/v1/frontend``
does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.verifier.server import Hub, Peer


@dataclass(frozen=True)
class EngineInfo:
    """What runs the target, as the operator should see it."""

    backend: str
    model: str
    dtype: str
    device: str


def fleet_view(hub: Hub) -> dict[str, Any]:
    core = hub.intake.core if hub.intake is not None else None
    status: dict[str, Any] = dict(core.status()) if core is not None else {}
    kv = core.kv_stats() if core is not None else None
    summaries: dict[str, dict[str, Any]] = status.get("drafters", {})
    engine = hub.engine
    return {
        "time": time.time(),
        "instance": hub.welcome.instance,
        "ready": core is not None,
        "engine": {"backend": engine.backend, "model": engine.model, "dtype": engine.dtype, "device": engine.device,
                   "max_model_len": hub.welcome.max_model_len},
        "policies": {key: status.get(key) for key in ("allocation", "batching", "trim", "fill")},
        "estimator": (status.get("estimator") or {}).get("coef", {}),
        # a forward feeding each session one token: what the dashboard prices target-only with
        "target_only": (status.get("estimator") or {}).get("target_only"),
        # ... and the busy time between its forwards, [at zero, per session] (the measured guard's price too)
        "between_forwards": (status.get("estimator") or {}).get("between_forwards"),
        "kv": None if kv is None else {"budget_bytes": kv.budget_bytes, "reserved_bytes": kv.reserved_bytes,
                                       "cached_tokens": kv.cached_tokens, "sessions": kv.sessions,
                                       "waiting": kv.waiting},
        "sessions": len(hub.routes),
        "totals": hub.metrics.totals(),
        "drafters": [_drafter_row(hub, peer, summaries.get(peer.node_id, {}))
                     for peer in hub.peers.values() if peer.role == "drafter"],
    }


def _drafter_row(hub: Hub, peer: Peer, summary: dict[str, Any]) -> dict[str, Any]:
    drafted, accepted = hub.metrics.drafter_totals(peer.node_id)
    sessions = int(summary.get("sessions", 0))
    latency = peer.ws.latency  # the last keepalive ping's round trip (0 before the first pong)
    return {
        "node": peer.node_id,
        "model": peer.model,
        "trusted": peer.trusted,
        "connected_since": peer.connected_at,
        "rtt_s": latency if latency > 0 else None,
        "sessions": sessions,
        "alpha": summary.get("alpha") if sessions else None,
        "budget": summary.get("budget", 0) / sessions if sessions else None,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
    }
