"""Device parametrization: every numeric test runs on the CPU and, marked `gpu`, on CUDA."""

import pytest

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
