"""Shared test configuration: GPU-marked tests skip on machines without CUDA; pytest-xdist workers share
the CPU cores."""

import os

import pytest
import torch

import fp4moe  # noqa: F401  (registers torch.ops.fp4moe)


def pytest_configure(config):
    # Each xdist worker would otherwise start one OpenMP thread per core for torch's CPU ops: N workers
    # oversubscribe the cores N times over, and the threads' spin-waits at every small op's barrier turn a
    # test of a fraction of a second into minutes (the runs log has the measurement). An explicit
    # OMP_NUM_THREADS is the user's choice and stays.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(workers)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def recorded_calls_forgotten():
    """A registry of recorded calls without programs or keys seen, before and after the test
    (`fp4moe.kernels.host_launcher.forget_recorded_calls`): for tests that count their own calls' trips
    into Python, or that patch the launch layer's rules, which a replay recorded under other rules
    would not follow. On a GPU, work in flight ends first: a forgotten program may hold the last
    reference to a compiled kernel."""
    from fp4moe.kernels import host_launcher

    host_launcher.forget_recorded_calls()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    host_launcher.forget_recorded_calls()
