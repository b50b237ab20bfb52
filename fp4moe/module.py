"""`FusedMoE`: an inference-only router + NVFP4 experts block to drop in for a HF-style MoE block."""

from __future__ import annotations

import torch
from torch import nn

from fp4moe import nvfp4
from fp4moe.weights import MoEWeights, quantize_moe_weights

ROUTINGS = ("softmax", "deepseek_v3")


class FusedMoE(nn.Module):
    """Router (bf16 linear, FP32 logits) -> `route_softmax_topk` or `route_deepseek_v3` -> `fused_moe`.

    `forward(hidden_states [..., H], router_logits=None) -> [..., H]` in the input's dtype (the experts run
    on bf16 activations), like the MoE block of a HF DeepSeek/Qwen model (which returns only the hidden
    states; shared experts stay outside this block). Expert weights are buffers, so `.to(device)` and
    `state_dict()` carry them; `.to(dtype)` / `.half()` / `.bfloat16()` leave the buffers whose dtype is
    part of the op contract as they are (`FIXED_DTYPE_BUFFERS`). Build it from `MoEWeights`
    (`fp4moe.moe_weights_from_nvfp4` adopts a checkpoint's NVFP4 tensors, `fp4moe.checkpoint` reads whole
    checkpoints) or quantize bf16 experts with `from_dense`.

    `router_weight=None` builds the block without a router of its own: `forward` then takes the
    `router_logits [..., E]` of a router that stays outside, in its own precision (`fp4moe.hf` passes the
    model's own router module's logits).
    """

    FIXED_DTYPE_BUFFERS = (
        "w1", "w1_scales", "w1_alpha", "w2", "w2_scales", "w2_alpha", "correction_bias", "fc1_input_scale",
        "fc2_input_scale",
    )
    """uint8 codes, E4M3 block scales and FP32 alphas, routing bias and activation global scales."""

    def __init__(
        self,
        router_weight: torch.Tensor | None,
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
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if routing == "deepseek_v3" and (correction_bias is None or n_group is None or topk_group is None):
            raise ValueError("routing='deepseek_v3' needs correction_bias, n_group and topk_group")
        if router_weight is not None and (router_weight.dim() != 2 or router_weight.shape[1] != weights.hidden_size):
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
        self.register_buffer("router_weight", None if router_weight is None else router_weight.to(torch.bfloat16))
        self.register_buffer("correction_bias", None if correction_bias is None else correction_bias.float())
        self.register_buffer("fc1_input_scale", fc1_input_scale)
        self.register_buffer("fc2_input_scale", fc2_input_scale)
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

    def _apply(self, fn, recurse=True):
        # `Module.to(dtype)` converts every floating-point tensor, float8 included, which would turn the
        # E4M3 scales into bf16 and round the FP32 alphas. The contract buffers keep their dtype and only
        # follow device moves: where `fn` changed a dtype, the original tensor is moved instead.
        kept = {name: self._buffers[name] for name in self.FIXED_DTYPE_BUFFERS if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        x = tokens.to(torch.bfloat16)
        if router_logits is not None:
            logits = router_logits.reshape(tokens.shape[0], -1).float()
        elif self.router_weight is None:
            raise ValueError("this FusedMoE has no router (router_weight=None): pass router_logits to forward")
        else:  # in the router's own dtype (bf16 unless the module was converted)
            logits = torch.nn.functional.linear(tokens.to(self.router_weight.dtype), self.router_weight).float()
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
        )
        return out.reshape(shape).to(hidden_states.dtype)
