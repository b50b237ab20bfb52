"""The MoE problems the harness times: model shapes, random NVFP4 experts, fixed-seed routing, and one
case per token count with the bytes and FLOPs it must move and do.

One problem per shape holds `max_tokens` tokens; the case for T tokens is the first T of them. Routing
and quantization are row-independent, so every token's expected output is the same in every case, and
one reference computation per shape and mode serves the spot-checks of all of them (`moe_checks`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fp4moe import nvfp4
from fp4moe.weights import MoEWeights

ops = torch.ops.fp4moe


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    routing: str
    """`softmax` (softmax top-k, renormalized) or `deepseek_v3` (grouped sigmoid routing, semantics §3.1)."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_local_experts: int | None = None
    """Experts held by this rank (expert parallelism); None: all of them."""
    local_expert_offset: int = 0

    @property
    def local_experts(self) -> int:
        return self.num_local_experts or self.num_experts

    def describe(self) -> str:
        local = (
            f", EP shard: experts [{self.local_expert_offset}, {self.local_expert_offset + self.local_experts})"
            if self.num_local_experts
            else ""
        )
        return (
            f"E={self.num_experts}, top-{self.top_k}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"{self.routing} routing{local}"
        )


_DEEPSEEK_V3 = dict(
    num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048,
    routing="deepseek_v3", n_group=8, topk_group=4, routed_scaling_factor=2.5,
)
SHAPES = {
    shape.name: shape
    for shape in (
        MoEShape("deepseek_v3", **_DEEPSEEK_V3),
        # One of 8 expert-parallel ranks: 32 consecutive experts, which here is routing group 2 of 8.
        MoEShape("deepseek_v3_ep32", **_DEEPSEEK_V3, num_local_experts=32, local_expert_offset=64),
        # GLM-4.5 routes like DeepSeek-V3 (sigmoid, correction bias, scale 2.5) over a single group.
        MoEShape("glm", 256, 8, 6144, 512, "deepseek_v3", routed_scaling_factor=2.5),
        MoEShape("qwen3_30b_a3b", 128, 8, 2048, 768, "softmax"),
    )
}
SMOKE_SHAPES = {
    shape.name: shape
    for shape in (
        MoEShape("smoke", 8, 2, 256, 128, "softmax"),
        MoEShape("smoke_ep", 16, 4, 256, 128, "deepseek_v3", 4, 2, 2.5, num_local_experts=4, local_expert_offset=4),
    )
}


@dataclass(frozen=True)
class QuantConfig:
    """One `fused_moe` quantization mode (semantics §3.8)."""

    name: str
    quant_mode: str
    per_token_activation: bool

    @property
    def per_tensor_w4a4(self) -> bool:
        return self.quant_mode == "w4a4" and not self.per_token_activation


W4A4_PER_TENSOR = QuantConfig("w4a4_tensor", "w4a4", False)
W4A4_PER_TOKEN = QuantConfig("w4a4_token", "w4a4", True)
W4A16 = QuantConfig("w4a16", "w4a16", False)
QUANT_CONFIGS = (W4A4_PER_TENSOR, W4A4_PER_TOKEN, W4A16)
ALIGNED_MOE = "aligned_moe"
"""The spot-check's key for the aligned MoE's own reference (semantics §5), beside the fused_moe modes."""

FC2_INPUT_AMAX = 64.0
"""Static calibration of the intermediate for per-tensor W4A4 (encode scale 2688 / 64): gate and up are
about unit-variance by construction, so |silu(gate) * up| stays well below 64; a value above it would
saturate to code ±6, which every implementation must reproduce anyway."""

_E2M1_RMS = math.sqrt(sum(v * v for v in nvfp4.E2M1_VALUES) / len(nvfp4.E2M1_VALUES))
_BLOCK_SCALE_LOW, _BLOCK_SCALE_HIGH = 224.0, 448.0
"""Block scales are drawn uniformly from this range. Any E4M3 value is a valid scale; a narrow range
keeps the magnitude of the decoded weights predictable, and the global scale then normalizes it."""
_BLOCK_SCALE_RMS = math.sqrt(  # of the uniform law on [low, high]: sqrt((high^3 - low^3) / (3 (high - low)))
    (_BLOCK_SCALE_HIGH**3 - _BLOCK_SCALE_LOW**3) / (3 * (_BLOCK_SCALE_HIGH - _BLOCK_SCALE_LOW))
)
_EXPERT_SCALE_JITTER = (0.8, 1.25)
"""Each expert's global scale is scaled by a random factor in this range, so that a kernel applying
another expert's alpha gives a wrong result instead of the right one."""


def random_nvfp4_experts(experts: int, rows: int, cols: int, generator: torch.Generator, device: torch.device):
    """Codes uint8 [experts, rows, cols/2], linear E4M3 scales [experts, rows, cols/16] and FP32 encode
    global scales [experts] of random NVFP4 weights whose decoded values have standard deviation about
    1/sqrt(cols), so each product with unit-variance activations has unit variance.

    Drawn directly rather than quantized from random bf16: any bytes are valid E2M1 code pairs and any
    E4M3 value is a valid block scale, and quantizing DeepSeek-V3's 256 experts would cost more time
    than the benchmark itself.
    """
    codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=generator, dtype=torch.uint8, device=device)
    scales = torch.empty(experts, rows, cols // nvfp4.BLOCK_SIZE, device=device)
    scales.uniform_(_BLOCK_SCALE_LOW, _BLOCK_SCALE_HIGH, generator=generator)
    jitter = torch.empty(experts, device=device).uniform_(*_EXPERT_SCALE_JITTER, generator=generator)
    global_scale = _E2M1_RMS * _BLOCK_SCALE_RMS * math.sqrt(cols) * jitter
    return codes, scales.to(torch.float8_e4m3fn), global_scale


def random_moe_weights(
    experts: int, hidden: int, intermediate: int, generator: torch.Generator, device: torch.device
) -> MoEWeights:
    """`random_nvfp4_experts` for both projections of SwiGLU experts (FC1 [2I, H], FC2 [H, I]), linear layout."""
    w1, w1_scales, w1_gs = random_nvfp4_experts(experts, 2 * intermediate, hidden, generator, device)
    w2, w2_scales, w2_gs = random_nvfp4_experts(experts, hidden, intermediate, generator, device)
    return MoEWeights(w1, w1_scales, w1_gs, w2, w2_scales, w2_gs, "swiglu")


def aligned_moe_arguments(
    weights: MoEWeights, x, topk_ids, topk_weights, block_m: int, local_experts: int, local_expert_offset: int = 0,
    global_num_experts: int | None = None,
) -> dict:
    """Every argument of `aligned_moe_` but `out`, for the MoE layer of `weights` on `x` routed by `topk_ids`:
    `x` quantized to NVFP4 without a global scale (the aligned MoE's `hidden`), the W4A16 alphas as
    `scale_gate = scale_up` and `scale_down`, the route plan of `align_block_size` (built here, as an engine
    builds it before the layer) and a routed scaling factor of 1 (the routing weights carry any)."""
    w1_alpha, w2_alpha = weights.alphas()
    hidden, hidden_scales = ops.quantize(x, torch.ones(1, device=x.device), "linear", "off")
    plan = ops.align_block_size(topk_ids, block_m, local_experts, local_expert_offset)
    return dict(
        hidden=hidden, hidden_scales=hidden_scales,
        w1=weights.w1, w1_scales=weights.w1_scales, w2=weights.w2, w2_scales=weights.w2_scales,
        scale_gate=w1_alpha, scale_up=w1_alpha, scale_down=w2_alpha,
        sorted_token_ids=plan[0], expert_ids=plan[1], num_tokens_post_padded=plan[2],
        topk_weights=topk_weights, routed_scaling_factor=1.0, block_m=block_m, weight_layout=weights.layout,
        global_num_experts=global_num_experts,
    )


@dataclass(frozen=True)
class MoECase:
    """The first `num_tokens` tokens of a problem, with the host-side counts that judge its timings
    (computed from the routing on the host before anything is timed)."""

    problem: MoEProblem
    num_tokens: int
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    local_pairs: int
    """(token, slot) pairs routed to a local expert."""
    touched_experts: int
    """Distinct local experts with at least one pair: the experts whose weights must be read."""

    @property
    def bytes_moved(self) -> int:
        """The fewest bytes a MoE layer must move: the NVFP4 weights and block scales of the touched
        experts, the bf16 activations in and the bf16 outputs out (routing tensors are negligible)."""
        activations = 2 * self.x.numel() * self.x.element_size()
        return self.touched_experts * self.problem.nvfp4_bytes_per_expert + activations

    @property
    def flops(self) -> int:
        """2 * local pairs * 3 * H * I: the gate/up GEMM (2I x H) and the down GEMM (H x I) per local pair."""
        shape = self.problem.shape
        return 2 * self.local_pairs * 3 * shape.hidden_size * shape.intermediate_size

    def fused_moe_arguments(self, config: QuantConfig) -> dict:
        return self.problem.fused_moe_arguments(config, self.x, self.topk_ids, self.topk_weights)

    def aligned_moe_arguments(self, block_m: int) -> dict:
        return self.problem.aligned_moe_arguments(self.x, self.topk_ids, self.topk_weights, block_m)


class MoEProblem:
    """Random NVFP4 experts (the local ones), `max_tokens` bf16 tokens and their fixed-seed routing."""

    def __init__(self, shape: MoEShape, max_tokens: int, device: torch.device, seed: int):
        self.shape = shape
        self.device = device
        generator = torch.Generator(device=device).manual_seed(seed)
        h, i, experts = shape.hidden_size, shape.intermediate_size, shape.local_experts
        self.weights = random_moe_weights(experts, h, i, generator, device)
        self.x = torch.randn(max_tokens, h, generator=generator, device=device).to(torch.bfloat16)
        logits = torch.randn(max_tokens, shape.num_experts, generator=generator, device=device)
        if shape.routing == "deepseek_v3":
            bias = 0.1 * torch.randn(shape.num_experts, generator=generator, device=device)
            self.topk_ids, self.topk_weights = ops.route_deepseek_v3(
                logits, bias, shape.top_k, shape.n_group, shape.topk_group, shape.routed_scaling_factor
            )
        else:
            self.topk_ids, self.topk_weights = ops.route_softmax_topk(logits, shape.top_k, renormalize=True)
        self.host_topk_ids = self.topk_ids.cpu()
        # Per-tensor W4A4 calibration, static as in a checkpoint: the activations' amax over all tokens.
        self.fc1_input_scale = nvfp4.global_scale_from_amax(self.x.float().abs().amax().reshape(1))
        self.fc2_input_scale = nvfp4.global_scale_from_amax(torch.tensor([FC2_INPUT_AMAX], device=device))

    @functools.cached_property
    def nvfp4_bytes_per_expert(self) -> int:
        w = self.weights
        return sum(t[0].numel() * t.element_size() for t in (w.w1, w.w1_scales, w.w2, w.w2_scales))

    def case(self, num_tokens: int) -> MoECase:
        ids = self.host_topk_ids[:num_tokens].long() - self.shape.local_expert_offset
        local = (ids >= 0) & (ids < self.shape.local_experts)
        return MoECase(
            problem=self,
            num_tokens=num_tokens,
            x=self.x[:num_tokens],
            topk_ids=self.topk_ids[:num_tokens],
            topk_weights=self.topk_weights[:num_tokens],
            local_pairs=int(local.sum()),
            touched_experts=int(ids[local].unique().numel()),
        )

    def fused_moe_arguments(self, config: QuantConfig, x, topk_ids, topk_weights) -> dict:
        """Every argument of `fused_moe` by its schema name, so that the op and the reference pipeline
        (`fp4moe.pipeline.fused_moe`, which takes them all) are called with the same ones. The experts
        are passed in the prepared layout (`MoEWeights.prepared`), as `FusedMoE` passes them."""
        w = self.prepared_weights
        fc1, fc2 = (self.fc1_input_scale, self.fc2_input_scale) if config.per_tensor_w4a4 else (None, None)
        w1_alpha, w2_alpha = w.alphas(fc1, fc2)
        return dict(
            x=x, topk_ids=topk_ids, topk_weights=topk_weights,
            w1=w.w1, w1_scales=w.w1_scales, w1_alpha=w1_alpha, w2=w.w2, w2_scales=w.w2_scales, w2_alpha=w2_alpha,
            fc1_input_scale=fc1, fc2_input_scale=fc2,
            quant_mode=config.quant_mode, per_token_activation=config.per_token_activation,
            activation="swiglu", swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None,
            apply_router_weight_on_input=False, deterministic=False,
            local_expert_offset=self.shape.local_expert_offset, num_local_experts=self.shape.local_experts,
            x_scales=None, weight_layout=w.layout, global_num_experts=self.shape.num_experts,
        )

    def aligned_moe_arguments(self, x, topk_ids, topk_weights, block_m: int, prepared: bool = True) -> dict:
        """`aligned_moe_arguments` for the same layer: the experts prepared (as the kernels read them) or
        linear, the local experts of the shape, the router's expert count as the size hint
        `global_num_experts`, as `fused_moe_arguments` passes it."""
        return aligned_moe_arguments(
            self.prepared_weights if prepared else self.weights, x, topk_ids, topk_weights, block_m,
            self.shape.local_experts, self.shape.local_expert_offset, self.shape.num_experts,
        )

    @functools.cached_property
    def prepared_weights(self) -> MoEWeights:
        return self.weights.prepared()

    @functools.cached_property
    def bf16_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 `w1 [E, 2I, H]` and `w2 [E, H, I]` dequantized once from the NVFP4 weights with the
        W4A16 alphas folded in: the same expert weights for a baseline that runs without FP4."""
        w = self.weights
        w1_alpha, w2_alpha = w.alphas()

        def dequantize(codes, scales, alpha):
            dense = torch.empty(*codes.shape[:2], codes.shape[2] * 2, dtype=torch.bfloat16, device=codes.device)
            for expert in range(codes.shape[0]):  # one expert at a time bounds the FP32 temporary
                dense[expert] = nvfp4.dequantize_blocks(codes[expert], scales[expert]) * alpha[expert]
            return dense

        return dequantize(w.w1, w.w1_scales, w1_alpha), dequantize(w.w2, w.w2_scales, w2_alpha)
