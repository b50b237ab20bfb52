"""The routing ops (docs/semantics.md §3.1) in one launch each for Hopper (sm_90a), bitwise equal to the
reference on the same GPU: `route_deepseek_v3` (`RouteDeepSeekV3Sm90`) and `route_softmax_topk`
(`RouteSoftmaxTopkSm90`), one warp per token.

The reference's device-dependent steps are torch's own FP32 kernels: `torch.sigmoid`, and `torch.softmax`
(its warp softmax for rows of at most 2048 values: a maximum and a sum in a fixed order over the lanes,
then one division per value). Everything after them is exactly specified (FP32 sums and quotients rounded
to nearest, stable selections). The kernels compute those steps with the instructions CUDA's compiler makes
of torch's source, without fast math: `TORCH_SIGMOID_PTX` and `TORCH_EXPF_PTX`, each one inline-PTX
snippet so that no compiler can change it; the softmax's maximum and sum follow torch's order of
operations value for value (`RouteSoftmaxTopkSm90`). The rest uses `nvfp4_device`'s explicitly rounded
arithmetic.

Selections compare order keys (`order_key`): a signed integer per FP32 value that orders as
`torch.sort` orders the values (NaN above every number, -0 equal to +0), so a stable descending
selection is a maximum over (key, then the lower id).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr
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
TORCH_QUIET_NAN_BITS = 0x7FC00000
"""`std::numeric_limits<float>::quiet_NaN()`, which torch's softmax writes for a row whose sum is 0."""


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


TORCH_EXPF_PTX = (
    "{ .reg .f32 t, j, c, r, p, e; .reg .b32 bits; "
    "fma.rn.f32 t, $1, 0f3BBB989D, 0f3F000000; "
    "cvt.sat.f32.f32 t, t; "
    "fma.rm.f32 j, t, 0f437C0000, 0f4B400001; "
    "add.rn.f32 c, j, 0fCB40007F; "
    "neg.f32 c, c; "
    "fma.rn.f32 r, $1, 0f3FB8AA3B, c; "
    "fma.rn.f32 r, $1, 0f32A57060, r; "
    "mov.b32 bits, j; "
    "shl.b32 bits, bits, 23; "
    "mov.b32 p, bits; "
    "ex2.approx.ftz.f32 e, r; "
    "mul.rn.f32 $0, e, p; }"
)
"""`expf` as CUDA's compiler makes it without fast math ($1: x, $0: the result): `TORCH_SIGMOID_PTX`'s
range reduction and exponential, the final multiply by the power of two rounded on its own (torch's
softmax keeps each exponential, so nothing contracts it)."""


@dsl_user_op
def expf_as_torch(x, *, loc=None, ip=None) -> Float32:
    """`std::exp` of an FP32 value in torch's CUDA kernels, bit for bit (`TORCH_EXPF_PTX`)."""
    return dev.inline_ptx("f", TORCH_EXPF_PTX, "f", x, loc=loc, ip=ip)


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


@cute.jit
def choose_top_k(keys: list, scores: list, experts: list, top_k: int, no_expert: int):
    """The warp's `top_k` largest keys, slot by slot (the lower expert id on ties, as a stable descending
    sort): their experts and scores, the same on every lane. `keys`, `scores`, `experts`: the lane's
    candidates (a non-candidate's key `NO_KEY`); `keys` is consumed."""
    ids, weights = [], []
    for _ in cutlass.range_constexpr(top_k):
        best_key, best_expert, best_score = Int32(NO_KEY), Int32(no_expert), Float32(0.0)
        for i in cutlass.range_constexpr(len(keys)):  # a lane's experts ascend: the first wins a tie
            takes = keys[i] > best_key
            best_key = cutlass.select_(takes, keys[i], best_key)
            best_expert = cutlass.select_(takes, experts[i], best_expert)
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
        for i in cutlass.range_constexpr(len(keys)):
            keys[i] = cutlass.select_(experts[i] == best_expert, Int32(NO_KEY), keys[i])
    return ids, weights


@cute.jit
def write_slots(ids: list, weights: list, renormalize: bool, factor, mIds, mWeights, token, lane):
    """The slots' weights renormalized in slot order (`renormalize`), times `factor` (None: not
    scaled); lane `j` writes slot `j`."""
    if const_expr(renormalize):
        total = weights[0]
        for j in cutlass.range_constexpr(1, len(weights)):
            total = dev.add_rn(total, weights[j])
        weights = [dev.div_rn(w, total) for w in weights]
    for j in cutlass.range_constexpr(len(ids)):
        if lane == j:
            mIds[token, j] = ids[j]
            if const_expr(factor is None):
                mWeights[token, j] = weights[j]
            else:
                mWeights[token, j] = dev.mul_rn(weights[j], factor)


def launch_per_token(kernel, tokens, stream):
    """A routing kernel's grid: one warp per token, `WARPS` per CTA."""
    kernel.launch(grid=[cute.ceil_div(tokens, WARPS), 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=USE_PDL)


@cute.jit
def warp_token():
    """A routing kernel's first statement (`launch_per_token`'s grid, after the PDL wait): (the token of
    this warp, this thread's lane)."""
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    wait_for_predecessor_and_release_successor()
    return cta * WARPS + tidx // 32, tidx % 32


class RouteDeepSeekV3Sm90:
    """`route_deepseek_v3` for `experts` experts in `n_group` groups: one warp per token, lane `l`
    holding experts `l, l + 32, ...` (coalesced loads; a lane's experts ascend).

    1. Each lane computes its experts' scores `s = sigmoid(logit)` and biased scores `b = RN(s + bias)`,
       kept with their order keys.
    2. Per group, the two largest keys over the warp (a butterfly over the lanes' own top two), and
       the group score `RN(b_(1) + b_(2))` of their values.
    3. Every lane picks the `topk_group` best groups (ascending group id on ties) from the same scores.
    4. `choose_top_k` over the kept groups' experts by `b`, their `s` as weights; `write_slots`
       renormalizes and scales them.
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
        launch_per_token(self.kernel(mLogits, mBias, mIds, mWeights, scaling_factor), mLogits.shape[0], stream)

    @cute.kernel
    def kernel(self, mLogits, mBias, mIds, mWeights, scaling_factor):
        token, lane = warp_token()
        if token < mLogits.shape[0]:
            self.route(mLogits, mBias, mIds, mWeights, scaling_factor, token, lane)

    @cute.jit
    def route(self, mLogits, mBias, mIds, mWeights, scaling_factor, token, lane):
        # 1. Scores and biased keys of the lane's experts.
        scores, keys, groups, experts = [], [], [], []
        for i in cutlass.range_constexpr(self.per_lane):
            expert = lane + 32 * i
            score = Float32(0.0)
            key = Int32(NO_KEY)
            if expert < self.experts:
                score = sigmoid_as_torch(mLogits[token, expert].to(Float32))
                key = order_key(dev.add_rn(score, mBias[expert].to(Float32)))
            scores.append(score)
            keys.append(key)
            groups.append(expert // self.group_size)  # past the groups for a lane's missing experts
            experts.append(expert)

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

        # 4. The experts by biased score, weighted by their scores.
        ids, weights = choose_top_k(keys, scores, experts, self.top_k, self.experts)
        write_slots(ids, weights, self.renormalize, scaling_factor, mIds, mWeights, token, lane)


class RouteSoftmaxTopkSm90:
    """`route_softmax_topk` for `experts` experts: one warp per token, computing the row's softmax as
    torch's warp softmax does for a row of `experts` values, then `choose_top_k` and `write_slots`.

    torch's kernel spreads the row's next power of two, `P`, over `W = min(P, 32)` lanes, `P / W` per
    lane (lane `l` holding `l, l + W, ...`; positions past the row hold -inf), and per row:
    `m = x_0; m = m > x_i ? m : x_i` over the lane's values, then `m = m < o ? o : m` with the value
    `o` of lane `l ^ d` for d = W/2, ..., 1; `e_i = expf(x_i - m)`, `s = ((0 + e_0) + e_1) + ...`
    over the lane's values, then `s = s + o` likewise; `p_i = s == 0 ? NaN : e_i / s`. Lanes at or past
    `W` (narrow rows) hold -inf only and exchange among themselves, as torch's second row of a warp.
    """

    def __init__(self, experts: int, top_k: int, renormalize: bool):
        assert experts <= MAX_EXPERTS and top_k <= MAX_TOP_K
        self.experts = experts
        self.top_k = top_k
        self.renormalize = renormalize
        padded = 1 << (experts - 1).bit_length()
        self.width = min(padded, 32)
        self.per_lane = padded // self.width
        self.offsets = [self.width >> k for k in range(1, self.width.bit_length())]  # W/2, ..., 1

    @cute.jit
    def __call__(
        self,
        mLogits: cute.Tensor,  # [T, E] bf16 / fp16 / fp32, rows strided, elements contiguous
        mIds: cute.Tensor,  # int32 [T, top_k]
        mWeights: cute.Tensor,  # fp32 [T, top_k]
        stream,
    ):
        launch_per_token(self.kernel(mLogits, mIds, mWeights), mLogits.shape[0], stream)

    @cute.kernel
    def kernel(self, mLogits, mIds, mWeights):
        token, lane = warp_token()
        if token < mLogits.shape[0]:
            self.route(mLogits, mIds, mWeights, token, lane)

    @cute.jit
    def route(self, mLogits, mIds, mWeights, token, lane):
        values, experts = [], []
        for i in cutlass.range_constexpr(self.per_lane):
            expert = lane + self.width * i
            value = Float32(-float("inf"))
            if (lane < self.width) & (expert < self.experts):
                value = mLogits[token, expert].to(Float32)
            values.append(value)
            experts.append(expert)
        # The maximum, in torch's order and with its selects (which decide where NaNs go).
        top = values[0]
        for i in cutlass.range_constexpr(1, self.per_lane):
            top = cutlass.select_(top > values[i], top, values[i])
        for k in cutlass.range_constexpr(len(self.offsets)):
            other = cute.arch.shuffle_sync_bfly(top, self.offsets[k])
            top = cutlass.select_(top < other, other, top)
        # The exponentials and their sum, each operation rounded on its own.
        exponentials = [expf_as_torch(dev.sub_rn(v, top)) for v in values]
        total = dev.add_rn(Float32(0.0), exponentials[0])
        for i in cutlass.range_constexpr(1, self.per_lane):
            total = dev.add_rn(total, exponentials[i])
        for k in cutlass.range_constexpr(len(self.offsets)):
            total = dev.add_rn(total, cute.arch.shuffle_sync_bfly(total, self.offsets[k]))
        scores, keys = [], []
        for i in cutlass.range_constexpr(self.per_lane):
            probability = cutlass.select_(
                total == Float32(0.0), dev.f32_from_bits(Uint32(TORCH_QUIET_NAN_BITS)), dev.div_rn(exponentials[i], total)
            )
            real = (lane < self.width) & (experts[i] < self.experts)
            scores.append(probability)
            keys.append(cutlass.select_(real, order_key(probability), Int32(NO_KEY)))
        ids, weights = choose_top_k(keys, scores, experts, self.top_k, self.experts)
        write_slots(ids, weights, self.renormalize, None, mIds, mWeights, token, lane)
