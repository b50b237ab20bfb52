"""Spot-checks: every implementation's output, from the very replay that is then timed, against fp4moe's
reference backend on a fixed sample of token rows.

The reference runs on the sample rows alone (every output row depends only on its own token and
routing, semantics §3), so its cost does not grow with T, and one run per shape and mode serves every
token count. It is the pipeline with every stage on the reference (`reference=True`), called directly
rather than through the op, whose CUDA implementation runs the kernels under test.
"""

from __future__ import annotations

import math

import torch

from benchmarks.moe_cases import ALIGNED_MOE, MoEProblem, QuantConfig
from fp4moe import pipeline
from fp4moe.reference import aligned_moe as aligned_reference

CHECK_FIRST_ROWS = 8
CHECK_SPREAD_ROWS = 32


def check_rows(max_tokens: int, token_counts: list[int]) -> list[int]:
    """The rows checked: the first few, the last row of every case (where tile and tail handling go
    wrong), and rows spread evenly over the whole problem."""
    rows = set(range(min(CHECK_FIRST_ROWS, max_tokens)))
    rows.update(t - 1 for t in token_counts)
    rows.update(round(r * (max_tokens - 1) / (CHECK_SPREAD_ROWS - 1)) for r in range(CHECK_SPREAD_ROWS))
    return sorted(rows)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in FP64; NaN where `actual` has a non-finite value (NaN never
    passes); where `expected` is all zeros (no token routed to a local expert), 0 only for exact zeros."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return math.nan
    error, norm = float(torch.linalg.norm(actual - expected)), float(torch.linalg.norm(expected))
    if norm == 0:
        return 0.0 if error == 0 else math.inf
    return error / norm


class SpotCheck:
    def __init__(self, problem: MoEProblem, token_counts: list[int]):
        self.problem = problem
        self.rows = check_rows(problem.x.shape[0], token_counts)
        self._row_index = torch.tensor(self.rows, device=problem.device)
        self._expected: dict[QuantConfig, torch.Tensor] = {}

    def expected(self, config: QuantConfig | str) -> torch.Tensor:
        """The reference output of the sample rows in `config` (or of the aligned MoE, `ALIGNED_MOE`),
        computed once."""
        if config not in self._expected:
            p, rows = self.problem, self._row_index
            if config == ALIGNED_MOE:
                self._expected[config] = torch.cat([self._aligned_reference_row(row) for row in self.rows])
            else:
                arguments = p.fused_moe_arguments(config, p.x[rows], p.topk_ids[rows], p.topk_weights[rows])
                self._expected[config] = pipeline.fused_moe(**arguments, reference=True)
        return self._expected[config]

    def _aligned_reference_row(self, row: int) -> torch.Tensor:
        """The aligned reference's output [1, H] for one token. The reference computes every block of
        its plan with that block's experts dequantized to FP32, so the plan is cut to its used blocks
        (a host read: this is not timed) and made for one token at a time: at most top_k blocks."""
        p, block_m = self.problem, 8  # any block size: a row's output does not depend on the plan
        arguments = p.aligned_moe_arguments(
            p.x[row : row + 1], p.topk_ids[row : row + 1], p.topk_weights[row : row + 1], block_m, prepared=False
        )
        used = int(arguments["num_tokens_post_padded"])
        arguments["sorted_token_ids"] = arguments["sorted_token_ids"][:used]
        arguments["expert_ids"] = arguments["expert_ids"][: used // block_m]
        out = torch.zeros(1, p.shape.hidden_size, dtype=torch.bfloat16, device=p.device)
        if used:
            aligned_reference.aligned_moe_(out, **arguments)
        return out

    def relative_error(self, output: torch.Tensor, num_tokens: int, config: QuantConfig | str) -> float:
        """Of the sample rows below `num_tokens` of a case's output [num_tokens, H]."""
        expected_shape = (num_tokens, self.problem.shape.hidden_size)
        if tuple(output.shape) != expected_shape:
            raise ValueError(f"output has shape {tuple(output.shape)}, expected {expected_shape}")
        count = sum(row < num_tokens for row in self.rows)
        return relative_error(output[self._row_index[:count]], self.expected(config)[:count])
