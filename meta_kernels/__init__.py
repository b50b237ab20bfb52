"""Fake (meta) implementations of every `torch.ops.fp4moe` op, installed as `fp4moe.meta_kernels`.

Each fake validates its arguments like the real op and allocates through the same `fp4moe.op_outputs`
helper, so shapes, dtypes and errors agree with the real implementations under torch.compile.
"""

from fp4moe.meta_kernels import quantize  # noqa: F401  (registers the quantization fakes)
from fp4moe.meta_kernels import routing  # noqa: F401  (registers the routing fakes)
from fp4moe.meta_kernels import aligned_moe  # noqa: F401  (registers the aligned fused MoE fakes)
from fp4moe.meta_kernels import moe  # noqa: F401  (registers the MoE pipeline fakes)
