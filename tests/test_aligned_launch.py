"""The sm90 aligned MoE's host side: its setup kernel (`aligned_launch.aligned_plan`, on a Hopper GPU)
marks exactly the rows the reference processes (`fp4moe.reference.aligned_moe`'s module docstring):
rows of blocks that start below `num_tokens_post_padded` and name a local expert, holding a pair index
in [0, T*k); its decode beside it fills the one-kernel path's accumulator with -0; and the block sizes
it takes are those the GEMMs tile, and the calls that take the one-kernel path and its grid (no GPU
needed)."""

import pytest
import torch

from fp4moe.kernels.sm90 import aligned_launch
from fp4moe.kernels.sm90.aligned_launch import aligned_plan, fused_grid, fuses_gemms, gemms_tile
from tests.hopper import runs_the_sm90_kernels


@pytest.mark.gpu
@pytest.mark.skipif(not runs_the_sm90_kernels(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize(
    ("block_m", "experts", "num_pairs", "blocks", "live_blocks"),
    [
        (8, 4, 40, 9, 6),
        # More rows than the CTA's threads cover in one pass (1024 x 4), more pairs than its threads.
        (16, 300, 3000, 400, 350),
    ],
)
def test_setup_marks_the_rows_the_reference_processes(block_m, experts, num_pairs, blocks, live_blocks):
    g = torch.Generator().manual_seed(block_m)
    expert_ids = torch.randint(-2, experts + 2, (blocks,), generator=g, dtype=torch.int32)
    # Distinct pairs, sentinels and garbage (negative, too large) spread over the rows.
    rows = torch.randperm(blocks * block_m, generator=g)
    sorted_ids = torch.where(rows < num_pairs, rows, torch.tensor(num_pairs)).to(torch.int32)
    sorted_ids[3], sorted_ids[20] = -5, 10**6
    count = torch.tensor([live_blocks * block_m - 3], dtype=torch.int32)  # ragged: the last live block is partly past it
    scale_gate = torch.rand(experts, generator=g) + 0.5
    scale_up = torch.rand(experts, generator=g) + 0.5
    factor = 2.5 + 1e-9  # not an FP32 value: the kernel gets its round-to-nearest

    cuda = [t.cuda() for t in (sorted_ids, expert_ids, count, scale_gate, scale_up)]
    tile_expert, pair_to_row, gate_up_scales, factors, live_tiles = aligned_plan(*cuda, factor, block_m, num_pairs)

    expected_tiles, expected_rows = [], [-1] * num_pairs
    for b in range(blocks):
        live = b * block_m < int(count) and 0 <= int(expert_ids[b]) < experts
        expected_tiles.append(int(expert_ids[b]) if live else -1)
        for r in range(b * block_m, (b + 1) * block_m):
            pair = int(sorted_ids[r])
            if live and 0 <= pair < num_pairs:
                expected_rows[pair] = r
    assert tile_expert.tolist() == expected_tiles
    assert pair_to_row.tolist() == expected_rows
    assert tile_expert.dtype == pair_to_row.dtype == torch.int32
    assert 0 < sum(t >= 0 for t in expected_tiles) < blocks  # the case has live and dead blocks
    assert 0 < sum(r >= 0 for r in expected_rows) < num_pairs  # and processed and unprocessed pairs
    assert torch.equal(gate_up_scales.cpu(), torch.cat((scale_gate, scale_up)))
    assert torch.equal(factors.cpu(), torch.tensor([1.0, factor], dtype=torch.float32))
    assert live_tiles.tolist() == [live_blocks]  # the blocks starting below num_tokens_post_padded


@pytest.mark.gpu
@pytest.mark.skipif(not runs_the_sm90_kernels(), reason="needs a Hopper (sm_90) GPU")
def test_the_decode_fills_the_one_kernel_paths_accumulator_with_negative_zeros():
    """`moe_launch.decode_into(cleared=...)`: the accumulator (poisoned with NaN) becomes -0 everywhere, the
    identity the reference's sum keeps (`out + (-0)` leaves a -0 `out` as it is), and the decoded rows are
    those of the decode alone."""
    from fp4moe.kernels.sm90.moe_launch import decode_into, decode_operands

    g = torch.Generator().manual_seed(5)
    hidden = torch.randint(0, 256, (37, 3072), generator=g, dtype=torch.uint8).cuda()
    scales = torch.pow(2.0, torch.randint(-3, 3, (37, 384), generator=g).float()).to(torch.float8_e4m3fn).cuda()
    results = []
    for cleared in (None, torch.full((37, 6144), float("nan"), device="cuda")):
        codes, scale_bytes, out = decode_operands(hidden, scales)
        decode_into(codes, scale_bytes, out, cleared=cleared)
        results.append(out)
    assert (cleared == 0).all() and cleared.signbit().all()
    assert torch.equal(results[1], results[0])


def test_the_block_sizes_it_accepts_are_those_the_gemms_take():
    """`gemms_tile` agrees with the GEMM class's own checks (built on the CPU, nothing compiled), so a
    block size either raises NotImplementedError before any launch or runs."""
    from fp4moe.kernels.sm90.moe_gemm import MoEGemmSm90
    from fp4moe.kernels.sm90.moe_launch import row_granule

    for block_m in range(8, 272, 8):
        try:
            MoEGemmSm90(
                epilogue="gemm2_expanded", num_experts=4, prepared_rows=256, prepared_k=256, act_k=256, out_features=256,
                tile_features=128, tile_rows=block_m, row_granule=row_granule(block_m), tile_k=64 if block_m > 64 else 128,
                stages=3,
                ctas_per_sm=1, max_ctas=132, top_k=2,
            )
            built = True
        except AssertionError:
            built = False
        assert gemms_tile(block_m) == built, block_m


def test_the_one_kernel_path_takes_one_token_of_8_row_blocks_and_small_intermediates(monkeypatch):
    """One token (`FUSED_MAX_TOKENS`), plans of 8-row blocks (its tile), intermediate sizes up to
    `FUSED_MAX_INTERMEDIATE`, every pair expected on this rank; every other call takes the composition."""
    assert (aligned_launch.FUSED_MAX_TOKENS, aligned_launch.FUSED_MAX_INTERMEDIATE) == (1, 1024)
    assert fuses_gemms(1, 8, 512, True) and fuses_gemms(1, 8, 1024, True)
    assert not fuses_gemms(2, 8, 512, True) and not fuses_gemms(1, 16, 512, True)
    assert not fuses_gemms(1, 8, 1152, True) and not fuses_gemms(1, 8, 512, False)
    monkeypatch.setattr(aligned_launch, "FUSED_MAX_TOKENS", 16)
    assert fuses_gemms(16, 8, 512, True) and not fuses_gemms(17, 8, 512, True)


@pytest.mark.parametrize(
    ("pairs", "blocks", "intermediate", "grid"),
    [
        (8, 225, 512, (64, 1)),  # GLM at T = 1: 8 live blocks at most, 8 slices each: 128 CTAs, one per SM
        (8, 225, 1024, (132, 2)),  # 256 busy CTAs: one cluster per SM, two CTAs per SM
        (2, 3, 256, (8, 1)),  # fewer blocks than pairs would bound it: here pairs do
        (16, 2, 256, (8, 1)),  # and here blocks do
        (9, 225, 512, (132, 2)),  # 144 CTAs: more than the SMs
    ],
)
def test_the_one_kernel_grid_gives_busy_ctas_an_sm_each_where_they_fit(pairs, blocks, intermediate, grid):
    assert fused_grid(pairs, blocks, intermediate, 132) == grid
