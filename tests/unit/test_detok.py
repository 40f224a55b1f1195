"""IncrementalText: settled text only, never any part of a stop string, nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.verifier.detok import IncrementalText
from shared.models import load_tokenizer

CASES = [
    # (stops, generated text, what the client must see)
    ([], "plain text, no stops", "plain text, no stops"),
    (["ab"], "xxabyy", "xx"),
    (["aé"], "xxaéyy", "xx"),  # a multi-byte character inside the stop string
    (["。"], "你好。再见", "你好"),
    (["é!"], "héllo é!", "héllo "),
    (["zz", "ll"], "hello", "he"),
    (["never"], "héllo wörld", "héllo wörld"),
]


@pytest.mark.parametrize(("stops", "text", "expected"), CASES)
def test_release_never_leaks_a_stop(tiny_models: dict[str, Path], stops: list[str], text: str,
                                    expected: str) -> None:
    tok = load_tokenizer(tiny_models["target"])
    tracker = IncrementalText(tok, stops)
    released = []
    for token in tok.encode(text, add_special_tokens=False):
        stopped = tracker.push(token)
        released.append(tracker.release(final=stopped))
        if stopped:
            break
    else:
        released.append(tracker.release(final=True))
    assert "".join(released) == expected


@pytest.mark.parametrize(("stops", "text", "expected"), CASES)
def test_a_primed_text_goes_on_exactly_where_the_client_was(tiny_models: dict[str, Path], stops: list[str],
                                                             text: str, expected: str) -> None:
    """A request re-opened on a restarted verifier at every token boundary: the text already
    released plus the text released after priming is exactly the undisturbed text, and a stop
    string across the boundary still ends it."""
    tok = load_tokenizer(tiny_models["target"])
    ids = tok.encode(text, add_special_tokens=False)
    for cut in range(len(ids)):
        before = IncrementalText(tok, stops)
        sent = ""
        stopped = False
        for token in ids[:cut]:
            stopped = before.push(token)
            sent += before.release(final=stopped)
            if stopped:
                break
        if stopped:  # ended before the cut: nothing to resume
            assert sent == expected
            continue
        after = IncrementalText(tok, stops)
        after.prime(ids[:cut], len(sent))
        for token in ids[cut:]:
            stopped = after.push(token)
            sent += after.release(final=stopped)
            if stopped:
                break
        else:
            sent += after.release(final=True)
        assert sent == expected, f"resumed after {cut} tokens"
