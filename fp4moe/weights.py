"""Preparing NVFP4 expert weights for `fused_moe`: from checkpoint tensors or by quantizing bf16.

`fused_moe` takes, per projection, codes `uint8 [E, N, K/2]`, linear E4M3 block scales `[E, N, K/16]`
and a per-expert FP32 alpha. `MoEWeights` holds the codes, the scales and the per-expert *encode*
direction global scales (`gs = 2688 / amax`), and derives the alphas for a quantization mode.
Gated (SwiGLU) `w1` rows are `[gate; up]`, the vLLM/SGLang/HF convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4moe import nvfp4, validation, weight_layout


@dataclass(frozen=True)
class MoEWeights:
    w1: torch.Tensor
    """uint8 [E, 2I, H/2] (SwiGLU, `[gate; up]`) or [E, I, H/2] (relu2)."""
    w1_scales: torch.Tensor
    """float8_e4m3fn [E, N1, H/16], linear layout."""
    w1_global_scale: torch.Tensor
    """FP32 [E], encode direction; or [2, E] for SwiGLU whose gate (row 0) and up (row 1) halves have
    global scales of their own (checkpoints that do not tie them), which `alphas` keeps per half."""
    w2: torch.Tensor
    """uint8 [E, H, I/2]."""
    w2_scales: torch.Tensor
    w2_global_scale: torch.Tensor
    activation: str = "swiglu"
    layout: str = weight_layout.LINEAR
    """`linear` (the fields' shapes above) or `sm90`: w1/w2 (+ scales) hold `weight_layout`'s prepared
    uint8 tensors, padded; `sizes` then keeps the layer's (H, I)."""
    sizes: tuple[int, int] | None = None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1] if self.sizes is None else self.sizes[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2 if self.sizes is None else self.sizes[1]

    def prepared(self) -> MoEWeights:
        """The same weights in the sm90 prepared layout (`fp4moe.weight_layout`), made once: what the
        Hopper kernels stream. Any device computes with them (the reference reads the layout too)."""
        if self.layout == weight_layout.SM90:
            return self
        gated = self.activation == "swiglu"
        w1, w1_scales = weight_layout.prepare_sm90(self.w1, self.w1_scales, gated)
        w2, w2_scales = weight_layout.prepare_sm90(self.w2, self.w2_scales, gated=False)
        return MoEWeights(
            w1, w1_scales, self.w1_global_scale, w2, w2_scales, self.w2_global_scale, self.activation,
            weight_layout.SM90, (self.hidden_size, self.intermediate_size),
        )

    def alphas(self, fc1_input_scale: torch.Tensor | None = None, fc2_input_scale: torch.Tensor | None = None):
        """Per-expert GEMM alphas `(w1_alpha, w2_alpha)`, FP32 [E] each (`w1_alpha` [2, E], per SwiGLU half,
        where `w1_global_scale` is), what `fused_moe` multiplies each expert's GEMM1 / GEMM2 accumulator by.

        `fc1_input_scale`, `fc2_input_scale`: FP32, one element (shape [1] or []), encode direction
        (`2688 / amax` of the activation / of the intermediate), the per-tensor W4A4 scales; or None.
        `fc2_input_scale` may also be `[E]`, one per expert: each expert's intermediate is quantized with
        its own scale, and its alpha decodes it.
        alpha = decode(weight) * decode(activation) = RN(RN(1/w_gs) * RN(1/in_gs)) with the per-tensor
        input scales of W4A4; without an input scale (per-token W4A4, W4A16, pre-quantized activations)
        alpha is the weight decode scale alone. Scales are held in the encode direction: a ModelOpt decode
        scale `d` (`weight_scale_2`, `input_scale`) becomes `gs = RN(1/d)`, and `RN(1/gs)` is `d` or one
        FP32 ulp from it, so alpha is ModelOpt's product `weight_scale_2 * input_scale` to within an ulp
        or two, not always bitwise.
        """

        for name, scale in (("fc1_input_scale", fc1_input_scale), ("fc2_input_scale", fc2_input_scale)):
            if scale is not None:
                check_input_scale(name, scale, self.w1_global_scale, self.num_experts, name == "fc2_input_scale")

        def alpha(weight_gs, input_gs):
            decode = nvfp4.decode_scale_from_global_scale(weight_gs)
            if input_gs is None:
                return decode
            input_gs = input_gs.reshape(()) if input_gs.numel() == 1 else input_gs
            return decode * nvfp4.decode_scale_from_global_scale(input_gs)

        return alpha(self.w1_global_scale, fc1_input_scale), alpha(self.w2_global_scale, fc2_input_scale)

    def to(self, device) -> MoEWeights:
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        return MoEWeights(**moved, activation=self.activation, layout=self.layout, sizes=self.sizes)


_TENSOR_FIELDS = ("w1", "w1_scales", "w1_global_scale", "w2", "w2_scales", "w2_global_scale")


def check_input_scale(
    name: str, scale: torch.Tensor, w1_global_scale: torch.Tensor, num_experts: int, per_expert: bool
) -> None:
    """A per-tensor W4A4 activation scale: encode direction, FP32, one element (or, `per_expert`,
    one per expert: `[E]`), on the weights' device."""
    validation.check_tensor(name, scale)
    validation.check_dtype(name, scale, (torch.float32,))
    if per_expert:
        validation.check_tensor_or_expert_scale(name, scale, num_experts)
    else:
        validation.check_one_element(
            name, scale,
            " (the per-tensor activation scale; reduce a checkpoint's per-expert input scales to one first, "
            "e.g. the largest decode scale, which covers every expert's amax)",
        )
    validation.check_same_device(name, scale, "w1_global_scale", w1_global_scale)


def check_expert_shapes(w1: torch.Tensor, w2: torch.Tensor, activation: str, elements_per_byte: int) -> None:
    """`w1 [E, N1, H / elements_per_byte]` (N1 = 2I, `[gate; up]`, for SwiGLU; I for relu2) and
    `w2 [E, H, I / elements_per_byte]`, with H and I multiples of the NVFP4 block."""
    validation.check_python_scalar("activation", activation, str)
    validation.check_choice("activation", activation, validation.MOE_ACTIVATIONS)
    validation.check_dim("w1", w1, 3)
    validation.check_dim("w2", w2, 3)
    experts, n1, hidden = w1.shape[0], w1.shape[1], w1.shape[2] * elements_per_byte
    if experts < 1 or n1 < 1 or hidden == 0 or hidden % nvfp4.BLOCK_SIZE:
        raise ValueError(
            f"w1 must be [E >= 1, N1 >= 1, H{'/2' if elements_per_byte == 2 else ''}] with H a positive multiple of "
            f"{nvfp4.BLOCK_SIZE}, got {tuple(w1.shape)}"
        )
    intermediate = validation.check_gated_rows(activation, n1, "w1")
    validation.check_shape("w2", w2, (experts, hidden, intermediate // elements_per_byte))


def check_dense_experts(w1: torch.Tensor, w2: torch.Tensor, activation: str) -> None:
    """What `quantize_moe_weights` takes: floating-point tensors `w1 [E, N1, H]`, `w2 [E, H, I]` on one device."""
    for name, w in (("w1", w1), ("w2", w2)):
        validation.check_tensor(name, w)
        validation.check_dtype(name, w, validation.ACTIVATION_DTYPES)
    validation.check_same_device("w2", w2, "w1", w1)
    check_expert_shapes(w1, w2, activation, elements_per_byte=1)


def _quantize_experts(weights: torch.Tensor):
    """Per-expert global scale from the expert's amax (NaN ignored, semantics §1.6), then NVFP4 codes and
    linear scales. Weights that require grad (a model's parameters) are quantized as their values."""
    weights = weights.detach()
    global_scale = nvfp4.global_scale_from_amax(nvfp4.nan_ignoring_abs(weights.float()).amax(dim=(1, 2)))
    codes, scales = [], []
    for expert, gs in zip(weights, global_scale):
        c, s = torch.ops.fp4moe.quantize(expert, gs.reshape(1), sf_layout="linear")
        codes.append(c)
        scales.append(s)
    return torch.stack(codes), torch.stack(scales), global_scale


def quantize_moe_weights(w1: torch.Tensor, w2: torch.Tensor, activation: str = "swiglu") -> MoEWeights:
    """Quantize bf16/fp16/fp32 expert weights `w1 [E, N1, H]`, `w2 [E, H, I]` to NVFP4 with one
    global scale per expert and projection (the ModelOpt recipe)."""
    check_dense_experts(w1, w2, activation)
    w1_codes, w1_scales, w1_gs = _quantize_experts(w1)
    w2_codes, w2_scales, w2_gs = _quantize_experts(w2)
    return MoEWeights(w1_codes, w1_scales, w1_gs, w2_codes, w2_scales, w2_gs, activation)


def _linear_scales(scales: torch.Tensor, codes: torch.Tensor, sf_layout: str, name: str) -> torch.Tensor:
    experts, rows, cols = codes.shape[0], codes.shape[1], codes.shape[2] * 2 // nvfp4.BLOCK_SIZE
    validation.check_dtype(name, scales, (torch.float8_e4m3fn,))
    expected = (rows, cols) if sf_layout == "linear" else nvfp4.swizzled_shape(rows, cols)
    validation.check_shape(f"{name} ({sf_layout})", scales, (experts, *expected))
    return torch.stack([nvfp4.to_linear(s, sf_layout, rows, cols) for s in scales])


def _global_scale(global_scale, decode_scale, name: str, num_experts: int, per_half: bool = False) -> torch.Tensor:
    """Per-expert encode-direction global scales, FP32 [E], from either direction (one scale per
    expert, in any shape holding E elements: [E] or ModelOpt's stacked [E, 1]); with `per_half` (SwiGLU's
    w1) also [2, E], the gate and up halves' own (row 0, row 1), kept as [2, E] (a stacked [E, 2] is the
    caller's to transpose: at E = 2 the two shapes coincide)."""
    if (global_scale is None) == (decode_scale is None):
        raise ValueError(f"pass exactly one of {name}_global_scale (encode direction) and {name}_decode_scale")
    given, argument = (global_scale, f"{name}_global_scale") if global_scale is not None else (
        decode_scale, f"{name}_decode_scale"
    )
    if not given.is_floating_point():
        raise TypeError(f"{argument} must have a floating-point dtype, got {given.dtype}")
    halves = per_half and tuple(given.shape) == (2, num_experts)
    if given.numel() != num_experts and not halves:
        per_half_shape = ", or [2, E] per SwiGLU half (gate, up)" if per_half else ""
        raise ValueError(
            f"{argument} must hold one scale per expert (E = {num_experts} elements{per_half_shape}), "
            f"got shape {tuple(given.shape)}"
        )
    shape = (2, num_experts) if halves else (num_experts,)
    if global_scale is not None:
        return global_scale.float().reshape(shape)
    return nvfp4.global_scale_from_decode_scale(decode_scale).reshape(shape)


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
      `weight_scale_2`), converted to `RN(1 / decode)`. Exactly one of the two per projection. For SwiGLU
      `w1`, `[2, E]` gives the gate (row 0) and up (row 1) halves their own, as checkpoints that do not tie
      them store; `alphas` then returns `w1_alpha` `[2, E]`, which `fused_moe` applies per half.
    - `sf_layout`: `"linear"` or `"swizzled"`, the layout of both scale tensors (stored linear).
    - `activation`: `"swiglu"` or `"relu2"`.

    The value of weight element `(e, n, k)` is `e2m1 * sf / global_scale`. Activation scales are not part
    of `MoEWeights`: they go to `alphas` and `FusedMoE`. `fp4moe.checkpoint` builds these arguments from
    whole checkpoints (per-expert 2-D tensors stacked, gate and up joined)."""
    validation.check_python_scalar("sf_layout", sf_layout, str)
    validation.check_choice("sf_layout", sf_layout, nvfp4.SF_LAYOUTS)
    required = dict(w1=w1, w1_scales=w1_scales, w2=w2, w2_scales=w2_scales)
    global_scales = dict(w1_global_scale=w1_global_scale, w1_decode_scale=w1_decode_scale,
                         w2_global_scale=w2_global_scale, w2_decode_scale=w2_decode_scale)
    given = {**required, **{name: scale for name, scale in global_scales.items() if scale is not None}}
    for name, tensor in given.items():
        validation.check_tensor(name, tensor)
        validation.check_same_device(name, tensor, "w1", w1)
    for name, w in (("w1", w1), ("w2", w2)):
        validation.check_dtype(name, w, (torch.uint8, torch.float4_e2m1fn_x2))
    w1, w2 = (nvfp4.codes_from_float4_e2m1fn_x2(w) if w.dtype == torch.float4_e2m1fn_x2 else w for w in (w1, w2))
    check_expert_shapes(w1, w2, activation, elements_per_byte=2)
    experts = w1.shape[0]
    return MoEWeights(
        w1=w1,
        w1_scales=_linear_scales(w1_scales, w1, sf_layout, "w1_scales"),
        w1_global_scale=_global_scale(w1_global_scale, w1_decode_scale, "w1", experts, activation == "swiglu"),
        w2=w2,
        w2_scales=_linear_scales(w2_scales, w2, sf_layout, "w2_scales"),
        w2_global_scale=_global_scale(w2_global_scale, w2_decode_scale, "w2", experts),
        activation=activation,
    )
