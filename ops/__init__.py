"""The `torch.ops.fp4moe` operator library: schemas and CPU/CUDA registrations.

Installed as `fp4moe.ops`; importing `fp4moe` imports it. The fakes live in `fp4moe.meta_kernels`.
"""

from fp4moe.ops import quantize  # noqa: F401  (registers the quantization ops)
from fp4moe.ops import routing  # noqa: F401  (registers the routing ops)
from fp4moe.ops import aligned_moe  # noqa: F401  (registers the aligned fused MoE and its route-plan op)
from fp4moe.ops import moe  # noqa: F401  (registers the MoE pipeline ops)
