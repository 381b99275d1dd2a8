from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_tf32():
    """TF32 off for cuDNN and cuBLAS within the test, set back after it. Not ``monkeypatch``:
    from pytest 9.2 it restores an instance's attribute only from the instance's ``__dict__``, and
    ``torch.backends.cuda.matmul.allow_tf32`` lives behind ``__getattr__``, so its undo deletes
    the attribute and fails."""
    flags = (torch.backends.cudnn, torch.backends.cuda.matmul)
    before = [f.allow_tf32 for f in flags]
    for f in flags:
        f.allow_tf32 = False
    yield
    for f, b in zip(flags, before):
        f.allow_tf32 = b
