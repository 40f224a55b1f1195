"""Taking a request over in the verifier: ``Adopt`` on whichever replica holds it.

The verifier answers ``Adopted`` and replays the request's events to this coordinator, then
relays it here. A request no verifier knows (its queue died with its coordinator, or a drafter
has not opened it yet) is opened here, target-only; if a drafter opens it first, the verifier
routes its events here all the same (it remembers the adopter).
"""

from __future__ import annotations

import asyncio

import msgspec

from services.coordinator.errors import ApiError, invalid_request, service_unavailable
from services.coordinator.stream_ids import ECHO, last_position, text_pos
from services.coordinator.verifier_link import FrontendLink
from services.coordinator.verifier_pool import VerifierPool
from shared.log import get_logger
from shared.protocol import Adopted, OpenSession

log = get_logger("coordinator.adoption")
ADOPT_TIMEOUT_S = 10.0


def stream_not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no stream {request_id} to resume: it is unknown, it expired (finished streams are kept "
                         "for the verifier's --orphan-grace-s), or another API key made it. Send the request again.",
                    "invalid_request_error", None, "stream_not_found")


def stream_gap(request_id: str) -> ApiError:
    return ApiError(409, f"stream {request_id} cannot resume from there: a verifier restart lost that part of its "
                         "events. Send the request again.", "invalid_request_error", "Last-Event-ID", "stream_gap")


async def adopt(link: FrontendLink | VerifierPool, request_id: str, opened: OpenSession, node_id: str) -> Adopted:
    """Adopt ``request_id`` (subscribed already) on whichever replica holds it; open it here,
    target-only, when none knows it. 503 when no verifier answers."""
    links = link.links if isinstance(link, VerifierPool) else [link]
    futures = [one.adopt_nowait(request_id) for one in links if one.connected]
    if not futures:
        raise service_unavailable(f"the verifier is not connected ({link.last_error}); retry shortly", 1)
    try:
        async with asyncio.timeout(ADOPT_TIMEOUT_S):
            replies = await asyncio.gather(*futures, return_exceptions=True)
    except TimeoutError:
        raise service_unavailable("the verifier did not answer the resume in time; retry shortly", 1) from None
    finally:
        for key in [key for key, future in link.routing.adopting.items() if future in futures]:
            del link.routing.adopting[key]  # answered, or given up on
    answers = [r for r in replies if isinstance(r, Adopted)]
    for state in ("live", "finished", "gone"):
        found = next((r for r in answers if r.state == state), None)
        if found is not None:
            return found
    if not answers:
        raise service_unavailable("lost the verifier link during the resume; retry shortly", 1)
    link.routing.fallen_back.add(request_id)  # a drafter may open it first: then its events come here
    try:
        link.open_target_only(msgspec.structs.replace(opened, origin=node_id))
    except ConnectionError as exc:
        raise service_unavailable(f"cannot reach the verifier: {exc}", 1) from None
    log.info("resumed request was never opened; opened target-only here", request_id=request_id)
    return answers[0]


def check_position(request_id: str, choice: int, after: int, reply: Adopted) -> None:
    """Refuse a position the stream never reached, or one whose events the verifier no longer has."""
    if reply.state == "gone" or (reply.state == "finished" and not reply.last_seq):
        raise stream_not_found(request_id)  # (finished without an event: refused before it started)
    if reply.state == "unknown" and after > ECHO:  # it had sent text, yet no verifier knows it now
        raise stream_gap(request_id)
    if after > last_position(reply.state, reply.last_seq, choice):
        raise invalid_request(f"Last-Event-ID is past the end of stream {request_id} (choice {choice} position "
                              f"{after}); send the id of an event this stream sent", "Last-Event-ID",
                              "invalid_last_event_id")
    if reply.first_seq > 1 and after < text_pos(reply.first_seq - 1):
        raise stream_gap(request_id)
