"""The quantization ops' output rules (`fp4moe.op_outputs`) against the layouts they describe, written
out here from the specification (docs/semantics.md §1-2) for every row count up to 1000."""

import pytest
import torch

from fp4moe import nvfp4
from fp4moe.op_outputs import (
    OutputRule,
    RowGroups,
    allocate,
    dimension,
    quantize_outputs,
    quantize_per_token_outputs,
    tile_amax_output,
)

ROW_COUNTS = range(1001)
WIDTHS = (16, 48, 272, 2048, 7168)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def shapes_and_dtypes(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


def expected_quantize(rows, k, sf_layout):
    """codes [M, K/2]; scales [M, K/16], or that array as `nvfp4.swizzle_128x4` pads it."""
    linear_scales = torch.empty(rows, k // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn)
    scales = nvfp4.swizzle_128x4(linear_scales) if sf_layout == "swizzled" else linear_scales
    return [((rows, k // 2), torch.uint8), (tuple(scales.shape), torch.float8_e4m3fn)]


@pytest.mark.parametrize("sf_layout", nvfp4.SF_LAYOUTS)
@pytest.mark.parametrize("k", WIDTHS)
def test_quantizer_outputs_have_the_specified_shapes_for_every_row_count(k, sf_layout):
    for rows in ROW_COUNTS:
        x = torch.empty(rows, k, dtype=torch.bfloat16)
        expected = expected_quantize(rows, k, sf_layout)
        assert shapes_and_dtypes(quantize_outputs(x, sf_layout)) == expected, rows
        per_token = expected + [((rows,), torch.float32)]
        assert shapes_and_dtypes(quantize_per_token_outputs(x, sf_layout)) == per_token, rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "tile_n"), [(16, 16), (272, 8), (2048, 128), (2048, 200), (7168, 7168), (48, 64)])
def test_tile_amax_output_has_the_blocked_shape_for_every_row_count(dtype, n, tile_n):
    for rows in ROW_COUNTS:
        out = tile_amax_output(torch.empty(rows, n, dtype=dtype), tile_n)
        groups = (rows + 7) // 8  # blocked-8 layout (semantics §2.4)
        assert (tuple(out.shape), out.dtype) == ((groups, -(-n // tile_n), 8), dtype), rows


def test_row_groups_count_started_groups():
    assert [dimension(RowGroups(8, 1), rows) for rows in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
    assert [dimension(RowGroups(128, 128), rows) for rows in (0, 1, 128, 129)] == [0, 128, 128, 256]
    assert [dimension(RowGroups(1, 3), rows) for rows in (0, 5)] == [0, 15]
    assert dimension(7, 1000) == 7


def test_allocate_follows_the_rules_on_the_inputs_device_and_rows():
    rules = (OutputRule(torch.int32, (RowGroups(4, 2), 3)), OutputRule(torch.float16, (5,)))
    like = torch.empty(9, 1, dtype=torch.float32, device="meta")
    got = allocate(rules, like)
    assert shapes_and_dtypes(got) == [((6, 3), torch.int32), ((5,), torch.float16)]
    assert all(t.device.type == "meta" for t in got)

