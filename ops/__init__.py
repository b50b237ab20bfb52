"""The `torch.ops.fp4moe` operator library: schemas and CPU/CUDA registrations.

Installed as `fp4moe.ops`; importing `fp4moe` imports it. The fakes live in `fp4moe.meta_kernels`.
"""

from fp4moe.ops import quantize  # noqa: F401  (registers the quantization ops)
