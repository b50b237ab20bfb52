"""Random MoE problems and an independent per-(token, slot) loop reference of semantics §3.

The loop reference shares only the quantizer ops with fp4moe (they are tested bitwise on their own);
the permutation, the GEMMs (FP64 over dequantized values), the epilogues and the reduction are
written here, one routed pair at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import fp4moe
from fp4moe import nvfp4, weight_layout

ops = torch.ops.fp4moe


@dataclass
class MoEProblem:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: fp4moe.MoEWeights
    quant_mode: str = "w4a4"
    per_token_activation: bool = False
    fc1_input_scale: torch.Tensor | None = None
    fc2_input_scale: torch.Tensor | None = None
    options: dict = field(default_factory=dict)
    local_expert_offset: int = 0

    @property
    def alphas(self):
        return self.weights.alphas(self.fc1_input_scale, self.fc2_input_scale)

    def op_args(self):
        w = self.weights
        w1_alpha, w2_alpha = self.alphas
        return (self.x, self.topk_ids, self.topk_weights, w.w1, w.w1_scales, w1_alpha, w.w2, w.w2_scales, w2_alpha)

    def op_kwargs(self, **overrides):
        kwargs = dict(
            fc1_input_scale=self.fc1_input_scale,
            fc2_input_scale=self.fc2_input_scale,
            quant_mode=self.quant_mode,
            per_token_activation=self.per_token_activation,
            activation=self.weights.activation,
            local_expert_offset=self.local_expert_offset,
            **self.options,
        )
        kwargs.update(overrides)
        return kwargs

    def run(self, **overrides):
        return ops.fused_moe(*self.op_args(), **self.op_kwargs(**overrides))


def make_problem(
    tokens=7,
    hidden=64,
    intermediate=32,
    num_experts=8,
    top_k=2,
    activation="swiglu",
    mode="w4a4",
    local_experts=None,
    local_expert_offset=0,
    device="cpu",
    seed=0,
    per_half_w1_alpha=False,
    **options,
) -> MoEProblem:
    """A fresh random problem. `mode` is `w4a4` (per-tensor), `w4a4_per_token` or `w4a16`.
    Routing draws distinct global experts per token from `num_experts`; the weights cover the
    `local_experts` (default all) starting at `local_expert_offset`. `per_half_w1_alpha`: SwiGLU's up
    half gets a global scale of its own (the gate's times 1.3^(e % 3 + 1) for expert e), so `w1_alpha` is
    `[2, E]`, as from a checkpoint with untied gate/up scales."""
    g = torch.Generator().manual_seed(seed)
    local_experts = local_experts or num_experts
    rows = 2 * intermediate if activation == "swiglu" else intermediate
    w1 = torch.randn(local_experts, rows, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(local_experts, hidden, intermediate, generator=g) / intermediate**0.5
    weights = fp4moe.quantize_moe_weights(w1, w2, activation).to(device)
    if per_half_w1_alpha:
        gate = weights.w1_global_scale
        ratio = 1.3 ** (torch.arange(gate.shape[0], device=device) % 3 + 1)
        weights = replace(weights, w1_global_scale=torch.stack((gate, gate * ratio)))
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(torch.bfloat16).to(device)
    topk_ids = torch.argsort(torch.rand(tokens, num_experts, generator=g), dim=1)[:, :top_k]  # distinct per token
    topk_ids = topk_ids.to(torch.int32).to(device)
    topk_weights = torch.rand(tokens, top_k, generator=g).to(device) + 0.05
    problem = MoEProblem(x, topk_ids, topk_weights, weights, options=options, local_expert_offset=local_expert_offset)
    if mode == "w4a4":
        problem.fc1_input_scale = nvfp4.global_scale_from_amax(x.float().abs().amax(dim=1).max(dim=0, keepdim=True).values if tokens else torch.ones(1, device=device))
        problem.fc2_input_scale = torch.tensor([2688.0 / 64.0], device=device)  # calibrated: |intermediate| <= 64
    elif mode == "w4a4_per_token":
        problem.per_token_activation = True
    else:
        problem.quant_mode = "w4a16"
    return problem


def _dequant(codes, scales):
    return nvfp4.dequantize_blocks(codes, scales).double()


def _linear_experts(w: fp4moe.MoEWeights):
    """`(w1, w1_scales, w2, w2_scales)` of `w` in the linear layout, unpadded (`[gate; up]` halves of I
    rows for SwiGLU), whichever layout `w` holds."""
    if w.layout == weight_layout.LINEAR:
        return w.w1, w.w1_scales, w.w2, w.w2_scales
    gated = w.activation == "swiglu"
    hidden, intermediate = w.hidden_size, w.intermediate_size
    w1, w1_scales = weight_layout.as_linear(w.w1, w.w1_scales, w.layout, gated, None if gated else intermediate, hidden)
    if gated:  # each padded half cut to its first I rows
        half = w1.shape[1] // 2
        rows = torch.cat((torch.arange(intermediate), half + torch.arange(intermediate))).to(w1.device)
        w1, w1_scales = w1[:, rows], w1_scales[:, rows]
    w2, w2_scales = weight_layout.as_linear(w.w2, w.w2_scales, w.layout, False, hidden, intermediate)
    return w1, w1_scales, w2, w2_scales


def loop_reference(p: MoEProblem) -> torch.Tensor:
    """bf16 [T, H]: semantics §3 one (token, slot) pair at a time, FP64 products, FP32 epilogue order.
    `p.weights` may be in either layout."""
    w = p.weights
    w1, w1_scales, w2, w2_scales = _linear_experts(w)
    w1_alpha, w2_alpha = p.alphas
    tokens, top_k = p.topk_ids.shape
    opts = p.options
    router_weight_on_input = opts.get("apply_router_weight_on_input", False)
    w4a4 = p.quant_mode == "w4a4"
    if not w4a4:
        a, a_pts = p.x.double(), None
    elif p.per_token_activation:
        codes, scales, a_pts = ops.quantize_per_token(p.x, sf_layout="linear")
        a = _dequant(codes, scales)
    else:
        codes, scales = ops.quantize(p.x, p.fc1_input_scale, sf_layout="linear")
        a, a_pts = _dequant(codes, scales), None
    out = torch.zeros(tokens, w.hidden_size, dtype=torch.float32, device=p.x.device)
    for t in range(tokens):
        for j in range(top_k):
            e = int(p.topk_ids[t, j]) - p.local_expert_offset
            if not 0 <= e < w.num_experts:
                continue
            weight = p.topk_weights[t, j]
            h = (a[t] @ _dequant(w1[e], w1_scales[e]).T).float()
            if w1_alpha.dim() == 2:  # per SwiGLU half: [gate; up]
                h = h * torch.cat((w1_alpha[0, e].expand(h.shape[0] // 2), w1_alpha[1, e].expand(h.shape[0] // 2)))
            else:
                h = h * w1_alpha[e]
            if a_pts is not None:
                h = h * a_pts[t]
            if w.activation == "relu2":
                act = torch.relu(h) ** 2
            else:
                gate, up = h[: w.intermediate_size], h[w.intermediate_size :]
                limit = opts.get("swiglu_limit")
                if limit is not None:
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                alpha = 1.0 if opts.get("swiglu_alpha") is None else opts["swiglu_alpha"]
                beta = 0.0 if opts.get("swiglu_beta") is None else opts["swiglu_beta"]
                act = gate * torch.sigmoid(alpha * gate) * (up + beta)
            if router_weight_on_input:
                act = act * weight
            row = act[None]
            inter_pts = None
            if not w4a4:
                inter = row.to(torch.bfloat16).double()
            elif p.per_token_activation:
                codes, scales, inter_pts = ops.quantize_per_token(row.to(torch.bfloat16), sf_layout="linear")
                inter = _dequant(codes, scales)
            else:
                fc2 = p.fc2_input_scale if p.fc2_input_scale.numel() == 1 else p.fc2_input_scale[e : e + 1]
                codes, scales = ops.quantize(row, fc2, sf_layout="linear")
                inter = _dequant(codes, scales)
            down = (inter[0] @ _dequant(w2[e], w2_scales[e]).T).float() * w2_alpha[e]
            if inter_pts is not None:
                down = down * inter_pts[0]
            if not router_weight_on_input:
                down = down * weight
            out[t] += down
    return out.to(torch.bfloat16)


def assert_moe_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Both sides are bf16 roundings of FP32 sums that differ only in FP32 accumulation order, so they
    agree to about one bf16 ulp (2^-8 relative); in W4A4 an intermediate value within FP32 rounding of
    an E2M1 decision point may take the neighbouring code, moving outputs by a small fraction of the
    row's magnitude. Hence: elementwise 2^-7 relative plus 2^-8 of the largest output, and 1e-3 in norm."""
    actual, expected = actual.float(), expected.float()
    assert torch.isfinite(actual).all()
    scale = expected.abs().max().clamp(min=1e-30)
    bound = expected.abs() * 2**-7 + scale * 2**-8
    assert ((actual - expected).abs() <= bound).all(), float(((actual - expected).abs() / bound).max())
    norm = torch.linalg.norm(expected).clamp(min=1e-30)
    assert torch.linalg.norm(actual - expected) / norm <= 1e-3
