"""The README as a new user reads it: the "Using it" example runs verbatim, and CI runs the "Set up"
commands verbatim."""

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
