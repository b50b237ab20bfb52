"""Reading NVFP4 checkpoints: compressed-tensors (llm-compressor) and NVIDIA ModelOpt.

Both formats store every quantized linear layer `<p>` (a module path such as
`model.layers.3.mlp.experts.7.gate_proj`) as three or four safetensors tensors; SPEC §1 fixes what the
numbers mean:

| tensor | compressed-tensors `nvfp4-pack-quantized` | ModelOpt `NVFP4` |
|---|---|---|
| E2M1 codes `uint8 [N, K/2]` (element 2i in the low nibble) | `<p>.weight_packed` | `<p>.weight` |
| E4M3 block scales `[N, K/16]`, linear layout | `<p>.weight_scale` | `<p>.weight_scale` |
| weight global scale, FP32 | `<p>.weight_global_scale`, encode `2688/amax` | `<p>.weight_scale_2`, decode `amax/2688` |
| activation global scale (W4A4 only) | `<p>.input_global_scale`, encode | `<p>.input_scale`, decode |

The format is read from the checkpoint's `config.json` (`quantization_config`) or, for ModelOpt exports
that carry it, `hf_quant_config.json`; layers left in high precision are listed in `ignore`
(compressed-tensors: module names or `re:` regular expressions) or `exclude_modules` (ModelOpt: `fnmatch`
wildcards) and are stored as a plain `<p>.weight`. NVFP4A16 compressed-tensors checkpoints have no
activation scales.

Tensors are read from memory-mapped safetensors files (one file, or shards listed by
`model.safetensors.index.json`) one at a time, so the only host copies are the ones the caller keeps.

MoE layers (`NVFP4Checkpoint.moe_layer`) are assembled into `fp4moe.MoEWeights` from per-expert
projections (`<experts>.{e}.gate_proj / up_proj / down_proj`, the Hugging Face checkpoint convention) or
from fused 3-D tensors (`<experts>.gate_up_proj` `[E, 2I, H/2]` with `[gate; up]` rows and
`<experts>.down_proj` `[E, H, I/2]`, with the same suffixes). Two facts of the MoE op contract shape what
can be represented exactly; both choices are explained where they are made:
- one weight global scale per expert for the whole `[gate; up]` GEMM where the checkpoint's gate and up
  scales allow it exactly, else one per half (`join_gate_up`), and
- one activation global scale per layer for GEMM1, one per expert for GEMM2 (`NVFP4MoELayer.activation_scales`).
"""

from __future__ import annotations

import fnmatch
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4moe import nvfp4
from fp4moe.weights import MoEWeights, moe_weights_from_nvfp4

CHECKPOINT_FORMATS = ("compressed-tensors", "modelopt")
COMPRESSED_TENSORS_NVFP4 = "nvfp4-pack-quantized"
MODELOPT_NVFP4 = "NVFP4"
MODELOPT_NVFP4_WEIGHT_ONLY = "W4A16_NVFP4"
"""ModelOpt's weight-only NVFP4 (no activation scales), which its mixed-precision exports name per layer."""
NVFP4_SPEC = (4, "float", nvfp4.BLOCK_SIZE)
"""compressed-tensors' (num_bits, type, group_size) of NVFP4 weights and activations."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
MODELOPT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class TensorNames:
    """The suffixes one format gives a quantized layer's tensors, and the direction of its global scales."""

    codes: str
    block_scales: str
    weight_global_scale: str
    input_global_scale: str
    decode_direction: bool
    """True when the stored global scales are decode scales (`amax / 2688`, ModelOpt)."""


TENSOR_NAMES = {
    "compressed-tensors": TensorNames(
        "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", False
    ),
    "modelopt": TensorNames("weight", "weight_scale", "weight_scale_2", "input_scale", True),
}


@dataclass(frozen=True)
class NVFP4Format:
    """What a checkpoint's quantization config says: the format, whether activation scales are stored
    (W4A4) or not (W4A16), which modules are quantized (`targets`) and which are not (`ignore`)."""

    name: str
    activation_scales: bool
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)

    @property
    def tensor_names(self) -> TensorNames:
        return TENSOR_NAMES[self.name]

    def is_ignored(self, module_name: str) -> bool:
        """Whether the config lists `module_name` as kept in high precision."""
        if self.name == "modelopt":
            return any(fnmatch.fnmatchcase(module_name, pattern) for pattern in self.ignore)
        return any(_compressed_tensors_match(module_name, pattern) for pattern in self.ignore)

    def is_quantized(self, module_name: str, class_name: str = "Linear") -> bool:
        """Whether the config quantizes the module `module_name` of class `class_name` to NVFP4.

        compressed-tensors targets are class names (`Linear`), module names or `re:` patterns; ModelOpt
        NVFP4 quantizes every linear layer. Either way the ignore list wins.
        """
        targeted = any(
            pattern == class_name or _compressed_tensors_match(module_name, pattern) for pattern in self.targets
        )
        return targeted and not self.is_ignored(module_name)


def _compressed_tensors_match(module_name: str, pattern: str) -> bool:
    """compressed-tensors' rule: `re:<regex>` matches from the start of the name, anything else is a name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return module_name == pattern


# ---------------------------------------------------------------------------------------------------
# Format detection
# ---------------------------------------------------------------------------------------------------
def detect_format(quantization_config: dict | None, hf_quant_config: dict | None = None) -> NVFP4Format:
    """The NVFP4 format of a checkpoint from `config.json`'s `quantization_config` and/or ModelOpt's
    `hf_quant_config.json`. Raises `ValueError` for a missing or unknown format and
    `NotImplementedError` for a known format in a variant fp4moe does not serve."""
    if quantization_config is None and hf_quant_config is None:
        raise ValueError(
            f"the checkpoint has no quantization config (neither config.json's quantization_config nor "
            f"{MODELOPT_CONFIG}); fp4moe reads {CHECKPOINT_FORMATS} NVFP4 checkpoints"
        )
    method = (quantization_config or {}).get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization_config)
    if method == "modelopt" or (quantization_config is None and hf_quant_config is not None):
        return _modelopt_format(quantization_config or {}, hf_quant_config or {})
    raise ValueError(
        f"unknown quantization format: quant_method={method!r}; fp4moe reads compressed-tensors "
        f"'{COMPRESSED_TENSORS_NVFP4}' (llm-compressor) and ModelOpt '{MODELOPT_NVFP4}' checkpoints"
    )


def _compressed_tensors_format(config: dict) -> NVFP4Format:
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    activation_scales, targets = set(), []
    for group_name, group in groups.items():
        fmt = group.get("format") or config.get("format")  # a group's null format is the config's
        if fmt != COMPRESSED_TENSORS_NVFP4:
            raise ValueError(
                f"unknown quantization format: compressed-tensors format {fmt!r} in config group {group_name!r}; "
                f"fp4moe reads '{COMPRESSED_TENSORS_NVFP4}'"
            )
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != NVFP4_SPEC:
            raise NotImplementedError(
                f"config group {group_name!r}: weights {weights} are not NVFP4 (4-bit float, group 16)"
            )
        inputs = group.get("input_activations")
        if inputs is not None and (inputs.get("num_bits"), inputs.get("type"), inputs.get("group_size")) != NVFP4_SPEC:
            raise NotImplementedError(f"config group {group_name!r}: input activations {inputs} are not NVFP4")
        activation_scales.add(inputs is not None)
        targets += list(group.get("targets") or ["Linear"])
    if len(activation_scales) != 1:
        raise NotImplementedError("config groups mix W4A4 and W4A16 NVFP4; fp4moe serves one activation mode")
    return NVFP4Format("compressed-tensors", activation_scales.pop(), tuple(config.get("ignore") or ()), tuple(targets))


def _modelopt_format(config: dict, hf_quant_config: dict) -> NVFP4Format:
    """`NVFP4` (W4A4: activation scales stored) or `W4A16_NVFP4` (weights only), in any letter case, as
    vLLM reads them. An `NVFP4` config whose `config_groups` (newer exports, compressed-tensors' schema)
    all have `input_activations: null` is weight-only too."""
    section = hf_quant_config.get("quantization", {})
    algo = config.get("quant_algo", section.get("quant_algo"))
    name = algo.upper() if isinstance(algo, str) else algo
    if name not in (MODELOPT_NVFP4, MODELOPT_NVFP4_WEIGHT_ONLY):
        raise NotImplementedError(
            f"ModelOpt quant_algo {algo!r} is not served; fp4moe reads '{MODELOPT_NVFP4}' and "
            f"'{MODELOPT_NVFP4_WEIGHT_ONLY}'"
        )
    group_size = config.get("group_size", section.get("group_size", nvfp4.BLOCK_SIZE))
    if group_size != nvfp4.BLOCK_SIZE:
        raise NotImplementedError(f"ModelOpt NVFP4 group_size {group_size}; NVFP4 blocks have {nvfp4.BLOCK_SIZE}")
    activation_scales = name == MODELOPT_NVFP4
    groups = (config.get("config_groups") or {}).values()
    if activation_scales and groups:
        quantized_inputs = {group.get("input_activations") is not None for group in groups}
        if len(quantized_inputs) != 1:
            raise NotImplementedError("config groups mix W4A4 and W4A16 NVFP4; fp4moe serves one activation mode")
        activation_scales = quantized_inputs.pop()
    ignore = config.get("exclude_modules", config.get("ignore", section.get("exclude_modules", ())))
    return NVFP4Format("modelopt", activation_scales, tuple(ignore or ()))


def read_format(checkpoint_dir: str | Path, quantization_config: dict | None = None) -> NVFP4Format:
    """`detect_format` from the files of a checkpoint directory (`config.json`, `hf_quant_config.json`).
    `quantization_config` (e.g. a loaded model's `config.quantization_config`) is used when config.json
    has none."""
    directory = Path(checkpoint_dir)
    config = _read_json(directory / "config.json") or {}
    hf_quant_config = _read_json(directory / MODELOPT_CONFIG)
    return detect_format(config.get("quantization_config", quantization_config), hf_quant_config)


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------
class SafetensorsFiles:
    """The tensors of a safetensors checkpoint directory, memory-mapped and opened lazily.

    With `model.safetensors.index.json` the index's `weight_map` says which shard holds each tensor;
    without it every `*.safetensors` file of the directory is read.
    """

    def __init__(self, directory: str | Path):
        from safetensors import safe_open  # the `hf` extra; not needed to import fp4moe

        self.directory = Path(directory)
        self._safe_open = safe_open
        self._handles: dict[str, object] = {}
        index = _read_json(self.directory / SAFETENSORS_INDEX)
        if index is not None:
            self._file_of = dict(index["weight_map"])
            for file in sorted(set(self._file_of.values())):
                if not (self.directory / file).exists():
                    raise FileNotFoundError(f"{SAFETENSORS_INDEX} names shard {file!r}, not in {self.directory}")
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
            self._file_of = {name: file for file in files for name in self._handle(file).keys()}

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._safe_open(str(self.directory / file), framework="pt", device="cpu")
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str, needed_for: str = "") -> torch.Tensor:
        """The tensor `name`, memory-mapped (not copied); raises `ValueError` naming it when it is missing."""
        if name not in self._file_of:
            reason = f" (needed for {needed_for})" if needed_for else ""
            raise ValueError(f"checkpoint {self.directory} has no tensor {name!r}{reason}")
        return self._handle(self._file_of[name]).get_tensor(name)


def _check_dtype(name: str, tensor: torch.Tensor, dtypes: tuple) -> None:
    if tensor.dtype not in dtypes:
        expected = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        actual = str(tensor.dtype).removeprefix("torch.")
        raise TypeError(f"checkpoint tensor {name!r} must be {expected}, got {actual}")


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} must have shape {list(shape)}, got {list(tensor.shape)}")


def _scalar_scales(name: str, tensor: torch.Tensor, count: int, decode_direction: bool) -> torch.Tensor:
    """`count` global scales (FP32, stored `[]`, `[1]`, `[count]` or `[count, 1]`) in the encode direction."""
    _check_dtype(name, tensor, (torch.float32,))
    if tensor.numel() != count:
        raise ValueError(f"checkpoint tensor {name!r} must hold {count} global scale(s), got {list(tensor.shape)}")
    scales = tensor.reshape(count).float()
    if decode_direction:
        scales = nvfp4.global_scale_from_decode_scale(scales)
    if torch.isnan(scales).any() or (scales <= 0).any():
        values = tensor.reshape(-1)[:8].tolist()
        raise ValueError(f"checkpoint tensor {name!r} holds a non-positive or NaN global scale: {values}")
    return scales


@dataclass(frozen=True)
class NVFP4Linear:
    """One quantized linear layer's weight `[N, K]` as stored, with encode-direction global scales."""

    codes: torch.Tensor
    """uint8 [N, K/2], element 2i in the low nibble."""
    block_scales: torch.Tensor
    """float8_e4m3fn [N, K/16], linear layout."""
    global_scale: torch.Tensor
    """FP32 [1], encode direction (`2688 / amax`)."""
    input_global_scale: torch.Tensor | None
    """FP32 [1], encode direction; None for W4A16 checkpoints or when not asked for."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`e2m1 * sf * RN(1 / gs)` in FP32 (one rounding: `e2m1 * sf` is exact), then cast to `dtype`."""
        decoded = nvfp4.dequantize_blocks(self.codes, self.block_scales)
        return (decoded * nvfp4.decode_scale_from_global_scale(self.global_scale)).to(dtype)


# ---------------------------------------------------------------------------------------------------
# Gate and up halves of one expert
# ---------------------------------------------------------------------------------------------------
def join_gate_up(
    gate_scales: torch.Tensor,
    gate_global_scale: torch.Tensor,
    up_scales: torch.Tensor,
    up_global_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block scales of the `[gate; up]` rows and their global scales, exactly: FP32 [2] (gate, up).

    Where the two global scales (encode direction, FP32 [1] each) are equal, both entries are that
    scale. Where they differ by a power of two, one half's E4M3 block scales are re-expressed for the
    other half's global scale, `sf' = sf * gs_other / gs_own`, if every `sf'` is itself an E4M3 value
    (no saturation past 448, no bits lost below E4M3's subnormals), so that one alpha serves the expert
    as before. Otherwise each half keeps its own global scale, and `MoEWeights` holds `[2, E]`: `fused_moe`
    then takes `w1_alpha` per half (semantics §3.3). The checkpoint's codes are never touched.
    llm-compressor ties the two scales, as ModelOpt does for experts that saw calibration tokens;
    published ModelOpt exports of GLM and DeepSeek-V3-style models also have untied ones (ratios up to 10x).
    """
    if torch.equal(gate_global_scale, up_global_scale):
        return gate_scales, up_scales, torch.cat((gate_global_scale, gate_global_scale))
    gate_exponent = torch.frexp(gate_global_scale)
    up_exponent = torch.frexp(up_global_scale)
    if torch.equal(gate_exponent.mantissa, up_exponent.mantissa):
        shift = int(gate_exponent.exponent - up_exponent.exponent)  # gs_gate = gs_up * 2^shift
        rescaled_up = _rescale_exactly(up_scales, shift)
        if rescaled_up is not None:
            return gate_scales, rescaled_up, torch.cat((gate_global_scale, gate_global_scale))
        rescaled_gate = _rescale_exactly(gate_scales, -shift)
        if rescaled_gate is not None:
            return rescaled_gate, up_scales, torch.cat((up_global_scale, up_global_scale))
    return gate_scales, up_scales, torch.cat((gate_global_scale, up_global_scale))


def _w1_global_scales(pairs: torch.Tensor) -> torch.Tensor:
    """`MoEWeights.w1_global_scale` from each expert's (gate, up) global scales `[E, 2]`: `[E]` where
    every expert's two are one, else `[2, E]`."""
    return pairs[:, 0].clone() if torch.equal(pairs[:, 0], pairs[:, 1]) else pairs.t().contiguous()


def _rescale_exactly(block_scales: torch.Tensor, shift: int) -> torch.Tensor | None:
    """`block_scales * 2^shift` as E4M3 if every product is an E4M3 value, else None."""
    scaled = torch.ldexp(block_scales.float(), torch.tensor(float(shift)))
    rounded = nvfp4.to_e4m3(scaled)
    return rounded if torch.equal(rounded.float(), scaled) else None


# ---------------------------------------------------------------------------------------------------
# MoE layers
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NVFP4MoELayer:
    """One MoE layer's NVFP4 experts and, for W4A4 checkpoints, their stored activation scales.

    `fc1_input_scales` (FP32 [E, 2]: the gate and up projections' scales of each expert) and
    `fc2_input_scales` (FP32 [E], the down projections') are encode-direction global scales as the
    checkpoint stores them (ModelOpt's decode scales converted); `activation_scales` gives what
    `fused_moe` takes: one FC1 scale per layer (reduced), the FC2 scales per expert (exact).
    """

    weights: MoEWeights
    fc1_input_scales: torch.Tensor | None = None
    fc2_input_scales: torch.Tensor | None = None

    def activation_scales(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`(fc1_input_scale, fc2_input_scale, exact)`, encode direction, for per-tensor W4A4.

        `fc2_input_scale` is the down projections' per-expert scales as stored, FP32 [E]: fused_moe
        quantizes each expert's intermediate rows with their expert's scale and decodes them with its
        `w2_alpha`, which is exact. `fc1_input_scale` is FP32 [1]: fused_moe quantizes a token's
        activation once for all of its experts, so GEMM1 gets one scale per layer, the smallest encode
        scale, i.e. the largest calibrated amax, which clips no expert's calibrated range (FlashInfer's
        convention, which vLLM and SGLang follow for their FlashInfer NVFP4 MoE backends:
        `input_scale.max()` over all experts of the decode scales). `exact` says whether every expert
        stored that same FC1 scale, in which case nothing was reduced.
        """
        if self.fc1_input_scales is None or self.fc2_input_scales is None:
            raise ValueError("this layer has no activation scales (a W4A16 checkpoint, or loaded without them)")
        fc1 = self.fc1_input_scales.min().reshape(1)
        exact = bool((self.fc1_input_scales == fc1).all())
        return fc1, self.fc2_input_scales.float().contiguous(), exact


class NVFP4Checkpoint:
    """A safetensors NVFP4 checkpoint directory: its format (`NVFP4Format`) and typed, checked tensors.

    Every tensor read is checked for presence, dtype and shape, and a failure names the tensor. Pass
    `quantization_config` (e.g. a loaded model's `config.quantization_config`) for a directory whose
    config.json carries none.
    """

    def __init__(self, checkpoint_dir: str | Path, quantization_config: dict | None = None):
        self.directory = Path(checkpoint_dir)
        self.format = read_format(self.directory, quantization_config)
        self.files = SafetensorsFiles(self.directory)

    @property
    def names(self) -> TensorNames:
        return self.format.tensor_names

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str, needed_for: str = "") -> torch.Tensor:
        return self.files.get(name, needed_for)

    def linear(self, prefix: str, shape: tuple[int, int] | None = None, input_scale: bool = False) -> NVFP4Linear:
        """The NVFP4 weight of layer `prefix`, `[N, K]` = `shape` when given (checked)."""
        names = self.names
        codes_name = f"{prefix}.{names.codes}"
        codes = self.tensor(codes_name, f"the NVFP4 layer {prefix}")
        if codes.dtype == torch.float4_e2m1fn_x2:
            codes = nvfp4.codes_from_float4_e2m1fn_x2(codes)
        _check_dtype(codes_name, codes, (torch.uint8,))
        if codes.dim() != 2:
            raise ValueError(f"checkpoint tensor {codes_name!r} must be 2-D [N, K/2], got shape {list(codes.shape)}")
        rows, cols = shape if shape is not None else (codes.shape[0], codes.shape[1] * 2)
        if cols % nvfp4.BLOCK_SIZE:
            raise ValueError(f"checkpoint tensor {codes_name!r}: K = {cols} is not a multiple of {nvfp4.BLOCK_SIZE}")
        _check_shape(codes_name, codes, (rows, cols // 2))
        scales_name = f"{prefix}.{names.block_scales}"
        block_scales = self.tensor(scales_name, f"the NVFP4 layer {prefix}")
        _check_dtype(scales_name, block_scales, (torch.float8_e4m3fn,))
        _check_shape(scales_name, block_scales, (rows, cols // nvfp4.BLOCK_SIZE))
        gs_name = f"{prefix}.{names.weight_global_scale}"
        stored = self.tensor(gs_name, f"the NVFP4 layer {prefix}")
        global_scale = _scalar_scales(gs_name, stored, 1, names.decode_direction)
        input_global_scale = None
        if input_scale:
            in_name = f"{prefix}.{names.input_global_scale}"
            needed_for = (
                f"the W4A4 layer {prefix}: per-tensor W4A4 takes the checkpoint's activation scales; load a "
                "checkpoint without them with quant_mode='w4a16' or per_token_activation=True"
            )
            input_global_scale = _scalar_scales(in_name, self.tensor(in_name, needed_for), 1, names.decode_direction)
        return NVFP4Linear(codes, block_scales, global_scale, input_global_scale)

    def moe_layer(
        self,
        experts_prefix: str,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation_scales: bool | None = None,
    ) -> NVFP4MoELayer:
        """The SwiGLU experts under `experts_prefix` (e.g. `model.layers.3.mlp.experts`) as `MoEWeights`
        (w1 `[E, 2I, H/2]` with `[gate; up]` rows, w2 `[E, H, I/2]`), from per-expert or fused tensors.

        `activation_scales` (default: whether the checkpoint is W4A4) also reads the activation scales.
        """
        if activation_scales is None:
            activation_scales = self.format.activation_scales
        if activation_scales and not self.format.activation_scales:
            raise ValueError(f"activation scales were asked for, but this {self.format.name} checkpoint is W4A16")
        projections = ("gate_proj", "up_proj", "down_proj")
        names = [f"{experts_prefix}.{e}.{p}" for e in range(num_experts) for p in projections]
        ignored = [name for name in names if self.format.is_ignored(name)]
        if ignored:
            raise ValueError(
                f"{ignored[0]} is in the checkpoint's ignore list (not quantized); fp4moe serves NVFP4 experts only"
            )
        fused = f"{experts_prefix}.gate_up_proj.{self.names.codes}" in self.files
        load = self._fused_experts if fused else self._per_expert
        return load(experts_prefix, num_experts, hidden_size, intermediate_size, activation_scales)

    def _per_expert(self, prefix, experts, hidden, intermediate, activation_scales) -> NVFP4MoELayer:
        # Filled in place, so the only copy of the experts is the stacked one.
        w1 = torch.empty(experts, 2 * intermediate, hidden // 2, dtype=torch.uint8)
        w1_scales = torch.empty(experts, 2 * intermediate, hidden // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn)
        w2 = torch.empty(experts, hidden, intermediate // 2, dtype=torch.uint8)
        w2_scales = torch.empty(experts, hidden, intermediate // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn)
        w1_gs, w2_gs = torch.empty(experts, 2), torch.empty(experts)
        fc1_in = torch.empty(experts, 2) if activation_scales else None
        fc2_in = torch.empty(experts) if activation_scales else None
        for e in range(experts):
            gate = self.linear(f"{prefix}.{e}.gate_proj", (intermediate, hidden), activation_scales)
            up = self.linear(f"{prefix}.{e}.up_proj", (intermediate, hidden), activation_scales)
            down = self.linear(f"{prefix}.{e}.down_proj", (hidden, intermediate), activation_scales)
            gate_scales, up_scales, w1_gs[e] = join_gate_up(
                gate.block_scales, gate.global_scale, up.block_scales, up.global_scale
            )
            w1[e, :intermediate], w1[e, intermediate:] = gate.codes, up.codes
            w1_scales[e, :intermediate], w1_scales[e, intermediate:] = gate_scales, up_scales
            w2[e], w2_scales[e], w2_gs[e] = down.codes, down.block_scales, down.global_scale[0]
            if activation_scales:
                fc1_in[e, 0], fc1_in[e, 1] = gate.input_global_scale[0], up.input_global_scale[0]
                fc2_in[e] = down.input_global_scale[0]
        weights = moe_weights_from_nvfp4(
            w1, w1_scales, w2, w2_scales, w1_global_scale=_w1_global_scales(w1_gs), w2_global_scale=w2_gs
        )
        return NVFP4MoELayer(weights, fc1_in, fc2_in)

    def _fused_experts(self, prefix, experts, hidden, intermediate, activation_scales) -> NVFP4MoELayer:
        names = self.names
        tensors = {}
        for projection, rows, cols in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
            p = f"{prefix}.{projection}"
            codes = self.tensor(f"{p}.{names.codes}", f"the fused NVFP4 experts {prefix}")
            codes = nvfp4.codes_from_float4_e2m1fn_x2(codes) if codes.dtype == torch.float4_e2m1fn_x2 else codes
            _check_dtype(f"{p}.{names.codes}", codes, (torch.uint8,))
            _check_shape(f"{p}.{names.codes}", codes, (experts, rows, cols // 2))
            scales = self.tensor(f"{p}.{names.block_scales}", f"the fused NVFP4 experts {prefix}")
            _check_dtype(f"{p}.{names.block_scales}", scales, (torch.float8_e4m3fn,))
            _check_shape(f"{p}.{names.block_scales}", scales, (experts, rows, cols // nvfp4.BLOCK_SIZE))
            tensors[projection] = (codes, scales)
        w1, w1_scales = tensors["gate_up_proj"]
        w2, w2_scales = tensors["down_proj"]

        # One weight global scale per expert ([E] or [E, 1]), or one per half ([E, 2]: gate, up).
        gs_name = f"{prefix}.gate_up_proj.{names.weight_global_scale}"
        stored = self.tensor(gs_name, f"the fused NVFP4 experts {prefix}")
        per_half = stored.numel() == 2 * experts
        w1_gs = _scalar_scales(gs_name, stored, 2 * experts if per_half else experts, names.decode_direction)
        if per_half:
            halves = w1_gs.view(experts, 2)
            w1_scales = w1_scales.clone()  # the memory-mapped tensor stays read-only
            pairs = torch.empty(experts, 2)
            for e in range(experts):
                gate, up = w1_scales[e, :intermediate], w1_scales[e, intermediate:]
                gate_scales, up_scales, pairs[e] = join_gate_up(gate, halves[e, :1], up, halves[e, 1:])
                w1_scales[e, :intermediate], w1_scales[e, intermediate:] = gate_scales, up_scales
            w1_gs = _w1_global_scales(pairs)
        w2_gs_name = f"{prefix}.down_proj.{names.weight_global_scale}"
        w2_gs = _scalar_scales(
            w2_gs_name, self.tensor(w2_gs_name, f"the fused NVFP4 experts {prefix}"), experts, names.decode_direction
        )

        fc1_in = fc2_in = None
        if activation_scales:
            fc1_in = self._fused_input_scales(f"{prefix}.gate_up_proj", experts, halves=2)
            fc2_in = self._fused_input_scales(f"{prefix}.down_proj", experts, halves=1).reshape(experts)
        weights = moe_weights_from_nvfp4(w1, w1_scales, w2, w2_scales, w1_global_scale=w1_gs, w2_global_scale=w2_gs)
        return NVFP4MoELayer(weights, fc1_in, fc2_in)

    def _fused_input_scales(self, prefix: str, experts: int, halves: int) -> torch.Tensor:
        """Fused activation scales, stored one for all experts, one per expert or one per expert half
        (gate, up), as [E, halves]."""
        name = f"{prefix}.{self.names.input_global_scale}"
        stored = self.tensor(name, f"the W4A4 fused experts {prefix}")
        count = stored.numel()
        if count not in (1, experts, experts * halves):
            raise ValueError(
                f"checkpoint tensor {name!r} must hold 1, {experts} or {experts * halves} scales, "
                f"got {list(stored.shape)}"
            )
        scales = _scalar_scales(name, stored, count, self.names.decode_direction)
        if count == experts * halves:
            return scales.reshape(experts, halves)
        return scales.reshape(-1, 1).expand(experts, halves).clone()


def warn_reduced_activation_scales(reduced_layers: list[str]) -> None:
    """One warning for all layers whose per-expert FC1 input scales `NVFP4MoELayer.activation_scales`
    reduced (a documented, deliberate reduction, said once per load rather than once per layer)."""
    if reduced_layers:
        warnings.warn(
            f"{len(reduced_layers)} MoE layer(s) ({reduced_layers[0]}, ...) store per-expert FC1 input scales; "
            "fused_moe quantizes a token once for all its experts, so each layer uses its largest calibrated "
            "amax (FlashInfer's convention; see fp4moe.checkpoint.NVFP4MoELayer.activation_scales)",
            stacklevel=3,
        )
