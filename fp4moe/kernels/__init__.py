"""CuTe DSL kernels, one folder per architecture (`sm90`), and their host layers.

Importing this package does not import the CuTe DSL; the backends' modules do
(`fp4moe.dispatch.KERNEL_MODULES`), and the op layer imports them only for devices that run these
kernels (`fp4moe.dispatch.device_backend`).
"""
