"""Tensors that cannot be read directly, tensors dropped mid-call, and exact float64 factors.

The crash-prone cases run in a child process, so a regression shows up as a failed test, not
as a dead test run.
"""
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import ampx
from ampx import ops


def _run(code, timeout=300):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_wrapper_subclass_without_storage_is_refused_not_written():
    out = _run("""
        import torch, ampx
        from ampx import ops

        class Wrapper(torch.Tensor):
            @staticmethod
            def __new__(cls, inner):
                return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                           device=inner.device)
            def __init__(self, inner):
                self.inner = inner
            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                unwrap = lambda a: a.inner if isinstance(a, Wrapper) else a
                return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})

        w = Wrapper(torch.ones(100))
        for fn in (lambda: ops.mul_([w], 2.0), lambda: ops.unscale_([w], 0.5, torch.zeros(1)),
                   lambda: ops.norm([w]), lambda: ops.cast_([torch.ones(100)], [w])):
            try:
                fn()
            except ValueError as e:
                assert "no storage of its own" in str(e), e
            else:
                raise SystemExit("no error")
        print("refused")
    """)
    assert "refused" in out


def test_jagged_nested_tensor_is_refused():
    out = _run("""
        import torch
        from ampx import ops
        nt = torch.nested.nested_tensor([torch.ones(3), torch.ones(5)], layout=torch.jagged)
        try:
            ops.mul_([nt], 2.0)
        except ValueError as e:
            print("refused", type(e).__name__)
    """)
    assert "refused" in out


def test_list_cleared_by_another_thread_while_the_kernel_runs():
    out = _run("""
        import threading, time, torch
        from ampx import ops
        for trial in range(3):
            lst = [torch.ones(1 << 25) for _ in range(4)]
            t = threading.Thread(target=lambda: ops.mul_(lst, 2.0))
            t.start()
            time.sleep(0.005)
            lst.clear()   # drops the only other references while the GIL is released
            t.join()
        print("alive")
    """)
    assert "alive" in out


def test_float64_factor_is_not_rounded_to_float32():
    x = torch.ones(5, dtype=torch.float64)
    y = x.clone()
    ops.mul_(x, 0.1)
    torch._foreach_mul_([y], 0.1)
    assert torch.equal(x, y)
    d = torch.empty(5, dtype=torch.float64)
    ops.cast_(torch.ones(5, dtype=torch.float64), d, inv_scale=0.1)
    assert torch.equal(d, y)
    # a float32 tensor factor (torch's inv_scale) is used as the float32 value it holds
    z = torch.ones(5, dtype=torch.float64)
    ops.unscale_([z], torch.tensor([0.1]), torch.zeros(1))
    assert torch.equal(z, torch.full((5,), float(torch.tensor(0.1)), dtype=torch.float64))


def test_last_step_skipped_after_a_fused_step_without_grads():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], fused=True)
    s = ampx.GradScaler("cpu")
    s.scale(torch.ones(()))
    s.step(opt)
    assert bool(s.last_step_skipped) is False


def test_scaler_on_dtensor_gradients_matches_torch():
    out = _run("""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.tensor import distribute_tensor, Shard
        from torch.distributed.device_mesh import init_device_mesh
        import ampx
        mesh = init_device_mesh("cpu", (1,))
        results = []
        for cls in (torch.amp.GradScaler, ampx.GradScaler):
            torch.manual_seed(0)
            p = torch.nn.Parameter(distribute_tensor(torch.randn(1000), mesh, [Shard(0)]))
            opt = torch.optim.SGD([p], lr=0.1)
            s = cls("cpu", init_scale=2.0**8)
            for i in range(3):
                loss = (p.full_tensor() ** 2).sum()
                s.scale(loss).backward()
                if i == 1:
                    p.grad.to_local()[7] = float("inf")
                s.step(opt); s.update(); opt.zero_grad()
            results.append((p.to_local().clone(), s.get_scale()))
        assert torch.equal(results[0][0], results[1][0]), "params differ"
        assert results[0][1] == results[1][1]
        print("same", results[1][1])
        dist.destroy_process_group()
    """)
    assert "same" in out


@pytest.mark.parametrize("name,call", [
    ("inv_scale", lambda: ops.unscale_([torch.zeros(2)], 10**400, None)),
    ("factor", lambda: ops.mul_([torch.zeros(2)], -10**400)),
    ("inv_scale", lambda: ops.cast_([torch.zeros(2)], [torch.zeros(2)], inv_scale=10**400)),
])
def test_a_factor_beyond_a_double_names_its_argument(name, call):
    with pytest.raises(ValueError, match=rf"ampx\.ops\.\w+: {name} is an integer too large for a float"):
        call()


class _RefusesToCopy(torch.Tensor):
    """A tensor whose .contiguous() fails, as a staging copy that runs out of memory would."""

    def contiguous(self, *a, **k):
        raise MemoryError("staging copy refused (injected)")


@pytest.mark.parametrize("op", ["unscale_", "mul_", "unscale_norm_"])
def test_a_failing_staging_copy_leaves_every_tensor_unwritten(op):
    a = torch.randn(6)                      # contiguous: would be written first
    b = torch.randn(4, 3).t()               # non-contiguous: staged
    bad = torch.randn(5, 2).t().as_subclass(_RefusesToCopy)  # staged last, and fails
    before = [a.clone(), b.clone(), bad.clone()]
    call = {"unscale_": lambda: ops.unscale_([a, b, bad], 0.5, torch.zeros(1)),
            "mul_": lambda: ops.mul_([a, b, bad], 0.5),
            "unscale_norm_": lambda: ops.unscale_norm_([a, b, bad], 0.5, torch.zeros(1))}[op]
    with pytest.raises(MemoryError, match="injected"):
        call()
    for t, was in zip((a, b, bad), before):
        assert torch.equal(torch.Tensor(t), torch.Tensor(was))


def test_staged_aliases_still_apply_in_turn():
    base = torch.randn(4, 3)
    x = base.t()                              # non-contiguous, listed twice
    want = base.t() * 0.25
    ops.unscale_([x, x], 0.5, torch.zeros(1))
    assert torch.equal(x, want)
    y = torch.randn(4, 3)
    y0 = y.clone()
    ops.mul_([y.t(), y[:, :2].t()], 2.0)     # overlapping views, each staged
    assert torch.equal(y[:, :2], y0[:, :2] * 4) and torch.equal(y[:, 2], y0[:, 2] * 2)


def test_a_source_tree_without_its_build_says_what_to_do(tmp_path):
    """Python started in the folder holding an unbuilt ampx checkout imports that checkout."""
    import shutil

    src = pathlib.Path(ampx.__file__).parent
    shutil.copytree(src, tmp_path / "ampx", ignore=shutil.ignore_patterns("*.so", "*.fatbin", "__pycache__"))
    code = textwrap.dedent("""
        import importlib.abc, sys
        class NoBuiltC(importlib.abc.MetaPathFinder):  # an editable install elsewhere must not help
            def find_spec(self, name, path=None, target=None):
                if name == "ampx._C":
                    raise ModuleNotFoundError("No module named 'ampx._C'")
        sys.meta_path.insert(0, NoBuiltC())
        try:
            import ampx
        except ImportError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "ampx's C extension (ampx._C) could not be imported from" in out.stdout, out.stdout + out.stderr
    assert str(tmp_path) in out.stdout and "source checkout" in out.stdout
