"""`benchmarks.sm90_cta_timeline` (needs a GPU to run): each harness shape's GEMMs are the configurations
`fused_moe` picks (host only, no GPU needed); its stamping GEMMs read the timer where they say and compute
what the default GEMMs compute, with `wgmma` (DeepSeek-V3) and with per-warp `mma.sync` (GLM's GEMM1 at
T = 1) (SASS, no GPU needed); and its summaries of the stamps (synthetic)."""

import inspect
import random
import textwrap

import pytest
import torch

from benchmarks import precompile
from benchmarks.moe_cases import SHAPES
from benchmarks.sm90_cta_timeline import SLOTS, STAMPS, WAIT_SUMS, compile_pair, sm_persistence, summary
from fp4moe.kernels.sm90 import moe_launch
from tests.sm90_compile import compile_in_subprocess, sass

_COMPUTED_BY = ("epilogue", "shape_key", "act_k", "out_features", "top_k", "activation", "swiglu", "router_weighted",
                "k_splits", "per_token_numerator", "tiling_invariant")
"""The arguments of `moe_launch.compile_gemm` that decide what a GEMM computes and how it is tiled: the
timeline's GEMMs differ from `fused_moe`'s only in the others (the stamps' buffer as `row_scaled`, no
routed-weight prefetch, no plan read before the wait, the epilogue's row chunk stated as the tile's rows)."""


@pytest.fixture
def asked(monkeypatch):
    """The arguments (defaults applied) of every `moe_launch.compile_gemm` call from here on; no kernel is
    compiled (nor cached under a stub)."""
    asked = []
    signature = inspect.signature(moe_launch.compile_gemm)

    def recording(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        asked.append(arguments.arguments)
        return lambda *_args, **_kwargs: None

    recording.cache_clear = lambda: None  # `timed_kernels` clears the process cache of its kernels
    monkeypatch.setattr(moe_launch, "compile_gemm", recording)
    return asked


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_compiles_the_gemms_fused_moe_picks(asked, shape):
    for tokens in (1, 2, 16):
        asked.clear()
        with precompile.compile_without_launching(132, compile_kernels=False):
            precompile.compile_cell(SHAPES[shape], tokens, "fused_moe_w4a16")
        picked = [tuple(a[name] for name in _COMPUTED_BY) for a in asked]
        assert [p[0] for p in picked] == ["gemm1", "gemm2_fused"], picked
        for timed in (False, True):
            asked.clear()
            compile_pair(SHAPES[shape], tokens, 132, timed)
            assert [tuple(a[name] for name in _COMPUTED_BY) for a in asked] == picked, (tokens, timed)
            assert {a["row_scaled"] for a in asked} == {timed}
    if shape == "glm":  # its T = 1 GEMM1 is the per-warp `mma.sync` one that `kernels` compiles
        asked.clear()
        compile_pair(SHAPES[shape], 1, 132, False)
        assert [moe_launch.uses_warp_mma(a["shape_key"]) for a in asked] == [True, False]


@pytest.mark.parametrize("shape", ["deepseek_v3", "deepseek_v3_ep32"])
def test_per_token_gemm2_is_the_one_fused_moe_has_quantize_its_rows(asked, shape):
    for tokens in (1, 2, 3):
        asked.clear()
        with precompile.compile_without_launching(132, compile_kernels=False):
            precompile.compile_cell(SHAPES[shape], tokens, "fused_moe_w4a4_token")
        picked = [tuple(a[name] for name in _COMPUTED_BY) for a in asked if a["epilogue"] == "gemm2_fused"]
        assert len(picked) == 1 and picked[0][_COMPUTED_BY.index("per_token_numerator")] is not None, picked
        for timed in (False, True):
            asked.clear()
            compile_pair(SHAPES[shape], tokens, 132, timed, per_token=True)
            assert tuple(asked[1][name] for name in _COMPUTED_BY) == picked[0], (tokens, timed)
    with pytest.raises(ValueError, match="kernel of its own"):
        compile_pair(SHAPES[shape], 4, 132, False, per_token=True)


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from benchmarks import sm90_cta_timeline as timeline
    from benchmarks.moe_cases import SHAPES
    out = Path(sys.argv[1])
    spec = json.loads(sys.argv[2])
    shape = SHAPES[spec["shape"]]
    for timed in (False, True):
        gemms = timeline.compile_pair(shape, 1, 132, timed, spec["per_token"], spec["sums_waits"])
        for name, compiled in list(zip(("gemm1", "gemm2"), gemms))[1 if spec["per_token"] else 0:]:
            (out / f"{name}_{'timed' if timed else 'default'}.cubin").write_bytes(compiled.__cubin__)
    """
)


@pytest.fixture(scope="module", params=["deepseek_v3", "glm"])
def kernels(request, tmp_path_factory):
    """The T = 1 GEMMs of DeepSeek-V3 (`wgmma`) and of GLM (GEMM1 with per-warp `mma.sync`)."""
    out = compile_in_subprocess(
        _SCRIPT, {"shape": request.param, "per_token": False, "sums_waits": True},
        tmp_path_factory.mktemp("cta_timeline"),
    )
    return request.param, {f.stem: sass(f) for f in out.glob("*.cubin")}


@pytest.fixture(scope="module")
def quantizing_gemm2(tmp_path_factory):
    """DeepSeek-V3's per-token W4A4 GEMM2 at T = 1, quantizing its rows (`--per-token`)."""
    out = compile_in_subprocess(
        _SCRIPT, {"shape": "deepseek_v3", "per_token": True, "sums_waits": True},
        tmp_path_factory.mktemp("cta_timeline_per_token"),
    )
    return "deepseek_v3", {f.stem: sass(f) for f in out.glob("*.cubin")}


@pytest.fixture(scope="module")
def stamps_only(tmp_path_factory):
    """DeepSeek-V3's T = 1 GEMMs stamping the four points alone (`--no-wait-sums`)."""
    out = compile_in_subprocess(
        _SCRIPT, {"shape": "deepseek_v3", "per_token": False, "sums_waits": False},
        tmp_path_factory.mktemp("cta_timeline_stamps_only"),
    )
    return "deepseek_v3", {f.stem: sass(f) for f in out.glob("*.cubin")}


@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
def test_the_stamping_gemms_read_the_timer_around_the_pdl_wait_and_keep_the_default_compute(kernels, gemm):
    check_stamping_gemm(kernels, gemm)


def test_the_stamping_quantizing_gemm2_keeps_its_panel(quantizing_gemm2):
    _, code = quantizing_gemm2
    check_stamping_gemm(quantizing_gemm2, "gemm2")
    for instruction in ("REDUX", "STS.128", "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C", "FENCE.VIEW.ASYNC.S"):
        assert code["gemm2_timed"].count(instruction) == code["gemm2_default"].count(instruction) > 0, instruction


@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
def test_the_stamps_only_gemms_read_the_timer_four_times_and_issue_their_copies_as_the_default(stamps_only, gemm):
    check_stamping_gemm(stamps_only, gemm, sums_waits=False)
    _, code = stamps_only
    default, timed = code[f"{gemm}_default"], code[f"{gemm}_timed"]
    lines = [line for line in timed.splitlines() if "SR_GLOBALTIMERLO" in line or "ACQBULK" in line]
    assert [("ACQBULK" in line) for line in lines] == [False, True, False, False, False]
    # The wait sums cost DeepSeek-V3's GEMM2 consumers a spilled register; the stamps alone spill nothing.
    assert timed.count("LDL") == default.count("LDL")


def check_stamping_gemm(kernels, gemm, sums_waits=True):
    """The stamps, the wait sums (where `sums_waits`, else none) and the default's compute in the stamping
    kind of `gemm` of `kernels`."""
    shape, code = kernels
    default, timed = code[f"{gemm}_default"], code[f"{gemm}_timed"]
    assert "SR_GLOBALTIMER" not in default and "REDG.E.ADD.64" not in default
    # The stamps, then two reads around every pipeline wait of the producer's and the consumers' loops, whose
    # durations two threads add up (`WAIT_SUMS`).
    waits = timed.count("REDG.E.ADD.64")
    assert (waits >= 2 if sums_waits else waits == 0) and "SR_VIRTUALSMID" in timed
    assert timed.count("SR_GLOBALTIMERLO") == len(STAMPS) + 2 * waits
    lines = [line for line in timed.splitlines() if "SR_GLOBALTIMERLO" in line or "ACQBULK" in line]
    assert [("ACQBULK" in line) for line in lines[:3]] == [False, True, False]  # entry, the wait, waited
    warp_mma = (shape, gemm) == ("glm", "gemm1")
    assert (default.count("HMMA") > 0, default.count("HGMMA") > 0) == (warp_mma, not warp_mma)
    # The producers' bulk copies issue as the default's, not each in a loop over the warp's lanes (`ELECT`,
    # `BRA.U.ANY`), which a branch around the timed wait made ptxas emit (`blocked_wait_ns`).
    for instruction in ("HGMMA", "HMMA", "HMUL2.BF16_V2", "UBLKCP.S.G", "ELECT", "BRA.U.ANY"):
        assert timed.count(instruction) == default.count(instruction), instruction


def _stamps(sm, *times_ns, waits_ns=None):
    """Rows of `SLOTS`: each CTA's SM, its `STAMPS` times, its `WAIT_SUMS` (`waits_ns`, one list per sum; zeros
    by default)."""
    waits_ns = waits_ns or [[0] * len(sm)] * len(WAIT_SUMS)
    rows = [[sm, *t, *w] for sm, t, w in zip(sm, zip(*times_ns), zip(*waits_ns))]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, SLOTS)


def test_the_summary_takes_times_from_the_first_gemm1_entry_and_medians_over_replays():
    replays = []
    for offset in (1_000_000, 5_000_000, 9_000_000):  # the same CTAs' times in three replays
        gemm1 = _stamps([0, 1], [offset, offset + 500], [offset, offset + 500], [offset + 20_000] * 2,
                        [offset + 30_000, offset + 34_000], waits_ns=[[3_000, 1_000], [9_000, 12_000]])
        gemm2 = _stamps([2, 0, 1], [offset + 2_000, offset + 31_000, offset + 35_000], [offset + 35_500] * 3,
                        [offset + 50_000] * 3, [offset + 52_000, offset + 55_000, offset + 56_000])
        replays.append((gemm1, gemm2))
    rows = summary(replays)
    assert rows[("GEMM1", "ended")] == [30.0, 34.0]
    assert rows[("GEMM2", "entry")] == [2.0, 31.0, 35.0]
    assert rows[("GEMM2", "ended")] == [52.0, 55.0, 56.0]
    assert rows[("GEMM2", "resident before GEMM1's last end")] == [2.0]
    assert rows[("GEMM2", "distinct SMs")] == [3.0]
    assert rows[("GEMM1", "producer waited on empty")] == [1.0, 3.0]  # sums in us, not times since the entry
    assert rows[("GEMM1", "consumer waited on full")] == [9.0, 12.0]
    assert rows[("GEMM2", "consumer waited on full")] == [0.0, 0.0, 0.0]
    stamps_only = summary(replays, sums_waits=False)  # `--no-wait-sums`: the same times, no wait rows
    assert stamps_only == {key: value for key, value in rows.items() if key[1] not in WAIT_SUMS}


@pytest.mark.parametrize("persistent", [True, False])
def test_sm_persistence_tells_slow_sms_from_slow_replays(persistent):
    """Synthetic CTAs whose time from their wait to their end is 30 us, plus each SM's own lateness (the same
    in every replay and both GEMMs) or a fresh one per replay and GEMM, on SMs shuffled per replay."""
    rng = random.Random(7)
    own = {sm: rng.gauss(0, 1) for sm in range(132)}
    replays = []
    for _ in range(20):
        gemms = []
        for ctas in (128, 132):
            sms = rng.sample(range(132), ctas)
            late = [own[sm] if persistent else rng.gauss(0, 1) for sm in sms]
            ended = [2_000 + 30_000 + int(1_000 * x) for x in late]
            gemms.append(_stamps(sms, [1_000] * ctas, [2_000] * ctas, [20_000] * ctas, ended))
        replays.append(tuple(gemms))
    for name, ((p10, p90), halves, other) in sm_persistence(replays).items():
        if persistent:
            assert p10 < -0.8 and p90 > 0.8 and halves > 0.95 and other > 0.95, name
        else:
            assert -0.5 < p10 < 0 < p90 < 0.5 and abs(halves) < 0.4 and abs(other) < 0.4, name
