"""Shared test configuration: GPU-marked tests skip on machines without CUDA."""

import pytest
import torch

import fp4moe  # noqa: F401  (registers torch.ops.fp4moe)

def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
