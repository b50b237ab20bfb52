"""The transformers drop-in (`fp4moe.hf`): tiny Qwen3-MoE, DeepSeek-V3 and GLM-4.5 NVFP4 checkpoints in
both formats, served through `FusedMoE`, against the dequantize-everything FP32 reference model.

Tolerances (relative Frobenius error of the logits, which have a standard deviation of ~0.6 here):
- W4A16: the reference's weights are the checkpoint's, decoded, so the differences are the bf16
  activations of the MoE blocks (their input, intermediate and output are each rounded once to bf16,
  unit roundoff 2^-9): at most 3 * 2^-9 relative to the MoE output, and less on the logits, which add the
  other layers' exact contributions. The top-1 token must agree wherever the reference decides it
  (`assert_top1_agrees`: a top-2 margin above twice the largest logit difference).
- W4A4: both activations of every expert are NVFP4 (E2M1 with E4M3 block scales: ~10% relative RMS
  error each, the weights' own figure in `test_weights.py`); their errors compound to ~15% of the MoE
  output, the bound used, which the logits (MoE output plus attention and residual) stay under. A
  random tiny model has near-tied logits, so a few top-1 positions may flip. That bound is loose, so
  W4A4 is also held to a reference whose experts quantize their activations as the checkpoint says
  (`activation_quantized_reference`: the same bf16 inputs through the same encoder, FP32 GEMMs): the
  codes then agree but where an FP32 rounding difference moves a value across a rounding boundary of
  E2M1 or E4M3, which is rare (measured: 5e-7 relative, no such crossing); 2e-3 allows a few. A swapped
  gate/up, an expert's alpha on another expert or a 10% wrong activation scale each give 1.5-27%.
"""

import contextlib
import copy
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

import fp4moe  # noqa: E402
import fp4moe.hf  # noqa: E402
from tests.compare import assert_bitwise_equal  # noqa: E402
from tests.nvfp4_checkpoints import (  # noqa: E402
    FAMILIES,
    FORMATS,
    VOCAB,
    activation_quantized_reference,
    save,
    write_checkpoint,
)

W4A16_TOLERANCE = 3 * 2**-9
W4A4_TOLERANCE = 0.15
W4A4_QUANTIZED_REFERENCE_TOLERANCE = 2e-3
TOKENS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(family, fmt, w4a4=True, **options)`: a written checkpoint, made once per module."""
    made = {}

    def get(family, fmt, w4a4=True, **options):
        key = (family, fmt, w4a4, tuple(sorted(options.items())))
        if key not in made:
            made[key] = write_checkpoint(tmp_path_factory.mktemp(f"{family}-{fmt}"), family, fmt, w4a4=w4a4, **options)
        return made[key]

    return get


def logits(model, ids=TOKENS, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def relative_error(actual, expected):
    return (torch.linalg.norm(actual.float() - expected) / torch.linalg.norm(expected)).item()


def top1_agreement(actual, expected):
    return (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()


def assert_top1_agrees(actual, expected):
    """The same top-1 token wherever `expected` decides it: its top-2 margin exceeds twice the largest
    logit difference (a closer pair is a tie at the precision compared, which a random tiny model has
    now and then). At least 90% of the positions must be decided."""
    actual, expected = actual.float(), expected.float()
    difference = (actual - expected).abs().amax()
    top2 = expected.topk(2, dim=-1).values
    decided = top2[..., 0] - top2[..., 1] > 2 * difference
    assert decided.float().mean() >= 0.9, f"only {decided.float().mean():.0%} of the positions are decided"
    agree = actual.argmax(-1) == expected.argmax(-1)
    assert agree[decided].all(), f"top-1 differs at decided positions {(~agree & decided).nonzero().tolist()}"


def load(ck, **options):
    return fp4moe.hf.from_pretrained(ck.path, dtype=torch.float32, **options)


# ---------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------
W4A16_CASES = [
    ("compressed-tensors", False, {}),  # an NVFP4A16 checkpoint: W4A16 by default
    ("compressed-tensors", True, {"quant_mode": "w4a16"}),
    ("modelopt", True, {"quant_mode": "w4a16"}),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt, w4a4, options", W4A16_CASES)
def test_w4a16_logits_match_the_dequantized_reference(checkpoint, family, fmt, w4a4, options):
    ck = checkpoint(family, fmt, w4a4)
    model = load(ck, **options)
    actual, expected = logits(model), logits(ck.reference)
    assert actual.dtype == torch.float32
    assert relative_error(actual, expected) < W4A16_TOLERANCE
    assert_top1_agrees(actual, expected)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("per_token", [False, True])
def test_w4a4_logits_match_the_dequantized_reference(checkpoint, family, fmt, per_token):
    ck = checkpoint(family, fmt)
    if per_token:
        model = load(ck, per_token_activation=True)
    else:
        # The writers calibrate every expert on its own tokens: the FC1 scales are reduced, and said so.
        with pytest.warns(UserWarning, match="per-expert FC1 input scales"):
            model = load(ck)
    moe = model.model.layers[1].mlp.moe
    assert (moe.quant_mode, moe.per_token_activation) == ("w4a4", per_token)
    assert (moe.fc1_input_scale is None) == per_token
    actual, expected = logits(model), logits(ck.reference)
    assert relative_error(actual, expected) < W4A4_TOLERANCE
    assert top1_agreement(actual, expected) >= 0.8
    quantized = logits(activation_quantized_reference(ck, fmt, per_token))
    assert relative_error(actual, quantized) < W4A4_QUANTIZED_REFERENCE_TOLERANCE
    assert_top1_agrees(actual, quantized)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("per_token", [False, True])
def test_a_model_loaded_onto_the_gpu_matches_the_reference(checkpoint, family, per_token):
    """`from_pretrained(device="cuda")`: the whole model on the GPU, its MoE blocks on the Hopper kernels
    (prepared weights), W4A16 from an NVFP4A16 checkpoint and per-token W4A4 from a W4A4 one, against the
    same references as on the CPU; compiled whole (`fullgraph=True`, no graph break), the same logits as
    eager; in W4A16 greedy generation with the KV cache gives the reference's tokens."""
    ck = checkpoint(family, "compressed-tensors", w4a4=per_token)
    model = load(ck, device="cuda", deterministic=True, **({"per_token_activation": True} if per_token else {}))
    assert {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()} == {"cuda"}
    moe = model.model.layers[1].mlp.moe
    choice = fp4moe.moe_dispatch(4, moe.top_k, moe.w1.shape[0], moe.quant_mode, per_token, "cuda")
    assert moe.weight_layout == "sm90" and choice.gemm1 == choice.gemm2 == fp4moe.dispatch.CUTE_SM90_BACKEND
    actual = logits(model, TOKENS.cuda()).cpu()
    torch._dynamo.reset()
    compiled = logits(torch.compile(model, fullgraph=True), TOKENS.cuda()).cpu()
    # Inductor may round the dense layers' FP32 arithmetic otherwise, which the MoE's bf16 input carries on.
    assert relative_error(compiled, actual) < 1e-3
    assert_top1_agrees(compiled, actual)
    if per_token:
        quantized = logits(activation_quantized_reference(ck, "compressed-tensors", True))
        assert relative_error(actual, quantized) < W4A4_QUANTIZED_REFERENCE_TOLERANCE
        assert_top1_agrees(actual, quantized)
        return
    assert relative_error(actual, logits(ck.reference)) < W4A16_TOLERANCE
    assert_top1_agrees(actual, logits(ck.reference))
    prompt = TOKENS[:1]
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        generated = model.generate(prompt.cuda(), attention_mask=torch.ones_like(prompt).cuda(), **options)
        expected = ck.reference.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    assert torch.equal(generated.cpu(), expected), family


@pytest.mark.parametrize("fmt", FORMATS)
def test_untied_gate_up_scales_load_exactly_per_half(checkpoint, fmt):
    """Experts whose gate and up projections have global scales of their own (as some published ModelOpt
    exports have them) load with those scales, `w1_alpha` per half, and serve the dequantized reference's
    logits."""
    ck = checkpoint("deepseek_v3", fmt, w4a4=False, tied_gate_up=False)
    model = load(ck)
    moe = model.model.layers[1].mlp.moe
    assert moe.w1_alpha.shape == (2, moe.w1.shape[0]) and not torch.equal(moe.w1_alpha[0], moe.w1_alpha[1])
    actual, expected = logits(model), logits(ck.reference)
    assert relative_error(actual, expected) < W4A16_TOLERANCE
    assert_top1_agrees(actual, expected)


def test_sharded_fused_and_hf_quant_config_checkpoints_load_alike(checkpoint):
    plain = load(checkpoint("qwen3_moe", "modelopt"), quant_mode="w4a16")
    for options in (dict(shards=3), dict(fused_experts=True), dict(modelopt_config_file=True)):
        other = load(checkpoint("qwen3_moe", "modelopt", **options), quant_mode="w4a16")
        assert_bitwise_equal(logits(other), logits(plain), str(options))


def test_generation_with_the_kv_cache_matches_the_reference(checkpoint):
    for family in FAMILIES:
        ck = checkpoint(family, "compressed-tensors", w4a4=False)
        model = load(ck)
        prompt = TOKENS[:1]
        options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            cached = model.generate(prompt, use_cache=True, **options)
            uncached = model.generate(prompt, use_cache=False, **options)
            expected = ck.reference.generate(prompt, use_cache=True, **options)
        assert cached.shape == (1, prompt.shape[1] + 8)
        assert torch.equal(cached, expected), family
        assert torch.equal(cached, uncached), family


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("per_tensor_w4a4", [False, True])
def test_compiled_model_has_no_graph_breaks(checkpoint, family, per_tensor_w4a4):
    ck = checkpoint(family, "compressed-tensors", w4a4=per_tensor_w4a4)
    with pytest.warns(UserWarning) if per_tensor_w4a4 else contextlib.nullcontext():
        model = load(ck)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)  # fullgraph: a graph break raises
    compiled_logits = logits(compiled)
    assert counter.frame_count == 1
    assert_bitwise_equal(compiled_logits, logits(model))


# ---------------------------------------------------------------------------------------------------
# The swapped model
# ---------------------------------------------------------------------------------------------------
def test_blocks_are_swapped_with_the_models_routing(checkpoint):
    qwen = load(checkpoint("qwen3_moe", "compressed-tensors", w4a4=False))
    assert not qwen.training and not any(p.requires_grad for p in qwen.parameters())  # ready for inference
    for layer in qwen.model.layers:
        block = layer.mlp
        assert isinstance(block, fp4moe.hf.NVFP4MoEBlock) and isinstance(block.moe, fp4moe.FusedMoE)
        assert (block.moe.routing, block.moe.renormalize, block.moe.top_k) == ("softmax", False, 2)
        assert block.moe.router_weight is None and block.shared_experts is None
        assert block.gate.weight.dtype == torch.float32  # the model's router, in the model's precision
    ck = checkpoint("deepseek_v3", "modelopt")
    deepseek = load(ck, quant_mode="w4a16")
    block = deepseek.model.layers[1].mlp
    moe = block.moe
    assert (moe.routing, moe.renormalize, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (
        "deepseek_v3", True, 4, 2, 2.5)
    assert_bitwise_equal(moe.correction_bias, ck.tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert block.shared_experts.gate_proj.weight.dtype == torch.float32  # dense, dequantized
    assert not isinstance(deepseek.model.layers[0].mlp, fp4moe.hf.NVFP4MoEBlock)  # the dense first layer
    assert deepseek.lm_head.weight is deepseek.model.embed_tokens.weight  # tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_to_dtype_keeps_the_nvfp4_buffers(checkpoint, dtype):
    ck = checkpoint("deepseek_v3", "compressed-tensors", w4a4=False)
    model = load(ck)
    before = {name: buffer.clone() for name, buffer in model.named_buffers() if ".moe." in name}
    model.to(dtype)
    for name, buffer in model.named_buffers():
        if name in before:
            assert_bitwise_equal(buffer, before[name], name)
    actual = logits(model)
    assert actual.dtype == dtype
    # The whole model now runs in 16 bits: every layer rounds to it (unit roundoff 2^-9 for bf16).
    assert relative_error(actual, logits(ck.reference)) < 0.03
    block = model.model.layers[1].mlp
    hidden = torch.randn(1, 3, 64).to(dtype)
    assert block(hidden).dtype == dtype


def test_output_router_logits(checkpoint):
    ck = checkpoint("qwen3_moe", "compressed-tensors", w4a4=False)
    model = load(ck)
    with torch.no_grad():
        out = model(TOKENS, output_router_logits=True)
        expected = ck.reference(TOKENS, output_router_logits=True)
    assert len(out.router_logits) == len(expected.router_logits) == 2
    # Layer 0's router sees the same input in both models (up to the last bit of the dequantized attention).
    torch.testing.assert_close(out.router_logits[0], expected.router_logits[0])
    assert out.router_logits[1].shape == (TOKENS.numel(), 8)
    torch.testing.assert_close(out.aux_loss, expected.aux_loss, rtol=1e-3, atol=0)


def test_a_model_built_from_the_checkpoints_config_loads_like_from_pretrained(checkpoint, tmp_path):
    ck = checkpoint("qwen3_moe", "compressed-tensors", w4a4=False)
    config = transformers.AutoConfig.from_pretrained(ck.path)  # carries the quantization config
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # random weights
    fp4moe.hf.load_nvfp4_checkpoint(built, ck.path)
    assert_bitwise_equal(logits(built), logits(load(ck)))
    # The model's quantization config serves a checkpoint whose config.json has none.
    copy_dir = tmp_path / "no-quantization-config"
    shutil.copytree(ck.path, copy_dir)
    stripped = json.loads((copy_dir / "config.json").read_text())
    del stripped["quantization_config"]
    (copy_dir / "config.json").write_text(json.dumps(stripped))
    with pytest.raises(ValueError, match="has no quantization config"):
        fp4moe.hf.from_pretrained(copy_dir)
    fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fp4moe.hf.load_nvfp4_checkpoint(fresh, copy_dir)
    assert_bitwise_equal(logits(fresh), logits(built))


def test_dense_layers_can_be_left_to_the_caller(checkpoint):
    ck = checkpoint("qwen3_moe", "modelopt")
    config = transformers.AutoConfig.from_pretrained(ck.path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    original = q_proj.detach().clone()
    fp4moe.hf.load_nvfp4_checkpoint(model, ck.path, quant_mode="w4a16", dense_layers="skip")
    assert model.model.layers[0].self_attn.q_proj.weight is q_proj and torch.equal(q_proj, original)
    assert set(model.fp4moe_skipped_layers) == {
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in ("q", "v", "o")
    }  # k_proj is in the ignore list: loaded as stored
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert_bitwise_equal(model.get_parameter(k_proj), ck.tensors[k_proj])
    assert isinstance(model.model.layers[0].mlp, fp4moe.hf.NVFP4MoEBlock)


# ---------------------------------------------------------------------------------------------------
# Malformed checkpoints and unsupported requests
# ---------------------------------------------------------------------------------------------------
def rewritten(ck, path, drop=(), replace=None):
    """A copy of checkpoint `ck` at `path` with tensors dropped or replaced."""
    tensors = {k: v for k, v in ck.tensors.items() if k not in drop}
    tensors.update(replace or {})
    save(path, tensors)
    shutil.copy(ck.path / "config.json", path / "config.json")
    return path


@pytest.mark.parametrize(
    "drop, replace, error, message",
    [
        (["model.norm.weight"], None, ValueError, r"has no tensor 'model.norm.weight'"),
        (["model.layers.0.self_attn.q_proj.weight_scale"], None, ValueError,
         r"has no tensor 'model.layers.0.self_attn.q_proj.weight_scale' \(needed for the NVFP4 layer"),
        (["model.layers.1.mlp.experts.5.down_proj.weight_packed"], None, ValueError,
         r"has no tensor 'model.layers.1.mlp.experts.5.down_proj.weight_packed'"),
        ([], {"model.embed_tokens.weight": torch.zeros(VOCAB + 1, 64)}, ValueError,
         r"'model.embed_tokens.weight' has shape \[97, 64\], the model expects \[96, 64\]"),
        ([], {"model.layers.0.self_attn.o_proj.weight_packed": torch.zeros(64, 32, dtype=torch.int8)}, TypeError,
         r"'model.layers.0.self_attn.o_proj.weight_packed' must be uint8, got int8"),
        ([], {"model.layers.1.mlp.experts.0.gate_proj.weight_scale": torch.zeros(32, 4)}, TypeError,
         r"'model.layers.1.mlp.experts.0.gate_proj.weight_scale' must be float8_e4m3fn, got float32"),
        ([], {"model.layers.0.self_attn.q_proj.weight_packed": torch.zeros(64, 16, dtype=torch.uint8)}, ValueError,
         r"'model.layers.0.self_attn.q_proj.weight_packed' must have shape \[64, 32\], got \[64, 16\]"),
    ],
)
def test_malformed_checkpoints_raise_naming_the_tensor(checkpoint, tmp_path, drop, replace, error, message):
    path = rewritten(checkpoint("qwen3_moe", "compressed-tensors", w4a4=False), tmp_path / "bad", drop, replace)
    with pytest.raises(error, match=message):
        fp4moe.hf.from_pretrained(path)


def test_unknown_format_raises(checkpoint, tmp_path):
    path = rewritten(checkpoint("qwen3_moe", "compressed-tensors", w4a4=False), tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown quantization format: quant_method='fp8'"):
        fp4moe.hf.from_pretrained(path)


def test_unsupported_requests_raise(checkpoint):
    ck = checkpoint("qwen3_moe", "compressed-tensors", w4a4=False)
    with pytest.raises(ValueError, match="per-tensor W4A4 needs the checkpoint's activation scales"):
        load(ck, quant_mode="w4a4")
    with pytest.raises(ValueError, match="per_token_activation applies to quant_mode='w4a4' only"):
        load(ck, quant_mode="w4a16", per_token_activation=True)
    with pytest.raises(ValueError, match="dense_layers must be one of"):
        load(ck, dense_layers="keep")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE block fp4moe serves"):
        fp4moe.hf.load_nvfp4_checkpoint(llama, ck.path)
    model = copy.deepcopy(load(ck))
    with pytest.raises(ValueError, match="no router"):
        model.model.layers[0].mlp.moe(torch.zeros(1, 64))
