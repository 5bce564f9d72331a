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


def test_cuda_path_reports_itself_unavailable_and_cuda_tensors_are_refused():
    assert ampx.cuda.is_available() is False
    if torch.cuda.is_available():  # a GPU machine: a CUDA tensor must get a clear error
        import pytest

        with pytest.raises(ValueError, match="cuda"):
            ops.unscale_([torch.ones(3, device="cuda")], 1.0, None)
