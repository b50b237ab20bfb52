"""CuTe DSL kernels, one folder per architecture (`sm90`), and their host layers.

Importing this package does not import the CuTe DSL; `fp4moe.kernels.quantize_launch` does, and the
op layer imports it only for devices that run these kernels (`fp4moe.dispatch.quantize_backend`).
"""
