"""fp4moe: NVFP4 Mixture-of-Experts inference ops for PyTorch (`torch.ops.fp4moe.*`).

Importing the package registers every op, its CPU/CUDA implementations and its fake.
"""

import importlib
import importlib.util
import sys
from pathlib import Path


def _import_mapped_package(name: str):
    """Import `fp4moe.<name>`, which pyproject.toml maps from the top-level folder `<name>/`.

    Installed wheels and setuptools' editable finder provide the mapping. Running from a source checkout
    without them (PYTHONPATH at the repository root, or an editable install by a setuptools too old to
    map package folders) finds only `fp4moe/`; then the sibling folder is loaded under the same name.
    The sibling folder also wins over a mapping into another checkout: with one checkout on PYTHONPATH
    and an editable install of another, the editable finder would otherwise pair this `fp4moe/` with the
    other checkout's ops.
    """
    qualified = f"{__name__}.{name}"
    package = Path(__file__).resolve().parent
    folder = package.parent / name
    spec = importlib.util.find_spec(qualified)
    if spec is not None:
        origin = Path(spec.origin).resolve().parent if spec.origin else folder
        if origin == folder or origin.is_relative_to(package) or not (folder / "__init__.py").exists():
            return importlib.import_module(qualified)
    spec = importlib.util.spec_from_file_location(qualified, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


ops = _import_mapped_package("ops")  # defines the ops; must precede the fakes
meta_kernels = _import_mapped_package("meta_kernels")
from fp4moe.dispatch import AUX_AMAX_MIN_TOKENS, moe_dispatch, per_token_quant_path, quantize_backend
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
    "swizzle_128x4",
    "unswizzle_128x4",
]
