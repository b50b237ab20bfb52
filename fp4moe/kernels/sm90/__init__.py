"""Hopper (sm_90a) kernels: one kernel family per module, device-side NVFP4 numerics in `nvfp4_device`."""
