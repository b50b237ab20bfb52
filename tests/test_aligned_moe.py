"""The aligned fused MoE (semantics §5) and its route-plan op, against loop references written here.

Inputs are built directly as NVFP4 codes and E4M3 scales (fresh random bytes, never zeros). `hidden`
and `w1` use power-of-two block scales in [1/2, 2]: every product of two dequantized values is then a
multiple of 2^-4 below 144, so every partial sum of the K products of GEMM1 is exact in FP32 for
K <= 1024, whatever the order. GEMM1 therefore agrees bitwise between the op and the FP64 loop
reference, and so does the requantized intermediate, so the NVFP4 requantization is checked exactly.
The remaining differences are FP32 rounding in GEMM2, the scale products and the pair sum, bounded
in `assert_matches_reference`.
"""

import warnings
from typing import NamedTuple

import pytest
import torch
import torch._dynamo.testing

from fp4moe import nvfp4, weight_layout
from tests.compare import assert_bitwise_equal
from tests.devices import DEVICES
from tests.opcheck import opcheck

ops = torch.ops.fp4moe
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E2M1_MAGNITUDES = torch.tensor(nvfp4.E2M1_VALUES[:8], dtype=torch.float64)
ROUTED_SCALING_FACTOR = 2.5


# ---------------------------------------------------------------------------------------------------
# Route plan
# ---------------------------------------------------------------------------------------------------
def loop_align(topk_ids, block_m, num_experts, offset):
    """vLLM's moe_align_block_size convention, one pair at a time."""
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    members = [[] for _ in range(num_experts)]
    for pair, global_id in enumerate(flat):
        if offset <= global_id < offset + num_experts:
            members[global_id - offset].append(pair)
    sorted_ids, expert_ids = [], []
    for expert, pairs in enumerate(members):
        blocks = nvfp4.ceil_div(len(pairs), block_m)
        sorted_ids += pairs + [sentinel] * (blocks * block_m - len(pairs))
        expert_ids += [expert] * blocks
    used = len(sorted_ids)
    capacity = nvfp4.round_up(sentinel + num_experts * (block_m - 1), block_m)
    sorted_ids += [sentinel] * (capacity - used)
    expert_ids += [-1] * (capacity // block_m - len(expert_ids))
    return sorted_ids, expert_ids, used


def random_routing(num_tokens, top_k, num_global_experts, seed, dropped_fraction=0.0):
    """Distinct experts per token drawn with skewed popularity (ragged counts, some experts unused),
    and a fraction of the choices replaced by -1 (an id no shard owns)."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_global_experts, generator=g) ** 4 + 1e-3
    ids = torch.multinomial(popularity.expand(max(num_tokens, 1), -1), top_k, generator=g)[:num_tokens]
    ids[torch.rand(ids.shape, generator=g) < dropped_fraction] = -1
    return ids.to(torch.int32)


ALIGN_CASES = [
    # (T, top_k, global experts, local experts, offset, block_m, dropped fraction)
    pytest.param(37, 4, 8, 8, 0, 8, 0.0, id="ragged"),
    pytest.param(64, 2, 64, 64, 0, 16, 0.0, id="empty-experts"),
    pytest.param(50, 6, 32, 8, 16, 8, 0.1, id="ep-shard"),
    pytest.param(9, 3, 16, 4, 0, 64, 0.2, id="first-shard-big-blocks"),
    pytest.param(5, 2, 8, 8, 0, 1, 0.0, id="block-1"),
    pytest.param(1, 1, 4, 4, 0, 8, 0.0, id="one-pair"),
    pytest.param(0, 4, 8, 8, 0, 8, 0.0, id="no-tokens"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,global_experts,local_experts,offset,block_m,dropped", ALIGN_CASES)
def test_align_block_size_matches_loop(device, tokens, top_k, global_experts, local_experts, offset, block_m, dropped):
    topk_ids = random_routing(tokens, top_k, global_experts, seed=tokens + block_m, dropped_fraction=dropped)
    sorted_ids, expert_ids, post_padded = ops.align_block_size(topk_ids.to(device), block_m, local_experts, offset)
    expected_ids, expected_experts, expected_used = loop_align(topk_ids, block_m, local_experts, offset)
    assert sorted_ids.dtype == expert_ids.dtype == post_padded.dtype == torch.int32
    assert sorted_ids.device.type == expert_ids.device.type == post_padded.device.type == device
    assert sorted_ids.tolist() == expected_ids
    assert expert_ids.tolist() == expected_experts
    assert post_padded.tolist() == [expected_used]


def test_align_block_size_drops_every_pair_outside_the_shard():
    topk_ids = torch.tensor([[-5, 3], [12, 2**31 - 1], [4, 11]], dtype=torch.int32)
    sorted_ids, expert_ids, post_padded = ops.align_block_size(topk_ids, 8, 8, 4)  # global ids 4..11
    sentinel = 6
    assert post_padded.tolist() == [16]
    assert expert_ids.tolist() == [0, 7] + [-1] * 6  # capacity round_up(6 + 8 * 7, 8) = 64 slots
    assert sorted_ids.tolist() == [4] + [sentinel] * 7 + [5] + [sentinel] * 55


# ---------------------------------------------------------------------------------------------------
# Problems and the loop reference of aligned_moe_
# ---------------------------------------------------------------------------------------------------
def make_problem(tokens, top_k, experts, k, n, seed, global_experts=None, dropped=0.0, device="cpu"):
    """Operands of aligned_moe_ (without the plan), routing over `global_experts` ids, and a seeded `out`."""
    g = torch.Generator().manual_seed(seed)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def power_of_two_scales(*shape):  # 1/2, 1 or 2: keeps GEMM1 exact (module docstring)
        return torch.pow(2.0, torch.randint(-1, 2, shape, generator=g).float()).to(torch.float8_e4m3fn)

    def uniform(*shape, low, high):
        return torch.rand(shape, generator=g) * (high - low) + low

    problem = dict(
        hidden=codes(tokens, k // 2),
        hidden_scales=power_of_two_scales(tokens, k // 16),
        w1=codes(experts, n, k // 2),
        w1_scales=power_of_two_scales(experts, n, k // 16),
        w2=codes(experts, k, n // 4),
        w2_scales=uniform(experts, k, n // 32, low=0.05, high=0.5).to(torch.float8_e4m3fn),
        # GEMM1 outputs have a standard deviation of about 15 * sqrt(K); these put g and u near +-3.
        scale_gate=uniform(experts, low=0.1, high=0.3) / k**0.5,
        scale_up=uniform(experts, low=0.1, high=0.3) / k**0.5,
        scale_down=uniform(experts, low=0.01, high=0.05),
        topk_weights=uniform(tokens, top_k, low=0.1, high=1.0),
    )
    topk_ids = random_routing(tokens, top_k, global_experts or experts, seed + 1, dropped)
    out = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    return {name: t.to(device) for name, t in problem.items()}, topk_ids.to(device), out.to(device)


def dequantize(codes, scales):
    """e2m1 * sf in FP64, from the nibbles (low nibble first) and the E2M1 table."""
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    values = torch.where(nibbles >= 8, -E2M1_MAGNITUDES[nibbles % 8], E2M1_MAGNITUDES[nibbles % 8])
    return values * scales.double().repeat_interleave(16, dim=-1)


def requantize(act):
    """semantics §1.5 block math with gs = 1, literally: sf = e4m3(bmax * RN(1/6)), s = RN(1/sf),
    q = nearest E2M1 value of RN(x * s), ties to the even code; returns q * sf in FP64."""
    blocks = act.view(-1, 16)
    one_sixth = torch.tensor(1.0) / torch.tensor(6.0)
    sf = (blocks.abs().amax(dim=1) * one_sixth).clamp(max=448).to(torch.float8_e4m3fn).float()
    scaled = (blocks * (1.0 / sf)[:, None]).double()
    distance = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    even_code = torch.arange(8) % 2 == 0
    pick = torch.where((nearest & even_code).any(-1), (nearest & even_code).int().argmax(-1), nearest.int().argmax(-1))
    q = torch.copysign(E2M1_MAGNITUDES[pick], scaled)
    q = torch.where((sf == 0)[:, None], 0.0, q)
    return (q * sf.double()[:, None]).view(act.shape)


def loop_reference(problem, topk_ids, out, offset=0, routed_scaling_factor=ROUTED_SCALING_FACTOR):
    """Per routed pair (t, j) with a local expert: GEMMs in FP64 over exact dequantized values, FP32
    only where semantics §5.3 rounds (the scaled gate/up, the activation, its requantization).

    Returns (expected FP64 [M, K], magnitude [M, K]) where `magnitude` sums the absolute values of
    everything the op adds in FP32, for the error bound."""
    p = {name: t.cpu() for name, t in problem.items()}
    x = dequantize(p["hidden"], p["hidden_scales"])
    w1 = dequantize(p["w1"], p["w1_scales"])
    w2 = dequantize(p["w2"], p["w2_scales"])
    experts, intermediate = w1.shape[0], w1.shape[1] // 2
    expected = out.cpu().double().clone()
    magnitude = expected.abs()
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - offset
            if not 0 <= e < experts:
                continue
            gate_up = (w1[e] @ x[t]).float()  # exact: FP64 holds every partial sum, FP32 the result
            g = gate_up[:intermediate] * p["scale_gate"][e]
            u = gate_up[intermediate:] * p["scale_up"][e]
            silu = (g.double() / (1.0 + torch.exp(-g.double()))).float()  # FP32 SiLU via FP64, another formula
            act_q = requantize(silu * u)
            factor = p["scale_down"][e].double() * p["topk_weights"][t, j].double() * routed_scaling_factor
            expected[t] += (w2[e] @ act_q) * factor
            magnitude[t] += (w2[e].abs() @ act_q.abs()) * abs(factor)
    return expected, magnitude


def assert_matches_reference(actual, expected, magnitude, intermediate, top_k):
    """|actual - expected| <= half a bf16 ulp of `actual` (its one final rounding) + gamma * magnitude,
    gamma = (I + top_k + 8) * 2^-24: the standard bound for FP32 sums of I + top_k terms plus the
    handful of FP32 products per term (Higham, Accuracy and Stability, §3.1). Also checks that nearly
    every element is bitwise the rounding of the exact result: the bound is not hiding a bias."""
    actual64 = actual.cpu().double()
    _, exponent = torch.frexp(actual64)
    half_ulp = torch.ldexp(torch.ones_like(actual64), exponent - 9).clamp(min=2.0**-134)
    gamma = (intermediate + top_k + 8) * 2.0**-24
    excess = (actual64 - expected).abs() - (half_ulp + gamma * magnitude)
    assert (excess <= 0).all(), f"max excess {excess.max().item()} at {divmod(int(excess.argmax()), excess.shape[1])}"
    assert (actual.cpu() == expected.to(torch.bfloat16)).float().mean() > 0.99


def run_aligned_moe(problem, plan, out, block_m, routed_scaling_factor=ROUTED_SCALING_FACTOR, **options):
    result = ops.aligned_moe_(
        out, **problem, **plan, routed_scaling_factor=routed_scaling_factor, block_m=block_m, **options
    )
    assert result is None


def plan_for(topk_ids, block_m, experts, offset=0):
    sorted_ids, expert_ids, post_padded = ops.align_block_size(topk_ids, block_m, experts, offset)
    return dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=post_padded)


class MoECase(NamedTuple):
    tokens: int
    top_k: int
    experts: int  # local experts
    k: int
    n: int
    block_m: int
    offset: int = 0
    global_experts: int | None = None
    dropped: float = 0.0


MOE_CASES = [
    pytest.param(MoECase(19, 2, 4, 256, 256, 8), id="small"),
    pytest.param(MoECase(33, 4, 8, 512, 256, 16), id="ragged-k512"),
    pytest.param(MoECase(24, 4, 6, 256, 512, 8, offset=6, global_experts=16, dropped=0.1), id="ep-shard-n512"),
    pytest.param(MoECase(1, 1, 2, 256, 256, 32), id="one-token"),
    # An expert-parallel rank of 4 experts whose tokens choose 8 of 64 (top_k above the local E).
    pytest.param(MoECase(20, 8, 4, 256, 256, 8, offset=24, global_experts=64), id="ep-rank-top_k-above-e"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_aligned_moe_matches_loop_reference(device, case):
    c = case
    problem, topk_ids, out = make_problem(c.tokens, c.top_k, c.experts, c.k, c.n, seed=c.k + c.n + c.tokens,
                                          global_experts=c.global_experts, dropped=c.dropped, device=device)
    local = ((topk_ids >= c.offset) & (topk_ids < c.offset + c.experts)).any(dim=1)
    if c.global_experts:  # the shard case must exercise tokens that no local expert serves
        assert 0 < int(local.sum()) < c.tokens
    out[~local] = -0.0  # adding +0 would turn -0 into +0: only rows left unwritten keep it
    seed_out = out.clone()
    data_ptr = out.data_ptr()
    run_aligned_moe(
        problem, plan_for(topk_ids, c.block_m, c.experts, c.offset), out, c.block_m, global_num_experts=c.global_experts
    )
    assert out.data_ptr() == data_ptr
    expected, magnitude = loop_reference(problem, topk_ids, seed_out, c.offset)
    assert_matches_reference(out, expected, magnitude, c.n // 2, c.top_k)
    # Additive: tokens with no local expert are not written (their -0.0 survives bit for bit).
    assert_bitwise_equal(out[~local], seed_out[~local], "tokens without a local expert")


@pytest.mark.parametrize("device", DEVICES)
def test_aligned_moe_accumulates_onto_out(device):
    """Applying the op twice adds twice: out = bf16(bf16(seed + y) + y), checked by the loop reference."""
    problem, topk_ids, out = make_problem(12, 2, 4, 256, 256, seed=5, device=device)
    plan = plan_for(topk_ids, 8, 4)
    run_aligned_moe(problem, plan, out, 8)
    once = out.clone()
    run_aligned_moe(problem, plan, out, 8)
    expected, magnitude = loop_reference(problem, topk_ids, once)
    assert_matches_reference(out, expected, magnitude, 128, 2)
    assert not torch.equal(out, once)


@pytest.mark.parametrize("device", DEVICES)
def test_inert_rows_and_blocks_past_the_count_are_ignored(device):
    """Out-of-range ids where the plan has sentinels, a counted block whose expert id is -1, and
    blocks of live pairs with valid experts past num_tokens_post_padded change nothing."""
    block_m, experts = 8, 4
    problem, topk_ids, out = make_problem(16, 2, experts, 256, 256, seed=7, device=device)
    topk_ids[12:] = -1  # tokens 12..15 (pairs 24..31) route to no expert: the plan leaves them out
    plan = plan_for(topk_ids, block_m, experts)
    used = int(plan["num_tokens_post_padded"])
    assert plan["sorted_token_ids"].numel() - used >= 2 * block_m

    garbage = {name: t.clone() for name, t in plan.items()}
    ids, blocks = garbage["sorted_token_ids"], garbage["expert_ids"]
    sentinel_slots = (ids[:used] == 32).nonzero().flatten()
    assert sentinel_slots.numel() >= 2
    ids[sentinel_slots[0]], ids[sentinel_slots[1]] = 10**6, -3
    unrouted_pairs = torch.arange(24, 32, dtype=torch.int32)
    dead = used // block_m
    ids[used : used + block_m] = unrouted_pairs  # a counted block with expert id -1
    blocks[dead] = -1
    garbage["num_tokens_post_padded"] += block_m
    ids[used + block_m : used + 2 * block_m] = unrouted_pairs  # past the count, valid experts
    blocks[dead + 1 :] = torch.arange(blocks.numel() - dead - 1, dtype=torch.int32) % experts

    clean_out, garbage_out = out.clone(), out.clone()
    run_aligned_moe(problem, plan, clean_out, block_m)
    run_aligned_moe(problem, garbage, garbage_out, block_m)
    assert_bitwise_equal(garbage_out, clean_out, "garbage plan vs clean plan")
    assert_bitwise_equal(garbage_out[12:], out[12:], "tokens listed only in inert blocks")


@pytest.mark.parametrize("device", DEVICES)
def test_row_strided_views(device):
    """hidden, hidden_scales and out may be row-strided views (row stride a multiple of 16 bytes)."""
    tokens, k = 21, 256
    problem, topk_ids, out = make_problem(tokens, 2, 4, k, 256, seed=11, device=device)
    plan = plan_for(topk_ids, 8, 4)
    dense_out = out.clone()
    run_aligned_moe(problem, plan, dense_out, 8)

    def widened(t, extra_bytes):
        """t's bytes in the leading columns of a wider buffer whose other bytes are 0x5A."""
        raw = t.view(torch.uint8)
        wide = torch.full((raw.shape[0], raw.shape[1] + extra_bytes), 0x5A, dtype=torch.uint8, device=device)
        wide[:, : raw.shape[1]] = raw
        return wide.view(t.dtype)

    strided = dict(problem)
    strided["hidden"] = widened(problem["hidden"], 48)[:, : k // 2]
    strided["hidden_scales"] = widened(problem["hidden_scales"], 16)[:, : k // 16]
    out_storage = widened(out, 32)
    strided_out = out_storage[:, :k]
    assert strided["hidden"].stride(0) == k // 2 + 48 and strided_out.stride(0) == k + 16
    run_aligned_moe(strided, plan, strided_out, 8)
    assert_bitwise_equal(strided_out, dense_out, "row-strided inputs and output")
    assert (out_storage[:, k:].view(torch.uint8) == 0x5A).all(), "the op wrote outside out's view"


@pytest.mark.parametrize("device", DEVICES)
def test_a_one_row_out_of_any_row_stride_is_accepted(device):
    """One row has no row stride: a transposed column's is 1 (torch calls it contiguous, and `.contiguous()`
    keeps it), and the result is the loop reference's. (On Hopper this call takes the one-kernel decode
    path, whose atomic sum may differ from run to run in the last bit: compared to the reference's bound,
    not bitwise to a dense row.)"""
    problem, topk_ids, out = make_problem(1, 2, 4, 256, 256, seed=12, device=device)
    column_out = torch.empty(out.shape[1], 1, dtype=out.dtype, device=device).t()
    column_out.copy_(out)
    assert column_out.stride() == (1, 1) and column_out.contiguous().stride() == (1, 1)
    run_aligned_moe(problem, plan_for(topk_ids, 8, 4), column_out, 8)
    expected, magnitude = loop_reference(problem, topk_ids, out)
    assert_matches_reference(column_out, expected, magnitude, 128, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_prepared_weights_give_the_linear_result(device):
    """weight_layout="sm90" takes `weight_layout.prepare_sm90`'s layout (read back on the reference)."""
    problem, topk_ids, out = make_problem(13, 2, 4, 256, 512, seed=13, device=device)
    plan = plan_for(topk_ids, 8, 4)
    linear_out, prepared_out = out.clone(), out.clone()
    with warnings.catch_warnings():  # on Hopper, linear weights are prepared per call, with a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        run_aligned_moe(problem, plan, linear_out, 8)
    prepared = dict(problem)
    prepared["w1"], prepared["w1_scales"] = weight_layout.prepare_sm90(problem["w1"], problem["w1_scales"], gated=True)
    prepared["w2"], prepared["w2_scales"] = weight_layout.prepare_sm90(problem["w2"], problem["w2_scales"], gated=False)
    ops.aligned_moe_(
        prepared_out, **prepared, **plan, routed_scaling_factor=ROUTED_SCALING_FACTOR, block_m=8, weight_layout="sm90"
    )
    assert_bitwise_equal(prepared_out, linear_out, "prepared vs linear weights")


# ---------------------------------------------------------------------------------------------------
# Contract checks (raised on the host, before anything is written)
# ---------------------------------------------------------------------------------------------------
def valid_call(tokens=8, top_k=2, experts=4, k=256, n=256, block_m=8, device="cpu", global_num_experts=None):
    """Keyword arguments of a well-formed aligned_moe_ call, in schema order."""
    problem, topk_ids, out = make_problem(tokens, top_k, experts, k, n, seed=3, device=device)
    named = dict(out=out, **problem, **plan_for(topk_ids, block_m, experts))
    named.update(
        routed_scaling_factor=ROUTED_SCALING_FACTOR, block_m=block_m, weight_layout="linear",
        global_num_experts=global_num_experts,
    )
    return {a.name: named[a.name] for a in ops.aligned_moe_.default._schema.arguments}


def misaligned(t):
    """A contiguous copy of t whose data pointer is one byte past a 16-byte boundary."""
    raw = torch.empty(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    view = raw[1 : 1 + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


def edit(**changes):
    """Replaces arguments by values or by functions of (the argument, all arguments)."""

    def apply(call):
        for name, change in changes.items():
            call[name] = change(call[name], call) if callable(change) else change

    return apply


def prepared_weights(w1_k=None, w2_rows=None):
    """Edits putting w1 / w2 and their scales in the sm90 prepared layout, w1 cut to `w1_k` columns
    of K or w2 to `w2_rows` rows first when given."""

    def prepare(name, cut, gated):
        last = {}  # the call last prepared for and its result: the codes' and the scales' edits share it

        def change(call):
            if last.get("call") is not call:
                codes, scales = cut(call[name], call[f"{name}_scales"])
                last.update(call=call, result=weight_layout.prepare_sm90(codes.contiguous(), scales.contiguous(), gated))
            return last["result"]

        return change

    def cut_w1(codes, scales):
        return (codes, scales) if w1_k is None else (codes[..., : w1_k // 2], scales[..., : w1_k // 16])

    def cut_w2(codes, scales):
        return (codes, scales) if w2_rows is None else (codes[:, :w2_rows], scales[:, :w2_rows])

    w1_change, w2_change = prepare("w1", cut_w1, True), prepare("w2", cut_w2, False)
    return dict(
        w1=lambda t, c: w1_change(c)[0], w1_scales=lambda t, c: w1_change(c)[1],
        w2=lambda t, c: w2_change(c)[0], w2_scales=lambda t, c: w2_change(c)[1],
    )


BAD_ALIGNED_MOE_CALLS = [
    # dtypes
    (edit(out=lambda t, c: t.float()), TypeError, "out must have dtype"),
    (edit(hidden=lambda t, c: t.to(torch.int8)), TypeError, "hidden must have dtype"),
    (edit(hidden_scales=lambda t, c: t.float()), TypeError, "hidden_scales must have dtype"),
    (edit(w1=lambda t, c: t.to(torch.int8)), TypeError, "w1 must have dtype"),
    (edit(w2_scales=lambda t, c: t.view(torch.uint8)), TypeError,
     "w2_scales must have dtype torch.float8_e4m3fn with weight_layout='linear', got torch.uint8: uint8 scales"),
    (edit(scale_up=lambda t, c: t.double()), TypeError, "scale_up must have dtype"),
    (edit(sorted_token_ids=lambda t, c: t.long()), TypeError, "sorted_token_ids must have dtype"),
    (edit(expert_ids=lambda t, c: t.long()), TypeError, "expert_ids must have dtype"),
    (edit(num_tokens_post_padded=lambda t, c: t.long()), TypeError, "num_tokens_post_padded must have dtype"),
    (edit(topk_weights=lambda t, c: t.bfloat16()), TypeError, "topk_weights must have dtype"),
    # shapes and values
    (edit(hidden=lambda t, c: t[:, :64]), ValueError, r"K = 128\) must be a positive multiple of 256"),
    (edit(hidden=lambda t, c: t.reshape(-1)), ValueError, "hidden must be 2-D"),
    (edit(w1=lambda t, c: t[:, :128]), ValueError, r"N = 2I = 128\) must be a positive multiple of 256"),
    (edit(w1=lambda t, c: torch.cat((t, t), 1)[:, :384]), ValueError, r"N = 2I = 384\) must be"),
    (edit(hidden_scales=lambda t, c: t[:-1]), ValueError, "hidden_scales must have shape"),
    (edit(w1_scales=lambda t, c: t[:, :, :8]), ValueError, "w1_scales must have shape"),
    (edit(w2=lambda t, c: t[:-1]), ValueError, "w2 must have shape"),
    (edit(w2_scales=lambda t, c: t[:, :-1]), ValueError, "w2_scales must have shape"),
    (edit(scale_gate=lambda t, c: t[:-1]), ValueError, "scale_gate must have shape"),
    (edit(scale_down=lambda t, c: t[None]), ValueError, "scale_down must have shape"),
    (edit(topk_weights=lambda t, c: t[:-1]), ValueError, "topk_weights must have shape"),
    (edit(topk_weights=torch.ones(8, 5)), ValueError, r"top_k = 5\) must be in \[1, E = 4\]"),
    (edit(out=lambda t, c: t[:, :128]), ValueError, "out must have shape"),
    (edit(num_tokens_post_padded=lambda t, c: t.repeat(2)), ValueError, "num_tokens_post_padded must have shape"),
    (edit(expert_ids=lambda t, c: t[None]), ValueError, "expert_ids must be 1-D"),
    (edit(block_m=4), ValueError, "block_m must be a positive multiple of 8, got 4"),
    (edit(block_m=12), ValueError, "block_m must be a positive multiple of 8, got 12"),
    (edit(block_m=16), ValueError, r"but a plan for block_m = 16 has expert_ids.numel\(\) \* block_m"),
    (edit(sorted_token_ids=lambda t, c: t[:-1]), ValueError, "but a plan for block_m = 8 has"),
    (edit(sorted_token_ids=lambda t, c: torch.cat((t, t[:8]))), ValueError, "but a plan for block_m = 8 has"),
    (edit(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor must be finite"),
    (edit(routed_scaling_factor=float("-inf")), ValueError, "routed_scaling_factor must be finite"),
    (edit(routed_scaling_factor=1e39), ValueError, "routed_scaling_factor must be finite in FP32, got 1e"),
    (edit(scale_gate=lambda t, c: t.to("meta")), ValueError, "scale_gate is on meta but hidden is on cpu"),
    (edit(global_num_experts=3), ValueError, r"global_num_experts \(3\) must hold this rank's E = 4 experts"),
    (edit(global_num_experts=8, **{name: (lambda t, c: t[:0]) for name in (
        "w1", "w1_scales", "w2", "w2_scales", "scale_gate", "scale_up", "scale_down")}), ValueError,
     r"w1 must hold at least one expert \(E >= 1\), got \(0, 256, 128\)"),
    (edit(global_num_experts=2**31), ValueError, r"global_num_experts \(2147483648\) must hold .* at most 2\^31 - 1"),
    (edit(topk_weights=torch.ones(8, 9), global_num_experts=8), ValueError,
     r"top_k = 9\) must be in \[1, global_num_experts = 8\]"),
    # weight layouts: linear (checkpoint) or sm90 (prepared), whose scales are bytes
    (edit(weight_layout="tiled"), ValueError, "weight_layout must be one of"),
    (edit(weight_layout="sm90"), TypeError, "w1_scales must have dtype"),
    (edit(weight_layout="sm90", **prepared_weights(w2_rows=128)), ValueError, "w2 rows is 128, expected 256"),
    (edit(weight_layout="sm90", **prepared_weights(w1_k=128)), ValueError, "w1 K is 128, expected 256"),
    # layouts and alignment
    (edit(hidden=lambda t, c: t.t().contiguous().t()), ValueError, "hidden must have unit stride"),
    (edit(hidden=lambda t, c: torch.cat((t, t[:, :4]), 1)[:, :128]), ValueError, "hidden's row stride"),
    (edit(out=lambda t, c: torch.cat((t, t[:, :4]), 1)[:, :256]), ValueError, "out's row stride"),
    (edit(out=lambda t, c: t[:1].expand(8, 256)), ValueError, "out's rows overlap each other"),
    (edit(w1=lambda t, c: t.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "w1 must be contiguous"),
    (edit(topk_weights=lambda t, c: t.t().contiguous().t()), ValueError, "topk_weights must be contiguous"),
    (edit(w2=lambda t, c: misaligned(t)), ValueError, "w2's data pointer must be 16-byte aligned"),
    (edit(hidden_scales=lambda t, c: misaligned(t)), ValueError, "hidden_scales's data pointer must be"),
    # aliasing: out written while an input that shares its bytes is still read
    (edit(hidden=lambda t, c: c["out"].view(torch.uint8)[:, :128]), RuntimeError, "out overlaps hidden"),
    (edit(topk_weights=lambda t, c: c["out"].view(torch.float32).reshape(-1)[:16].view(8, 2)), RuntimeError,
     "out overlaps topk_weights"),
]


def test_the_valid_call_is_accepted():
    call = valid_call()
    ops.aligned_moe_(**call)


@pytest.mark.parametrize("change,error,match", BAD_ALIGNED_MOE_CALLS)
def test_aligned_moe_rejects_a_broken_contract(change, error, match):
    call = valid_call()
    change(call)
    out_before = call["out"].clone()
    with pytest.raises(error, match=match):
        ops.aligned_moe_(**call)
    assert_bitwise_equal(call["out"], out_before, "out after a rejected call")


@pytest.mark.parametrize("plan_block_m,block_m", [(16, 8), (32, 8), (64, 16), (8, 16)])
def test_a_plan_built_for_another_block_size_is_refused(plan_block_m, block_m):
    """A block_m smaller than the plan's passed every check and read the plan's blocks at the wrong
    offsets; the plan's shapes carry its block size, so any other block_m is refused before a write."""
    call = valid_call(tokens=19, block_m=plan_block_m)
    call["block_m"] = block_m
    out_before = call["out"].clone()
    with pytest.raises(ValueError, match="pass the block_m the plan was built with"):
        ops.aligned_moe_(**call)
    assert_bitwise_equal(call["out"], out_before, "out after a rejected call")


BAD_ALIGN_CALLS = [
    (lambda ids: (ids.long(), 8, 4, 0), TypeError, "topk_ids must have dtype"),
    (lambda ids: (ids.reshape(-1), 8, 4, 0), ValueError, "topk_ids must be 2-D"),
    (lambda ids: (ids[:, :0], 8, 4, 0), ValueError, "at least one column"),
    (lambda ids: (ids, 0, 4, 0), ValueError, "block_m must be >= 1, got 0"),
    (lambda ids: (ids, 8, 0, 0), ValueError, "num_experts must be >= 1, got 0"),
    (lambda ids: (ids, 8, 4, -1), ValueError, "local_expert_offset must be in"),
    (lambda ids: (ids, 8, 4, 2**31 - 4), ValueError, "local_expert_offset must be in"),
    (lambda ids: (ids[:1, :1].expand(2**30, 4), 8, 4, 0), ValueError, r"int32 slots \(> 2\^31 - 1\)"),
]


@pytest.mark.parametrize("make_args,error,match", BAD_ALIGN_CALLS)
def test_align_block_size_rejects_bad_arguments(make_args, error, match):
    with pytest.raises(error, match=match):
        ops.align_block_size(*make_args(random_routing(6, 2, 4, seed=0)))


# ---------------------------------------------------------------------------------------------------
# opcheck, torch.compile, CUDA graphs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_opcheck_align_block_size(device, tokens):
    topk_ids = random_routing(tokens, 3, 8, seed=tokens, dropped_fraction=0.2).to(device)
    opcheck(ops.align_block_size.default, (topk_ids, 8, 6, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("tokens", "global_num_experts"), [(0, None), (1, None), (13, None), (1, 32)])
def test_opcheck_aligned_moe(device, tokens, global_num_experts):
    call = valid_call(tokens=tokens, device=device, global_num_experts=global_num_experts)
    opcheck(ops.aligned_moe_.default, tuple(call.values()))


def moe_step(topk_ids, topk_weights, hidden, hidden_scales, out, weights, block_m=8):
    """Route plan + aligned MoE, the pattern an engine runs per layer."""
    experts = weights["w1"].shape[0]
    sorted_ids, expert_ids, post_padded = ops.align_block_size(topk_ids, block_m, experts)
    ops.aligned_moe_(out, hidden, hidden_scales, **weights, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
                     num_tokens_post_padded=post_padded, topk_weights=topk_weights,
                     routed_scaling_factor=ROUTED_SCALING_FACTOR, block_m=block_m)
    return out


def step_inputs(tokens, seed, device):
    problem, topk_ids, out = make_problem(tokens, 2, 4, 256, 256, seed=seed, device=device)
    weight_names = ("w1", "w1_scales", "w2", "w2_scales", "scale_gate", "scale_up", "scale_down")
    weights = {name: problem.pop(name) for name in weight_names}
    return (topk_ids, problem["topk_weights"], problem["hidden"], problem["hidden_scales"], out), weights


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic_tokens_matches_eager(device):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(moe_step, backend=counter, fullgraph=True)
    for tokens, seed in ((13, 1), (29, 2)):
        per_token, weights = step_inputs(tokens, seed, device)
        for t in per_token:
            torch._dynamo.mark_dynamic(t, 0)
        eager = moe_step(*[t.clone() for t in per_token], weights)
        assert_bitwise_equal(compiled(*per_token, weights), eager, f"compiled vs eager, {tokens} tokens")
    assert counter.frame_count == 1, "a new token count recompiled the graph"


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_replay_with_fresh_routing_matches_eager():
    static, weights = step_inputs(24, seed=20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graphs recommends
        moe_step(*[t.clone() for t in static], weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_step(*static, weights)
    for seed in (21, 22, 23):
        fresh, _ = step_inputs(24, seed=seed, device="cuda")
        for target, source in zip(static, fresh):
            target.copy_(source)
        graph.replay()
        eager = moe_step(*fresh, weights)
        assert_bitwise_equal(static[-1], eager, f"graph replay vs eager, seed {seed}")


@pytest.mark.gpu
@requires_cuda
def test_no_host_synchronization():
    per_token, weights = step_inputs(24, seed=30, device="cuda")
    moe_step(*[t.clone() for t in per_token], weights)  # first-call lazy initialization stays outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_step(*per_token, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
