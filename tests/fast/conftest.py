"""Settings for the hla_fast tests.

Without CUDA the Triton kernels run under Triton's interpreter on CPU tensors: the
flag must be in the environment before triton is first imported, which is why it
is set here, at conftest import time. Tests marked ``gpu`` are skipped then.
"""
import os

import pytest

try:
    import torch
except ImportError:  # the fast extra is not installed: every test here skips
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
if torch is not None and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# On a GPU machine the kernels compile; on CPU the interpreter runs them.
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poison(monkeypatch):
    """Kernel outputs start as NaN (see helpers.poison_kernel_buffers)."""
    from .helpers import poison_kernel_buffers

    poison_kernel_buffers(monkeypatch)
