"""`python -m fp4moe.demo`: a small NVFP4 MoE layer end to end, on CUDA if present, else on the CPU.

It quantizes random bf16 experts to NVFP4, routes random tokens with DeepSeek-V3 grouped routing, runs
`torch.ops.fp4moe.fused_moe` eagerly and under `torch.compile(fullgraph=True)`, and compares the result
with the same MoE computed densely in FP32 from the unquantized weights.
"""

from __future__ import annotations

import torch

import fp4moe


def dense_moe(x, topk_ids, topk_weights, w1, w2):
    """FP32 SwiGLU MoE over unquantized weights, one (token, slot) pair at a time."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    intermediate = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w1[e] @ x[t].float()
            out[t] += topk_weights[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:intermediate]) * h[intermediate:]))
    return out


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    tokens, hidden, intermediate, experts, top_k = 24, 256, 128, 16, 4
    print(f"fp4moe {fp4moe.__version__} on {device} (torch {torch.__version__})")
    router = torch.randn(experts, hidden) / hidden**0.5
    w1 = torch.randn(experts, 2 * intermediate, hidden) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate) / intermediate**0.5
    moe = fp4moe.FusedMoE.from_dense(
        router, w1, w2, top_k, routing="deepseek_v3", correction_bias=torch.zeros(experts), n_group=4, topk_group=2,
        routed_scaling_factor=2.5, quant_mode="w4a4", per_token_activation=True,
    ).to(device)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)

    with torch.inference_mode():
        eager = moe(x)
        compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")(x)
        logits = torch.nn.functional.linear(x, moe.router_weight).float()
        topk_ids, topk_weights = torch.ops.fp4moe.route_deepseek_v3(logits, moe.correction_bias, top_k, 4, 2, 2.5)
    expected = dense_moe(x.cpu(), topk_ids.cpu(), topk_weights.cpu(), w1, w2)
    relative_error = (torch.linalg.norm(eager.float().cpu() - expected) / torch.linalg.norm(expected)).item()
    plan = fp4moe.moe_dispatch(tokens, top_k, experts, "w4a4", True)
    print(f"dispatch for T={tokens}: {plan}")
    print(f"fused_moe output {tuple(eager.shape)} {eager.dtype}; compiled == eager: {torch.equal(compiled, eager)}")
    print(f"NVFP4 (W4A4, per-token) vs dense FP32 MoE: relative error {relative_error:.3f}")
    # Two NVFP4 weight quantizations (~10% each) and two activation quantizations compound to ~20%;
    # a wrong kernel or layout lands near 100% or more.
    if not torch.equal(compiled, eager) or not relative_error < 0.35:
        raise SystemExit("demo check failed")


if __name__ == "__main__":
    main()
