"""The sm90 quantization kernels compile for sm_90a without a GPU, and their PTX has the properties
the bitwise-exactness argument rests on (see `fp4moe.kernels.sm90.nvfp4_device`).

Runs in CI on a CPU machine. Compiling every variant (~250) takes about a minute, so this compiles a
representative subset: every (scale layout x 4-over-6 mode x scale source) combination for one
dtype at a ragged K, every dtype at every tested K for one combination, the widest row with the
heaviest mode, the many-rows class (`MANY_ELEMENTS`) at every tested K, the MoE pipeline's quantizers
that write decoded values (`DECODED_VARIANTS`), and the tile_amax producer per dtype and load width.
A variant is (dtype, K, scale layout, 4-over-6 mode, scale source, valid-row count given, many rows),
for the decoded ones then the launch order. The compilation runs in a subprocess because
`CUTE_DSL_KEEP` (which keeps the PTX) is read when the DSL is imported.
"""

import re
import textwrap

import pytest

from fp4moe.kernels.sm90.quantize import UNROLLED_TILES_PER_LANE, aux_tile_lanes, row_tiling
from fp4moe.nvfp4 import ceil_div
from tests.sm90_compile import ARCH, compile_in_subprocess, sass

QUANTIZE_VARIANTS = sorted(
    {
        *(
            ("bfloat16", 272, layout, mode, source, valid, False)
            for layout in ("linear", "swizzled")
            for mode in ("off", "mae", "mse")
            for source, valid in (("tensor", False), ("rescan", False), ("aux", False), ("aux", True))
        ),
        *(
            (dtype, k, "swizzled", "off", "rescan", False, many)
            for dtype in ("bfloat16", "float16", "float32")
            for k in (16, 272, 2048, 7168)
            for many in (False, True)
        ),
        *(("bfloat16", k, "linear", "off", "aux", True, True) for k in (16, 272, 2048, 7168)),
        ("bfloat16", 7168, "swizzled", "mse", "aux", True, False),
        ("float16", 2048, "linear", "mae", "aux", False, True),
        ("float32", 2048, "linear", "mse", "tensor", False, True),
    }
)
DECODED_VARIANTS = [
    # The MoE pipeline's quantizers that write the codes' bf16 values (`decoded`): linear, no 4-over-6;
    # the activation quantizers (per-tensor, per-token rescan) run alongside the plan kernel and wait
    # last, the intermediate ones (rescan, aux) release their successor first (`pdl.LAUNCH_ORDERS`).
    ("bfloat16", 2048, "linear", "off", "tensor", False, False, "before_wait"),
    ("bfloat16", 7168, "linear", "off", "rescan", False, True, "before_wait"),
    ("bfloat16", 2048, "linear", "off", "rescan", False, False, "release_first"),
    ("bfloat16", 2048, "linear", "off", "aux", True, False, "release_first"),
    ("bfloat16", 7168, "linear", "off", "aux", True, True, "release_first"),
]
TILE_AMAX_VARIANTS = [("bfloat16", 7168, 128, 8), ("float16", 272, 100, 4), ("float32", 33, 7, 1), ("bfloat16", 2048, 128, 1)]

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from fp4moe.kernels.sm90 import quantize_launch as launch
    out = Path(sys.argv[1])
    spec = json.loads(sys.argv[2])
    for i, (dtype, k, layout, mode, source, valid, many, tiles) in enumerate(spec["quantize"]):
        compiled = launch.compile_quantize(
            getattr(torch, dtype), k, layout, mode, source, valid, many, spec["arch"], tiles
        )
        (out / f"quantize_{i}.ptx").write_text(compiled.__ptx__)
        (out / f"quantize_{i}.cubin").write_bytes(compiled.__cubin__)
    for i, (dtype, k, layout, mode, source, valid, many, order, tiles) in enumerate(spec["decoded"]):
        compiled = launch.compile_quantize(
            getattr(torch, dtype), k, layout, mode, source, valid, many, spec["arch"], tiles, decoded=True,
            launch_order=order,
        )
        (out / f"decoded_{i}.ptx").write_text(compiled.__ptx__)
        (out / f"decoded_{i}.cubin").write_bytes(compiled.__cubin__)
    for i, (dtype, n, tile_n, vector) in enumerate(spec["tile_amax"]):
        compiled = launch.compile_tile_amax(getattr(torch, dtype), n, tile_n, vector, spec["arch"])
        (out / f"tile_amax_{i}.ptx").write_text(compiled.__ptx__)
        (out / f"tile_amax_{i}.cubin").write_bytes(compiled.__cubin__)
    """
)


def _aux_tiles(dtype, k, layout, source):
    """The `input_amax` tile count a variant is compiled for: GEMM1 tiles of 128 columns; of 48 for
    float16 (more tiles than a row has lanes at K=2048); of 1 for bfloat16 rows with linear scales
    (more tiles than the kernel unrolls). 0 without the aux path."""
    if source != "aux":
        return 0
    tile_n = 48 if dtype == "float16" else 1 if layout == "linear" else 128
    return ceil_div(k, tile_n)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Directory with the PTX and cubin of every variant, compiled for sm_90a in one subprocess."""
    out = tmp_path_factory.mktemp("sm90_kernels")
    quantize = [(*variant, _aux_tiles(*variant[:3], variant[4])) for variant in QUANTIZE_VARIANTS]
    # The pipeline's aux handoff: GEMM1's tiles of 8 columns.
    decoded = [(*variant, variant[1] // 8 if variant[4] == "aux" else 0) for variant in DECODED_VARIANTS]
    spec = {"arch": ARCH, "quantize": quantize, "decoded": decoded, "tile_amax": TILE_AMAX_VARIANTS}
    return compile_in_subprocess(_COMPILE_SCRIPT, spec, out)


def _ptx(compiled, name):
    # Inline-asm blocks arrive verbatim: drop comments so that only instructions are matched.
    return re.sub(r"//[^\n]*", "", (compiled / f"{name}.ptx").read_text())


def _all_ptx(compiled):
    names = [f"quantize_{i}" for i in range(len(QUANTIZE_VARIANTS))]
    names += [f"decoded_{i}" for i in range(len(DECODED_VARIANTS))]
    names += [f"tile_amax_{i}" for i in range(len(TILE_AMAX_VARIANTS))]
    return {name: _ptx(compiled, name) for name in names}


def test_every_variant_compiles_for_sm90a(compiled):
    for i, variant in enumerate(QUANTIZE_VARIANTS):
        assert ".target sm_90a" in _ptx(compiled, f"quantize_{i}"), variant
    for i, variant in enumerate(DECODED_VARIANTS):
        assert ".target sm_90a" in _ptx(compiled, f"decoded_{i}"), variant
    for i, variant in enumerate(TILE_AMAX_VARIANTS):
        assert ".target sm_90a" in _ptx(compiled, f"tile_amax_{i}"), variant


EXACT_PRODUCT_FMA = re.compile(
    r"fma\.rn\.f32\s+%?\w+,\s*(\w+,\s*0f(40000000|3F000000),\s*0f4B00000[04]|tiny_e2m1_value,\s*%\w+,\s*%\w+);"
)
"""The FMAs with exact products: the fast E2M1 encoder's (a product by 2 or 1/2 plus 2^23 (+4)), and
the 4-over-6 error's, whose first factor is a decoded E2M1 value times 2^-14
(`nvfp4_device.e2m1_scaled_error`), the second an E4M3 scale times 2^14. Each rounds once."""


def test_fp32_arithmetic_is_correctly_rounded_and_never_fused(compiled):
    """Every FP32 add/sub/mul carries `.rn` (which PTX forbids to contract into an FMA), the only FMAs
    have exact products, division is IEEE `div.rn`, and nothing flushes subnormals to zero."""
    for name, ptx in _all_ptx(compiled).items():
        assert not re.search(r"\b(fma|mad)\.[a-z.]*f32", EXACT_PRODUCT_FMA.sub("", ptx)), name
        assert not re.search(r"\b(add|sub|mul)\.f32\b", ptx), name
        assert not re.search(r"\.ftz\b", ptx), name
        assert not re.search(r"\b(div\.approx|div\.full|rcp\.)", ptx), name
        if not name.startswith("tile_amax"):
            assert "div.rn.f32" in ptx, name


def test_quantizers_use_the_exact_conversions_and_nan_ignoring_maxima(compiled):
    for i, (dtype, *_rest) in enumerate(QUANTIZE_VARIANTS):
        ptx = _ptx(compiled, f"quantize_{i}")
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert "cvt.rn.f16x2.e4m3x2" in ptx
        packed_max = {"bfloat16": "bf16x2", "float16": "f16x2", "float32": "f32"}[dtype]
        assert f"max.NaN.xorsign.abs.{packed_max}" in ptx, (dtype, packed_max)
        assert re.search(r"\bmax\.f32\b", ptx), "NaN-ignoring maxima"
        assert not re.search(r"\bmax\.NaN\.(?!xorsign)", ptx)


def test_rows_are_read_with_16_byte_loads(compiled):
    for i, variant in enumerate(QUANTIZE_VARIANTS):
        assert "ld.global.v4.b32" in _ptx(compiled, f"quantize_{i}"), variant
    for i, variant in enumerate(DECODED_VARIANTS):  # and their values written with 16-byte stores
        ptx = _ptx(compiled, f"decoded_{i}")
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, variant


def test_aux_tile_maxima_are_loaded_ahead_of_the_row(compiled):
    """The aux path issues its tile-maximum loads (up to `UNROLLED_TILES_PER_LANE` per lane) before
    the row's 16-byte loads, so the row amax is ready when the row arrives."""
    for i, (dtype, k, layout, _mode, source, _valid, many) in enumerate(QUANTIZE_VARIANTS):
        if source != "aux":
            continue
        ptx = _ptx(compiled, f"quantize_{i}")
        ahead = ptx[: ptx.index("ld.global.v4")].count("ld.global.b16")
        tiles_per_lane = ceil_div(_aux_tiles(dtype, k, layout, source), aux_tile_lanes(k, many))
        assert ahead == min(tiles_per_lane, UNROLLED_TILES_PER_LANE), QUANTIZE_VARIANTS[i]


def _launch_order(name: str) -> str:
    """The launch order a compiled variant was built with (`pdl.LAUNCH_ORDERS`)."""
    kind, index = name.rsplit("_", 1)
    return DECODED_VARIANTS[int(index)][-1] if kind == "decoded" else "wait_first"


def test_kernels_wait_for_their_predecessor_before_touching_global_memory(compiled):
    """Launched with programmatic dependent launch, a kernel may start before its predecessor ends:
    `griddepcontrol.wait` must come before every global load and store (`kernels.sm90.pdl`), and
    the release of the successor after it, except in the MoE pipeline's quantizers: those release
    first, and the activation quantizers, whose predecessor shares no memory with them, wait after
    their last store."""
    for name, ptx in _all_ptx(compiled).items():
        order = _launch_order(name)
        (wait,) = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
        (release,) = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
        accesses = [m.start() for m in re.finditer(r"\b(ld|st)\.global\b", ptx)]
        assert (release < wait) == (order != "wait_first"), name
        if order == "before_wait":
            assert wait > max(accesses), name
            assert "ret;" not in ptx[:wait], name  # no thread leaves without waiting
        else:
            assert wait < min(accesses), name


def test_only_rows_wider_than_a_warp_synchronize_the_cta(compiled):
    """Per-token rows wider than a warp combine their warps' maxima through shared memory, except on
    the aux path of the many-rows class, where every warp reduces all the row's tile maxima itself."""
    for i, (_dtype, k, _layout, _mode, source, _valid, many) in enumerate(QUANTIZE_VARIANTS):
        has_barrier = "bar.sync" in _ptx(compiled, f"quantize_{i}")
        threads_per_row, _, _ = row_tiling(k, many)
        per_warp_aux = source == "aux" and many
        assert has_barrier == (source != "tensor" and threads_per_row > 32 and not per_warp_aux), QUANTIZE_VARIANTS[i]


def test_16_bit_codes_take_their_sign_bits_from_the_packed_inputs(compiled):
    """The fast encoder places eight sign bits per code word with byte permutes (16-bit inputs only)."""
    for i, (dtype, *_rest) in enumerate(QUANTIZE_VARIANTS):
        has_permutes = "prmt.b32" in _ptx(compiled, f"quantize_{i}")
        assert has_permutes == (dtype != "float32"), QUANTIZE_VARIANTS[i]


def test_four_over_six_scores_the_fast_encoders_codes(compiled):
    """4-over-6 variants decode the FMA-pipe encoder's codes for both candidates' errors
    (`nvfp4_device.e2m1_scaled_error`) besides the exact path; without 4-over-6 there is no error."""
    for i, (_dtype, _k, _layout, mode, *_rest) in enumerate(QUANTIZE_VARIANTS):
        ptx = _ptx(compiled, f"quantize_{i}")
        assert ("tiny_e2m1_value" in ptx) == (mode != "off"), QUANTIZE_VARIANTS[i]


def test_row_maxima_take_one_reduction_per_warp(compiled):
    """Per-token rows of a warp or wider reduce each warp's maximum in one `redux.sync` instead of
    five shuffles; narrower rows of more than one thread shuffle inside their lane group."""
    for i, (_dtype, k, _layout, _mode, source, _valid, many) in enumerate(QUANTIZE_VARIANTS):
        ptx = _ptx(compiled, f"quantize_{i}")
        threads_per_row = row_tiling(k, many)[0]
        per_token = source != "tensor"
        assert ("redux.sync.max.u32" in ptx) == (per_token and threads_per_row >= 32), QUANTIZE_VARIANTS[i]
        assert ("shfl.sync.bfly" in ptx) == (per_token and 1 < threads_per_row < 32), QUANTIZE_VARIANTS[i]


def test_no_variant_spills_to_local_memory(compiled):
    for cubin in sorted(compiled.glob("*.cubin")):
        assert not re.search(r"\b(LDL|STL)\b", sass(cubin)), cubin.name
