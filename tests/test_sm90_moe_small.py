"""The compute-sanitizer case (`benchmarks.sm90_moe_small`), its calls checked on the CPU's reference backend:
the sanitizers run it on a GPU, where a wrong argument would cost a lease to find."""

import dataclasses

import pytest
import torch

from benchmarks import sm90_moe_small as small
from benchmarks.moe_cases import SHAPES, random_moe_weights


@pytest.fixture
def no_cuda_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


@pytest.fixture
def tiny_shape(monkeypatch):
    """A tiny Qwen-style layer (16 experts, top-4) among the shapes, as "tiny"."""
    tiny = dataclasses.replace(
        SHAPES["qwen3_30b_a3b"], name="tiny", num_experts=16, top_k=4, hidden_size=256, intermediate_size=128
    )
    monkeypatch.setitem(small.SHAPES, "tiny", tiny)


def test_the_shapes_mode_calls_every_mode_both_finalizes_and_the_aligned_moe(tiny_shape, capsys, no_cuda_sync):
    """The tiny layer at T = 1 (rescan path) and 4 (aux-amax path): one line per call, the finalizes
    agreeing."""
    assert small.run_shapes(["tiny"], (1, 4), device="cpu") == 0
    lines = capsys.readouterr().out.splitlines()
    calls = [line.split()[:4] for line in lines]
    expected = [
        ["tiny", mode, str(tokens), str(deterministic)]
        for tokens in (1, 4) for mode in ("w4a4_tensor", "w4a4_token", "w4a16") for deterministic in (False, True)
    ]
    assert [c for c in calls if c[1] != "aligned"] == expected
    assert [c for c in calls if c[1] == "aligned"] == [["tiny", "aligned", "1", "8"], ["tiny", "aligned", "4", "8"]]
    assert all(float(line.split()[-1]) > 0 for line in lines)  # every output holds a contribution


def test_the_aligned_moe_agrees_across_its_block_sizes(capsys, no_cuda_sync):
    g = torch.Generator().manual_seed(1)
    weights = random_moe_weights(small.EXPERTS, small.HIDDEN, small.INTERMEDIATE, g, "cpu").prepared()
    x = torch.randn(5, small.HIDDEN, generator=g).to(torch.bfloat16)
    topk_ids, topk_weights = torch.ops.fp4moe.route_softmax_topk(
        torch.randn(5, small.EXPERTS, generator=g), small.TOP_K, True
    )
    assert small.aligned_outputs_agree(torch.ops.fp4moe, weights, x, topk_ids, topk_weights)
    norms = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [n[:3] for n in norms] == [["aligned", "5", str(b)] for b in small.ALIGNED_BLOCKS]
    assert float(norms[0][3]) > 0


def test_the_shapes_mode_with_experts_prepared_on_the_cpu_prints_the_same_calls(tiny_shape, capsys, no_cuda_sync):
    assert small.run_shapes(["tiny"], (1,), device="cpu") == 0
    directly = capsys.readouterr()
    assert small.run_shapes(["tiny"], (1,), device="cpu", prepare_on_cpu=True) == 0
    on_the_cpu = capsys.readouterr()
    assert on_the_cpu.out == directly.out and len(directly.out.splitlines()) == 7
    assert "preparing tiny's 16 experts on the CPU" in on_the_cpu.err


@pytest.mark.parametrize("argv", [["--shapes", "no_such_shape"], ["--tokens", "1"], ["--prepare-on-cpu"]])
def test_bad_arguments_are_refused(argv):
    """An unknown shape; token counts or CPU preparation without the shapes mode (the small case has its own)."""
    with pytest.raises(SystemExit):
        small.main(argv)
