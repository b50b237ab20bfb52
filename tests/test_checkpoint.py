"""Reading NVFP4 checkpoints (`fp4moe.checkpoint`): format detection, MoE layers from per-expert and
fused tensors, scale directions, gate/up and activation scales, malformed checkpoints.

Every checkpoint is written here, the way the formats document their tensors (`tests/nvfp4_checkpoints.py`),
and every loaded weight is compared with an independent decode of the written bytes.
"""

import json

import pytest
import torch

pytest.importorskip("safetensors")

from fp4moe import nvfp4  # noqa: E402
from fp4moe.checkpoint import NVFP4Checkpoint, NVFP4Format, detect_format, join_gate_up  # noqa: E402
from tests.compare import assert_bitwise_equal  # noqa: E402
from tests.nvfp4_checkpoints import (  # noqa: E402
    FORMATS,
    expert_tensors,
    quantization_config,
    quantize_linear,
    save,
    write_config,
)

PREFIX = "model.layers.0.mlp.experts"
EXPERTS, HIDDEN, INTERMEDIATE = 4, 64, 32


def make_experts(seed=0, up_decode_ratio=None, w4a4=True):
    """(gate, up, down) `QuantizedLinear`s per expert, gate and up sharing their global scale unless
    `up_decode_ratio` makes up's decode scale that multiple of gate's; per-expert activation amaxes."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for e in range(EXPERTS):
        gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g)
        down = torch.randn(HIDDEN, INTERMEDIATE, generator=g) * 2
        amax = gate_up.abs().amax()
        fc1_amax, fc2_amax = (3.0 + e, 10.0 + 2 * e) if w4a4 else (None, None)
        gate = quantize_linear(gate_up[:INTERMEDIATE], amax, fc1_amax)
        up_amax = amax if up_decode_ratio is None else amax * up_decode_ratio
        up = quantize_linear(gate_up[INTERMEDIATE:], up_amax, fc1_amax)
        layers.append((gate, up, quantize_linear(down, input_amax=fc2_amax)))
    return layers


def write(path, fmt, layers, *, fused=False, shards=1, w4a4=True, drop=(), replace=None, ignore=("lm_head",)):
    tensors = expert_tensors(PREFIX, layers, fmt, fused)
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    save(path, tensors, shards)
    write_config(path, quantization_config(fmt, w4a4, list(ignore)), {})
    return NVFP4Checkpoint(path)


def load(ckpt, **kwargs):
    return ckpt.moe_layer(PREFIX, EXPERTS, HIDDEN, INTERMEDIATE, **kwargs)


def decoded_experts(weights):
    """The loaded experts' weights as the MoE op uses them: `e2m1 * sf` times the per-expert alpha (per
    SwiGLU half where `w1_alpha` is `[2, E]`)."""
    w1_alpha, w2_alpha = weights.alphas()
    if w1_alpha.dim() == 2:
        w1_alpha = w1_alpha.t().repeat_interleave(weights.w1.shape[1] // 2, dim=1)[:, :, None]  # [E, 2I, 1]
    else:
        w1_alpha = w1_alpha[:, None, None]
    w1 = nvfp4.dequantize_blocks(weights.w1, weights.w1_scales) * w1_alpha
    w2 = nvfp4.dequantize_blocks(weights.w2, weights.w2_scales) * w2_alpha[:, None, None]
    return w1, w2


def reference_experts(layers, fmt):
    """The written bytes decoded by the format's own formula, independently of fp4moe."""
    w1 = torch.stack([torch.cat((g.dequantized(fmt), u.dequantized(fmt))) for g, u, _ in layers])
    w2 = torch.stack([d.dequantized(fmt) for *_, d in layers])
    return w1, w2


# ---------------------------------------------------------------------------------------------------
# Format detection
# ---------------------------------------------------------------------------------------------------
def test_detects_compressed_tensors_w4a4_and_w4a16():
    w4a4 = detect_format(quantization_config("compressed-tensors", True, ["lm_head", "re:.*mlp\\.gate$"]))
    assert (w4a4.name, w4a4.activation_scales) == ("compressed-tensors", True)
    assert w4a4.ignore == ("lm_head", "re:.*mlp\\.gate$")
    w4a16 = detect_format(quantization_config("compressed-tensors", False, []))
    assert (w4a16.name, w4a16.activation_scales) == ("compressed-tensors", False)


def test_detects_modelopt_from_config_json_or_hf_quant_config(tmp_path):
    in_config = detect_format(quantization_config("modelopt", True, ["lm_head"]))
    assert (in_config.name, in_config.activation_scales, in_config.ignore) == ("modelopt", True, ("lm_head",))
    section = {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}
    hf_quant_config = {"producer": {"name": "modelopt"}, "quantization": section}
    assert detect_format(None, hf_quant_config) == in_config
    qconfig = quantization_config("modelopt", True, ["lm_head"])
    write_config(tmp_path, qconfig, {"model_type": "x"}, modelopt_config_file=True)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    save(tmp_path, {"a": torch.zeros(1)})
    assert NVFP4Checkpoint(tmp_path).format == in_config


NVFP4_GROUP = {"weights": {"num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}


@pytest.mark.parametrize(
    "config, activation_scales",
    [
        ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}, False),  # weight-only, named per layer too
        ({"quant_method": "modelopt", "quant_algo": "nvfp4"}, True),  # any letter case, as vLLM reads it
        # Newer ModelOpt exports in compressed-tensors' schema: no input activations is weight-only.
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {"g": {**NVFP4_GROUP,
          "input_activations": None}}}, False),
        # A config group whose format is null takes the config's (compressed-tensors' own rule).
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
          **NVFP4_GROUP, "format": None, "input_activations": None}}}, False),
    ],
)
def test_format_variants_published_checkpoints_use(config, activation_scales):
    assert detect_format(config).activation_scales == activation_scales


def test_ignore_lists_in_each_pattern_language():
    ct = NVFP4Format("compressed-tensors", True, ("lm_head", "re:.*self_attn\\.k_proj$"))
    assert ct.is_ignored("lm_head") and ct.is_ignored("model.layers.3.self_attn.k_proj")
    assert not ct.is_ignored("model.layers.3.self_attn.q_proj") and not ct.is_ignored("model.lm_head")
    assert ct.is_quantized("model.layers.3.self_attn.q_proj") and not ct.is_quantized("lm_head")
    modelopt = NVFP4Format("modelopt", True, ("lm_head", "model.layers.*.self_attn.k_proj", "*mlp.gate"))
    assert modelopt.is_ignored("model.layers.3.self_attn.k_proj") and modelopt.is_ignored("model.layers.0.mlp.gate")
    assert not modelopt.is_ignored("model.layers.3.self_attn.q_proj")
    assert not modelopt.is_ignored("model.layers.0.mlp.gate_proj")


@pytest.mark.parametrize(
    "config, error, message",
    [
        (None, ValueError, "has no quantization config"),
        ({"quant_method": "awq", "bits": 4}, ValueError, "unknown quantization format: quant_method='awq'"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized"}}}, ValueError,
         "unknown quantization format: compressed-tensors format 'pack-quantized'"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "nvfp4-pack-quantized",
          "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, NotImplementedError, "are not NVFP4"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, NotImplementedError, "quant_algo 'FP8' is not served"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {"a": {"input_activations": None},
          "b": {"input_activations": {"num_bits": 4}}}}, NotImplementedError, "mix W4A4 and W4A16"),
    ],
)
def test_unknown_and_unsupported_formats_raise(config, error, message):
    with pytest.raises(error, match=message):
        detect_format(config)


# ---------------------------------------------------------------------------------------------------
# MoE layers
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fused,shards", [(False, 1), (False, 3), (True, 1)])
def test_moe_layer_holds_the_written_experts(tmp_path, fmt, fused, shards):
    layers = make_experts(seed=1)
    layer = load(write(tmp_path, fmt, layers, fused=fused, shards=shards))
    weights = layer.weights
    # Codes and block scales are the written bytes, gate rows above up rows.
    assert_bitwise_equal(weights.w1, torch.stack([torch.cat((g.codes, u.codes)) for g, u, _ in layers]), "w1")
    w1_scales = torch.stack([torch.cat((g.block_scales, u.block_scales)) for g, u, _ in layers])
    assert_bitwise_equal(weights.w1_scales, w1_scales, "w1_scales")
    assert_bitwise_equal(weights.w2, torch.stack([d.codes for *_, d in layers]), "w2")
    # Global scales in the encode direction: compressed-tensors stores them so, ModelOpt's decode
    # scales are inverted (RN(1 / decode)).
    expected_gs = torch.stack([1.0 / d.decode_scale for *_, d in layers])
    assert_bitwise_equal(weights.w2_global_scale, expected_gs, "w2_global_scale")
    # As the op uses them, the weights equal the format's own decode up to FP32 rounding order
    # (e2m1 * sf * RN(1/gs) against compressed-tensors' e2m1 * RN(sf / gs), ModelOpt's e2m1 * sf * decode
    # against RN(1 / RN(1 / decode))): a relative 2^-22.
    for actual, expected in zip(decoded_experts(weights), reference_experts(layers, fmt)):
        torch.testing.assert_close(actual, expected, rtol=2**-22, atol=0)
    # Activation scales per expert, encode direction, [E, 2] (gate, up) and [E].
    fc1 = torch.tensor([[2688.0 / (3 + e)] * 2 for e in range(EXPERTS)])
    fc2 = torch.tensor([2688.0 / (10 + 2 * e) for e in range(EXPERTS)])
    torch.testing.assert_close(layer.fc1_input_scales, fc1, rtol=2**-22, atol=0)
    torch.testing.assert_close(layer.fc2_input_scales, fc2, rtol=2**-22, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_and_per_expert_layouts_load_alike(tmp_path, fmt):
    layers = make_experts(seed=2)
    per_expert = load(write(tmp_path / "a", fmt, layers))
    fused = load(write(tmp_path / "b", fmt, layers, fused=True))
    for name in ("w1", "w1_scales", "w1_global_scale", "w2", "w2_scales", "w2_global_scale"):
        assert_bitwise_equal(getattr(fused.weights, name), getattr(per_expert.weights, name), name)
    assert_bitwise_equal(fused.fc1_input_scales, per_expert.fc1_input_scales)
    assert_bitwise_equal(fused.fc2_input_scales, per_expert.fc2_input_scales)


def test_w4a16_checkpoints_have_no_activation_scales(tmp_path):
    layer = load(write(tmp_path, "compressed-tensors", make_experts(w4a4=False), w4a4=False))
    assert layer.fc1_input_scales is None and layer.fc2_input_scales is None
    with pytest.raises(ValueError, match="no activation scales"):
        layer.activation_scales()


def test_fc1_scales_reduce_to_the_largest_amax_and_fc2_scales_stay_per_expert(tmp_path):
    layer = load(write(tmp_path, "modelopt", make_experts(seed=3)))
    fc1, fc2, exact = layer.activation_scales()
    # fc1 amax 3..6 per expert: the shared scale is that of amax 6; fc2 keeps every expert's own.
    assert not exact
    assert_bitwise_equal(fc1, (1.0 / torch.tensor([6.0 / 2688.0])))
    assert_bitwise_equal(fc2, layer.fc2_input_scales)
    assert fc2.shape == (layer.weights.num_experts,) and fc2.unique().numel() > 1


def test_equal_activation_scales_are_exact(tmp_path):
    layers = make_experts(seed=4)
    for gate, up, down in layers:
        gate.input_amax = up.input_amax = 5.0
        down.input_amax = 7.0
    fc1, fc2, exact = load(write(tmp_path, "compressed-tensors", layers)).activation_scales()
    assert exact
    assert_bitwise_equal(fc1, torch.tensor([2688.0 / 5.0]))
    assert_bitwise_equal(fc2, torch.full((len(layers),), 2688.0 / 7.0))


# ---------------------------------------------------------------------------------------------------
# Gate and up with different global scales
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_gate_up_scales_a_power_of_two_apart_are_joined_exactly(tmp_path, fmt):
    # up's decode scale is twice gate's: its block scales are re-expressed for gate's global scale
    # (sf * 2, all E4M3 values), the codes untouched.
    layers = make_experts(seed=5, up_decode_ratio=2.0)
    weights = load(write(tmp_path, fmt, layers)).weights
    assert_bitwise_equal(weights.w1, torch.stack([torch.cat((g.codes, u.codes)) for g, u, _ in layers]), "w1")
    assert_bitwise_equal(weights.w1_global_scale, torch.stack([1.0 / g.decode_scale for g, _, _ in layers]).reshape(-1))
    up_scales = torch.stack([u.block_scales.float() * 2 for _, u, _ in layers])
    assert_bitwise_equal(weights.w1_scales[:, INTERMEDIATE:].float(), up_scales, "re-expressed up block scales")
    for actual, expected in zip(decoded_experts(weights), reference_experts(layers, fmt)):
        torch.testing.assert_close(actual, expected, rtol=2**-22, atol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gate_up_scales_without_an_exact_join_keep_their_own(tmp_path, fmt, fused):
    # Untied gate/up scales (up's decode scale 1.3x gate's): each half keeps its global scale, [2, E], and
    # the codes and block scales are the checkpoint's, bit for bit.
    layers = make_experts(seed=6, up_decode_ratio=1.3)
    replace = {}
    if fused:  # gate_up_proj's global scales stored [E, 2]
        decode = torch.stack([torch.stack((g.decode_scale, u.decode_scale)) for g, u, _ in layers])
        suffix, per_half = {"compressed-tensors": ("weight_global_scale", 1.0 / decode),
                            "modelopt": ("weight_scale_2", decode)}[fmt]
        replace = {f"{PREFIX}.gate_up_proj.{suffix}": per_half}
    weights = load(write(tmp_path, fmt, layers, fused=fused, replace=replace)).weights
    gate_up = [(1.0 / g.decode_scale, 1.0 / u.decode_scale) for g, u, _ in layers]
    expected = torch.tensor([[float(g) for g, _ in gate_up], [float(u) for _, u in gate_up]])
    torch.testing.assert_close(weights.w1_global_scale, expected, rtol=2**-23, atol=0)
    assert_bitwise_equal(weights.w1, torch.stack([torch.cat((g.codes, u.codes)) for g, u, _ in layers]), "w1")
    scales = torch.stack([torch.cat((g.block_scales, u.block_scales)) for g, u, _ in layers])
    assert_bitwise_equal(weights.w1_scales.float(), scales.float(), "w1 block scales")
    assert weights.alphas()[0].shape == (2, len(layers))
    for actual, expected in zip(decoded_experts(weights), reference_experts(layers, fmt)):
        torch.testing.assert_close(actual, expected, rtol=2**-22, atol=0)


def test_join_gate_up_keeps_both_scales_where_a_rescale_would_leave_e4m3():
    gs = torch.tensor([100.0])
    big = torch.full((2, 1), 448.0).to(torch.float8_e4m3fn)
    tiny = torch.full((2, 1), 2.0**-9).to(torch.float8_e4m3fn)  # E4M3's smallest subnormal
    # up (gs / 2) would need its scales doubled past 448, gate its scales halved below 2^-9.
    gate_scales, up_scales, global_scales = join_gate_up(tiny, gs, big, gs / 2)
    assert gate_scales is tiny and up_scales is big
    assert global_scales.tolist() == [100.0, 50.0]


# ---------------------------------------------------------------------------------------------------
# Malformed checkpoints
# ---------------------------------------------------------------------------------------------------
def test_a_missing_tensor_is_named(tmp_path):
    missing = f"{PREFIX}.2.up_proj.weight_scale"
    ckpt = write(tmp_path, "compressed-tensors", make_experts(), drop=[missing])
    message = rf"has no tensor '{missing}' \(needed for the NVFP4 layer {PREFIX}\.2\.up_proj\)"
    with pytest.raises(ValueError, match=message):
        load(ckpt)


def test_a_missing_activation_scale_is_named(tmp_path):
    missing = f"{PREFIX}.1.down_proj.input_scale"
    ckpt = write(tmp_path, "modelopt", make_experts(), drop=[missing])
    with pytest.raises(ValueError, match=rf"has no tensor '{missing}' .*without them with quant_mode='w4a16'"):
        load(ckpt)
    assert load(ckpt, activation_scales=False).fc2_input_scales is None  # W4A16 serving does not read it


@pytest.mark.parametrize(
    "name, value, error, message",
    [
        (f"{PREFIX}.1.gate_proj.weight_scale", torch.zeros(INTERMEDIATE, HIDDEN // 16, dtype=torch.uint8), TypeError,
         "must be float8_e4m3fn, got uint8"),
        (f"{PREFIX}.1.gate_proj.weight_packed", torch.zeros(INTERMEDIATE, HIDDEN // 2, dtype=torch.int8), TypeError,
         "must be uint8, got int8"),
        (f"{PREFIX}.3.down_proj.weight_global_scale", torch.ones(1, dtype=torch.bfloat16), TypeError,
         "must be float32, got bfloat16"),
        (f"{PREFIX}.0.down_proj.weight_packed", torch.zeros(HIDDEN, INTERMEDIATE, dtype=torch.uint8), ValueError,
         rf"must have shape \[{HIDDEN}, {INTERMEDIATE // 2}\], got \[{HIDDEN}, {INTERMEDIATE}\]"),
        (f"{PREFIX}.0.up_proj.weight_scale", torch.zeros(INTERMEDIATE, 2, dtype=torch.float8_e4m3fn), ValueError,
         rf"must have shape \[{INTERMEDIATE}, {HIDDEN // 16}\], got \[{INTERMEDIATE}, 2\]"),
        (f"{PREFIX}.2.gate_proj.weight_global_scale", torch.ones(2), ValueError, "must hold 1 global scale"),
        (f"{PREFIX}.2.up_proj.input_global_scale", torch.tensor([float("nan")]), ValueError,
         "holds a non-positive or NaN"),
    ],
)
def test_wrong_dtypes_shapes_and_values_are_named(tmp_path, name, value, error, message):
    ckpt = write(tmp_path, "compressed-tensors", make_experts(), replace={name: value})
    with pytest.raises(error, match=rf"checkpoint tensor '{name}' {message}"):
        load(ckpt)


def test_experts_in_the_ignore_list_are_refused(tmp_path):
    ckpt = write(tmp_path, "compressed-tensors", make_experts(), ignore=["lm_head", "re:.*experts.*"])
    with pytest.raises(ValueError, match=rf"{PREFIX}\.0\.gate_proj is in the checkpoint's ignore list"):
        load(ckpt)


def test_a_shard_named_by_the_index_must_exist(tmp_path):
    write(tmp_path, "modelopt", make_experts(), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names shard 'model-00002-of-00002.safetensors'"):
        NVFP4Checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Dense layers
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_dense_layer_matches_the_format_decode(tmp_path, fmt):
    q = quantize_linear(torch.randn(48, 80, generator=torch.Generator().manual_seed(7)), input_amax=4.0)
    save(tmp_path, q.tensors("model.layers.0.self_attn.o_proj", fmt))
    write_config(tmp_path, quantization_config(fmt, True, []), {})
    linear = NVFP4Checkpoint(tmp_path).linear("model.layers.0.self_attn.o_proj", (48, 80), input_scale=True)
    torch.testing.assert_close(linear.dequantize(), q.dequantized(fmt), rtol=2**-22, atol=0)
    assert linear.dequantize(torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(linear.input_global_scale, torch.tensor([2688.0 / 4.0]), rtol=2**-22, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_experts_with_per_half_global_scales(tmp_path, fmt):
    # gate_up_proj global scales stored [E, 2] (gate, up), up's decode scale twice gate's: joined exactly.
    layers = make_experts(seed=8, up_decode_ratio=2.0)
    decode = torch.stack([torch.stack((g.decode_scale, u.decode_scale)) for g, u, _ in layers])
    stored = {"compressed-tensors": ("weight_global_scale", 1.0 / decode), "modelopt": ("weight_scale_2", decode)}
    suffix, per_half = stored[fmt]
    ckpt = write(tmp_path, fmt, layers, fused=True, replace={f"{PREFIX}.gate_up_proj.{suffix}": per_half})
    weights = load(ckpt).weights
    for actual, expected in zip(decoded_experts(weights), reference_experts(layers, fmt)):
        torch.testing.assert_close(actual, expected, rtol=2**-22, atol=0)
