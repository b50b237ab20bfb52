"""`FusedMoE`: an inference-only router + NVFP4 experts block to drop in for a HF-style MoE block."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from fp4moe import nvfp4, validation
from fp4moe import weight_layout as weight_layouts
from fp4moe.weights import MoEWeights, check_dense_experts, quantize_moe_weights

ROUTINGS = ("softmax", "deepseek_v3")
DEEPSEEK_V3_ONLY = ("correction_bias", "n_group", "topk_group", "routed_scaling_factor")
"""Routing arguments that only `routing="deepseek_v3"` uses: given with softmax routing, they raise."""
_PYTHON_OPTIONS = {
    "top_k": (int, False),
    "routing": (str, False),
    "renormalize": (bool, False),
    "n_group": (int, True),
    "topk_group": (int, True),
    "routed_scaling_factor": (float, True),
    "quant_mode": (str, False),
    "per_token_activation": (bool, False),
    "swiglu_alpha": (float, True),
    "swiglu_beta": (float, True),
    "swiglu_limit": (float, True),
    "apply_router_weight_on_input": (bool, False),
    "deterministic": (bool, False),
    "local_expert_offset": (int, False),
    "weight_layout": (str, False),
}
"""The module's Python-valued arguments: (type, whether None is allowed)."""


def _check_options(
    router_weight: torch.Tensor | None, num_local_experts: int, hidden_size: int, device: torch.device,
    activation: str, options: dict,
) -> None:
    """Everything about the module's arguments that needs no quantized weights: their Python types,
    the options of `fused_moe` they become (`validation.check_fused_moe_options`), this rank's experts,
    the router's shape, and the routing, checked by the routing op's own validation on an empty
    batch of the FP32 logits `forward` routes, on the experts' `device`. Without a router of its own
    the router's expert count is unknown until `forward`: the logits checked here span the experts up
    to the last local one, or the `correction_bias`'s (DeepSeek-V3 routing), or `top_k` (softmax:
    `forward`'s routing op checks `top_k` against the logits it gets)."""
    for name, (kind, optional) in _PYTHON_OPTIONS.items():
        validation.check_python_scalar(name, options[name], kind, optional)
    validation.check_fused_moe_options(
        options["quant_mode"], options["per_token_activation"], activation, options["swiglu_alpha"],
        options["swiglu_beta"], options["swiglu_limit"], options["weight_layout"],
    )
    validation.check_local_experts(num_local_experts, options["local_expert_offset"], "w1.shape[0]")
    if router_weight is None:
        experts = options["local_expert_offset"] + num_local_experts
        bias = options["correction_bias"]
        if options["routing"] == "deepseek_v3" and isinstance(bias, torch.Tensor) and bias.dim() == 1:
            experts = max(experts, bias.shape[0])
        elif options["routing"] == "softmax":
            experts = max(experts, options["top_k"])
        _check_routing(options, experts, device, "the expert weights")
        return
    validation.check_tensor("router_weight", router_weight)
    if not router_weight.is_floating_point():
        raise TypeError(f"router_weight must have a floating-point dtype, got {router_weight.dtype}")
    validation.check_dim("router_weight", router_weight, 2)
    if router_weight.shape[1] != hidden_size:
        raise ValueError(f"router_weight must be [E, H = {hidden_size}], got {tuple(router_weight.shape)}")
    experts, offset = router_weight.shape[0], options["local_expert_offset"]
    if experts < offset + num_local_experts:
        end = offset + num_local_experts
        raise ValueError(
            f"router_weight has {experts} rows (one per expert), but the expert weights are experts "
            f"[{offset}, {end}) of the router's: it needs at least {end} rows"
        )
    _check_routing(options, experts, router_weight.device, "router_weight")


def _check_routing(options: dict, experts: int, device: torch.device, device_of: str) -> None:
    """The routing options, checked by the routing op's validation on an empty batch of logits on
    `device` (that of `device_of`: the router weight, or the expert weights without one)."""
    validation.check_choice("routing", options["routing"], ROUTINGS)
    logits = torch.empty((0, experts), dtype=torch.float32, device=device)
    if options["routing"] == "softmax":
        ignored = [name for name in DEEPSEEK_V3_ONLY if options[name] is not None]
        if ignored:
            raise ValueError(f"{validation.names_verb(ignored)} only to routing='deepseek_v3', got routing='softmax'")
        validation.check_route_softmax_topk(logits, options["top_k"])
        return
    missing = [name for name in ("correction_bias", "n_group", "topk_group") if options[name] is None]
    if missing:
        raise ValueError(f"routing='deepseek_v3' needs {', '.join(missing)}")
    bias = options["correction_bias"]
    validation.check_tensor("correction_bias", bias)
    if bias.device != device:
        raise ValueError(
            f"correction_bias is on {bias.device}, {device_of} on {device}: build the module on one device "
            "(it follows .to() as a whole)"
        )
    if not bias.is_floating_point():
        raise TypeError(f"correction_bias must have a floating-point dtype, got {bias.dtype}")
    validation.check_route_deepseek_v3(
        logits, bias.float(), options["top_k"], options["n_group"], options["topk_group"],
        _routed_scaling_factor(options["routed_scaling_factor"]),
    )


def _routed_scaling_factor(value: float | None) -> float:
    return 1.0 if value is None else float(value)


def _input_scale_from_amax(name: str, amax: float | None, device: torch.device) -> torch.Tensor | None:
    """The encode-direction global scale `2688 / amax` (FP32 [1]) of a calibrated activation maximum."""
    validation.check_python_scalar(name, amax, float, optional=True)
    if amax is None:
        return None
    amax32 = validation.fp32(amax)
    global_scale = validation.fp32(nvfp4.GLOBAL_SCALE_NUMERATOR / amax32) if amax32 > 0 else math.inf
    if not (math.isfinite(amax32) and math.isfinite(global_scale)):
        raise ValueError(
            f"{name} must be a finite activation maximum > 0 whose global scale 2688 / amax is finite in FP32, "
            f"got {amax!r}"
        )
    return nvfp4.global_scale_from_amax(torch.tensor([amax32], device=device))


class FusedMoE(nn.Module):
    """Router (bf16 linear, FP32 logits) -> `route_softmax_topk` or `route_deepseek_v3` -> `fused_moe`.

    `forward(hidden_states [..., H], router_logits=None) -> [..., H]` in the input's dtype (the experts run
    on bf16 activations), like the MoE block of a HF DeepSeek/Qwen model (which returns only the hidden
    states; shared experts stay outside this block). Expert weights are buffers, so `.to(device)` and
    `state_dict()` carry them; by default they are kept in the prepared layout the Hopper kernels stream
    (`weight_layout="sm90"`, made once here; every backend reads it). `.to(dtype)` / `.half()` /
    `.bfloat16()` leave the buffers whose dtype is part of the op contract as they are
    (`FIXED_DTYPE_BUFFERS`). Build it from `MoEWeights` (`fp4moe.moe_weights_from_nvfp4` adopts a
    checkpoint's NVFP4 tensors, `fp4moe.checkpoint` reads whole checkpoints) or quantize bf16 experts
    with `from_dense`.

    `router_weight` is `[E, H]` over the global experts; the expert weights are experts
    `[local_expert_offset, local_expert_offset + E_local)` of them (expert parallelism; all of them
    by default); `forward` passes the router's expert count to `fused_moe` as `global_num_experts`, so
    that the kernels of an expert-parallel rank size their tiles for its share of the pairs.
    `correction_bias`, `n_group`, `topk_group` and `routed_scaling_factor` (default 1.0) apply to
    `routing="deepseek_v3"` only. Every argument is checked here, before the first forward.
    `router_weight=None` builds the block without a router of its own: `forward` then takes the
    `router_logits [..., E]` (or `[N, E]` over the tokens flattened) of a router that stays outside, in its
    own precision (`fp4moe.hf` passes the model's own router module's logits); the router's E is then
    known from them only. Tensors passed in are kept detached (buffers, not parameters).
    """

    FIXED_DTYPE_BUFFERS = (
        "w1", "w1_scales", "w1_alpha", "w2", "w2_scales", "w2_alpha", "correction_bias", "fc1_input_scale",
        "fc2_input_scale",
    )
    """uint8 codes, E4M3 block scales and FP32 alphas, routing bias and activation global scales."""

    def __init__(
        self,
        router_weight: torch.Tensor | None,
        weights: MoEWeights,
        top_k: int,
        *,
        routing: str = "softmax",
        renormalize: bool = True,
        correction_bias: torch.Tensor | None = None,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float | None = None,
        quant_mode: str = "w4a4",
        per_token_activation: bool = False,
        fc1_input_scale: torch.Tensor | None = None,
        fc2_input_scale: torch.Tensor | None = None,
        swiglu_alpha: float | None = None,
        swiglu_beta: float | None = None,
        swiglu_limit: float | None = None,
        apply_router_weight_on_input: bool = False,
        deterministic: bool = False,
        local_expert_offset: int = 0,
        weight_layout: str = weight_layouts.SM90,
    ):
        super().__init__()
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights must be MoEWeights (fp4moe.moe_weights_from_nvfp4), got {type(weights).__name__}")
        options = dict(
            top_k=top_k, routing=routing, renormalize=renormalize, correction_bias=correction_bias, n_group=n_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, quant_mode=quant_mode,
            per_token_activation=per_token_activation, swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta,
            swiglu_limit=swiglu_limit, apply_router_weight_on_input=apply_router_weight_on_input,
            deterministic=deterministic, local_expert_offset=local_expert_offset, weight_layout=weight_layout,
        )
        _check_options(
            router_weight, weights.num_experts, weights.hidden_size, weights.w1.device, weights.activation, options
        )
        if router_weight is not None:
            validation.check_same_device("router_weight", router_weight, "w1", weights.w1)
        if weight_layout == weight_layouts.SM90:
            weights = weights.prepared()
        elif weights.layout != weight_layouts.LINEAR:
            raise ValueError("weight_layout='linear' needs MoEWeights in the linear layout")
        self.weight_layout = weight_layout
        w1_alpha, w2_alpha = weights.alphas(fc1_input_scale, fc2_input_scale)
        # The op's own contract, on an empty batch: quantization mode, scales, SwiGLU parameters, shapes.
        x = weights.w1.new_empty((0, weights.hidden_size), dtype=torch.bfloat16)
        topk_ids = weights.w1.new_empty((0, top_k), dtype=torch.int32)
        validation.check_fused_moe(
            x, topk_ids, topk_ids.float(), weights.w1, weights.w1_scales, w1_alpha, weights.w2, weights.w2_scales,
            w2_alpha, fc1_input_scale, fc2_input_scale, quant_mode, per_token_activation, weights.activation,
            swiglu_alpha, swiglu_beta, swiglu_limit, apply_router_weight_on_input, deterministic, local_expert_offset,
            None, None, weight_layout, None,
        )
        self.top_k = top_k
        self.routing = routing
        self.renormalize = renormalize
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = _routed_scaling_factor(routed_scaling_factor)
        self.quant_mode = quant_mode
        self.per_token_activation = per_token_activation
        self.activation = weights.activation
        self.swiglu = (swiglu_alpha, swiglu_beta, swiglu_limit)
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.deterministic = deterministic
        self.local_expert_offset = local_expert_offset
        self.hidden_size = weights.hidden_size
        # Buffers, not parameters: detached, so that a `nn.Parameter` passed in (a model's own router
        # weight) neither makes the inference-only ops see a tensor that requires grad nor blocks deepcopy.
        def buffer(tensor, dtype=None):
            return None if tensor is None else tensor.detach().to(dtype or tensor.dtype)

        self.register_buffer("router_weight", buffer(router_weight, torch.bfloat16))
        self.register_buffer("correction_bias", buffer(correction_bias, torch.float32))
        self.register_buffer("fc1_input_scale", buffer(fc1_input_scale))
        self.register_buffer("fc2_input_scale", buffer(fc2_input_scale))
        for name in ("w1", "w1_scales", "w2", "w2_scales"):
            self.register_buffer(name, getattr(weights, name))
        self.register_buffer("w1_alpha", w1_alpha)
        self.register_buffer("w2_alpha", w2_alpha)

    @classmethod
    def from_dense(
        cls,
        router_weight: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        *,
        activation: str = "swiglu",
        fc1_input_amax: float | None = None,
        fc2_input_amax: float | None = None,
        **options,
    ) -> FusedMoE:
        """Quantize bf16 experts `w1 [E, N1, H]` (`[gate; up]` rows for SwiGLU) and `w2 [E, H, I]`.
        Per-tensor W4A4 needs the calibrated activation maxima `fc1_input_amax` / `fc2_input_amax`
        (Python floats); other modes take none. `options` are the constructor's keyword arguments.
        Every argument is checked before the weights are quantized."""
        parameters = inspect.signature(cls.__init__).parameters
        accepted = set(parameters) - {"self", "router_weight", "weights", "top_k", "fc1_input_scale", "fc2_input_scale"}
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TypeError(
                f"FusedMoE.from_dense got unexpected keyword arguments {', '.join(unknown)} (it takes the "
                "constructor's options, and fc1_input_amax / fc2_input_amax instead of the input scales)"
            )
        check_dense_experts(w1, w2, activation)
        # The constructor's checks that need no quantized weights, with its defaults, before quantizing.
        all_options = {name: options.get(name, parameters[name].default) for name in accepted}
        _check_options(router_weight, w1.shape[0], w1.shape[2], w1.device, activation, {**all_options, "top_k": top_k})
        per_tensor_w4a4 = all_options["quant_mode"] == "w4a4" and not all_options["per_token_activation"]
        for name, amax in (("fc1_input_amax", fc1_input_amax), ("fc2_input_amax", fc2_input_amax)):
            if per_tensor_w4a4 and amax is None:
                raise ValueError(f"per-tensor w4a4 needs the calibrated activation maximum {name} (a Python float)")
            if not per_tensor_w4a4 and amax is not None:
                raise ValueError(
                    f"{name} is only used by per-tensor w4a4; got quant_mode={all_options['quant_mode']!r}, "
                    f"per_token_activation={all_options['per_token_activation']}"
                )
        fc1_input_scale = _input_scale_from_amax("fc1_input_amax", fc1_input_amax, w1.device)
        fc2_input_scale = _input_scale_from_amax("fc2_input_amax", fc2_input_amax, w1.device)
        weights = quantize_moe_weights(w1, w2, activation)
        return cls(
            router_weight, weights, top_k, fc1_input_scale=fc1_input_scale, fc2_input_scale=fc2_input_scale, **options
        )

    def _apply(self, fn, recurse=True):
        # `Module.to(dtype)` converts every floating-point tensor, float8 included, which would turn the
        # E4M3 scales into bf16 and round the FP32 alphas. The contract buffers keep their dtype and only
        # follow device moves: where `fn` changed a dtype, the original tensor is moved instead.
        kept = {name: self._buffers[name] for name in self.FIXED_DTYPE_BUFFERS if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    def _check_router_logits(self, router_logits: torch.Tensor, hidden_shape: torch.Size) -> None:
        """`router_logits` must be over the same tokens as the hidden states: `[..., E]` with their leading
        dimensions, or `[N, E]` over them flattened (as transformers' routers return them); logits laid
        out otherwise would route other tokens. Floating-point, on their device, E covering the local
        experts."""
        validation.check_tensor("router_logits", router_logits)
        if not router_logits.is_floating_point():
            raise TypeError(f"router_logits must have a floating-point dtype, got {router_logits.dtype}")
        leading = tuple(hidden_shape[:-1])
        tokens = math.prod(leading)
        same_tokens = router_logits.dim() >= 1 and (
            tuple(router_logits.shape[:-1]) == leading or tuple(router_logits.shape[:-1]) == (tokens,)
        )
        if not same_tokens:
            raise ValueError(
                f"router_logits must be [..., E] with hidden_states' leading dimensions {leading}, or [{tokens}, E], "
                f"got {tuple(router_logits.shape)}"
            )
        end = self.local_expert_offset + self.w1.shape[0]
        if router_logits.shape[-1] < end:
            raise ValueError(
                f"router_logits has {router_logits.shape[-1]} experts, but this block holds experts "
                f"[{self.local_expert_offset}, {end}) of the router's: it needs at least {end}"
            )
        validation.check_same_device("router_logits", router_logits, "the module's w1", self.w1)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        validation.check_tensor("hidden_states", hidden_states)
        validation.check_dtype("hidden_states", hidden_states, validation.ACTIVATION_DTYPES)
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [..., H = {self.hidden_size}], got {tuple(hidden_states.shape)}")
        validation.check_same_device("hidden_states", hidden_states, "the module's w1", self.w1)
        _refuse_grad("hidden_states", hidden_states)
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        x = tokens.to(torch.bfloat16)
        if router_logits is not None:
            self._check_router_logits(router_logits, shape)
            _refuse_grad("router_logits", router_logits)
            logits = router_logits.reshape(tokens.shape[0], router_logits.shape[-1])
        elif self.router_weight is None:
            raise ValueError("this FusedMoE has no router (router_weight=None): pass router_logits to forward")
        else:  # in the router's own dtype (bf16 unless the module was converted)
            logits = torch.nn.functional.linear(tokens.to(self.router_weight.dtype), self.router_weight)
        if logits.dtype not in validation.ROUTER_LOGITS_DTYPES:
            logits = logits.float()  # the routing ops widen bf16 / fp16 to FP32 exactly themselves
        ops = torch.ops.fp4moe
        if self.routing == "softmax":
            topk_ids, topk_weights = ops.route_softmax_topk(logits, self.top_k, self.renormalize)
        else:
            topk_ids, topk_weights = ops.route_deepseek_v3(
                logits, self.correction_bias, self.top_k, self.n_group, self.topk_group,
                self.routed_scaling_factor, self.renormalize,
            )
        out = ops.fused_moe(
            x, topk_ids, topk_weights, self.w1, self.w1_scales, self.w1_alpha, self.w2, self.w2_scales, self.w2_alpha,
            self.fc1_input_scale, self.fc2_input_scale, self.quant_mode, self.per_token_activation, self.activation,
            *self.swiglu, self.apply_router_weight_on_input, self.deterministic, self.local_expert_offset,
            weight_layout=self.weight_layout, global_num_experts=logits.shape[-1],
        )
        return out.reshape(shape).to(hidden_states.dtype)


def _refuse_grad(name: str, tensor: torch.Tensor) -> None:
    """`FusedMoE` is inference-only: an input that requires grad (grad mode on) is named here, rather than
    in the error of the first fp4moe op it would reach (the routing's)."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        raise NotImplementedError(
            f"FusedMoE is inference-only (its fp4moe ops have no autograd formula) and {name} requires grad: "
            "call it under torch.no_grad() / torch.inference_mode(), or detach it"
        )
