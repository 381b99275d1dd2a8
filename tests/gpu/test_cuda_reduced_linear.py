"""CUDA: a 10-class classifier's step with its last linear layer as a reduction
(``ops/reduced_linear.py``) calls no cuBLAS product and holds no cuBLAS workspace."""
from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers import small_config
from tr_hydra import startup
from tr_hydra.compiler.compile import BLAS_WORKSPACE_BYTES
from tr_hydra.runtime.build import Runtime

pytestmark = pytest.mark.cuda


def test_a_ten_class_step_holds_no_blas_workspace():
    """Compiled by Inductor, warmed up and captured: besides the arena the process holds the
    small model's activations, a few MiB, and no 65 MiB workspace set, which any cuBLAS product
    in the step would have allocated; the plan counted none."""
    gc.collect()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # earlier tests' workspaces
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    tr = Runtime(small_config(device="cuda", amp=True, compile="inductor"), log=lambda *_: None, source=False)
    assert tr.prepared.linears == ["fc"] and tr.compiled.library_workspace == 0
    startup.get_ready(tr, None, lambda *_: None)
    torch.cuda.synchronize()
    extra = torch.cuda.memory_allocated() - base - tr.arena.arena.numel()
    assert extra < BLAS_WORKSPACE_BYTES // 4, extra / 2**20
