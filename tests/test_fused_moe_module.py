"""`FusedMoE` as a drop-in block: an outside router's logits, the input's dtype, and `.to(dtype)`
leaving the contract buffers (uint8 codes, E4M3 scales, FP32 alphas and scales) as they are."""

import copy

import pytest
import torch

import fp4moe
from tests.compare import assert_bitwise_equal
from tests.moe_problems import assert_moe_close, loop_reference, make_problem

ops = torch.ops.fp4moe
HIDDEN, INTERMEDIATE, EXPERTS = 64, 32, 8


def _dense(seed):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    w1 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / 8
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / 6
    return router, w1, w2, g


def test_router_logits_from_outside_route_like_the_own_router():
    router, w1, w2, g = _dense(1)
    weights = fp4moe.quantize_moe_weights(w1, w2)
    bias = torch.randn(EXPERTS, generator=g) * 0.1
    options = dict(routing="deepseek_v3", correction_bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   quant_mode="w4a16")
    own = fp4moe.FusedMoE(router, weights, 2, **options)
    outside = fp4moe.FusedMoE(None, weights, 2, **options)
    assert "router_weight" not in outside.state_dict()
    x = torch.randn(3, 5, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.nn.functional.linear(x, router.to(torch.bfloat16)).float()  # what `own` computes
    out = outside(x, logits)
    assert_bitwise_equal(out, own(x))
    flat = x.reshape(-1, HIDDEN)
    problem = make_problem(tokens=15, num_experts=EXPERTS, mode="w4a16")
    problem.x, problem.weights = flat, weights
    problem.topk_ids, problem.topk_weights = ops.route_deepseek_v3(logits.reshape(15, -1), bias, 2, 4, 2, 2.5)
    assert_moe_close(out.reshape(-1, HIDDEN), loop_reference(problem))
    with pytest.raises(ValueError, match="no router"):
        outside(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_has_the_input_dtype(dtype):
    router, w1, w2, g = _dense(2)
    block = fp4moe.FusedMoE.from_dense(router, w1, w2, 2, quant_mode="w4a16")
    x = torch.randn(7, HIDDEN, generator=g).to(dtype)
    out = block(x)
    assert out.dtype == dtype
    # The experts and the bf16 router run on bf16 activations: the result is the bf16 block's, converted once.
    assert_bitwise_equal(out, block(x.to(torch.bfloat16)).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_conversion_keeps_the_contract_buffers(dtype):
    router, w1, w2, g = _dense(3)
    block = fp4moe.FusedMoE.from_dense(
        router, w1, w2, 2, routing="deepseek_v3", correction_bias=torch.randn(EXPERTS, generator=g), n_group=2,
        topk_group=1, fc1_input_amax=3.0, fc2_input_amax=1.5,
    )
    unconverted = copy.deepcopy(block)
    block.to(dtype)
    for name in block.FIXED_DTYPE_BUFFERS:
        assert_bitwise_equal(getattr(block, name), getattr(unconverted, name), name)
    # The router is the caller's precision choice: it follows the module, and its logits drive the same
    # experts as before the conversion.
    assert block.router_weight.dtype == dtype
    x = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.nn.functional.linear(x.to(dtype), block.router_weight).float()
    assert_bitwise_equal(block(x), unconverted(x, logits))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", [dict(quant_mode="w4a16"), dict(fc1_input_amax=12.0, fc2_input_amax=8.0), dict(per_token_activation=True)],
    ids=["w4a16", "w4a4", "w4a4_per_token"],
)
def test_the_block_on_a_gpu_serves_eager_compiled_and_graph_replayed_calls_alike(mode):
    """A block built on the CPU and moved to the GPU (its prepared weights travel as they are) gives, for
    the same router logits, the CPU block's output up to FP32 summation order; `torch.compile(fullgraph=True)`
    and a CUDA graph replayed on fresh hidden states give the eager GPU call's output bitwise (deterministic
    finalize)."""
    hidden, intermediate, experts = 256, 128, 16
    g = torch.Generator().manual_seed(40)
    router = torch.randn(experts, hidden, generator=g)
    w1 = torch.randn(experts, 2 * intermediate, hidden, generator=g) / 16
    w2 = torch.randn(experts, hidden, intermediate, generator=g) / 11
    options = dict(routing="deepseek_v3", correction_bias=torch.randn(experts, generator=g) * 0.1, n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, deterministic=True, **mode)
    cpu_block = fp4moe.FusedMoE.from_dense(router, w1, w2, 4, **options)
    block = copy.deepcopy(cpu_block).to("cuda")
    xs = [(torch.randn(3, 11, hidden, generator=g) * torch.rand(3, 11, 1, generator=g) * 4).to(torch.bfloat16).cuda()
          for _ in range(2)]

    eager = [block(x) for x in xs]
    for x, out in zip(xs, eager):
        logits = torch.nn.functional.linear(x, block.router_weight).float()
        assert_bitwise_equal(block(x, logits), out)
        assert_moe_close(out.cpu().reshape(-1, hidden), cpu_block(x.cpu(), logits.cpu()).reshape(-1, hidden))

    compiled = torch.compile(block, fullgraph=True)
    for x, out in zip(xs, eager):
        assert_bitwise_equal(compiled(x), out)

    static = xs[0].clone()
    block(static)  # compiles and loads every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = block(static)
    for x, out in zip(reversed(xs), reversed(eager)):
        replayed.fill_(float("nan"))
        static.copy_(x)
        graph.replay()
        assert_bitwise_equal(replayed, out)


def test_experts_with_untied_gate_up_scales_serve_per_half_alphas():
    """`MoEWeights` with `w1_global_scale` [2, E] (a checkpoint whose gate and up halves keep their own):
    the block passes `w1_alpha` [2, E] on, and gives the loop reference's result for its routing."""
    problem = make_problem(tokens=9, num_experts=EXPERTS, hidden=HIDDEN, intermediate=INTERMEDIATE, mode="w4a4",
                           seed=4, per_half_w1_alpha=True)
    block = fp4moe.FusedMoE(None, problem.weights, 2, quant_mode="w4a4", fc1_input_scale=problem.fc1_input_scale,
                            fc2_input_scale=problem.fc2_input_scale)
    assert block.w1_alpha.shape == (2, EXPERTS)
    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(5))
    out = block(problem.x, logits)
    problem.topk_ids, problem.topk_weights = ops.route_softmax_topk(logits, 2, True)
    assert_moe_close(out, loop_reference(problem))
