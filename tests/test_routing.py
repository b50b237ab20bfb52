"""The routing ops against a per-token plain-Python reference, opcheck, bad input, torch.compile and
CUDA graphs.

The Python reference starts from the FP32 scores (torch's softmax / sigmoid of the logits on the same
device) and re-does everything after them — grouping, selection with ties to the lower id, the
slot-order FP32 sum, the division and the scaling — one token at a time with FP32 rounding emulated,
so the op must match it bit for bit.
"""

import struct

import pytest
import torch
import torch._dynamo.testing

import fp4moe
from fp4moe import dispatch
from tests.compare import assert_bitwise_equal
from tests.devices import DEVICES
from tests.hopper import poisoned, skip_without_hopper

ops = torch.ops.fp4moe
LOGIT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SOFTMAX_CONFIGS = [(4, 4), (8, 2), (64, 6), (256, 8)]
"""(E, top_k): top_k == E, a small one, DeepSeek-V2-Lite's and DeepSeek-V3's."""
DEEPSEEK_V3 = dict(experts=256, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
DEEPSEEK_CONFIGS = [
    DEEPSEEK_V3,
    dict(experts=16, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=1.0),
    dict(experts=64, top_k=6, n_group=8, topk_group=3, routed_scaling_factor=1.5),
    dict(experts=8, top_k=8, n_group=4, topk_group=4, routed_scaling_factor=0.7),  # every expert chosen
    dict(experts=20, top_k=3, n_group=10, topk_group=2, routed_scaling_factor=1.3),  # groups of two experts
    dict(experts=32, top_k=5, n_group=1, topk_group=1, routed_scaling_factor=1.0),  # one group: plain biased top-k
]


def f32(value: float) -> float:
    """Round a Python float to the nearest FP32 value. A single +, -, * or / of two FP32 values done
    in double and then rounded this way is the correctly rounded FP32 result."""
    return struct.unpack("f", struct.pack("f", value))[0]


def ranked(values, candidates):
    """`candidates` by descending value, equal values by ascending id."""
    return sorted(candidates, key=lambda i: (-values[i], i))


def finish_weights(weights, renormalize, factor=1.0):
    if renormalize:
        total = 0.0
        for w in weights:
            total = f32(total + w)
        weights = [f32(w / total) for w in weights]
    return [f32(w * f32(factor)) for w in weights]


def python_softmax_topk(probabilities, top_k, renormalize):
    chosen = ranked(probabilities, range(len(probabilities)))[:top_k]
    return chosen, finish_weights([probabilities[e] for e in chosen], renormalize)


def python_deepseek_v3(scores, bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    group_size = len(scores) // n_group
    biased = [f32(s + b) for s, b in zip(scores, bias)]
    group_scores = []
    for g in range(n_group):
        first, second = sorted(biased[g * group_size : (g + 1) * group_size], reverse=True)[:2]
        group_scores.append(f32(first + second))
    kept = set(ranked(group_scores, range(n_group))[:topk_group])
    candidates = [e for e in range(len(scores)) if e // group_size in kept]
    chosen = ranked(biased, candidates)[:top_k]
    return chosen, finish_weights([scores[e] for e in chosen], renormalize, routed_scaling_factor)


def per_token(reference, scores, *args):
    """Run a per-token Python reference over FP32 scores [T, E]; returns int32 ids and fp32 weights."""
    top_k = args[0]
    ids, weights = [], []
    for row in scores.cpu().tolist():
        row_ids, row_weights = reference(row, *args)
        ids.append(row_ids)
        weights.append(row_weights)
    shape = (scores.shape[0], top_k)
    return (
        torch.tensor(ids, dtype=torch.int32).reshape(shape),
        torch.tensor(weights, dtype=torch.float32).reshape(shape),
    )


def expected_softmax_topk(logits, top_k, renormalize):
    probabilities = logits.contiguous().float().softmax(dim=-1)
    return per_token(python_softmax_topk, probabilities, top_k, renormalize)


def expected_deepseek_v3(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    scores = logits.contiguous().float().sigmoid()
    bias_row = bias.float().cpu().tolist()

    def reference(row, *args):
        return python_deepseek_v3(row, bias_row, *args)

    return per_token(reference, scores, top_k, n_group, topk_group, routed_scaling_factor, renormalize)


def assert_routing_equal(actual, expected, what=""):
    ids, weights = actual
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32, what
    assert torch.equal(ids.cpu(), expected[0]), f"{what}: ids differ\n{ids}\nvs\n{expected[0]}"
    assert_bitwise_equal(weights.cpu(), expected[1], f"{what}: weights")


def random_logits(tokens, experts, dtype, device, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g) * scale).to(dtype=dtype, device=device)


def tied_logits(tokens, experts, dtype, device, seed):
    """Logits from five integer values: most experts share their score with others."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (tokens, experts), generator=g).to(dtype=dtype, device=device)


def random_bias(experts, dtype, device, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed + 1000)
    return (torch.randn(experts, generator=g) * scale).to(dtype=dtype, device=device)


def deepseek_config_id(config):
    return "E{experts}-k{top_k}-g{n_group}-kg{topk_group}".format(**config)


def deepseek_args(config):
    return config["top_k"], config["n_group"], config["topk_group"], config["routed_scaling_factor"]


# --- numbers against the Python reference -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize(("experts", "top_k"), SOFTMAX_CONFIGS)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_softmax_topk_matches_python(device, dtype, experts, top_k, renormalize, tokens):
    logits = random_logits(tokens, experts, dtype, device, seed=experts + top_k + tokens)
    actual = ops.route_softmax_topk(logits, top_k, renormalize)
    assert actual[0].device == logits.device and actual[1].device == logits.device
    assert_routing_equal(actual, expected_softmax_topk(logits, top_k, renormalize))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize(("experts", "top_k"), SOFTMAX_CONFIGS)
def test_softmax_topk_ties_go_to_lower_ids(device, dtype, experts, top_k):
    logits = tied_logits(29, experts, dtype, device, seed=experts)
    for renormalize in (False, True):
        actual = ops.route_softmax_topk(logits, top_k, renormalize)
        assert_routing_equal(actual, expected_softmax_topk(logits, top_k, renormalize), f"renormalize={renormalize}")
    ids, weights = ops.route_softmax_topk(torch.full((3, experts), 0.25, dtype=dtype, device=device), top_k, True)
    assert ids.cpu().tolist() == [list(range(top_k))] * 3
    assert weights.cpu().tolist() == [[f32(1 / top_k)] * top_k] * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("config", DEEPSEEK_CONFIGS, ids=deepseek_config_id)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_deepseek_v3_matches_python(device, dtype, config, renormalize, tokens):
    experts = config["experts"]
    logits = random_logits(tokens, experts, dtype, device, seed=experts + tokens)
    args = deepseek_args(config)
    for bias_dtype in dict.fromkeys((torch.float32, dtype)):
        bias = random_bias(experts, bias_dtype, device, seed=experts)
        actual = ops.route_deepseek_v3(logits, bias, *args, renormalize)
        expected = expected_deepseek_v3(logits, bias, *args, renormalize)
        assert_routing_equal(actual, expected, f"bias {bias_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", DEEPSEEK_CONFIGS, ids=deepseek_config_id)
def test_deepseek_v3_ties_go_to_lower_ids(device, config):
    """Integer logits and a zero bias tie groups and experts; all-equal logits keep the first groups."""
    experts, top_k, n_group, topk_group, factor = config["experts"], *deepseek_args(config)
    bias = torch.zeros(experts, device=device)
    logits = tied_logits(31, experts, torch.bfloat16, device, seed=experts)
    for renormalize in (True, False):
        actual = ops.route_deepseek_v3(logits, bias, top_k, n_group, topk_group, factor, renormalize)
        expected = expected_deepseek_v3(logits, bias, top_k, n_group, topk_group, factor, renormalize)
        assert_routing_equal(actual, expected, f"renormalize={renormalize}")
    equal = torch.full((2, experts), 0.5, device=device)
    ids, _ = ops.route_deepseek_v3(equal, bias, top_k, n_group, topk_group, factor)
    assert ids.cpu().tolist() == [list(range(top_k))] * 2


@pytest.mark.parametrize("device", DEVICES)
def test_deepseek_v3_never_picks_dropped_groups(device):
    """With a large negative bias every biased score is negative; experts of dropped groups still lose
    (a 0.0 fill of the dropped scores, as in HF's modeling code, would pick them)."""
    experts, top_k, n_group, topk_group = 64, 8, 8, 2
    logits = random_logits(23, experts, torch.float32, device, seed=5)
    bias = random_bias(experts, torch.float32, device, seed=5) - 3.0
    actual = ops.route_deepseek_v3(logits, bias, top_k, n_group, topk_group, 2.5)
    groups = (actual[0] // (experts // n_group)).cpu()
    assert all(len(set(row)) <= topk_group for row in groups.tolist())
    assert_routing_equal(actual, expected_deepseek_v3(logits, bias, top_k, n_group, topk_group, 2.5, True))


@pytest.mark.parametrize("device", DEVICES)
def test_deepseek_v3_renormalized_weights_sum_to_the_scaling_factor(device):
    logits = random_logits(64, 256, torch.bfloat16, device, seed=11)
    bias = random_bias(256, torch.float32, device, seed=11)
    _, weights = ops.route_deepseek_v3(logits, bias, *deepseek_args(DEEPSEEK_V3))
    torch.testing.assert_close(weights.sum(dim=1), torch.full((64,), 2.5, device=device), rtol=4e-7, atol=0)
    assert (weights > 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_logits_rank_first(device):
    """Documented: NaN ranks above every number (torch.sort's order)."""
    logits = torch.randn(2, 16)
    logits[0, 9] = float("nan")
    logits = logits.to(device)
    ids, weights = ops.route_softmax_topk(logits, 3, True)
    assert weights[0].isnan().all() and not weights[1].isnan().any()
    ids, weights = ops.route_deepseek_v3(logits, torch.zeros(16, device=device), 3, 4, 2, 1.0, False)
    assert ids[0, 0] == 9 and weights[0, 0].isnan() and not weights[0, 1:].isnan().any()


def special_logits(device):
    """DeepSeek-V3-style logits (E = 64 in 8 groups) with NaNs (several per row, so NaN groups and
    experts tie), +-inf logits, and a bias with +-inf entries."""
    logits = random_logits(5, 64, torch.float32, device, seed=13)
    logits[0, [41, 3, 40]] = float("nan")
    logits[1, [5, 6]] = float("inf")
    logits[2, :] = float("-inf")
    logits[3, ::7] = float("nan")
    bias = random_bias(64, torch.float32, device, seed=13)
    bias[17] = float("inf")
    bias[50] = float("-inf")
    return logits, bias


@pytest.mark.parametrize("device", DEVICES)
def test_deepseek_v3_orders_nans_and_infinities_as_torch_sort(device):
    logits, bias = special_logits(device)
    ids, weights = ops.route_deepseek_v3(logits, bias, 8, 8, 3, 2.5)
    assert ids[0, :3].tolist() == [3, 40, 41], "NaN experts first, equal NaNs by ascending id"
    assert weights[0].isnan().all(), "a NaN weight makes the renormalized row NaN"
    assert ids[2, 0] == 17 and 50 not in ids[2].tolist(), "all-(-inf) logits: the bias alone ranks"


# --- the Hopper kernel (fp4moe.kernels.sm90.routing) -------------------------------------------
KERNEL_CONFIGS = [
    DEEPSEEK_V3,
    dict(experts=160, top_k=8, n_group=1, topk_group=1, routed_scaling_factor=2.5),  # GLM-4.5: one group
    dict(experts=384, top_k=8, n_group=1, topk_group=1, routed_scaling_factor=2.827),  # Kimi-K2-like
    dict(experts=72, top_k=6, n_group=9, topk_group=3, routed_scaling_factor=1 / 3),  # experts on part of the lanes
    dict(experts=512, top_k=32, n_group=32, topk_group=8, routed_scaling_factor=1.0),  # the kernel's largest
]


@pytest.fixture
def hopper():
    skip_without_hopper()


@pytest.mark.gpu
@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=deepseek_config_id)
@pytest.mark.parametrize("tokens", [1, 3, 17, 1000, 4099])
def test_the_hopper_kernel_is_bitwise_the_reference(hopper, monkeypatch, config, tokens):
    """On Hopper `route_deepseek_v3` runs its kernel (the reference's own function is never called): ids
    and weights bit for bit the reference's on the same GPU, for every logits dtype and both bias dtypes,
    renormalized or not, into poisoned allocations; at small T also the Python reference's."""
    from fp4moe.reference import routing as reference

    assert fp4moe.routing_backend("route_deepseek_v3", "cuda") == dispatch.CUTE_SM90_BACKEND
    experts, args = config["experts"], deepseek_args(config)
    for seed, dtype in enumerate(LOGIT_DTYPES):
        logits = random_logits(tokens, experts, dtype, "cuda", seed=seed)
        for bias_dtype in {torch.float32, dtype}:
            bias = random_bias(experts, bias_dtype, "cuda", seed=seed)
            for renormalize in (True, False):
                expected = reference.route_deepseek_v3(logits, bias, *args, renormalize)
                with monkeypatch.context() as patched:
                    patched.setattr(reference, "route_deepseek_v3", None)  # calling it would raise
                    poisoned([torch.empty(tokens, config["top_k"], dtype=torch.float32, device="cuda") for _ in range(4)])
                    actual = ops.route_deepseek_v3(logits, bias, *args, renormalize)
                what = f"{dtype} logits, {bias_dtype} bias, renormalize={renormalize}"
                assert_routing_equal(actual, tuple(t.cpu() for t in expected), what)
                if tokens <= 17:
                    assert_routing_equal(actual, expected_deepseek_v3(logits, bias, *args, renormalize), what)


SOFTMAX_KERNEL_CONFIGS = [(128, 8), (60, 4), (8, 2), (1, 1), (512, 32), (256, 8)]
"""(E, top_k): Qwen3-MoE's; a row padded to 64; rows narrower than a warp; the kernel's largest; 256."""


@pytest.mark.gpu
@pytest.mark.parametrize(("experts", "top_k"), SOFTMAX_KERNEL_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3, 17, 1000, 4099])
def test_the_hopper_softmax_kernel_is_bitwise_the_reference(hopper, monkeypatch, experts, top_k, tokens):
    """On Hopper `route_softmax_topk` runs its kernel (the reference's own function is never called): ids
    and weights bit for bit the reference's (torch.softmax on the same GPU, then the exact rules), for
    every logits dtype, renormalized or not, into poisoned allocations; at small T also the Python
    reference's."""
    from fp4moe.reference import routing as reference

    assert fp4moe.routing_backend("route_softmax_topk", "cuda") == dispatch.CUTE_SM90_BACKEND
    for seed, dtype in enumerate(LOGIT_DTYPES):
        logits = random_logits(tokens, experts, dtype, "cuda", seed=seed, scale=4.0)
        for renormalize in (True, False):
            expected = reference.route_softmax_topk(logits, top_k, renormalize)
            with monkeypatch.context() as patched:
                patched.setattr(reference, "route_softmax_topk", None)  # calling it would raise
                poisoned([torch.empty(tokens, top_k, dtype=torch.float32, device="cuda") for _ in range(4)])
                actual = ops.route_softmax_topk(logits, top_k, renormalize)
            what = f"{dtype} logits, renormalize={renormalize}"
            assert_routing_equal(actual, tuple(t.cpu() for t in expected), what)
            if tokens <= 17:
                assert_routing_equal(actual, expected_softmax_topk(logits, top_k, renormalize), what)


@pytest.mark.gpu
def test_the_hopper_kernels_order_nans_and_infinities_as_the_reference(hopper):
    from fp4moe.reference import routing as reference

    logits, bias = special_logits("cuda")
    for renormalize in (True, False):
        actual = ops.route_deepseek_v3(logits, bias, 8, 8, 3, 2.5, renormalize)
        expected = reference.route_deepseek_v3(logits, bias, 8, 8, 3, 2.5, renormalize)
        assert_routing_equal(actual, tuple(t.cpu() for t in expected), f"deepseek_v3, renormalize={renormalize}")
        for rows in (logits, logits[:, :60], logits[:, :8]):  # a full warp, a padded row, a narrow one
            actual = ops.route_softmax_topk(rows, 4, renormalize)
            expected = reference.route_softmax_topk(rows, 4, renormalize)
            assert_routing_equal(actual, tuple(t.cpu() for t in expected), f"softmax E={rows.shape[1]}, renormalize={renormalize}")


def _elementwise_kernel(function_name: str):
    """A compiled CuTe DSL kernel applying `fp4moe.kernels.sm90.routing.<function_name>` to every element
    of an FP32 vector (`kernel(x, y)`)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from fp4moe.kernels.sm90 import routing
    from fp4moe.kernels.sm90.compiler import compile_kernel

    function = getattr(routing, function_name)

    class Elementwise:
        @cute.jit
        def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
            self.kernel(mX, mY).launch(grid=[cute.ceil_div(mX.shape[0], 256), 1, 1], block=[256, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mX, mY):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            i = cta * 256 + tidx
            if i < mX.shape[0]:
                mY[i] = function(mX[i])

    length = cute.sym_int()
    vectors = [make_fake_compact_tensor(cutlass.Float32, (length,)) for _ in range(2)]
    return compile_kernel(Elementwise(), *vectors)


@pytest.mark.gpu
@pytest.mark.parametrize(("function_name", "torch_function"), [("sigmoid_as_torch", torch.sigmoid), ("expf_as_torch", torch.exp)])
def test_the_kernels_sigmoid_and_exponential_are_torch_s_for_every_fp32_value(hopper, function_name, torch_function):
    """Every one of the 2^32 FP32 bit patterns (numbers of every magnitude, subnormals, infinities, NaNs):
    the routing kernels' sigmoid and exponential give torch's bits on this GPU. The routing kernels' equality
    with the reference rests on this (their other steps are exactly rounded operations)."""
    kernel = _elementwise_kernel(function_name)
    chunk = 1 << 28
    mismatches, examples = 0, []
    for start in range(-(1 << 31), 1 << 31, chunk):
        x = torch.arange(start, start + chunk, dtype=torch.int32, device="cuda").view(torch.float32)
        y = torch.empty_like(x)
        kernel(x, y)
        different = y.view(torch.int32) != torch_function(x).view(torch.int32)
        count = int(different.sum())
        if count:
            mismatches += count
            examples += x[different][:4].tolist()
    assert mismatches == 0, f"{mismatches} inputs differ, e.g. {examples[:8]}"


@pytest.mark.gpu
def test_the_hopper_kernels_refuse_what_they_cannot_hold(hopper):
    logits = random_logits(4, 1024, torch.bfloat16, "cuda", seed=1)
    with pytest.raises(NotImplementedError, match="at most 512 experts"):
        ops.route_deepseek_v3(logits, torch.zeros(1024, device="cuda"), 8, 8, 4)
    with pytest.raises(NotImplementedError, match="at most 512 experts"):
        ops.route_softmax_topk(logits, 8)


def test_routing_backends_on_the_cpu():
    assert fp4moe.routing_backend("route_deepseek_v3", "cpu") == dispatch.REFERENCE_BACKEND
    assert fp4moe.routing_backend("route_softmax_topk", torch.device("cpu")) == dispatch.REFERENCE_BACKEND
    with pytest.raises(ValueError, match="op must be one of"):
        fp4moe.routing_backend("route_topk", "cpu")


# --- opcheck ------------------------------------------------------------------------------------


def opcheck_logits(layout, device):
    tokens = 0 if layout == "zero_tokens" else 13
    logits = random_logits(tokens, 64, torch.bfloat16, device, seed=7)
    if layout == "transposed":
        logits = logits.t().contiguous().t()
    elif layout == "row_sliced":
        logits = random_logits(tokens, 128, torch.bfloat16, device, seed=7)[:, 32:96]
    return logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "row_sliced", "zero_tokens"])
def test_opcheck_route_softmax_topk(device, layout):
    logits = opcheck_logits(layout, device)
    torch.library.opcheck(ops.route_softmax_topk.default, (logits, 6), {"renormalize": True})
    torch.library.opcheck(ops.route_softmax_topk.default, (logits, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "row_sliced", "zero_tokens"])
def test_opcheck_route_deepseek_v3(device, layout):
    logits = opcheck_logits(layout, device)
    bias = random_bias(64, torch.float32, device, seed=7)
    torch.library.opcheck(ops.route_deepseek_v3.default, (logits, bias, 6, 8, 3), {"routed_scaling_factor": 2.5})
    torch.library.opcheck(ops.route_deepseek_v3.default, (logits, bias.bfloat16(), 4, 4, 1, 1.0, False))


# --- bad input ----------------------------------------------------------------------------------

def softmax_call(device, shape=(4, 8), dtype=torch.float32, top_k=2):
    return torch.randn(shape, device=device).to(dtype), top_k


SOFTMAX_BAD_CALLS = [
    pytest.param(
        dict(dtype=torch.int64), TypeError, r"router_logits must have dtype in .*got torch.int64", id="int64 logits"
    ),
    pytest.param(
        dict(dtype=torch.float64), TypeError, r"router_logits must have dtype in .*got torch.float64", id="fp64 logits"
    ),
    pytest.param(dict(dtype=torch.bool), TypeError, r"router_logits must have dtype .*got torch.bool", id="bool"),
    pytest.param(
        dict(dtype=torch.float8_e4m3fn), TypeError, r"router_logits must have dtype .*float8_e4m3fn", id="fp8 logits"
    ),
    pytest.param(dict(shape=(8,)), ValueError, r"router_logits must be 2-D, got shape \(8,\)", id="1-D logits"),
    pytest.param(
        dict(shape=(2, 4, 8)), ValueError, r"router_logits must be 2-D, got shape \(2, 4, 8\)", id="3-D logits"
    ),
    pytest.param(
        dict(shape=(4, 0), top_k=1),
        ValueError,
        r"router_logits.shape\[1\] \(the number of experts E\) must be positive",
        id="no experts",
    ),
    pytest.param(dict(top_k=0), ValueError, r"top_k must be in \[1, E = 8\], got 0", id="top_k 0"),
    pytest.param(dict(top_k=-3), ValueError, r"top_k must be in \[1, E = 8\], got -3", id="top_k negative"),
    pytest.param(dict(top_k=9), ValueError, r"top_k must be in \[1, E = 8\], got 9", id="top_k > E"),
    pytest.param(
        dict(shape=(0, 8), top_k=9), ValueError, r"top_k must be in \[1, E = 8\], got 9", id="top_k > E, no tokens"
    ),
]


def deepseek_call(
    device, logits_shape=(5, 16), logits_dtype=torch.bfloat16, bias_shape=(16,), bias_dtype=torch.float32, **overrides
):
    args = dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    args.update(overrides)
    logits = torch.randn(logits_shape, device=device).to(logits_dtype)
    bias = torch.randn(bias_shape, device=device).to(bias_dtype)
    return (logits, bias, args["top_k"], args["n_group"], args["topk_group"], args["routed_scaling_factor"])


KEPT_EXPERTS = r"top_k must be in \[1, topk_group \* E / n_group = 8\]"
NOT_FINITE = r"routed_scaling_factor must be finite in FP32"
DEEPSEEK_BAD_CALLS = [
    pytest.param(
        dict(logits_dtype=torch.int32), TypeError, r"router_logits must have dtype in .*got torch.int32", id="int32"
    ),
    pytest.param(dict(logits_shape=(1, 5, 16)), ValueError, r"router_logits must be 2-D", id="3-D logits"),
    pytest.param(
        dict(bias_dtype=torch.float16),
        TypeError,
        r"correction_bias must have dtype in \(torch.float32, torch.bfloat16\), got torch.float16",
        id="fp16 bias for bf16 logits",
    ),
    pytest.param(
        dict(logits_dtype=torch.float32, bias_dtype=torch.bfloat16),
        TypeError,
        r"correction_bias must have dtype in \(torch.float32\), got torch.bfloat16",
        id="bf16 bias for fp32 logits",
    ),
    pytest.param(
        dict(bias_dtype=torch.float64), TypeError, r"correction_bias must have dtype .*got torch.float64", id="fp64"
    ),
    pytest.param(
        dict(bias_shape=(17,)), ValueError, r"correction_bias must have shape \(16,\), got \(17,\)", id="long bias"
    ),
    pytest.param(
        dict(bias_shape=(1, 16)), ValueError, r"correction_bias must have shape \(16,\), got \(1, 16\)", id="2-D bias"
    ),
    pytest.param(dict(n_group=0), ValueError, r"n_group must be a positive divisor of E = 16, got 0", id="n_group 0"),
    pytest.param(
        dict(n_group=3), ValueError, r"n_group must be a positive divisor of E = 16, got 3", id="n_group not dividing E"
    ),
    pytest.param(
        dict(n_group=16, topk_group=4),
        ValueError,
        r"each group needs at least 2 experts, got E / n_group = 16 / 16 = 1",
        id="groups of one expert",
    ),
    pytest.param(
        dict(topk_group=0), ValueError, r"topk_group must be in \[1, n_group = 4\], got 0", id="topk_group 0"
    ),
    pytest.param(
        dict(topk_group=5), ValueError, r"topk_group must be in \[1, n_group = 4\], got 5", id="topk_group > n_group"
    ),
    pytest.param(dict(top_k=0), ValueError, KEPT_EXPERTS + ", got 0", id="top_k 0"),
    pytest.param(dict(top_k=9), ValueError, KEPT_EXPERTS + ", got 9", id="top_k > kept experts"),
    pytest.param(dict(routed_scaling_factor=float("inf")), ValueError, NOT_FINITE + ", got inf", id="inf scaling"),
    pytest.param(dict(routed_scaling_factor=float("nan")), ValueError, NOT_FINITE + ", got nan", id="nan scaling"),
    pytest.param(
        dict(routed_scaling_factor=-1e39), ValueError, NOT_FINITE + r", got -1e\+39", id="scaling overflows FP32"
    ),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta runs the fake: it must raise the same
@pytest.mark.parametrize(("call", "error", "pattern"), SOFTMAX_BAD_CALLS)
def test_route_softmax_topk_rejects(device, call, error, pattern):
    with pytest.raises(error, match=pattern):
        ops.route_softmax_topk(*softmax_call(device, **call))


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta runs the fake: it must raise the same
@pytest.mark.parametrize(("call", "error", "pattern"), DEEPSEEK_BAD_CALLS)
def test_route_deepseek_v3_rejects(device, call, error, pattern):
    with pytest.raises(error, match=pattern):
        ops.route_deepseek_v3(*deepseek_call(device, **call))


def test_route_deepseek_v3_rejects_bias_on_another_device():
    logits, _, *rest = deepseek_call("cpu")
    with pytest.raises(ValueError, match=r"correction_bias is on meta but router_logits is on cpu"):
        ops.route_deepseek_v3(logits, torch.zeros(16, device="meta"), *rest)


def test_routing_ops_refuse_autograd():
    logits = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"fp4moe.route_softmax_topk is inference-only"):
        ops.route_softmax_topk(logits, 2)
    with pytest.raises(NotImplementedError, match=r"fp4moe.route_deepseek_v3 is inference-only"):
        ops.route_deepseek_v3(logits, torch.zeros(16), 4, 4, 2)


# --- torch.compile and CUDA graphs --------------------------------------------------------------


def route_both(logits, bias):
    softmax = ops.route_softmax_topk(logits, 8, renormalize=True)
    deepseek = ops.route_deepseek_v3(logits, bias, 8, 8, 4, routed_scaling_factor=2.5)
    return (*softmax, *deepseek)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic_tokens_matches_eager(device):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(route_both, backend=counter, fullgraph=True)
    bias = random_bias(256, torch.float32, device, seed=9)
    for tokens in (5, 17, 64):
        logits = random_logits(tokens, 256, torch.bfloat16, device, seed=tokens)
        torch._dynamo.mark_dynamic(logits, 0)
        actual = compiled(logits, bias)
        for got, want in zip(actual, route_both(logits, bias), strict=True):
            assert_bitwise_equal(got, want, f"T={tokens}")
    assert counter.frame_count == 1, "a dynamic token count must not recompile"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_with_fresh_logits():
    bias = random_bias(256, torch.float32, "cuda", seed=4)
    static_logits = random_logits(48, 256, torch.bfloat16, "cuda", seed=40)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route_both(static_logits, bias)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = route_both(static_logits, bias)
    for seed in (41, 42):
        fresh = random_logits(48, 256, torch.bfloat16, "cuda", seed=seed)
        static_logits.copy_(fresh)
        for out in static_outputs:  # poison, so a replay that writes nothing cannot pass
            out.fill_(-1 if out.dtype == torch.int32 else float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(static_outputs, route_both(fresh, bias), strict=True):
            assert_bitwise_equal(got, want, f"replay seed {seed}")
