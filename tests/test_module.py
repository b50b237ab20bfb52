"""`fp4moe.FusedMoE` misused as a new user would: every bad argument is a typed error raised before any
weight is quantized or any op runs, naming the argument the caller passed."""

import math

import numpy as np
import pytest
import torch

import fp4moe
from fp4moe import module

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 32, 2


def dense_experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    w1 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
    return router, w1, w2


PER_TOKEN = dict(quant_mode="w4a4", per_token_activation=True)
DEEPSEEK = dict(routing="deepseek_v3", correction_bias=torch.zeros(EXPERTS), n_group=4, topk_group=2)


def from_dense(router=None, w1=None, w2=None, top_k=TOP_K, **options):
    router_, w1_, w2_ = dense_experts()
    options = {**PER_TOKEN, **options}
    return lambda: fp4moe.FusedMoE.from_dense(
        router_ if router is None else router, w1_ if w1 is None else w1, w2_ if w2 is None else w2, top_k, **options
    )


_R, _W1, _W2 = dense_experts()


def per_tensor(fc1_input_amax=4.0, fc2_input_amax=1.0):
    """Per-tensor W4A4 with calibrated activation maxima (replace one to make it bad)."""
    return from_dense(per_token_activation=False, fc1_input_amax=fc1_input_amax, fc2_input_amax=fc2_input_amax)


AMAX = "fc1_input_amax must be a finite activation maximum > 0"
BAD_FROM_DENSE = [
    # experts
    (TypeError, "w1 must be a Tensor, got list", from_dense(w1=_W1.tolist())),
    (TypeError, "w1 must be a Tensor, got ndarray", from_dense(w1=_W1.numpy())),
    (TypeError, "w2 must have dtype", from_dense(w2=_W2.to(torch.int64))),
    (ValueError, "w2 must have shape", from_dense(w2=_W2[:, :, :16])),
    (ValueError, "activation must be one of", from_dense(activation="gelu")),
    # calibrated maxima
    (TypeError, "fc1_input_amax must be None or a Python float, got str", per_tensor(fc1_input_amax="4.0")),
    (ValueError, AMAX, per_tensor(fc1_input_amax=math.nan)),
    (ValueError, "fc2_input_amax must be a finite activation maximum > 0", per_tensor(fc2_input_amax=math.inf)),
    (ValueError, AMAX, per_tensor(fc1_input_amax=0.0)),
    (ValueError, AMAX, per_tensor(fc1_input_amax=-2.0)),
    (ValueError, "whose global scale 2688 / amax is finite in FP32", per_tensor(fc1_input_amax=1e-40)),
    (ValueError, "per-tensor w4a4 needs the calibrated activation maximum fc2_input_amax",
     per_tensor(fc2_input_amax=None)),
    (ValueError, "fc1_input_amax is only used by per-tensor w4a4", from_dense(fc1_input_amax=4.0)),
    # the router and the routing
    (ValueError, r"router_weight has 7 rows \(one per expert\), but the expert weights are experts \[0, 8\)",
     from_dense(router=_R[:-1])),
    (ValueError, r"router_weight must be \[E, H = 64\]", from_dense(router=_R[:, :32])),
    (TypeError, "router_weight must have a floating-point dtype", from_dense(router=_R.to(torch.int32))),
    (TypeError, "router_weight must be a Tensor, got ndarray", from_dense(router=_R.numpy())),
    (ValueError, "routed_scaling_factor applies only to routing='deepseek_v3', got routing='softmax'",
     from_dense(routed_scaling_factor=2.5)),
    (ValueError, "correction_bias, n_group apply only to routing='deepseek_v3'",
     from_dense(correction_bias=torch.zeros(EXPERTS), n_group=4)),
    (ValueError, "routing='deepseek_v3' needs n_group, topk_group",
     from_dense(routing="deepseek_v3", correction_bias=torch.zeros(EXPERTS))),
    (ValueError, r"each group needs at least 2 experts, got E / n_group = 8 / 8", from_dense(**{**DEEPSEEK, "n_group": 8})),
    (ValueError, r"correction_bias must have shape \(8,\)", from_dense(**{**DEEPSEEK, "correction_bias": torch.zeros(7)})),
    (TypeError, "correction_bias must be a Tensor, got list", from_dense(**{**DEEPSEEK, "correction_bias": [0.0] * 8})),
    (ValueError, r"top_k must be in \[1, E = 8\]", from_dense(top_k=9)),
    (ValueError, "routing must be one of", from_dense(routing="sigmoid")),
    # Python types: a TypeError here, not the dispatcher's bare RuntimeError at the first forward
    (TypeError, "top_k must be a Python int, got str '2'", from_dense(top_k="2")),
    (TypeError, "top_k must be a Python int, got bool", from_dense(top_k=True)),
    (TypeError, "n_group must be None or a Python int, got float", from_dense(**{**DEEPSEEK, "n_group": 4.0})),
    (TypeError, "routed_scaling_factor must be None or a Python float, got str",
     from_dense(**DEEPSEEK, routed_scaling_factor="2.5")),
    (TypeError, "quant_mode must be a Python str, got int", from_dense(quant_mode=4)),
    (TypeError, "per_token_activation must be a Python bool, got str", from_dense(per_token_activation="yes")),
    (TypeError, "swiglu_limit must be None or a Python float, got str", from_dense(swiglu_limit="7")),
    (TypeError, "renormalize must be a Python bool, got int", from_dense(renormalize=1)),
    (TypeError, "unexpected keyword arguments n_groups", from_dense(n_groups=4)),
    (ValueError, "quant_mode must be one of", from_dense(quant_mode="w8a8")),
    # the options fused_moe takes from the block
    (ValueError, "swiglu_limit must be > 0", from_dense(swiglu_limit=-1.0)),
    (ValueError, "swiglu_alpha must be finite", from_dense(swiglu_alpha=math.nan)),
    (ValueError, "swiglu_alpha applies only to activation='swiglu', got activation='relu2'",
     from_dense(w1=_W1[:, :INTERMEDIATE], activation="relu2", swiglu_alpha=1.0)),
    (ValueError, "local_expert_offset must be in", from_dense(local_expert_offset=-1)),
    (ValueError, "per_token_activation applies to quant_mode='w4a4' only", from_dense(quant_mode="w4a16")),
    (ValueError, "weight_layout must be one of", from_dense(weight_layout="bogus")),
]


@pytest.mark.parametrize("error,match,call", BAD_FROM_DENSE, ids=[m[:60] for _, m, _ in BAD_FROM_DENSE])
def test_from_dense_refuses_bad_arguments_before_quantizing(error, match, call, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("quantized the experts before the arguments were checked")

    monkeypatch.setattr(module, "quantize_moe_weights", no_work)
    with pytest.raises(error, match=match):
        call()


WEIGHTS = fp4moe.quantize_moe_weights(_W1, _W2)


def construct(router=_R, weights=WEIGHTS, **options):
    return lambda: fp4moe.FusedMoE(router, weights, TOP_K, **options)


BAD_CONSTRUCTOR_CALLS = [
    (TypeError, "weights must be MoEWeights", construct(weights={"w1": WEIGHTS.w1})),
    (ValueError, r"fc1_input_scale \(the encode-direction global scale\) is required for per-tensor w4a4", construct()),
    (ValueError, r"fc2_input_scale must hold one element \(per tensor\) or have shape \[E = ",
     construct(fc1_input_scale=torch.ones(1), fc2_input_scale=torch.ones(EXPERTS + 1))),
    (ValueError, r"fc1_input_scale must hold exactly one element \(the per-tensor activation scale",
     construct(fc1_input_scale=torch.ones(EXPERTS), fc2_input_scale=torch.ones(1))),
    (ValueError, "fc1_input_scale is only used by per-tensor w4a4",
     construct(quant_mode="w4a16", fc1_input_scale=torch.ones(1))),
    (ValueError, "swiglu_limit must be > 0", construct(**PER_TOKEN, swiglu_limit=-1.0)),
    (ValueError, "local_expert_offset must be in", construct(**PER_TOKEN, local_expert_offset=-1)),
    (ValueError, r"router_weight has 8 rows .* experts \[4, 12\)", construct(**PER_TOKEN, local_expert_offset=4)),
    (ValueError, "router_weight is on meta but w1 is on cpu", construct(router=_R.to("meta"), **PER_TOKEN)),
    (TypeError, "weight_layout must be a Python str, got int", construct(**PER_TOKEN, weight_layout=1)),
    (ValueError, "correction_bias is on meta, the expert weights on cpu: build the module on one device",
     construct(router=None, **PER_TOKEN, **{**DEEPSEEK, "correction_bias": torch.zeros(EXPERTS, device="meta")})),
    (ValueError, "correction_bias is on meta, router_weight on cpu",
     construct(**PER_TOKEN, **{**DEEPSEEK, "correction_bias": torch.zeros(EXPERTS, device="meta")})),
]


@pytest.mark.parametrize("error,match,call", BAD_CONSTRUCTOR_CALLS, ids=[m[:50] for _, m, _ in BAD_CONSTRUCTOR_CALLS])
def test_the_constructor_refuses_bad_arguments(error, match, call):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("options", [
    dict(swiglu_limit=-1.0), dict(swiglu_beta=math.inf), dict(local_expert_offset=-1), dict(quant_mode="w4a16"),
    dict(weight_layout="bogus"),
], ids=str)
def test_the_constructor_refuses_bad_options_before_preparing_the_weights(options, monkeypatch):
    def no_work(self):
        raise AssertionError("prepared the experts before the options were checked")

    monkeypatch.setattr(fp4moe.MoEWeights, "prepared", no_work)
    with pytest.raises(ValueError):
        fp4moe.FusedMoE(_R, WEIGHTS, TOP_K, **{**PER_TOKEN, **options})


def test_forward_refuses_inputs_it_would_silently_cast():
    moe = fp4moe.FusedMoE(_R, WEIGHTS, TOP_K, **PER_TOKEN)
    tokens = torch.randn(3, HIDDEN)
    with pytest.raises(TypeError, match="hidden_states must have dtype"):
        moe(tokens.to(torch.int64))
    with pytest.raises(ValueError, match=r"hidden_states must be \[\.\.\., H = 64\], got \(3, 32\)"):
        moe(tokens[:, :32])
    with pytest.raises(TypeError, match="hidden_states must be a Tensor, got ndarray"):
        moe(np.zeros((3, HIDDEN), dtype=np.float32))
    # float32 and float16 hidden states are rounded to bf16 like the module's own computation
    assert torch.equal(moe(tokens), moe(tokens.to(torch.bfloat16)))


def test_forward_checks_the_router_logits_it_is_given():
    moe = fp4moe.FusedMoE(None, WEIGHTS, TOP_K, **PER_TOKEN)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(2, 3, EXPERTS, generator=g)
    out = moe(x, logits)
    assert out.shape == x.shape and out.abs().sum() > 0
    # flattened over the tokens, as transformers' routers return them: the same tokens, the same result
    assert torch.equal(moe(x, logits.reshape(6, EXPERTS)), out)
    with pytest.raises(ValueError, match=r"router_logits must be \[\.\.\., E\] with hidden_states' leading dimensions \(2, 3\)"):
        moe(x, logits.transpose(0, 1))  # other tokens' logits
    with pytest.raises(ValueError, match=r"got \(3, 16\)"):
        moe(x, logits.reshape(3, 2 * EXPERTS))
    with pytest.raises(TypeError, match="router_logits must have a floating-point dtype, got torch.int64"):
        moe(x, logits.to(torch.int64))
    with pytest.raises(TypeError, match="router_logits must be a Tensor, got list"):
        moe(x, logits.tolist())
    with pytest.raises(ValueError, match=r"router_logits has 4 experts, but this block holds experts \[0, 8\)"):
        moe(x, logits[..., :4])
    empty = moe(x[:0], logits[:0])
    assert empty.shape == (0, 3, HIDDEN)


def test_without_a_router_of_its_own_the_routers_expert_count_comes_with_the_logits():
    # Expert parallelism without a router module: this block holds experts [0, 8) of 32, top-9 over them
    # (more than the block holds, which only the logits' expert count can refuse).
    moe = fp4moe.FusedMoE(None, WEIGHTS, 9, **PER_TOKEN)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, HIDDEN, generator=g).to(torch.bfloat16)
    out = moe(x, torch.randn(5, 32, generator=g))
    assert out.shape == x.shape
    with pytest.raises(ValueError, match="top_k"):
        moe(x, torch.randn(5, EXPERTS, generator=g))
    deepseek = fp4moe.FusedMoE(None, WEIGHTS, 4, **PER_TOKEN, **{**DEEPSEEK, "correction_bias": torch.zeros(32)})
    assert deepseek(x, torch.randn(5, 32, generator=g)).shape == x.shape
    # on the meta device (the weights there too) it builds and its checks follow the weights' device
    meta = fp4moe.quantize_moe_weights(_W1.to("meta"), _W2.to("meta"))
    fp4moe.FusedMoE(None, meta, TOP_K, **PER_TOKEN, **{**DEEPSEEK, "correction_bias": torch.zeros(EXPERTS, device="meta")})


def test_parameters_are_taken_as_their_values():
    # A model's own router and expert weights are nn.Parameters that require grad: the block keeps
    # detached buffers, runs with grad mode on and deep-copies.
    import copy

    router = torch.nn.Parameter(_R.clone())
    moe = fp4moe.FusedMoE.from_dense(router, torch.nn.Parameter(_W1.clone()), _W2, TOP_K, **PER_TOKEN)
    reference = fp4moe.FusedMoE.from_dense(_R, _W1, _W2, TOP_K, **PER_TOKEN)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    assert not moe.router_weight.requires_grad
    assert torch.equal(moe(x), reference(x))
    assert torch.equal(copy.deepcopy(moe)(x), reference(x))


def test_inputs_that_require_grad_are_refused_by_name():
    # The block is inference-only: an input that requires grad (grad mode on) is named in the error, not
    # the routing op it would first reach; under no_grad the same call runs.
    moe = fp4moe.FusedMoE.from_dense(_R, _W1, _W2, TOP_K, **PER_TOKEN)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16).requires_grad_()
    with pytest.raises(NotImplementedError, match="hidden_states requires grad"):
        moe(x)
    logits = torch.randn(3, EXPERTS, requires_grad=True)
    with pytest.raises(NotImplementedError, match="router_logits requires grad"):
        moe(x.detach(), logits)
    with torch.no_grad():
        assert torch.equal(moe(x), moe(x.detach())) and torch.equal(moe(x, logits), moe(x.detach(), logits.detach()))


def test_expert_parallel_router_and_routing_defaults():
    # A router over 16 global experts, this rank holding experts [8, 16); DeepSeek-V3 routing with the
    # default routed_scaling_factor (1.0), which equals passing 1.0.
    g = torch.Generator().manual_seed(5)
    router = torch.randn(16, HIDDEN, generator=g)
    options = dict(**PER_TOKEN, routing="deepseek_v3", correction_bias=torch.zeros(16), n_group=4, topk_group=2,
                   local_expert_offset=8)
    default = fp4moe.FusedMoE(router, WEIGHTS, 4, **options)
    explicit = fp4moe.FusedMoE(router, WEIGHTS, 4, **options, routed_scaling_factor=1.0)
    x = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16)
    out = default(x)
    assert torch.equal(out, explicit(x)) and out.abs().sum() > 0
