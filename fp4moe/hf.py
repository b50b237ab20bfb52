"""Hugging Face transformers drop-in: an NVFP4 checkpoint's MoE layers served by `fp4moe.FusedMoE`.

    model = fp4moe.hf.from_pretrained("path/to/Qwen3-30B-A3B-NVFP4", dtype=torch.bfloat16)

builds the model from the checkpoint's config on the meta device and loads it with
`load_nvfp4_checkpoint`, which also serves a model the caller built (`from_config`, on the meta device or
with weights): every supported MoE block becomes an `NVFP4MoEBlock`, and every other tensor is loaded
from the checkpoint, NVFP4 linear layers dequantized.

Importing this module needs `transformers` and `safetensors` (the `fp4moe[hf]` extra); `import fp4moe`
does not import it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from torch import nn

from fp4moe.checkpoint import NVFP4Checkpoint, warn_reduced_activation_scales
from fp4moe.module import FusedMoE

DENSE_LAYER_MODES = ("dequantize", "skip")


class NVFP4MoEBlock(nn.Module):
    """A transformers MoE block with its experts in `fp4moe.FusedMoE`.

    `gate` is the model's own router module, unchanged and in its own precision (DeepSeek-V3's FP32
    router stays FP32 in a bf16 model); its logits are what `output_router_logits=True` records, and
    `moe` routes from them with fp4moe's routing op (the router module's own top-k result is not used:
    O(tokens x experts) work, which `torch.compile` removes). `shared_experts` (DeepSeek-V3) is the model's
    dense module, added to the routed output as transformers does. Returns the input's dtype.
    """

    def __init__(self, gate: nn.Module, moe: FusedMoE, shared_experts: nn.Module | None = None):
        super().__init__()
        self.gate = gate
        self.moe = moe
        self.shared_experts = shared_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)[0]
        out = self.moe(hidden_states, router_logits)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


# ---------------------------------------------------------------------------------------------------
# Supported blocks: the routing of each, read from its router module (transformers 5 layout: fused
# `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`, a `gate` router module)
# ---------------------------------------------------------------------------------------------------
def _softmax_routing(block: nn.Module) -> dict:
    """Qwen3-MoE: softmax over the experts, top-k, renormalized when `norm_topk_prob`."""
    return dict(top_k=block.gate.top_k, routing="softmax", renormalize=bool(block.gate.norm_topk_prob))


def _deepseek_v3_routing(block: nn.Module) -> dict:
    """DeepSeek-V3 and GLM-4.5 (whose router is DeepSeek-V3's): grouped sigmoid routing with the
    correction bias and the routed scaling factor."""
    gate = block.gate
    return dict(
        top_k=gate.top_k, routing="deepseek_v3", renormalize=bool(gate.norm_topk_prob),
        correction_bias=gate.e_score_correction_bias.detach().float().clone(),
        n_group=gate.num_group, topk_group=gate.topk_group, routed_scaling_factor=float(gate.routed_scaling_factor),
    )


MOE_BLOCKS: dict[str, Callable[[nn.Module], dict]] = {
    "Qwen3MoeSparseMoeBlock": _softmax_routing,
    "DeepseekV3MoE": _deepseek_v3_routing,
    "Glm4MoeMoE": _deepseek_v3_routing,
}
"""transformers MoE block class name -> the `FusedMoE` routing options of a block of that class."""


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------
def from_pretrained(
    checkpoint: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    model_class=None,
    **options,
) -> nn.Module:
    """Build `model_class` (default `transformers.AutoModelForCausalLM`) from the checkpoint's config on
    the meta device, in `dtype`, and load it with `load_nvfp4_checkpoint(model, checkpoint, device=device,
    **options)`: no random initialization, no weights in host memory but the model's own."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    model_class = transformers.AutoModelForCausalLM if model_class is None else model_class
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=dtype)
    return load_nvfp4_checkpoint(model, checkpoint, device=device, **options)


def load_nvfp4_checkpoint(
    model: nn.Module,
    checkpoint: str | Path,
    *,
    quant_mode: str | None = None,
    per_token_activation: bool = False,
    dense_layers: str = "dequantize",
    device: str | torch.device | None = None,
    **moe_options,
) -> nn.Module:
    """Serve an NVFP4 checkpoint (compressed-tensors or ModelOpt, `fp4moe.checkpoint`) with `model`, in place.

    - Every supported MoE block (`MOE_BLOCKS`) becomes an `NVFP4MoEBlock` whose `FusedMoE` holds the
      checkpoint's NVFP4 experts and routes like the model (`renormalize`, DeepSeek-V3 groups, bias and
      scaling factor from the model's router module).
    - `quant_mode`: `"w4a4"` (default for checkpoints with activation scales; per-tensor with the
      checkpoint's scales, reduced to one per layer and GEMM as `NVFP4MoELayer.activation_scales` explains,
      or dynamic per-token scales with `per_token_activation=True`) or `"w4a16"` (default for NVFP4A16
      checkpoints; bf16 activations, the weights alone quantized).
    - `dense_layers="dequantize"` (default) loads every other NVFP4 linear layer (attention projections,
      DeepSeek's dense MLPs and shared experts) dequantized to the model's dtype: `e2m1 * sf * RN(1/gs)` in
      FP32, rounded once; they run unquantized, and their activation scales are not used.
      `dense_layers="skip"` leaves those modules exactly as they are, for a caller that serves them with an
      NVFP4 linear of its own; `model.fp4moe_skipped_layers` lists them.
    - Every other tensor (embeddings, norms, routers, unquantized layers) is loaded as stored, cast to the
      dtype of the model's tensor; a tensor the model expects and the checkpoint lacks raises, naming it
      (weights tied to another, e.g. `lm_head.weight` with `tie_word_embeddings`, are tied instead).
    - Tensors go to `device` (default: where the model's tensors are, the CPU for a meta-device model);
      the model is put in eval mode with `requires_grad=False` (the fp4moe ops are inference-only).
    - `moe_options` are passed on to every `FusedMoE` (e.g. `deterministic=True`).

    Tensors are read memory-mapped, one at a time. Returns `model`.
    """
    if dense_layers not in DENSE_LAYER_MODES:
        raise ValueError(f"dense_layers must be one of {DENSE_LAYER_MODES}, got {dense_layers!r}")
    quantization_config = getattr(model.config, "quantization_config", None)
    if quantization_config is not None and not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    ckpt = NVFP4Checkpoint(checkpoint, quantization_config)
    quant_mode = _quant_mode(ckpt, quant_mode, per_token_activation)
    per_tensor_w4a4 = quant_mode == "w4a4" and not per_token_activation
    hidden_act = getattr(model.config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise NotImplementedError(f"fp4moe serves SwiGLU (hidden_act='silu') experts, the model has {hidden_act!r}")

    blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ in MOE_BLOCKS]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block fp4moe serves ({', '.join(MOE_BLOCKS)})")
    expert_prefixes = tuple(f"{name}.experts." for name, _ in blocks)
    skipped = _load_dense_tensors(model, ckpt, expert_prefixes, dense_layers, device)

    reduced = []
    for name, block in blocks:
        experts = block.experts
        layer = ckpt.moe_layer(
            f"{name}.experts", experts.num_experts, experts.hidden_dim, experts.intermediate_dim,
            activation_scales=per_tensor_w4a4,
        )
        # The module is built on the target device, where the router (and DeepSeek-V3's correction bias)
        # already are, with the checkpoint's experts and scales moved there first: the weights' prepared
        # layout is then made on that device, a GPU's included.
        target = _target_device(block.gate.weight, device)
        scales = {}
        if per_tensor_w4a4:
            fc1, fc2, exact = layer.activation_scales()
            scales = dict(fc1_input_scale=fc1.to(target), fc2_input_scale=fc2.to(target))
            if not exact:
                reduced.append(name)
        routing = MOE_BLOCKS[type(block).__name__](block)
        moe = FusedMoE(
            None, layer.weights.to(target), routing.pop("top_k"), quant_mode=quant_mode,
            per_token_activation=per_token_activation, **routing, **scales, **moe_options,
        )
        model.set_submodule(name, NVFP4MoEBlock(block.gate, moe, getattr(block, "shared_experts", None)))
    warn_reduced_activation_scales(reduced)

    _materialize_remaining(model, device)
    model.fp4moe_skipped_layers = skipped
    model.eval()
    model.requires_grad_(False)
    return model


def _quant_mode(ckpt: NVFP4Checkpoint, quant_mode: str | None, per_token_activation: bool) -> str:
    if quant_mode is None:
        quant_mode = "w4a4" if ckpt.format.activation_scales or per_token_activation else "w4a16"
    if quant_mode not in ("w4a4", "w4a16"):
        raise ValueError(f"quant_mode must be 'w4a4' or 'w4a16', got {quant_mode!r}")
    if quant_mode == "w4a16" and per_token_activation:
        raise ValueError("per_token_activation applies to quant_mode='w4a4' only")
    if quant_mode == "w4a4" and not per_token_activation and not ckpt.format.activation_scales:
        raise ValueError(
            f"per-tensor W4A4 needs the checkpoint's activation scales, and this {ckpt.format.name} checkpoint "
            "is W4A16 (no input scales): use quant_mode='w4a16' or per_token_activation=True"
        )
    return quant_mode


def _target_device(like: torch.Tensor, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cpu") if like.is_meta else like.device


def _load_dense_tensors(model, ckpt: NVFP4Checkpoint, expert_prefixes: tuple, dense_layers: str, device) -> list[str]:
    """Load every parameter and persistent buffer of `model` outside the experts; returns the NVFP4
    linear layers left alone by `dense_layers="skip"`."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    skipped, tie_needed = [], False
    for module_name, module in model.named_modules():
        if (module_name + ".").startswith(expert_prefixes):
            continue
        persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for attr in [*module._parameters, *persistent]:
            current = getattr(module, attr)
            if current is None:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            if isinstance(module, nn.Linear) and attr == "weight" and ckpt.format.is_quantized(module_name):
                if dense_layers == "skip":
                    skipped.append(module_name)
                    continue
                value = ckpt.linear(module_name, tuple(current.shape)).dequantize(torch.float32)
            elif name not in ckpt and name in tied:
                tie_needed = True
                continue
            else:
                value = ckpt.tensor(name, f"{type(model).__name__}.{name}")
                if tuple(value.shape) != tuple(current.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {list(value.shape)}, "
                        f"the model expects {list(current.shape)}"
                    )
                if value.is_floating_point() != current.is_floating_point():
                    raise TypeError(f"checkpoint tensor {name!r} is {value.dtype}, the model expects {current.dtype}")
            _assign(module, attr, value.to(device=_target_device(current, device), dtype=current.dtype, copy=True))
    if tie_needed:
        model.tie_weights()
    return skipped


def _assign(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    """Replace the tensor (works for meta-device models). `_is_hf_initialized` tells transformers' init
    functions not to overwrite it."""
    if attr in module._parameters:
        value = nn.Parameter(value, requires_grad=False)
    value._is_hf_initialized = True
    (module._parameters if attr in module._parameters else module._buffers)[attr] = value


def _materialize_remaining(model, device) -> None:
    """Non-persistent buffers of a meta-device model (rotary frequencies) are computed, not stored: they are
    allocated and initialized by the model's own `_init_weights`. Anything else still on the meta device
    was neither in the checkpoint nor computable."""
    target = torch.device("cpu") if device is None else torch.device(device)
    for module in model.modules():
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            module.to_empty(device=target, recurse=False)
            model._init_weights(module)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"after loading, {len(left)} tensor(s) are neither in the checkpoint nor computed: {left[:5]}")
