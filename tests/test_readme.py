"""The README as a new user reads it: the "Using it" example runs verbatim, CI runs the "Set up"
commands verbatim, and the performance table quotes the result file it names."""

import re
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parent.parent
README = REPOSITORY / "README.md"


def first_block(heading: str, language: str) -> str:
    """The first fenced `language` block under the README's `## heading`."""
    text = README.read_text()
    section = text[text.index(f"\n## {heading}\n") :]
    match = re.search(rf"```{language}\n(.*?)```\n", section, re.DOTALL)
    assert match, f"no ```{language} block under ## {heading}"
    return match.group(1)


def using_it_example() -> str:
    return first_block("Using it", "python")


def test_the_using_it_example_runs_as_written():
    torch._dynamo.reset()
    namespace = {}
    exec(compile(using_it_example(), str(README), "exec"), namespace)
    hidden_states, y = namespace["hidden_states"], namespace["y"]
    assert y.shape == hidden_states.shape and y.dtype == torch.bfloat16
    assert torch.isfinite(y.float()).all() and y.abs().sum() > 0
    with torch.inference_mode():
        assert torch.equal(y, namespace["moe"](hidden_states))  # compiled == eager
    x, x_hat = namespace["x"].float(), namespace["x_hat"].float()
    assert torch.linalg.norm(x_hat - x) / torch.linalg.norm(x) < 0.15  # one NVFP4 round trip


def test_ci_runs_the_set_up_commands_verbatim():
    commands = [line.split("  #")[0].strip() for line in first_block("Set up", "bash").splitlines()]
    assert len(commands) == 2 and all(commands)
    ci_lines = [line.strip() for line in (REPOSITORY / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci_lines, command


def test_the_performance_table_is_the_result_file_it_names():
    """The README's DeepSeek-V3 table quotes the benchmark of record it names, cell for cell (median us)."""
    import json

    text = README.read_text()
    section = text[text.index("\n## Performance\n") :]
    stem = re.search(r"benchmarks/results/(moe_\d{8}-\d{6}_[\w-]+)\.md", section).group(1)
    record = json.loads((REPOSITORY / "benchmarks" / "results" / f"{stem}.json").read_text())
    rows = {r["num_tokens"]: r for s in record["shapes"] if s["shape"]["name"] == "deepseek_v3" for r in s["rows"]}
    header = next(line for line in section.splitlines() if line.startswith("| DeepSeek-V3 (E=256"))
    tokens = [int(t) for t in re.findall(r"T=(\d+)", header)]
    implementations = {
        "BF16 `torch._grouped_mm` MoE": "bf16_grouped_mm",
        "fp4moe `fused_moe` W4A16 (`cute_sm90`)": "fused_moe_w4a16",
        "fp4moe `fused_moe` W4A4 per-tensor": "fused_moe_w4a4_tensor",
        "fp4moe `fused_moe` W4A4 per-token": "fused_moe_w4a4_token",
        "fp4moe `aligned_moe_` (NVFP4 hidden, route plan given)": "aligned_moe",
    }

    def quoted(seconds: float) -> str:  # the README's rounding of a median
        us = seconds * 1e6
        return f"{us:,.0f}" if us >= 1000 else f"{us:.0f}" if us >= 100 else f"{us:.1f}"

    for label, implementation in implementations.items():
        line = next(row for row in section.splitlines() if row.startswith(f"| {label} |"))
        cells = [cell.strip().strip("*").split(" (")[0] for cell in line.split("|")[2:-1]]
        expected = [quoted(rows[t]["results"][implementation]["median_s"]) for t in tokens]
        assert cells == expected, f"{label}: README {cells}, {stem}.json {expected}"
