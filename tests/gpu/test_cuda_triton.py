"""The fused Triton range kernels on the GPU equal the plain-torch reference."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda


def test_fused_kernels_match_reference_on_gpu():
    from tests.unit._triton_check import main
    assert main("cuda") == 0
