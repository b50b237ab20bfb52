"""fp4moe: NVFP4 Mixture-of-Experts inference ops for PyTorch (`torch.ops.fp4moe.*`).

Importing the package registers every op, its CPU/CUDA implementations and its fake.
"""

import importlib
import importlib.util
import sys
from pathlib import Path


def _import_mapped_package(name: str):
    """Import `fp4moe.<name>`, which pyproject.toml maps from the top-level folder `<name>/`.

    In a source checkout (`pyproject.toml` and `<name>/` beside `fp4moe/`: PYTHONPATH at the
    repository root, or an editable install) the sibling folder is loaded under the qualified name, so
    that `fp4moe` and its ops always come from the same checkout: setuptools' editable finder maps
    `fp4moe.<name>` to the folder of the checkout it was installed from, which for a second checkout
    on PYTHONPATH would be another one's. Installed wheels have no such sibling and provide the mapping.
    """
    qualified = f"{__name__}.{name}"
    checkout = Path(__file__).resolve().parent.parent
    folder = checkout / name
    if not ((checkout / "pyproject.toml").is_file() and (folder / "__init__.py").is_file()):
        return importlib.import_module(qualified)
    spec = importlib.util.spec_from_file_location(qualified, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


ops = _import_mapped_package("ops")  # defines the ops; must precede the fakes
meta_kernels = _import_mapped_package("meta_kernels")
from fp4moe.dispatch import AUX_AMAX_MIN_TOKENS, moe_dispatch, per_token_quant_path, quantize_backend, routing_backend
from fp4moe.module import FusedMoE
from fp4moe.nvfp4 import (
    DEFAULT_GLOBAL_SCALE_INV,
    as_float4_e2m1fn_x2,
    codes_from_float4_e2m1fn_x2,
    decode_scale_from_global_scale,
    global_scale_from_amax,
    global_scale_from_decode_scale,
    swizzle_128x4,
    unswizzle_128x4,
)
from fp4moe.weights import MoEWeights, moe_weights_from_nvfp4, quantize_moe_weights

__version__ = "0.1.0"

__all__ = [
    "AUX_AMAX_MIN_TOKENS",
    "DEFAULT_GLOBAL_SCALE_INV",
    "FusedMoE",
    "MoEWeights",
    "as_float4_e2m1fn_x2",
    "codes_from_float4_e2m1fn_x2",
    "decode_scale_from_global_scale",
    "global_scale_from_amax",
    "global_scale_from_decode_scale",
    "moe_dispatch",
    "moe_weights_from_nvfp4",
    "per_token_quant_path",
    "quantize_backend",
    "quantize_moe_weights",
    "routing_backend",
    "swizzle_128x4",
    "unswizzle_128x4",
]
