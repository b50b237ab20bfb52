"""The README's "Using it" example, run verbatim: the first contact must work as written."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def using_it_example() -> str:
    """The first fenced Python block under the README's "## Using it" heading."""
    text = README.read_text()
    section = text[text.index("\n## Using it\n") :]
    match = re.search(r"```python\n(.*?)```\n", section, re.DOTALL)
    assert match, "no ```python block under ## Using it"
    return match.group(1)


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
