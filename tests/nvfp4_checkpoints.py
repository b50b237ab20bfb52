"""Tiny NVFP4 checkpoints of transformers MoE models, written the way the two formats document their
tensors, and the dequantize-everything float reference of each.

Written independently of fp4moe's loader: tensor names, dtypes, shapes, nibble order and scale directions
follow the compressed-tensors `nvfp4-pack-quantized` and ModelOpt `NVFP4` documentation (see
`fp4moe/checkpoint.py`'s table), and the reference decodes the written bytes with a table of its own.
Only the encoder (`torch.ops.fp4moe.quantize`, bitwise-tested against the SPEC's golden values elsewhere)
is shared, to produce valid NVFP4 codes.

The writers quantize like llm-compressor and ModelOpt do: one weight global scale per linear layer from
its amax, tied between an expert's gate and up projections, and (W4A4) activation scales calibrated on a
batch: per linear layer, and per expert for the experts (each expert sees its own routed tokens, so the
experts' scales differ).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import pytest

import fp4moe  # noqa: F401  (registers torch.ops.fp4moe, whose encoder writes the codes)

safetensors_torch = pytest.importorskip("safetensors.torch")

FORMATS = ("compressed-tensors", "modelopt")
FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")
VOCAB = 96

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def tiny_config(family: str, **overrides):
    """A two-layer model, every matrix dimension a multiple of 16; layer 1 is MoE in every family."""
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_experts_per_tok=2, max_position_embeddings=64, initializer_range=0.08,
        rms_norm_eps=1e-6,
    )
    if family == "qwen3_moe":
        # Both layers MoE; norm_topk_prob=False: softmax top-k without renormalization.
        config = dict(common, num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=False)
        return transformers.Qwen3MoeConfig(**{**config, **overrides})
    if family == "glm4_moe":
        # GLM-4.5: DeepSeek-V3's router and shared expert, attention with biases, QK norms and half-rotary heads.
        config = dict(
            common, num_key_value_heads=2, n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
            attention_bias=True,
        )
        return transformers.Glm4MoeConfig(**{**config, **overrides})
    # Layer 0 dense, layer 1 MoE with one shared expert; renormalized grouped routing.
    config = dict(
        common, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=True,
    )
    return transformers.DeepseekV3Config(**{**config, **overrides})


def dense_model(config, seed: int = 0) -> nn.Module:
    """The FP32 model the checkpoint is made from; DeepSeek-V3's correction bias is made non-zero."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape) * 0.05)
    return model


# ---------------------------------------------------------------------------------------------------
# NVFP4, by the formats' documentation
# ---------------------------------------------------------------------------------------------------
def quantize_weight(weight: torch.Tensor, global_scale: torch.Tensor):
    """(codes uint8 [N, K/2] with element 2i in the low nibble, E4M3 block scales [N, K/16])."""
    return torch.ops.fp4moe.quantize(weight.float().contiguous(), global_scale.reshape(1).float(), sf_layout="linear")


def dequantize_weight(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, fmt: str):
    """FP32 weight of the written bytes (low nibble = even element) by each format's documented decode:
    compressed-tensors `e2m1 * (block_scale / weight_global_scale)`, ModelOpt
    `e2m1 * block_scale * weight_scale_2` (`global_scale` is the stored tensor of `fmt`)."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    scales = block_scales.float().repeat_interleave(16, dim=1)
    if fmt == "compressed-tensors":
        return _E2M1[codes.long()] * (scales / global_scale.float().reshape(()))
    return _E2M1[codes.long()] * scales * global_scale.float().reshape(())


@dataclass
class QuantizedLinear:
    codes: torch.Tensor
    block_scales: torch.Tensor
    decode_scale: torch.Tensor  # FP32 0-d: amax / 2688
    input_amax: float | None

    def tensors(self, prefix: str, fmt: str) -> dict[str, torch.Tensor]:
        """The layer's tensors, named and oriented as `fmt` stores them."""
        if fmt == "compressed-tensors":  # encode-direction global scales, [1]
            out = {
                f"{prefix}.weight_packed": self.codes,
                f"{prefix}.weight_scale": self.block_scales,
                f"{prefix}.weight_global_scale": (1.0 / self.decode_scale).reshape(1),
            }
            if self.input_amax is not None:
                out[f"{prefix}.input_global_scale"] = torch.tensor([2688.0 / self.input_amax])
            return out
        out = {  # ModelOpt: decode-direction scales, 0-d
            f"{prefix}.weight": self.codes,
            f"{prefix}.weight_scale": self.block_scales,
            f"{prefix}.weight_scale_2": self.decode_scale.reshape(()),
        }
        if self.input_amax is not None:
            out[f"{prefix}.input_scale"] = torch.tensor(self.input_amax / 2688.0)
        return out

    def dequantized(self, fmt: str) -> torch.Tensor:
        stored = (1.0 / self.decode_scale) if fmt == "compressed-tensors" else self.decode_scale
        return dequantize_weight(self.codes, self.block_scales, stored, fmt)


def quantize_linear(weight: torch.Tensor, amax: torch.Tensor | None = None, input_amax: float | None = None):
    """One linear layer the way both tools quantize it: decode scale `amax / 2688`, encoded with its inverse."""
    amax = weight.abs().amax() if amax is None else amax
    decode_scale = (amax.float() / 2688.0).reshape(())
    codes, block_scales = quantize_weight(weight, 1.0 / decode_scale)
    return QuantizedLinear(codes, block_scales, decode_scale, input_amax)


# ---------------------------------------------------------------------------------------------------
# Calibration: activation maxima of every linear layer and of every expert
# ---------------------------------------------------------------------------------------------------
def calibrate(model: nn.Module, token_ids: torch.Tensor):
    """`{linear module name: input amax}` and `{experts module name: (fc1 amax [E], fc2 amax [E])}`."""
    linear_amax, expert_amax, hooks = {}, {}, []

    def linear_hook(name):
        def hook(module, args):
            amax = float(args[0].abs().amax())
            linear_amax[name] = max(linear_amax.get(name, 0.0), amax)
        return hook

    def experts_hook(name):
        def hook(module, args):
            hidden, top_k_index, _ = args
            intermediate = module.intermediate_dim
            fc1, fc2 = torch.zeros(module.num_experts), torch.zeros(module.num_experts)
            for e in range(module.num_experts):
                rows = hidden[(top_k_index == e).any(dim=-1)]
                if rows.shape[0] == 0:
                    rows = hidden  # an expert with no calibration tokens: the layer's range
                gate_up = rows @ module.gate_up_proj[e].T
                act = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
                fc1[e], fc2[e] = rows.abs().amax(), act.abs().amax()
            expert_amax[name] = (fc1, fc2)
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(linear_hook(name)))
        elif hasattr(module, "gate_up_proj"):
            hooks.append(module.register_forward_pre_hook(experts_hook(name)))
    with torch.no_grad():
        model(token_ids)
    for hook in hooks:
        hook.remove()
    return linear_amax, expert_amax


# ---------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------
@dataclass
class TinyCheckpoint:
    path: Path
    reference: nn.Module
    """The dense FP32 model with every NVFP4 weight replaced by its dequantized value."""
    tensors: dict[str, torch.Tensor]
    """Everything written, by name."""


def quantization_config(fmt: str, w4a4: bool, ignore: list[str]) -> dict:
    if fmt == "compressed-tensors":
        nvfp4 = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False)
        inputs = {**nvfp4, "dynamic": "local"} if w4a4 else None
        group = {"targets": ["Linear"], "weights": nvfp4, "input_activations": inputs, "format": "nvfp4-pack-quantized"}
        return {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ignore,
        }
    algo = "NVFP4" if w4a4 else "W4A16_NVFP4"  # ModelOpt names its weight-only NVFP4 apart
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "exclude_modules": ignore}


def _ignore_list(fmt: str, family: str) -> tuple[list[str], Callable[[str], bool]]:
    """The layers kept in high precision (lm_head and, to exercise pattern matching, one attention
    projection per layer), in each format's pattern language, and the predicate they mean."""
    kept = "kv_a_proj_with_mqa" if family == "deepseek_v3" else "k_proj"
    if fmt == "compressed-tensors":
        patterns = ["lm_head", f"re:.*self_attn\\.{kept}$"]
    else:
        patterns = ["lm_head", f"model.layers.*.self_attn.{kept}"]
    return patterns, lambda name: name == "lm_head" or name.endswith(f"self_attn.{kept}")


def write_checkpoint(
    path: Path,
    family: str,
    fmt: str,
    *,
    w4a4: bool = True,
    fused_experts: bool = False,
    shards: int = 1,
    modelopt_config_file: bool = False,
    seed: int = 0,
    config_overrides: dict | None = None,
    tied_gate_up: bool = True,
) -> TinyCheckpoint:
    """Quantize a tiny random `family` model and write it to `path` as a `fmt` NVFP4 checkpoint.

    `fused_experts` stores each layer's experts as 3-D `experts.gate_up_proj` / `experts.down_proj`
    tensors instead of per-expert projections; `shards > 1` splits the tensors over that many files with
    a `model.safetensors.index.json`; `modelopt_config_file` puts ModelOpt's config in
    `hf_quant_config.json` instead of config.json. `tied_gate_up=False` gives each expert's gate and up
    projections global scales of their own (per-expert tensors only).
    """
    if fused_experts and not tied_gate_up:
        raise ValueError("fused experts store one global scale per expert: untied gate/up scales need per-expert tensors")
    config = tiny_config(family, **(config_overrides or {}))
    model = dense_model(config, seed)
    reference = copy.deepcopy(model)
    calibration = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(seed + 1))
    linear_amax, expert_amax = calibrate(model, calibration) if w4a4 else ({}, {})
    ignore, is_ignored = _ignore_list(fmt, family)
    tensors: dict[str, torch.Tensor] = {}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not is_ignored(name):
            q = quantize_linear(module.weight.detach(), input_amax=linear_amax.get(name) if w4a4 else None)
            tensors.update(q.tensors(name, fmt))
            reference.get_submodule(name).weight.data.copy_(q.dequantized(fmt))
        elif hasattr(module, "gate_up_proj"):
            tensors.update(_expert_tensors(name, module, reference.get_submodule(name), fmt, fused_experts,
                                           expert_amax.get(name), tied_gate_up))
    written_modules = {n.rsplit(".", 1)[0] for n in tensors}
    for name, tensor in model.state_dict().items():
        module_name, attr = name.rsplit(".", 1)
        # A quantized layer's weight is written above; its bias (GLM's attention) stays as it is.
        if (module_name in written_modules and attr != "bias") or ".experts." in name or name in tied:
            continue
        tensors[name] = tensor.detach().clone()

    save(path, tensors, shards)
    write_config(path, quantization_config(fmt, w4a4, ignore), config.to_dict(), modelopt_config_file)
    return TinyCheckpoint(path, reference.eval(), tensors)


def write_config(path: Path, qconfig: dict, model_config: dict, modelopt_config_file: bool = False) -> None:
    """config.json with `qconfig` as its quantization_config, or (ModelOpt's older exports) without it and
    `hf_quant_config.json` holding it."""
    model_config = dict(model_config)
    if modelopt_config_file:
        with open(path / "hf_quant_config.json", "w") as f:
            section = {k: v for k, v in qconfig.items() if k != "quant_method"}
            json.dump({"producer": {"name": "modelopt", "version": "0.0"}, "quantization": section}, f)
    else:
        model_config["quantization_config"] = qconfig
    with open(path / "config.json", "w") as f:
        json.dump(model_config, f)


def _expert_tensors(name, experts, reference_experts, fmt, fused, amax, tied_gate_up=True) -> dict[str, torch.Tensor]:
    intermediate = experts.intermediate_dim
    per_expert = []
    for e in range(experts.num_experts):
        gate_up = experts.gate_up_proj[e].detach()
        fc1_amax, fc2_amax = (None, None) if amax is None else (float(amax[0][e]), float(amax[1][e]))
        # Gate and up share the weight global scale, as llm-compressor does (and ModelOpt for calibrated
        # experts); untied, each half takes its own amax, as some published ModelOpt exports have it.
        tied_amax = gate_up.abs().amax() if tied_gate_up else None
        gate = quantize_linear(gate_up[:intermediate], tied_amax, fc1_amax)
        up = quantize_linear(gate_up[intermediate:], tied_amax, fc1_amax)
        down = quantize_linear(experts.down_proj[e].detach(), input_amax=fc2_amax)
        reference_experts.gate_up_proj.data[e] = torch.cat((gate.dequantized(fmt), up.dequantized(fmt)))
        reference_experts.down_proj.data[e] = down.dequantized(fmt)
        per_expert.append((gate, up, down))
    return expert_tensors(name, per_expert, fmt, fused)


def expert_tensors(name: str, per_expert: list, fmt: str, fused: bool) -> dict[str, torch.Tensor]:
    """The tensors of experts `name` from `(gate, up, down)` `QuantizedLinear`s: per expert
    (`<name>.{e}.gate_proj.*`), or fused 3-D (`<name>.gate_up_proj.*` `[E, 2I, H/2]` with `[gate; up]`
    rows and one global scale per expert, which needs gate and up to share it; `<name>.down_proj.*`)."""
    out = {}
    if not fused:
        for e, layers in enumerate(per_expert):
            for projection, q in zip(("gate_proj", "up_proj", "down_proj"), layers):
                out.update(q.tensors(f"{name}.{e}.{projection}", fmt))
        return out
    kinds = (("gate_up_proj", [(g, u) for g, u, _ in per_expert]), ("down_proj", [(d,) for *_, d in per_expert]))
    for projection, parts in kinds:
        stacked = [
            QuantizedLinear(torch.cat([q.codes for q in p]), torch.cat([q.block_scales for q in p]),
                            p[0].decode_scale, p[0].input_amax).tensors(f"{name}.{projection}", fmt)
            for p in parts
        ]
        out.update({key: torch.stack([s[key] for s in stacked]) for key in stacked[0]})
    return out


def save(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """safetensors: one file, or `shards` files and a `model.safetensors.index.json`."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ---------------------------------------------------------------------------------------------------
# W4A4: the reference with NVFP4 expert activations
# ---------------------------------------------------------------------------------------------------
def decode_activation(packed: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """FP32 `e2m1 * block_scale` of activation codes [M, K/2] with linear scales [M, K/16]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
    return _E2M1[codes.long()] * block_scales.float().repeat_interleave(16, dim=1)


def fake_quantize(x: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """x through NVFP4 and back: per-tensor with an encode-direction `global_scale`, else per-token."""
    ops = torch.ops.fp4moe
    if global_scale is None:
        codes, scales, per_token_scale = ops.quantize_per_token(x.to(torch.bfloat16), sf_layout="linear")
        return decode_activation(codes, scales) * per_token_scale[:, None]
    codes, scales = ops.quantize(x, global_scale.reshape(1), sf_layout="linear")
    return decode_activation(codes, scales) * (1.0 / global_scale.reshape(()))


def activation_quantized_reference(ck: TinyCheckpoint, fmt: str, per_token: bool) -> nn.Module:
    """`ck.reference` with each MoE layer's expert activations through NVFP4 as a W4A4 MoE computes them:
    the bf16 layer input and every expert's SwiGLU output quantized (per token, the intermediate first
    materialized in bf16; or per tensor: the layer input with the largest amax any expert of the layer
    was calibrated with, every expert's intermediate with its own scale, from the written tensors), FP32
    GEMMs over the dequantized weights,
    the routed sum rounded once to bf16."""
    reference = copy.deepcopy(ck.reference)
    suffix = "input_global_scale" if fmt == "compressed-tensors" else "input_scale"
    for name, module in reference.named_modules():
        if hasattr(module, "gate_up_proj"):
            scales = None
            if not per_token:
                stored = [
                    (k, v.reshape(-1)) for k, v in ck.tensors.items() if k.startswith(f"{name}.") and k.endswith(suffix)
                ]
                fc1 = torch.cat([v for k, v in stored if not k.endswith(f"down_proj.{suffix}")])
                fc2 = torch.cat([v for k, v in stored if k.endswith(f"down_proj.{suffix}")])
                if fmt == "modelopt":  # decode-direction scales
                    fc1, fc2 = 1.0 / fc1, 1.0 / fc2
                scales = (fc1.min(), fc2)
            module.forward = _nvfp4_activation_experts(module, scales)
    return reference


def _nvfp4_activation_experts(experts: nn.Module, scales):
    fc1_scale, fc2_scale = (None, None) if scales is None else scales

    def forward(hidden_states, top_k_index, top_k_weights):
        x = fake_quantize(hidden_states.to(torch.bfloat16).float(), fc1_scale)
        out = torch.zeros(x.shape, dtype=torch.float32)
        intermediate = experts.intermediate_dim
        for e in range(experts.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate_up = x[token] @ experts.gate_up_proj[e].float().T
            act = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            if fc2_scale is None:
                act = act.to(torch.bfloat16).float()  # per-token W4A4 materializes the intermediate in bf16
            down = fake_quantize(act, None if fc2_scale is None else fc2_scale[e]) @ experts.down_proj[e].float().T
            out.index_add_(0, token, down * top_k_weights[token, slot, None].float())
        return out.to(torch.bfloat16).to(hidden_states.dtype)

    return forward
