"""A first check that the build works: ampx imports, reports its SIMD levels, unscales
like torch on a small tensor, and says why its CUDA path is unavailable on a machine
without a GPU. The behaviour itself is tested in the files named after it."""
import torch

import ampx
from ampx import ops


def test_import_and_simd_levels():
    levels = ops.available_simd_levels()
    assert levels[-1] == "portable"
    assert ops.simd_level() in levels


def test_unscale_matches_torch_small():
    x = torch.randn(1000)
    ref = x.clone()
    fi_ref = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_([ref], fi_ref, torch.tensor([0.5]))
    fi = torch.zeros(1)
    ops.unscale_([x], torch.tensor([0.5]), fi)
    assert torch.equal(x, ref)
    assert fi.item() == fi_ref.item() == 0.0


def test_cuda_path_is_unavailable_without_a_gpu():
    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU machine: tests/test_cuda.py covers the CUDA path")
    assert ampx.cuda.is_available() is False
    assert ampx.cuda.unavailable_reason()
