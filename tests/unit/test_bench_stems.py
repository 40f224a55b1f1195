"""Which results file a runner benchmark writes: one kind of host never overwrites another's."""

from __future__ import annotations

import pytest

import shared.models
from bench.edge import ISA_LIMITS, machine_stem


@pytest.mark.parametrize(("native_bf16", "isa_limit", "stem"), [
    (True, None, "decode"),
    (False, None, "decode-no-bf16"),
    (True, "ONEDNN_MAX_CPU_ISA", "decode-isa-limited"),
    (False, "MKL_ENABLE_INSTRUCTIONS", "decode-isa-limited"),
])
def test_the_stem_names_the_kind_of_host(monkeypatch: pytest.MonkeyPatch, native_bf16: bool, isa_limit: str | None,
                                         stem: str) -> None:
    for name in ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    if isa_limit:
        monkeypatch.setenv(isa_limit, "AVX2")
    monkeypatch.setattr(shared.models, "cpu_has_native_bf16", lambda: native_bf16)
    assert machine_stem("decode") == stem
