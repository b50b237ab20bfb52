"""The consumer probe's variants (`benchmarks.sm90_consumer_probe`, no GPU needed) remove what they say
they remove: the consumer variants from the default GEMM1 of DeepSeek-V3 decode, and nothing of the
producer (`no_weight_copies` the weight copies only, `no_activation_copies` the activation gather only,
and nothing of the consumers; `skeleton` both and the consumers' work, `skeleton_short_items` also the
items' k loops past one copy; `spinning_waits` only how the pipeline waits; `grouped_copies_*` only how
many k tiles a weight copy takes; `dynamic_k_chunks` only which work units a CTA walks); the epilogue
variants nothing of the code (they skip it at run time); the panel variants from the GEMM2 that
quantizes its rows (per-token W4A4, T = 1), and nothing of its consumers or its weight stream; the
weight-policy and prefetch variants only the weight copies' cache policy or the prefetches' byte counts."""

import re
import textwrap

import pytest

from tests.sm90_compile import bulk_copies, compile_in_subprocess, sass

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from benchmarks import sm90_consumer_probe as probe
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    _, configs1, configs2 = probe.gemm_configurations(spec.get("tokens", 1), 132)
    epilogue = spec.get("epilogue", "gemm1")
    key = (configs1 if epilogue == "gemm1" else configs2)[0][0]
    for name in spec["names"]:
        compiled = probe.compile_variant(name, epilogue, key)
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
        (out / f"{name}.ptx").write_text(compiled.__ptx__)
    """
)
"""DeepSeek-V3's decode GEMM1 at T = 1 (or at `tokens`; with `epilogue` "gemm2_fused", its fused GEMM2) built
from each variant of `names`."""


GEMM1_VARIANTS = (
    "default", "no_decode", "no_mma", "barriers_only", "no_epilogue", "no_gemm1_stores", "no_weight_copies",
    "no_activation_copies", "skeleton", "spinning_waits", "dynamic_k_chunks",
)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    out = compile_in_subprocess(_SCRIPT, {"names": GEMM1_VARIANTS}, tmp_path_factory.mktemp("consumer_probe"))
    return {name: sass(out / f"{name}.cubin") for name in GEMM1_VARIANTS}


def test_each_variant_drops_its_part_of_the_consumer_k_step(variants):
    def count(name, instruction):
        return variants[name].count(instruction)

    assert count("default", "HGMMA") > 0 and count("default", "HMUL2.BF16_V2") > 0
    assert count("no_decode", "HGMMA") == count("default", "HGMMA") and count("no_decode", "HMUL2.BF16_V2") == 0
    assert count("no_mma", "HGMMA") == 0 and count("no_mma", "HMUL2.BF16_V2") == count("default", "HMUL2.BF16_V2")
    for name in ("barriers_only", "skeleton"):
        assert count(name, "HGMMA") == 0 and count(name, "HMUL2.BF16_V2") == 0, name
    for name in variants:  # the producer's bulk copies and gathers are every variant's but those without them
        assert ("UBLKCP.S.G" in variants[name]) == (name not in ("no_weight_copies", "skeleton")), name
        assert ("LDGSTS.E" in variants[name]) == (name not in ("no_activation_copies", "skeleton")), name
        assert "LDGSTSBAR" in variants[name], name  # every producer thread's arrival on `full` stays


@pytest.mark.parametrize("name", ["no_weight_copies", "no_activation_copies"])
def test_the_producer_variants_keep_the_whole_consumer(variants, name):
    for instruction in ("HGMMA", "HMUL2.BF16_V2", "SHFL.IDX", "LDS.128"):
        assert variants[name].count(instruction) == variants["default"].count(instruction) > 0, instruction


def test_spinning_waits_poll_instead_of_suspending_and_keep_the_rest(variants):
    """`spinning_waits`: every pipeline wait (all of them lie in the producer's and the consumers' loops) polls
    (`SYNCS.PHASECHK` without `TRYWAIT`, no `NANOSLEEP` after it), and the copies and math are the default's."""
    default, spinning = variants["default"], variants["spinning_waits"]
    assert default.count("NANOSLEEP.SYNCS") > spinning.count("NANOSLEEP.SYNCS")
    assert spinning.count("PHASECHK.TRANS64.TRYWAIT") == 0 < default.count("PHASECHK.TRANS64.TRYWAIT")
    for instruction in ("HGMMA", "HMUL2.BF16_V2", "UBLKCP.S.G", "LDGSTS.E", "SHFL.IDX", "LDS.128"):
        assert spinning.count(instruction) == default.count(instruction) > 0, instruction


def test_the_epilogue_variants_keep_the_epilogue_code_behind_a_run_time_test(variants):
    def count(name, instruction):
        return len(re.findall(rf"\b{instruction}\b", variants[name]))

    # Every MMA and every store of the default stays in the code; the skip is one comparison per block
    # (`no_epilogue`) or per store (`no_gemm1_stores`).
    for name in ("no_epilogue", "no_gemm1_stores"):
        for instruction in ("HGMMA", "STG", "HMUL2.BF16_V2", "MUFU.EX2"):
            assert count(name, instruction) == count("default", instruction) > 0, (name, instruction)
        assert count(name, "FSETP") > count("default", "FSETP"), name
    assert count("no_gemm1_stores", "FSETP") > count("no_epilogue", "FSETP")


_GEMM2_EPILOGUE_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from benchmarks import sm90_consumer_probe as probe
    out = Path(sys.argv[1])
    _, _, configs2 = probe.gemm_configurations(4096, 132)
    for name in ("default", "gemm2_vector_reduce", "half_gemm2_epilogue", "gemm2_plain_stores", "gemm2_math_only",
                 "no_alpha_loads"):
        compiled = probe.compile_variant(name, "gemm2_fused", configs2[0][0])
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
    """
)


def test_the_gemm2_epilogue_variants_of_prefill_tiles(tmp_path):
    """`gemm2_vector_reduce` adds four features per instruction; `half_gemm2_epilogue` keeps every
    reduction in the code (it skips them at run time in half the CTAs); `gemm2_plain_stores` stores where
    the default reduces; `gemm2_math_only` keeps every reduction behind a run-time test on its value."""
    out = compile_in_subprocess(_GEMM2_EPILOGUE_SCRIPT, {}, tmp_path)
    names = ("default", "gemm2_vector_reduce", "half_gemm2_epilogue", "gemm2_plain_stores", "gemm2_math_only",
             "no_alpha_loads")
    code = {name: sass(out / f"{name}.cubin") for name in names}
    scalar = {name: text.count("REDG.E.ADD.F32.FTZ.RN") for name, text in code.items()}
    vector = {name: text.count("REDG.E.ADD.F32x4.FTZ.RN") for name, text in code.items()}
    assert scalar["default"] > 0 and vector["default"] == 0
    assert vector["gemm2_vector_reduce"] > 0 and scalar["gemm2_vector_reduce"] < scalar["default"]
    assert code["gemm2_vector_reduce"].count("HGMMA") == code["default"].count("HGMMA") > 0
    assert scalar["half_gemm2_epilogue"] == scalar["default"] == scalar["gemm2_math_only"]
    assert scalar["gemm2_plain_stores"] == 0 and code["gemm2_plain_stores"].count("STG.E ") == scalar["default"]
    assert code["gemm2_math_only"].count("FSETP") > code["default"].count("FSETP")
    assert code["no_alpha_loads"].count("LDG.E ") == code["default"].count("LDG.E ") - 1
    assert scalar["no_alpha_loads"] == scalar["default"]
    for name in ("half_gemm2_epilogue", "gemm2_plain_stores", "gemm2_math_only", "no_alpha_loads"):
        assert code[name].count("HGMMA") == code["default"].count("HGMMA"), name


_PANEL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from benchmarks import sm90_consumer_probe as probe
    from fp4moe.kernels.sm90 import moe_launch
    out = Path(sys.argv[1])
    arguments = json.loads(sys.argv[2])["gemm2"]
    arguments[1], arguments[6] = tuple(arguments[1]), tuple(arguments[6])
    for name in ("default", "panel_no_scan", "panel_no_quantize", "panel_none"):
        with probe.variant_kernels(name):
            compiled = moe_launch.compile_gemm(*arguments)
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
    """
)


def test_each_panel_variant_drops_its_part_of_the_panel(tmp_path):
    from fp4moe import nvfp4
    from fp4moe.kernels.sm90.quantize_launch import per_token_numerator

    # DeepSeek-V3's fused GEMM2 at T = 1 on the rescan path: seven-group CTAs, two slices of K, quantizing.
    gemm2 = ["gemm2_fused", (256, 7168, 2048, 448, 8, 8, 64, 12, 1, 132), 2048, 7168, 8, "none", (None, None, None),
             False, False, False, False, 2, 32, 0, False, per_token_numerator(nvfp4.DEFAULT_GLOBAL_SCALE_INV)]
    out = compile_in_subprocess(_PANEL_SCRIPT, {"gemm2": gemm2}, tmp_path)
    code = {name: sass(out / f"{name}.cubin") for name in ("default", "panel_no_scan", "panel_no_quantize", "panel_none")}
    row_loads = {name: text.count("LDG.E.128") for name, text in code.items()}  # the rows' 16-byte chunks
    assert row_loads["default"] > row_loads["panel_no_scan"] > row_loads["panel_none"]
    assert row_loads["panel_no_quantize"] == row_loads["default"]
    # The quantization arithmetic (its E4M3 block scales) is in the variants that keep it only.
    assert [name for name, text in code.items() if "F2FP.SATFINITE.E4M3" in text] == ["default", "panel_no_scan"]
    for name, text in code.items():  # the consumers' MMAs and the weight stream are every variant's
        assert text.count("HGMMA") == code["default"].count("HGMMA") > 0 and "UBLKCP.S.G" in text, name


_GLM_DECODE_GEMM_OPTIONS = dict(
    num_experts=256, prepared_k=6144, act_k=6144, tile_features=64, tile_rows=8, row_granule=8, tile_k=128,
    stages=16, ctas_per_sm=2, max_ctas=264, top_k=8,
)
"""`MoEGemmSm90` options of GLM's decode GEMMs at T = 1 (64-feature CTAs, 8-row tiles, 48 k tiles of 128),
less the rows, for the variants' constructor tests."""


@pytest.mark.parametrize("name, splits", [("gemm1_k_splits_2", 2), ("gemm1_k_splits_4", 4)])
def test_the_gemm1_split_variants_slice_gemm1_only(name, splits):
    from benchmarks import sm90_consumer_probe as probe

    options = dict(_GLM_DECODE_GEMM_OPTIONS, prepared_rows=1024)
    gemm1 = probe.VARIANTS[name](epilogue="gemm1", out_features=512, **options)
    # GLM's GEMM1 at T = 1: 48 k tiles of 128 K per 64-feature item, now `splits` items of fewer.
    assert (gemm1.k_splits, gemm1.k_iterations) == (splits, 48 // splits)
    assert [gemm1.item_place(item)[2] for item in range(splits)] == [s * 48 // splits for s in range(splits)]
    gemm2 = probe.VARIANTS[name](epilogue="gemm2_fused", out_features=6144, activation="none", **options)
    assert (gemm2.k_splits, gemm2.k_iterations) == (1, 48)


_GLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from benchmarks import sm90_consumer_probe as probe, sm90_gemm_sweep as sweep
    from benchmarks.moe_cases import SHAPES
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    glm = SHAPES["glm"]
    _, configs1, _ = sweep.gemm_configurations(1, 132, glm)
    routed = spec.get("prefetches_routed", False)
    for name in spec["names"]:
        with probe.variant_kernels(name):
            kernel = sweep.compile_gemm1(configs1[0], glm, prefetches_routed=routed)
        (out / f"{name}.cubin").write_bytes(kernel.__cubin__)
        (out / f"{name}.ptx").write_text(kernel.__ptx__)
    """
)
"""GLM's decode GEMM1 at T = 1 (`sm90_gemm_sweep.compile_gemm1`) built from each variant of `names`;
with `prefetches_routed`, as the whole call builds it (the routed L2 prefetch)."""


def test_grouped_copies_expect_a_group_of_k_tiles_on_one_barrier_and_keep_the_rest(tmp_path):
    """`grouped_copies_1` / `_2` / `_4` and the default (`moe_gemm.WEIGHT_COPY_K_TILES` k tiles) on GLM's
    decode GEMM1 (CTAs of one 64-row block; the kernel's own `tiles_per_copy`): thread 0 expects one, two or
    four k tiles' weight bytes (4,608 each: 4 KB of codes, 512 B of scales) on the group's first `full`,
    still in one bulk copy of codes and one of scales, and arrives plainly on each later stage's `full`; the
    producer waits for each stage of the group to be free (one phase check per stage); the activation
    copies and their arrivals come once per k tile of the group; the consumers' code is the same."""
    from fp4moe.kernels.sm90.moe_gemm import WEIGHT_COPY_K_TILES

    names = ("grouped_copies_1", "default", "grouped_copies_2", "grouped_copies_4")
    out = compile_in_subprocess(_GLM_SCRIPT, {"names": names}, tmp_path)
    kernels = {name: sass(out / f"{name}.cubin") for name in names}
    single = kernels["grouped_copies_1"]
    for name, group in zip(names, (1, WEIGHT_COPY_K_TILES, 2, 4)):
        kernel = kernels[name]
        for other in (1, 2, 4):
            assert (f"0x{other * 4608:x} " in kernel) == (other == group), (name, other)
        plain = kernel.count("SYNCS.ARRIVE.TRANS64.A1T0") - single.count("SYNCS.ARRIVE.TRANS64.A1T0")
        assert plain == group - 1, name
        waits = kernel.count("SYNCS.PHASECHK.TRANS64 ") - single.count("SYNCS.PHASECHK.TRANS64 ")
        assert waits == group - 1, name
        for instruction in ("LDGSTS.E", "LDGSTSBAR"):
            assert kernel.count(instruction) == group * single.count(instruction) > 0, (name, instruction)
        for instruction in ("HMMA", "HMUL2.BF16_V2", "UBLKCP.S.G"):
            assert kernel.count(instruction) == single.count(instruction) > 0, (name, instruction)


def test_thread_weight_copies_replace_the_bulk_copies_and_keep_the_rest(tmp_path):
    """`thread_weight_copies` on GLM's decode GEMM1 (one 64-row block of 128 K per k tile: 4 KB of codes,
    512 B of scales): no bulk copy; each producer thread's two 16-byte `cp.async`s of codes, one of scales
    (the first 32 threads') and its activation chunk, all before its one arrival on `full`; thread 0 arrives
    there without expecting bytes; the consumers' code is the one-copy-per-k-tile default's. With
    `barriers_only`' consumers (`thread_weight_copies_barriers_only`) the copies stay and the decode and MMAs
    go."""
    names = ("grouped_copies_1", "thread_weight_copies", "thread_weight_copies_barriers_only")
    out = compile_in_subprocess(_GLM_SCRIPT, {"names": names}, tmp_path)
    single, threads, stream_only = (sass(out / f"{name}.cubin") for name in names)
    assert single.count("UBLKCP.S.G") == 2 and "UBLKCP" not in threads
    assert single.count("LDGSTS.E") == 1 and threads.count("LDGSTS.E") == 4
    assert threads.count("LDGSTSBAR") == single.count("LDGSTSBAR") == 1
    assert "SYNCS.ARRIVE.TRANS64 " in single and "SYNCS.ARRIVE.TRANS64 " not in threads  # no expected bytes
    for instruction in ("HMMA", "HMUL2.BF16_V2", "LDSM", "LDS.128", "SHFL.IDX"):
        assert threads.count(instruction) == single.count(instruction) > 0, instruction
    for spill in ("LDL", "STL"):
        assert spill not in threads, spill
    assert "UBLKCP" not in stream_only and stream_only.count("LDGSTS.E") == 4
    assert "HMMA" not in stream_only and "HMUL2" not in stream_only


def test_dynamic_k_chunks_claim_units_from_a_counter_and_keep_the_k_step(variants):
    """`dynamic_k_chunks` (DeepSeek-V3's decode GEMM1): the producer's thread 0 claims units with global
    atomics, the counters go back to zero by exchange, the producer warps meet at `CLAIM_BARRIER`, and the
    consumers' k step and the producer's copies are the default's."""
    from benchmarks.sm90_consumer_probe import CLAIM_BARRIER

    default, dynamic = variants["default"], variants["dynamic_k_chunks"]
    assert "ATOMG.E.ADD" in dynamic and "ATOMG.E.EXCH" in dynamic and "ATOMG" not in default
    assert f"BAR.SYNC.DEFER_BLOCKING 0x{CLAIM_BARRIER:x}, 0x80" in dynamic
    for instruction in ("HGMMA", "HMUL2.BF16_V2", "UBLKCP.S.G", "LDGSTS.E"):
        assert dynamic.count(instruction) == default.count(instruction) > 0, instruction


def test_interleaved_k_streams_walk_runs_of_k_tiles_and_keep_the_rest(tmp_path):
    """`two_k_streams` / `four_k_streams` / `rotated_k_walk` on GLM's decode GEMM1 with its routed L2
    prefetch (the whole call's GEMM1 at T = 1): one k tile per bulk copy as `grouped_copies_1`, the routed
    prefetch split over the runs (one prefetch of codes and one of scales per run; `rotated_k_walk` one
    run from its rotated start), the consumers' code unchanged; with
    `barriers_only`' consumers the copies stay and the decode and MMAs go."""
    names = ("grouped_copies_1", "two_k_streams", "four_k_streams", "four_k_streams_barriers_only", "rotated_k_walk")
    out = compile_in_subprocess(_GLM_SCRIPT, {"names": names, "prefetches_routed": True}, tmp_path)
    single, two, four, stream_only, rotated = (sass(out / f"{name}.cubin") for name in names)
    for kernel, runs in ((single, 1), (two, 2), (four, 4), (stream_only, 4), (rotated, 1)):
        assert kernel.count("UBLKPF.L2") == 2 * runs
        assert kernel.count("UBLKCP.S.G") == 2 and kernel.count("LDGSTS.E") == 1
        for spill in ("LDL", "STL"):
            assert spill not in kernel, spill
    for instruction in ("HMMA", "HMUL2.BF16_V2", "LDSM", "LDS.128", "SHFL.IDX"):
        counts = {kernel.count(instruction) for kernel in (single, two, four, rotated)}
        assert len(counts) == 1 and counts.pop() > 0, instruction
    assert "HMMA" not in stream_only and "HMUL2" not in stream_only


def test_same_result_variants_are_checked_against_the_default():
    torch = pytest.importorskip("torch")
    from benchmarks.sm90_consumer_probe import SAME_RESULT_VARIANTS, VARIANTS, same_result_cell

    assert SAME_RESULT_VARIANTS <= set(VARIANTS) and "default" not in SAME_RESULT_VARIANTS
    default = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert same_result_cell("four_k_streams", default.clone(), default, 1e-3) == " (vs default 0.0e+00)"
    assert same_result_cell("four_k_streams", default * 1.01, default, 1e-3).endswith(" WRONG)")
    assert same_result_cell("four_k_streams", default, None, 1e-3) == ""  # no default ran
    assert same_result_cell("barriers_only", default * 2, default, 1e-3) == ""  # garbage by design


def test_the_copy_removing_variants_build_on_grouped_weight_copies(tmp_path):
    """`no_weight_copies` and `skeleton` on GLM's decode GEMM1, whose CTAs of one 64-row block copy two k
    tiles' weights per bulk copy (`moe_gemm.WEIGHT_COPY_K_TILES`): no weight copy; `no_weight_copies` keeps
    the activation copies (one per k tile of a group) and the consumers' MMAs, `skeleton` neither."""
    names = ("no_weight_copies", "skeleton")
    out = compile_in_subprocess(_GLM_SCRIPT, {"names": names}, tmp_path)
    no_weights, skeleton = (sass(out / f"{name}.cubin") for name in names)
    assert "UBLKCP" not in no_weights and no_weights.count("LDGSTS.E") == 2 and "HMMA" in no_weights
    assert "UBLKCP" not in skeleton and "LDGSTS.E" not in skeleton and "HMMA" not in skeleton


def test_the_short_item_skeleton_cuts_only_the_items_k_loop():
    """`skeleton_short_items` keeps `skeleton`'s items (the same places, slices and copies per group) and cuts
    each one's k loop to one weight copy: GLM's decode GEMM1 at T = 1 (48 k tiles of 128 per item, two per
    copy) and its fused GEMM2 in two slices of K."""
    from benchmarks import sm90_consumer_probe as probe

    options = dict(_GLM_DECODE_GEMM_OPTIONS, tiles_per_copy=2)
    for epilogue, rows, extra in (("gemm1", 1024, {}), ("gemm2_fused", 6144, {"activation": "none", "k_splits": 2})):
        skeleton, short = (
            probe.VARIANTS[name](epilogue=epilogue, prepared_rows=rows, out_features=rows, **options, **extra)
            for name in ("skeleton", "skeleton_short_items")
        )
        assert skeleton.k_iterations == 48 // extra.get("k_splits", 1) and short.k_iterations == 2
        assert (short.k_splits, short.tiles_per_copy, short.feature_blocks) == (
            skeleton.k_splits, skeleton.tiles_per_copy, skeleton.feature_blocks
        )


def test_decode_weight_copies_are_evict_first_and_the_control_takes_the_default_policy(tmp_path):
    """DeepSeek-V3's fused GEMM2 at T = 1 (8-row tiles, `moe_gemm.EVICT_FIRST_TILE_ROWS`): every weight
    copy carries a cache policy (`desc[...]`); `weights_evict_normal` the same copies with none, and its
    prefetches, consumers and epilogue are the default's."""
    names = ("default", "weights_evict_normal")
    out = compile_in_subprocess(_SCRIPT, {"names": names, "epilogue": "gemm2_fused"}, tmp_path)
    kernels = {name: sass(out / f"{name}.cubin") for name in names}
    copies = {name: bulk_copies(kernels[name]) for name in names}
    assert copies["default"] and all("desc[" in line for line in copies["default"])
    assert len(copies["weights_evict_normal"]) == len(copies["default"])
    assert not any("desc[" in line for line in copies["weights_evict_normal"])
    for instruction in ("UBLKPF.L2", "HGMMA", "HMUL2.BF16_V2", "LDS.128", "RED"):
        assert kernels["weights_evict_normal"].count(instruction) == kernels["default"].count(instruction) > 0, instruction


def test_the_everywhere_variant_copies_prefill_weights_evict_first_too(tmp_path):
    """DeepSeek-V3's GEMM1 at T = 4096 (128-row tiles, above `moe_gemm.EVICT_FIRST_TILE_ROWS`): the default's
    weight copies carry no cache policy, `weights_evict_first_all`'s carry one each."""
    names = ("default", "weights_evict_first_all")
    out = compile_in_subprocess(_SCRIPT, {"names": names, "tokens": 4096}, tmp_path)
    copies = {name: bulk_copies(sass(out / f"{name}.cubin")) for name in names}
    assert copies["default"] and not any("desc[" in line for line in copies["default"])
    assert len(copies["weights_evict_first_all"]) == len(copies["default"])
    assert all("desc[" in line for line in copies["weights_evict_first_all"])


def _prefetch_sizes(ptx: str) -> list[int]:
    """The byte counts of a kernel's bulk L2 prefetches, each a register set by the `mov` before it."""
    sizes = {register: int(value) for register, value in re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx)}
    return sorted(sizes[register] for register in re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], (%r\d+);", ptx))


def test_gemm2_prefetch_variants_scale_only_their_byte_counts(tmp_path):
    """DeepSeek-V3's fused GEMM2 at T = 1 (CTAs of seven consumer groups, 64 K per k tile): the default
    prefetches `moe_gemm.SEVEN_GROUP_PREFETCH_K_TILES` (8) k tiles, 16 KB of codes and 2 KB of scales per
    block, as `gemm2_prefetch_8` does; `gemm2_prefetch_2` and `gemm2_prefetch_4` issue the same prefetches
    with a quarter and half the bytes, and nothing else changes."""
    names = ("default", "gemm2_prefetch_2", "gemm2_prefetch_4", "gemm2_prefetch_8")
    out = compile_in_subprocess(_SCRIPT, {"names": names, "epilogue": "gemm2_fused"}, tmp_path)
    ptx = {name: (out / f"{name}.ptx").read_text() for name in names}
    default = _prefetch_sizes(ptx["default"])
    assert default and set(default) == {2048, 16384}
    for name, factor in (("gemm2_prefetch_2", 4), ("gemm2_prefetch_4", 2), ("gemm2_prefetch_8", 1)):
        assert [size * factor for size in _prefetch_sizes(ptx[name])] == default, name
        kernel, reference = sass(out / f"{name}.cubin"), sass(out / "default.cubin")
        for instruction in ("UBLKPF.L2", "UBLKCP.S.G", "HGMMA", "HMUL2.BF16_V2"):
            assert kernel.count(instruction) == reference.count(instruction) > 0, (name, instruction)


def test_the_larger_routed_prefetch_changes_only_its_budget(tmp_path):
    """GLM's decode GEMM1 at T = 1 with the routed prefetch: `routed_prefetch_8mb` divides 8 MB instead of
    `moe_gemm.ROUTED_PREFETCH_BYTES` among the (pair, feature block) combinations."""
    from fp4moe.kernels.sm90.moe_gemm import ROUTED_PREFETCH_BYTES

    names = ("default", "routed_prefetch_8mb")
    out = compile_in_subprocess(_GLM_SCRIPT, {"names": names, "prefetches_routed": True}, tmp_path)
    ptx = {name: (out / f"{name}.ptx").read_text() for name in names}
    assert ROUTED_PREFETCH_BYTES == 4 << 20
    assert str(4 << 20) in ptx["default"] and str(8 << 20) not in ptx["default"]
    assert str(8 << 20) in ptx["routed_prefetch_8mb"] and str(4 << 20) not in ptx["routed_prefetch_8mb"]
    kernel, reference = (sass(out / f"{name}.cubin") for name in names)
    assert kernel.count("UBLKPF.L2") == reference.count("UBLKPF.L2") > 0
