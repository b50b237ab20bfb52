"""Reference routing (semantics §3.1): softmax top-k and DeepSeek-V3 grouped sigmoid routing.

Inputs are assumed validated (`fp4moe.validation`); outputs are written into tensors from
`fp4moe.op_outputs.routing_outputs`, the allocator the fakes use.

Conventions, shared by both ops so that kernels have one target to reproduce:
- All scores are FP32 (`router_logits` widened exactly), and the results do not depend on the
  logits' strides.
- Selection is a stable descending sort: output slots are in descending score order and equal
  scores go to the lower expert (or group) id. `torch.topk` leaves its tie order unspecified, so it
  is not used. NaN ranks above every number, as in `torch.sort`: a NaN logit makes its softmax row
  all NaN, and in DeepSeek-V3 routing puts its expert (weight NaN) into slot 0.
- Renormalizing divides each weight by the sum of the token's k weights, added in slot order
  (j = 0, 1, ..., k-1), each addition rounded to FP32, so the result is reproducible bit for bit.
"""

from __future__ import annotations

import torch

from fp4moe.op_outputs import routing_outputs


def top_k_stable(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries along the last dim and their positions, largest first; equal entries
    keep ascending position order (a stable sort), so ties go to the lower position on every device."""
    ordered, positions = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[..., :k], positions[..., :k]


def renormalize_in_slot_order(weights: torch.Tensor) -> torch.Tensor:
    """`weights[:, j] / Σ_j weights[:, j]`, the sum taken over j ascending in FP32 (a fixed order,
    unlike `torch.sum`, whose association depends on the device and vector width)."""
    total = weights[:, 0]
    for slot in range(1, weights.shape[1]):
        total = total + weights[:, slot]
    return weights / total[:, None]


def _fp32_logits(router_logits: torch.Tensor) -> torch.Tensor:
    """Exactly widened, contiguous logits: what the scores are computed from on every path."""
    return router_logits.contiguous().float()


def route_softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """softmax over the experts in FP32 → the top_k experts → optionally renormalized weights."""
    ids_out, weights_out = routing_outputs(router_logits, top_k)
    probabilities = _fp32_logits(router_logits).softmax(dim=-1)
    weights, ids = top_k_stable(probabilities, top_k)
    if renormalize:
        weights = renormalize_in_slot_order(weights)
    ids_out.copy_(ids)
    weights_out.copy_(weights)
    return ids_out, weights_out


def route_deepseek_v3(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool,
):
    """DeepSeek-V3 `noaux_tc` routing.

    `s = sigmoid(logits)` and the biased `b = s + correction_bias` (FP32). Each of the `n_group`
    groups of `E / n_group` consecutive experts scores the sum of its two largest `b`; the
    `topk_group` best groups are kept, and the `top_k` experts with the largest `b` among them are
    chosen (slots in descending `b`). Experts of dropped groups are never chosen, whatever their
    bias (vLLM/SGLang mask them with -inf; HF's 0.0 fill could pick them when the kept scores are
    negative). The weights are the unbiased `s` of the chosen experts, renormalized when asked,
    then multiplied by `routed_scaling_factor` rounded to FP32 (one FP32 rounding).
    """
    ids_out, weights_out = routing_outputs(router_logits, top_k)
    tokens, experts = router_logits.shape
    group_size = experts // n_group
    scores = _fp32_logits(router_logits).sigmoid()
    biased = scores + correction_bias.float()

    # One addition of two FP32 values: the order of the top two does not matter.
    top_two, _ = top_k_stable(biased.view(tokens, n_group, group_size), 2)
    group_scores = top_two[..., 0] + top_two[..., 1]
    _, kept_groups = top_k_stable(group_scores, topk_group)

    # Candidates in ascending expert id (kept groups sorted by id, experts in order inside each),
    # so the stable selection below breaks ties between experts by the lower id.
    kept_groups = kept_groups.sort(dim=-1).values
    in_group = torch.arange(group_size, device=router_logits.device)
    candidates = (kept_groups[:, :, None] * group_size + in_group).view(tokens, topk_group * group_size)
    _, chosen = top_k_stable(biased.gather(1, candidates), top_k)
    ids = candidates.gather(1, chosen)

    weights = scores.gather(1, ids)
    if renormalize:
        weights = renormalize_in_slot_order(weights)
    weights = weights * routed_scaling_factor
    ids_out.copy_(ids)
    weights_out.copy_(weights)
    return ids_out, weights_out
