"""Preparing NVFP4 expert weights for `fused_moe`: from checkpoint tensors or by quantizing bf16.

`fused_moe` takes, per projection, codes `uint8 [E, N, K/2]`, linear E4M3 block scales `[E, N, K/16]`
and a per-expert FP32 alpha. `MoEWeights` holds the codes, the scales and the per-expert *encode*
direction global scales (`gs = 2688 / amax`), and derives the alphas for a quantization mode.
Gated (SwiGLU) `w1` rows are `[gate; up]`, the vLLM/SGLang/HF convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4moe import nvfp4


@dataclass(frozen=True)
class MoEWeights:
    w1: torch.Tensor
    """uint8 [E, 2I, H/2] (SwiGLU, `[gate; up]`) or [E, I, H/2] (relu2)."""
    w1_scales: torch.Tensor
    """float8_e4m3fn [E, N1, H/16], linear layout."""
    w1_global_scale: torch.Tensor
    """FP32 [E], encode direction."""
    w2: torch.Tensor
    """uint8 [E, H, I/2]."""
    w2_scales: torch.Tensor
    w2_global_scale: torch.Tensor
    activation: str = "swiglu"

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2

    def alphas(self, fc1_input_scale: torch.Tensor | None = None, fc2_input_scale: torch.Tensor | None = None):
        """Per-expert GEMM alphas `(w1_alpha, w2_alpha)`, FP32 [E] each, what `fused_moe` multiplies each
        expert's GEMM1 / GEMM2 accumulator by.

        `fc1_input_scale`, `fc2_input_scale`: FP32, one element (shape [1] or []), encode direction
        (`2688 / amax` of the activation / of the intermediate), the per-tensor W4A4 scales; or None.
        alpha = decode(weight) * decode(activation) = RN(RN(1/w_gs) * RN(1/in_gs)) with the per-tensor
        input scales of W4A4 (the ModelOpt product `weight_scale_2 * input_scale`); without an input
        scale (per-token W4A4, W4A16, pre-quantized activations) alpha is the weight decode scale alone.
        """

        def alpha(weight_gs, input_gs):
            decode = nvfp4.decode_scale_from_global_scale(weight_gs)
            if input_gs is None:
                return decode
            return decode * nvfp4.decode_scale_from_global_scale(input_gs.reshape(()))

        return alpha(self.w1_global_scale, fc1_input_scale), alpha(self.w2_global_scale, fc2_input_scale)

    def to(self, device) -> MoEWeights:
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        return MoEWeights(**moved, activation=self.activation)


_TENSOR_FIELDS = ("w1", "w1_scales", "w1_global_scale", "w2", "w2_scales", "w2_global_scale")


def _quantize_experts(weights: torch.Tensor):
    """Per-expert global scale from the expert's amax, then NVFP4 codes and linear scales."""
    global_scale = nvfp4.global_scale_from_amax(weights.float().abs().amax(dim=(1, 2)))
    codes, scales = [], []
    for expert, gs in zip(weights, global_scale):
        c, s = torch.ops.fp4moe.quantize(expert, gs.reshape(1), sf_layout="linear")
        codes.append(c)
        scales.append(s)
    return torch.stack(codes), torch.stack(scales), global_scale


def quantize_moe_weights(w1: torch.Tensor, w2: torch.Tensor, activation: str = "swiglu") -> MoEWeights:
    """Quantize bf16/fp16/fp32 expert weights `w1 [E, N1, H]`, `w2 [E, H, I]` to NVFP4 with one
    global scale per expert and projection (the ModelOpt recipe)."""
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0] or w1.shape[2] != w2.shape[1]:
        raise ValueError(f"expected w1 [E, N1, H] and w2 [E, H, I], got {tuple(w1.shape)} and {tuple(w2.shape)}")
    w1_codes, w1_scales, w1_gs = _quantize_experts(w1)
    w2_codes, w2_scales, w2_gs = _quantize_experts(w2)
    return MoEWeights(w1_codes, w1_scales, w1_gs, w2_codes, w2_scales, w2_gs, activation)


def _linear_scales(scales: torch.Tensor, rows: int, cols: int, sf_layout: str, name: str) -> torch.Tensor:
    expected = (rows, cols) if sf_layout == "linear" else nvfp4.swizzled_shape(rows, cols)
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be float8_e4m3fn, got {scales.dtype}")
    if scales.dim() != 3 or tuple(scales.shape[1:]) != expected:
        raise ValueError(f"{name} ({sf_layout}) must be [E, {expected[0]}, {expected[1]}], got {tuple(scales.shape)}")
    return torch.stack([nvfp4.to_linear(s, sf_layout, rows, cols) for s in scales])


def _global_scale(global_scale, decode_scale, name: str) -> torch.Tensor:
    if (global_scale is None) == (decode_scale is None):
        raise ValueError(f"pass exactly one of {name}_global_scale (encode direction) and {name}_decode_scale")
    if global_scale is not None:
        return global_scale.float().reshape(-1)
    return nvfp4.global_scale_from_decode_scale(decode_scale).reshape(-1)


def moe_weights_from_nvfp4(
    w1: torch.Tensor,
    w1_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    *,
    w1_global_scale: torch.Tensor | None = None,
    w1_decode_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    w2_decode_scale: torch.Tensor | None = None,
    sf_layout: str = "linear",
    activation: str = "swiglu",
) -> MoEWeights:
    """Adopt standard NVFP4 expert tensors (already stacked per layer) as `MoEWeights`.

    - `w1`: codes `uint8` (or `float4_e2m1fn_x2`, viewed without a copy) `[E, N1, H/2]`, two E2M1 values
      per byte, element 2i in the low nibble; `N1 = 2I` with `[gate; up]` rows for SwiGLU, `I` for relu2.
    - `w1_scales`: E4M3 (`float8_e4m3fn`) block scales, one per 16 elements along H: `[E, N1, H/16]` in
      the `linear` layout, or `[E, round_up(N1, 128), round_up(H/16, 4)]` in the `swizzled` 128x4 layout.
    - `w2`, `w2_scales`: the same for the down projection, `[E, H, I/2]` and `[E, H, I/16]` (linear).
    - `w1_global_scale` / `w2_global_scale`: FP32 `[E]`, one per expert, **encode** direction
      (`2688 / amax`, compressed-tensors' `weight_global_scale`); or instead
    - `w1_decode_scale` / `w2_decode_scale`: FP32 `[E]`, **decode** direction (`amax / 2688`, ModelOpt's
      `weight_scale_2`), converted to `RN(1 / decode)`. Exactly one of the two per projection.
    - `sf_layout`: `"linear"` or `"swizzled"`, the layout of both scale tensors (stored linear).
    - `activation`: `"swiglu"` or `"relu2"`.

    The value of weight element `(e, n, k)` is `e2m1 * sf / global_scale`. Activation scales are not part
    of `MoEWeights`: they go to `alphas` and `FusedMoE`. `fp4moe.checkpoint` builds these arguments from
    whole checkpoints (per-expert 2-D tensors stacked, gate and up joined)."""
    if sf_layout not in nvfp4.SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {nvfp4.SF_LAYOUTS}, got {sf_layout!r}")
    w1 = nvfp4.codes_from_float4_e2m1fn_x2(w1) if w1.dtype == torch.float4_e2m1fn_x2 else w1
    w2 = nvfp4.codes_from_float4_e2m1fn_x2(w2) if w2.dtype == torch.float4_e2m1fn_x2 else w2
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != torch.uint8 or w.dim() != 3:
            raise ValueError(f"{name} must be uint8 (or float4_e2m1fn_x2) [E, N, K/2], got {w.dtype} {tuple(w.shape)}")
    return MoEWeights(
        w1=w1,
        w1_scales=_linear_scales(w1_scales, w1.shape[1], w1.shape[2] * 2 // nvfp4.BLOCK_SIZE, sf_layout, "w1_scales"),
        w1_global_scale=_global_scale(w1_global_scale, w1_decode_scale, "w1"),
        w2=w2,
        w2_scales=_linear_scales(w2_scales, w2.shape[1], w2.shape[2] * 2 // nvfp4.BLOCK_SIZE, sf_layout, "w2_scales"),
        w2_global_scale=_global_scale(w2_global_scale, w2_decode_scale, "w2"),
        activation=activation,
    )
