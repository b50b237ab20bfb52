"""`FusedMoE`: an inference-only router + NVFP4 experts block to drop in for a HF-style MoE block."""

from __future__ import annotations

import torch
from torch import nn

from fp4moe import nvfp4
from fp4moe import weight_layout as weight_layouts
from fp4moe.weights import MoEWeights, quantize_moe_weights

ROUTINGS = ("softmax", "deepseek_v3")


class FusedMoE(nn.Module):
    """Router (bf16 linear, FP32 logits) -> `route_softmax_topk` or `route_deepseek_v3` -> `fused_moe`.

    `forward(hidden_states [..., H]) -> [..., H]` in bf16, like the MoE block of a HF DeepSeek/Qwen model
    (which returns only the hidden states; shared experts stay outside this block). Expert weights are
    buffers, so `.to(device)` and `state_dict()` carry them; by default they are kept in the prepared
    layout the Hopper kernels stream (`weight_layout="sm90"`, made once here; every backend reads it).
    Build it from `MoEWeights`
    (`fp4moe.moe_weights_from_nvfp4` adopts a checkpoint's NVFP4 tensors) or quantize bf16 experts
    with `from_dense`.
    """

    def __init__(
        self,
        router_weight: torch.Tensor,
        weights: MoEWeights,
        top_k: int,
        *,
        routing: str = "softmax",
        renormalize: bool = True,
        correction_bias: torch.Tensor | None = None,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        quant_mode: str = "w4a4",
        per_token_activation: bool = False,
        fc1_input_scale: torch.Tensor | None = None,
        fc2_input_scale: torch.Tensor | None = None,
        swiglu_alpha: float | None = None,
        swiglu_beta: float | None = None,
        swiglu_limit: float | None = None,
        apply_router_weight_on_input: bool = False,
        deterministic: bool = False,
        local_expert_offset: int = 0,
        weight_layout: str = weight_layouts.SM90,
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if routing == "deepseek_v3" and (correction_bias is None or n_group is None or topk_group is None):
            raise ValueError("routing='deepseek_v3' needs correction_bias, n_group and topk_group")
        if router_weight.dim() != 2 or router_weight.shape[1] != weights.hidden_size:
            raise ValueError(f"router_weight must be [E, H = {weights.hidden_size}], got {tuple(router_weight.shape)}")
        self.top_k = top_k
        self.routing = routing
        self.renormalize = renormalize
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.quant_mode = quant_mode
        self.per_token_activation = per_token_activation
        self.activation = weights.activation
        self.swiglu = (swiglu_alpha, swiglu_beta, swiglu_limit)
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.deterministic = deterministic
        self.local_expert_offset = local_expert_offset
        self.register_buffer("router_weight", router_weight.to(torch.bfloat16))
        self.register_buffer("correction_bias", None if correction_bias is None else correction_bias.float())
        self.register_buffer("fc1_input_scale", fc1_input_scale)
        self.register_buffer("fc2_input_scale", fc2_input_scale)
        if weight_layout not in weight_layouts.WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {weight_layouts.WEIGHT_LAYOUTS}, got {weight_layout!r}")
        if weight_layout == weight_layouts.SM90:
            weights = weights.prepared()
        elif weights.layout != weight_layouts.LINEAR:
            raise ValueError("weight_layout='linear' needs linear MoEWeights")
        self.weight_layout = weight_layout
        w1_alpha, w2_alpha = weights.alphas(fc1_input_scale, fc2_input_scale)
        for name in ("w1", "w1_scales", "w2", "w2_scales"):
            self.register_buffer(name, getattr(weights, name))
        self.register_buffer("w1_alpha", w1_alpha)
        self.register_buffer("w2_alpha", w2_alpha)

    @classmethod
    def from_dense(
        cls,
        router_weight: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        *,
        activation: str = "swiglu",
        fc1_input_amax: float | None = None,
        fc2_input_amax: float | None = None,
        **options,
    ) -> FusedMoE:
        """Quantize bf16 experts `w1 [E, N1, H]` (`[gate; up]` rows for SwiGLU) and `w2 [E, H, I]`.
        Per-tensor W4A4 needs the calibrated activation maxima `fc1_input_amax` / `fc2_input_amax`."""
        weights = quantize_moe_weights(w1, w2, activation)

        def input_scale(amax):
            return None if amax is None else nvfp4.global_scale_from_amax(torch.tensor([amax], device=w1.device))

        return cls(
            router_weight, weights, top_k,
            fc1_input_scale=input_scale(fc1_input_amax), fc2_input_scale=input_scale(fc2_input_amax), **options,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).to(torch.bfloat16)
        logits = torch.nn.functional.linear(x, self.router_weight).float()
        ops = torch.ops.fp4moe
        if self.routing == "softmax":
            topk_ids, topk_weights = ops.route_softmax_topk(logits, self.top_k, self.renormalize)
        else:
            topk_ids, topk_weights = ops.route_deepseek_v3(
                logits, self.correction_bias, self.top_k, self.n_group, self.topk_group,
                self.routed_scaling_factor, self.renormalize,
            )
        out = ops.fused_moe(
            x, topk_ids, topk_weights, self.w1, self.w1_scales, self.w1_alpha, self.w2, self.w2_scales, self.w2_alpha,
            self.fc1_input_scale, self.fc2_input_scale, self.quant_mode, self.per_token_activation, self.activation,
            *self.swiglu, self.apply_router_weight_on_input, self.deterministic, self.local_expert_offset,
            weight_layout=self.weight_layout,
        )
        return out.reshape(shape)
