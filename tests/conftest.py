"""Test set-up: GPU-marked tests run only where CUDA is; elsewhere Triton runs interpreted."""

import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is imported anywhere: kernels then run on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if HAS_CUDA else 0
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))


@pytest.fixture(autouse=True)
def _free_gpu_memory(request):
    """GPU tests on preset shapes allocate gigabytes: release them before the next test."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _seed(request):
    """A different seed per test (fresh random inputs), reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
