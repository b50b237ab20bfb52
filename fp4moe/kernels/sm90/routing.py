"""DeepSeek-V3 routing (`route_deepseek_v3`, docs/semantics.md §3.1) in one launch for Hopper (sm_90a),
bitwise equal to the reference on the same GPU.

The reference's only device-dependent step is `torch.sigmoid` in FP32; everything after it is exactly
specified (FP32 sums and quotients rounded to nearest, stable selections). `sigmoid_as_torch` is the
instruction sequence CUDA's compiler makes of torch's FP32 sigmoid kernel (`1 / (1 + expf(-x))`,
without fast math: `expf`'s range reduction and `ex2.approx.ftz`, the `1 +` contracted into its last
multiply, then an IEEE reciprocal), written as one inline-PTX snippet so that no compiler can change
it. The rest uses `nvfp4_device`'s explicitly rounded arithmetic.

Selections compare order keys (`order_key`): a signed integer per FP32 value that orders as
`torch.sort` orders the values (NaN above every number, -0 equal to +0), so a stable descending
selection is a maximum over (key, then the lower id).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from fp4moe.kernels.sm90 import nvfp4_device as dev
from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor

WARPS = 4
"""Tokens per CTA: one warp each."""
MAX_EXPERTS = 512
"""Experts a warp holds in registers (16 per lane)."""
MAX_TOP_K = 32
"""Slots one lane each writes."""
MAX_GROUPS = 32
NO_KEY = -(2**31)
"""Below every `order_key`: an expert that is not a candidate (no FP32 value has this key)."""
NAN_KEY = 2**31 - 1
"""Every NaN's key: above every number's."""


TORCH_SIGMOID_PTX = (
    "{ .reg .f32 n, t, j, c, r, p, e, q; .reg .b32 bits; "
    "neg.f32 n, $1; "
    "fma.rn.f32 t, n, 0f3BBB989D, 0f3F000000; "
    "cvt.sat.f32.f32 t, t; "
    "fma.rm.f32 j, t, 0f437C0000, 0f4B400001; "
    "add.rn.f32 c, j, 0fCB40007F; "
    "neg.f32 c, c; "
    "fma.rn.f32 r, n, 0f3FB8AA3B, c; "
    "fma.rn.f32 r, n, 0f32A57060, r; "
    "mov.b32 bits, j; "
    "shl.b32 bits, bits, 23; "
    "mov.b32 p, bits; "
    "ex2.approx.ftz.f32 e, r; "
    "fma.rn.f32 q, e, p, 0f3F800000; "
    "rcp.rn.f32 $0, q; }"
)
"""What CUDA's compiler makes of torch's FP32 sigmoid, `1 / (1 + expf(-x))` without fast math ($1: x,
$0: the result): `expf`'s range reduction of `-x` (a power of two `p` and a remainder `r`, in `fma`s),
`ex2.approx.ftz` of the remainder, the `1 +` contracted into the final multiply by `p`, then an IEEE
reciprocal. `tests/test_routing_kernels_compile.py` compares it with nvcc's output for torch's
expression."""


@dsl_user_op
def sigmoid_as_torch(x, *, loc=None, ip=None) -> Float32:
    """`torch.sigmoid` of an FP32 value on a CUDA GPU, bit for bit (`TORCH_SIGMOID_PTX`)."""
    return dev.inline_ptx("f", TORCH_SIGMOID_PTX, "f", x, loc=loc, ip=ip)


@dsl_user_op
def order_key(value, *, loc=None, ip=None) -> Int32:
    """A signed key that orders FP32 values as `torch.sort` does: -0 as +0 (adding +0 makes it +0),
    negative values by their bits with the magnitude bits flipped, every NaN at `NAN_KEY`."""
    ptx = (
        "{ .reg .pred nan, negative; .reg .f32 canonical; .reg .b32 bits, flipped; "
        "add.rn.f32 canonical, $1, 0f00000000; "
        "mov.b32 bits, canonical; "
        "setp.lt.s32 negative, bits, 0; "
        "xor.b32 flipped, bits, 0x7FFFFFFF; "
        "selp.b32 bits, flipped, bits, negative; "
        "setp.nan.f32 nan, $1, $1; "
        "selp.b32 $0, 0x7FFFFFFF, bits, nan; }"
    )
    return Int32(dev.inline_ptx("r", ptx, "f", value, loc=loc, ip=ip))


@cute.jit
def value_of_key(key: Int32) -> Float32:
    """The FP32 value of an `order_key` (a NaN for `NAN_KEY`)."""
    return dev.f32_from_bits(cutlass.select_(key < 0, key ^ 0x7FFFFFFF, key))


class RouteDeepSeekV3Sm90:
    """`route_deepseek_v3` for `experts` experts in `n_group` groups: one warp per token, lane `l`
    holding experts `l, l + 32, ...` (coalesced loads; a lane's experts ascend).

    1. Each lane computes its experts' scores `s = sigmoid(logit)` and biased scores `b = RN(s + bias)`,
       kept with their order keys.
    2. Per group, the two largest keys over the warp (a butterfly over the lanes' own top two), and
       the group score `RN(b_(1) + b_(2))` of their values.
    3. Every lane picks the `topk_group` best groups (ascending group id on ties) from the same scores.
    4. `top_k` rounds of a warp-wide maximum of (key, lower id) over the candidates not taken yet:
       slots in descending `b`, ties to the lower id, as the reference's stable selection.
    5. Weights: the chosen `s`, renormalized in slot order and scaled; lane `j` writes slot `j`.
    """

    def __init__(self, experts: int, top_k: int, n_group: int, topk_group: int, renormalize: bool):
        assert experts <= MAX_EXPERTS and top_k <= MAX_TOP_K and n_group <= MAX_GROUPS
        self.experts = experts
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.group_size = experts // n_group
        self.renormalize = renormalize
        self.per_lane = -(-experts // 32)

    @cute.jit
    def __call__(
        self,
        mLogits: cute.Tensor,  # [T, E] bf16 / fp16 / fp32, rows strided, elements contiguous
        mBias: cute.Tensor,  # [E] fp32 or the logits' dtype
        mIds: cute.Tensor,  # int32 [T, top_k]
        mWeights: cute.Tensor,  # fp32 [T, top_k]
        scaling_factor: Float32,  # routed_scaling_factor rounded to FP32
        stream,
    ):
        self.kernel(mLogits, mBias, mIds, mWeights, scaling_factor).launch(
            grid=[cute.ceil_div(mLogits.shape[0], WARPS), 1, 1], block=[32 * WARPS, 1, 1], stream=stream,
            use_pdl=USE_PDL,
        )

    @cute.kernel
    def kernel(self, mLogits, mBias, mIds, mWeights, scaling_factor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wait_for_predecessor_and_release_successor()
        lane = tidx % 32
        token = cta * WARPS + tidx // 32
        if token < mLogits.shape[0]:
            self.route(mLogits, mBias, mIds, mWeights, scaling_factor, token, lane)

    @cute.jit
    def route(self, mLogits, mBias, mIds, mWeights, scaling_factor, token, lane):
        # 1. Scores and biased keys of the lane's experts.
        scores, keys, groups = [], [], []
        for i in cutlass.range_constexpr(self.per_lane):
            expert = lane + 32 * i
            score = Float32(0.0)
            key = Int32(NO_KEY)
            if expert < self.experts:
                score = sigmoid_as_torch(mLogits[token, expert].to(Float32))
                key = order_key(dev.add_rn(score, mBias[expert].to(Float32)))
            scores.append(score)
            keys.append(key)
            groups.append(expert // self.group_size)  # past the experts for a lane's missing ones

        # 2. Group scores from each group's two largest keys.
        group_keys = []
        for g in cutlass.range_constexpr(self.n_group):
            first, second = Int32(NO_KEY), Int32(NO_KEY)
            for i in cutlass.range_constexpr(self.per_lane):
                key = cutlass.select_(groups[i] == g, keys[i], Int32(NO_KEY))
                second = cutlass.max(second, cutlass.min(first, key))
                first = cutlass.max(first, key)
            for step in cutlass.range_constexpr(5):
                other_first = cute.arch.shuffle_sync_bfly(first, 1 << step)
                other_second = cute.arch.shuffle_sync_bfly(second, 1 << step)
                second = cutlass.max(cutlass.min(first, other_first), cutlass.max(second, other_second))
                first = cutlass.max(first, other_first)
            group_keys.append(order_key(dev.add_rn(value_of_key(first), value_of_key(second))))

        # 3. The kept groups: `topk_group` rounds of the best group not kept yet (the first on ties).
        kept = [Int32(0) for _ in range(self.n_group)]
        for _ in cutlass.range_constexpr(self.topk_group):
            best_key, best_group = Int32(NO_KEY), Int32(self.n_group)
            for g in cutlass.range_constexpr(self.n_group):
                takes = (kept[g] == 0) & (group_keys[g] > best_key)
                best_key = cutlass.select_(takes, group_keys[g], best_key)
                best_group = cutlass.select_(takes, Int32(g), best_group)
            for g in cutlass.range_constexpr(self.n_group):
                kept[g] = cutlass.select_(best_group == g, Int32(1), kept[g])
        for i in cutlass.range_constexpr(self.per_lane):
            in_kept_group = Int32(0)
            for g in cutlass.range_constexpr(self.n_group):
                in_kept_group = cutlass.select_(groups[i] == g, kept[g], in_kept_group)
            keys[i] = cutlass.select_(in_kept_group != 0, keys[i], Int32(NO_KEY))

        # 4. The experts, slot by slot: the largest key among the candidates left, the lower id on ties.
        ids, weights = [], []
        for _ in cutlass.range_constexpr(self.top_k):
            best_key, best_expert, best_score = Int32(NO_KEY), Int32(self.experts), Float32(0.0)
            for i in cutlass.range_constexpr(self.per_lane):
                takes = keys[i] > best_key
                best_key = cutlass.select_(takes, keys[i], best_key)
                best_expert = cutlass.select_(takes, lane + 32 * i, best_expert)
                best_score = cutlass.select_(takes, scores[i], best_score)
            for step in cutlass.range_constexpr(5):
                other_key = cute.arch.shuffle_sync_bfly(best_key, 1 << step)
                other_expert = cute.arch.shuffle_sync_bfly(best_expert, 1 << step)
                other_score = cute.arch.shuffle_sync_bfly(best_score, 1 << step)
                takes = (other_key > best_key) | ((other_key == best_key) & (other_expert < best_expert))
                best_key = cutlass.select_(takes, other_key, best_key)
                best_expert = cutlass.select_(takes, other_expert, best_expert)
                best_score = cutlass.select_(takes, other_score, best_score)
            ids.append(best_expert)
            weights.append(best_score)
            for i in cutlass.range_constexpr(self.per_lane):
                keys[i] = cutlass.select_(lane + 32 * i == best_expert, Int32(NO_KEY), keys[i])

        # 5. Renormalized in slot order, scaled; lane j writes slot j.
        if const_expr(self.renormalize):
            total = weights[0]
            for j in cutlass.range_constexpr(1, self.top_k):
                total = dev.add_rn(total, weights[j])
            weights = [dev.div_rn(w, total) for w in weights]
        for j in cutlass.range_constexpr(self.top_k):
            if lane == j:
                mIds[token, j] = ids[j]
                mWeights[token, j] = dev.mul_rn(weights[j], scaling_factor)
