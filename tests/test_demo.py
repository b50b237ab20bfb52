"""`python -m fp4moe.demo`, the first thing a new user runs: it explains what it ran and checks it."""

from typing import NamedTuple

import pytest
import torch

import fp4moe
from fp4moe import demo, dispatch


def test_the_demo_explains_what_it_ran(capsys):
    torch._dynamo.reset()
    errors = demo.main()
    out = capsys.readouterr().out
    assert list(errors) == ["W4A16", "W4A4 per-token", "W4A4 per-tensor"]
    # Fewer roundings, smaller error; all near the sqrt(roundings) x round-trip estimate.
    assert 0.1 < errors["W4A16"] < errors["W4A4 per-token"] < 0.35
    for text in (f"H = {demo.HIDDEN}", f"I = {demo.INTERMEDIATE}", "MB in bf16", "MB in NVFP4", "x smaller",
                 "expected about", "Why these numbers", "default (inductor) backend", "fp4moe.moe_dispatch"):
        assert text in out, text
    assert "MoEDispatch(" not in out  # the dispatch in plain words, not its repr
    for field in fp4moe.moe_dispatch(demo.TOKENS, demo.TOP_K, demo.EXPERTS, "w4a4", True)._fields:
        assert demo.FIELD_WORDS.get(field, field.replace("_", " ")) in out, field


def test_the_demo_reports_the_dispatch_of_the_device_it_runs_on(monkeypatch, capsys):
    """On a GPU the demo's modules run the device's kernels: the dispatch it prints is asked for that
    device, not the CPU's (where every stage would read as the reference backend)."""
    asked = []
    dispatch_of = fp4moe.moe_dispatch

    def recording(*args, **kwargs):
        asked.append(kwargs["device"] if "device" in kwargs else args[5] if len(args) > 5 else "cpu")
        return dispatch_of(*args, **kwargs)

    monkeypatch.setattr(fp4moe, "moe_dispatch", recording)
    torch._dynamo.reset()
    demo.main()
    capsys.readouterr()
    assert asked == ["cuda" if torch.cuda.is_available() else "cpu"] * 3


def test_the_demo_fails_on_a_wrong_moe(monkeypatch):
    monkeypatch.setattr(fp4moe.FusedMoE, "forward", lambda self, hidden_states: torch.zeros_like(hidden_states))
    torch._dynamo.reset()
    with pytest.raises(SystemExit, match="demo check failed: W4A16, W4A4 per-token, W4A4 per-tensor"):
        demo.main()


class _Stages(NamedTuple):
    plan: str
    gemm1: str


class _FutureDispatch(NamedTuple):
    per_token_path: str | None
    backends: _Stages
    tile_m: int


def test_dispatch_fields_print_generically_in_plain_words():
    """Fields the dispatch does not have yet (a backend per stage) print without a change to the demo."""
    lines = demo.plain(_FutureDispatch(None, _Stages(dispatch.REFERENCE_BACKEND, dispatch.CUTE_SM90_BACKEND), 8))
    assert lines == [
        "    intermediate quantization path: none (not in this mode)",
        "    backends:",
        f"      plan: {demo.VALUE_WORDS[dispatch.REFERENCE_BACKEND]}",
        f"      gemm1: {demo.VALUE_WORDS[dispatch.CUTE_SM90_BACKEND]}",
        "    rows per plan tile (each expert's rows padded to it): 8",
    ]
    assert demo.plain({"new_stage_backend": "some_kernel"}) == ["    new stage backend: some_kernel"]
