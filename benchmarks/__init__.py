"""Benchmarks of the fp4moe ops, run from the repository root: `python -m benchmarks.moe`.

Pieces any benchmark can use live in their own modules: `timing` (CUDA graphs and events, median of
replays, cold L2), `ceilings` (the device's measured read bandwidth and bf16 GEMM rate), `progress`
(a progress line on stderr) and `report` (environment, result files, markdown tables, plotting).
The MoE harness is `moe` with its problems (`moe_cases`), spot-checks (`moe_checks`), implementation
registry (`moe_implementations`) and report (`moe_report`).
"""
