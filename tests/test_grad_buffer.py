"""ampx.GradBuffer: gradients as views of one flat buffer per (dtype, device).

Covers:
- layout: every gradient a view of its buffer, back to back (no gaps) in the order the scaler
  collects gradients, one buffer per dtype, frozen parameters left out, strides kept;
- parity: gradients, parameters, norms, skipped steps and overflow reports bit-identical to the
  same run without a buffer, over several steps, for plain / foreach / fused AdamW and SGD with
  ampx.GradScaler (fp16 and bf16 autocast on the CPU), clipping, an injected inf, gradient
  accumulation over micro-batches and zero_grad(set_to_none=True/False);
- GradBuffer.zero_grad (never None), load_state_dict of model and optimizer (same objects and a
  resumed run), mixed fp32 + bf16 parameters, ampx.MasterWeights (and its zero_grad on views);
- what breaks the views: p.grad = other (copied back), a view of another buffer, a cast model,
  p.grad.data swapped (check()), sparse gradients, DDP with gradient_as_bucket_view=True;
- DDP on 2 gloo ranks with gradient_as_bucket_view=False: the averaged gradients land in the
  views and match the run without a buffer bit for bit.
About 10 s on the 2-core VM, most of it the 2-rank spawn.
"""
import copy
import gc
import itertools
import os
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ampx
from ampx.grad_buffer import release

sys.path.insert(0, os.path.dirname(__file__))
from conftest import assert_bits_equal  # noqa: E402


def make_model(seed=0, bf16_head=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 17), torch.nn.Tanh(), torch.nn.Linear(17, 4))
    model[2].bias.requires_grad_(False)  # a frozen parameter in the middle of the list
    if bf16_head:
        model[5].to(torch.bfloat16)
    return model


class Head(torch.nn.Module):
    """A model whose last layer is bf16 while the rest is float32 (two buffers)."""

    def __init__(self):
        super().__init__()
        self.body = make_model(bf16_head=True)

    def forward(self, x):
        h = self.body[:5](x)
        return self.body[5](h.to(torch.bfloat16)).float()


OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


def collected(opt):
    """(params, grads) in the order ampx.GradScaler collects them."""
    params, grads, _ = ampx.GradScaler._params_with_grads(opt)
    return params, grads


def assert_back_to_back(buf, opt):
    """Every collected gradient is its buffer's view; per dtype, consecutive in collection order
    and without gaps, starting at the buffer's first element and ending at its last."""
    buf.check()
    _, grads = collected(opt)
    ends = {}
    for g in grads:
        key = (g.dtype, g.device)
        flat = buf.buffers[key]
        assert g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        start = ends.get(key, flat.data_ptr())
        assert g.data_ptr() == start, "a gap or a reordering in the buffer"
        ends[key] = start + g.numel() * g.element_size()
    for key, flat in buf.buffers.items():
        assert ends[key] == flat.data_ptr() + flat.numel() * flat.element_size(), "buffer not covered"


def train(model_fn, opt_name, *, dtype, set_to_none, use_buf, steps=5, accum=2, inf_step=2, clip=0.3,
          zero="opt", state=None):
    """Runs a short fp16/bf16 training loop; returns what each step saw (clones)."""
    model = model_fn()
    opt = OPTS[opt_name](model.parameters())
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=2,
                             named_parameters=model.named_parameters())
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
    buf = ampx.GradBuffer(opt, named_parameters=model.named_parameters()) if use_buf else None
    gen = torch.Generator().manual_seed(123)
    seen = []
    for step in range(steps):
        for _ in range(accum):
            x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
        if step == inf_step:
            with torch.no_grad():
                model[3].weight.grad[1, 2] = float("inf")
        if buf is not None:
            assert_back_to_back(buf, opt)
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        norm = scaler.clip_grad_norm_(opt, clip)
        scaler.step(opt)
        scaler.update()
        if buf is not None:
            buf.check()  # the scaler's passes and the step left every gradient in place
        report = scaler.overflow_report()
        seen.append({"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
                     "norm": norm.clone(), "skipped": bool(scaler.last_step_skipped),
                     "scale": scaler.get_scale(), "report": report and (report.step, report.inf, report.nan)})
        if zero == "buf" and buf is not None:
            buf.zero_grad()
        else:
            opt.zero_grad(set_to_none=set_to_none)
    return seen, (model, opt, scaler, buf)


def assert_same_runs(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert x["skipped"] == y["skipped"] and x["scale"] == y["scale"] and x["report"] == y["report"], step
        assert_bits_equal(x["norm"], y["norm"], f"norm, step {step}")
        for i, (gx, gy) in enumerate(zip(x["grads"], y["grads"])):
            assert (gx is None) == (gy is None), (step, i)
            if gx is not None:
                assert_bits_equal(gx, gy, f"grad {i}, step {step}")
        for i, (px, py) in enumerate(zip(x["params"], y["params"])):
            assert_bits_equal(px, py, f"param {i}, step {step}")


# ---- parity -----------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", sorted(OPTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["to_none", "zeroed"])
def test_training_is_bit_identical_to_no_buffer(opt_name, dtype, set_to_none):
    ref, _ = train(make_model, opt_name, dtype=dtype, set_to_none=set_to_none, use_buf=False)
    got, _ = train(make_model, opt_name, dtype=dtype, set_to_none=set_to_none, use_buf=True)
    assert any(s["skipped"] for s in ref) and not all(s["skipped"] for s in ref)
    assert ref[2]["report"][1] == ["3.weight"], "the overflow report names the parameter"
    assert any(float(s["norm"]) > 0.3 for s in ref if not s["skipped"]), "clipping was active"
    assert_same_runs(got, ref)


@pytest.mark.parametrize("opt_name", ["adamw-fused", "sgd-foreach"])
def test_buffer_zero_grad_equals_set_to_none_false(opt_name):
    # buf.zero_grad() = one memset per buffer; every parameter has a gradient, as with zeroing.
    ref, _ = train(make_model, opt_name, dtype=torch.bfloat16, set_to_none=False, use_buf=False)
    got, (model, opt, _, buf) = train(make_model, opt_name, dtype=torch.bfloat16, set_to_none=False,
                                      use_buf=True, zero="buf")
    assert_same_runs(got, ref)
    assert all(p.grad is buf.view(p) and not p.grad.any() for p in buf.params)


def test_gradient_accumulation_adds_into_the_views():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buf = ampx.GradBuffer(opt)
    ref = copy.deepcopy(model)
    xs = [torch.randn(5, 8) for _ in range(3)]
    for x in xs:
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        assert_back_to_back(buf, opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert_bits_equal(p.grad, q.grad)
    buf.zero_grad()
    model(xs[0]).square().sum().backward()
    ref.zero_grad()
    ref(xs[0]).square().sum().backward()
    for p, q in zip(buf.params, [q for q in ref.parameters() if q.requires_grad]):
        assert_bits_equal(p.grad, q.grad)


# ---- layout -----------------------------------------------------------------------------------

def test_layout_follows_the_optimizer_and_leaves_frozen_parameters_out():
    model = make_model()
    params = list(model.parameters())
    # two groups, listed in an order unlike the model's
    opt = torch.optim.AdamW([{"params": params[4:]}, {"params": params[:4], "lr": 0.1}])
    buf = ampx.GradBuffer(opt)
    order = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    assert [id(p) for p in buf.params] == [id(p) for p in order]
    assert all(p is not model[2].bias for p in buf.params)
    assert len(buf.buffers) == 1
    (flat,) = buf.buffers.values()
    assert flat.numel() == sum(p.numel() for p in order) and not flat.any()
    assert buf.nbytes == flat.numel() * 4
    assert all(p.grad is None for p in params), "no gradient appears before a backward"
    model(torch.randn(3, 8)).sum().backward()
    assert_back_to_back(buf, opt)
    assert model[2].bias.grad is None
    assert "GradBuffer(7 parameters; float32 on cpu: 521)" in repr(buf)


def test_mixed_dtypes_make_one_buffer_each():
    ref, _ = train(Head, "adamw-fused", dtype=torch.bfloat16, set_to_none=True, use_buf=False,
                   inf_step=None)
    got, (model, opt, _, buf) = train(Head, "adamw-fused", dtype=torch.bfloat16, set_to_none=True,
                                      use_buf=True, inf_step=None)
    assert_same_runs(got, ref)
    assert sorted(str(k[0]) for k in buf.buffers) == ["torch.bfloat16", "torch.float32"]
    assert buf.buffers[(torch.bfloat16, torch.device("cpu"))].numel() == 17 * 4 + 4


def test_existing_gradients_are_kept_and_strides_follow_the_parameter():
    w = torch.nn.Parameter(torch.randn(4, 3).t())  # a transposed (column-major) parameter
    b = torch.nn.Parameter(torch.randn(5))
    (w.sum() * 2 + b.square().sum()).backward()
    before = [w.grad.clone(), b.grad.clone()]
    buf = ampx.GradBuffer([w, b])
    assert w.grad.stride() == w.stride() and w.grad is buf.view(w)
    assert_bits_equal(w.grad, before[0])
    assert_bits_equal(b.grad, before[1])
    assert buf.view(b).data_ptr() == buf.view(w).data_ptr() + 12 * 4


# ---- checkpoints ------------------------------------------------------------------------------

def test_views_survive_load_state_dict_and_a_resumed_run_matches():
    kw = dict(dtype=torch.float16, set_to_none=True, inf_step=1)
    full, _ = train(make_model, "adamw-fused", use_buf=False, steps=6, **kw)
    first, (model, opt, scaler, buf) = train(make_model, "adamw-fused", use_buf=True, steps=3, **kw)
    state = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
             "scaler": scaler.state_dict()}
    # the same objects loading their own state keep their views
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    model(torch.randn(2, 8)).sum().backward()
    assert_back_to_back(buf, opt)
    # a fresh run resumed from the checkpoint, with a buffer built after loading, continues
    # as a resumed run without a buffer does (torch's load_state_dict may share the saved
    # tensors, hence a copy each)
    resumed, _ = train(make_model, "adamw-fused", use_buf=True, steps=3, state=copy.deepcopy(state), **kw)
    resumed_ref, _ = train(make_model, "adamw-fused", use_buf=False, steps=3, state=copy.deepcopy(state), **kw)
    assert_same_runs(resumed, resumed_ref)
    assert_same_runs(first, full[:3])


# ---- master weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("set_to_none", [True, False], ids=["to_none", "zeroed"])
def test_master_weights_read_the_views(set_to_none):
    def run(use_buf):
        model = make_model()
        opt = ampx.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                 model=model, dtype=torch.bfloat16)
        buf = ampx.GradBuffer(opt) if use_buf else None
        scaler = ampx.GradScaler("cpu", init_scale=2.0**8)
        gen = torch.Generator().manual_seed(5)
        out = []
        for _ in range(4):
            x = torch.randn(6, 8, generator=gen).bfloat16()
            scaler.scale(model(x).float().square().mean()).backward()
            if buf is not None:
                assert_back_to_back(buf, opt)
            scaler.clip_grad_norm_(opt, 0.05)
            scaler.step(opt)
            scaler.update()
            out.append([p.detach().clone() for p in model.parameters()])
            opt.zero_grad(set_to_none=set_to_none)
        return out, buf

    ref, _ = run(False)
    got, buf = run(True)
    assert list(buf.buffers) == [(torch.bfloat16, torch.device("cpu"))]
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            assert_bits_equal(x, y)


# ---- what breaks the views --------------------------------------------------------------------

def test_an_assigned_gradient_is_copied_back_at_the_next_backward():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buf = ampx.GradBuffer(opt)
    model(torch.randn(3, 8)).sum().backward()
    w = model[0].weight
    w.grad = torch.full_like(w, 2.0)
    with pytest.raises(RuntimeError, match="not views of the buffer"):
        buf.check()
    buf.reattach()
    assert_back_to_back(buf, opt)
    assert bool((w.grad == 2.0).all())
    w.grad = torch.ones_like(w)
    x = torch.randn(3, 8)
    model(x).sum().backward()  # accumulates into the assigned tensor, then the hook copies it in
    ref = make_model()
    ref(x).sum().backward()
    assert w.grad is buf.view(w)
    assert_bits_equal(w.grad, ref[0].weight.grad + 1.0)
    assert_back_to_back(buf, opt)


def test_a_swapped_storage_is_found_by_check():
    model = make_model()
    buf = ampx.GradBuffer(model)
    model(torch.randn(3, 8)).sum().backward()
    model[3].bias.grad.data = torch.zeros(17)
    with pytest.raises(RuntimeError, match=r"1 gradient\(s\) .*'3.bias'"):
        buf.check()
    with pytest.raises(RuntimeError, match="'3.bias' no longer lives in the buffer"):
        model(torch.randn(3, 8)).sum().backward()


def test_a_view_of_another_buffer_is_refused():
    model = make_model()
    buf = ampx.GradBuffer(model)
    other = torch.zeros(1000)
    model[0].bias.grad = other[:16]
    with pytest.raises(RuntimeError, match="'0.bias' is a view into another buffer .*gradient_as_bucket_view"):
        model(torch.randn(3, 8)).sum().backward()
    assert buf.view(model[0].bias) is not model[0].bias.grad


def test_a_cast_model_is_refused_at_the_next_backward():
    model = make_model()
    ampx.GradBuffer(model)
    model.double()  # no gradients yet: autograd's fresh float64 gradient meets a float32 view
    with pytest.raises(RuntimeError, match="cast or moved after the buffer was built"):
        model(torch.randn(3, 8, dtype=torch.float64)).sum().backward()
    model = make_model()
    ampx.GradBuffer(model)
    model(torch.randn(3, 8)).sum().backward()
    model.double()  # with gradients: Module._apply swaps each view's storage (p.grad.data = ...)
    with pytest.raises(RuntimeError, match="'5.bias' no longer lives in the buffer"):
        model(torch.randn(3, 8, dtype=torch.float64)).sum().backward()


def test_sparse_gradients_and_bad_parameters_are_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    first = ampx.GradBuffer(emb)
    with pytest.raises(RuntimeError, match="sparse_coo gradient; GradBuffer holds dense"):
        emb(torch.tensor([1, 2])).sum().backward()
    first.close()
    # refused whole: the dense parameter before it keeps its own gradient
    dense = torch.nn.Parameter(torch.ones(3))
    dense.grad = g = torch.ones(3)
    with pytest.raises(RuntimeError, match="sparse_coo gradient"):
        ampx.GradBuffer([dense, emb.weight])
    assert dense.grad is g
    with pytest.raises(TypeError, match=r"params\[1\] is a int"):
        ampx.GradBuffer([torch.nn.Parameter(torch.ones(2)), 3])
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        ampx.GradBuffer([torch.ones(3)])
    with pytest.raises(ValueError, match="not a leaf"):
        ampx.GradBuffer([torch.ones(3, requires_grad=True) * 2])


def test_one_open_buffer_per_parameter():
    model = make_model()
    buf = ampx.GradBuffer(model)
    with pytest.raises(ValueError, match="already covered by another open GradBuffer"):
        ampx.GradBuffer(model)
    with pytest.raises(ValueError, match="already covered"):
        ampx.GradBuffer([next(model.parameters())])  # one shared parameter is enough
    assert not buf.closed
    release(model)
    assert buf.closed and "closed" in repr(buf)
    again = ampx.GradBuffer(model)
    model(torch.randn(4, 8)).sum().backward()
    again.check()


def test_replace_takes_over_only_once_built():
    """replace=True (what the integrations use): the earlier buffer is closed once the new one
    is built; a build that raises leaves the earlier one open and every gradient where it was."""
    model = make_model()
    first = ampx.GradBuffer(model)
    model(torch.randn(4, 8)).sum().backward()
    first.check()
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1])).sum().backward()  # a sparse gradient: refused when the next buffer is built
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match="sparse_coo gradient"):
        ampx.GradBuffer(list(model.parameters()) + [emb.weight], replace=True)
    assert not first.closed and all(p.grad is g for p, g in zip(model.parameters(), grads))
    first.check()
    second = ampx.GradBuffer(model, replace=True)
    assert first.closed and not second.closed
    second.check()  # the gradients moved into the new buffer
    model.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    second.check()


def test_a_dropped_model_and_its_buffer_are_freed():
    """The hooks hold the buffer, the buffer only weak references to the parameters: no cycle
    through tensor hooks (which the garbage collector never frees), so dropping the model frees
    parameters, gradients and buffer without close()."""
    model = make_model()
    buf = ampx.GradBuffer(model)
    model(torch.randn(4, 8)).sum().backward()
    p_ref, buf_ref, flat_ref = weakref.ref(next(model.parameters())), weakref.ref(buf), \
        weakref.ref(next(iter(buf.buffers.values())))
    del model, buf
    gc.collect()
    assert p_ref() is None and buf_ref() is None and flat_ref() is None


def test_a_kept_buffer_outlives_its_dropped_model():
    model = make_model()
    buf = ampx.GradBuffer(model)
    model(torch.randn(4, 8)).sum().backward()
    del model
    gc.collect()
    assert buf.params == [] and buf.nbytes > 0
    buf.zero_grad()
    buf.reattach()
    buf.check()
    buf.close()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_keeps_autograds_gradients():
    model, ref = make_model(), make_model()
    buf = ampx.GradBuffer(model)
    x = torch.randn(3, 8)
    for m in (model, ref):
        m(x).square().sum().backward(create_graph=True)
        # a gradient penalty differentiates through the gradients
        sum(p.grad.square().sum() for p in m.parameters() if p.grad is not None).backward()
    w = model[0].weight
    assert w.grad.requires_grad and w.grad is not buf.view(w)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert_bits_equal(p.grad, q.grad)
    model.zero_grad()
    model(x).sum().backward()
    assert_back_to_back(buf, torch.optim.SGD(model.parameters()))


def test_close_removes_the_hooks():
    model = make_model()
    buf = ampx.GradBuffer(model)
    buf.close()
    model(torch.randn(3, 8)).sum().backward()
    assert model[0].weight.grad is not buf.view(model[0].weight)


# ---- DDP --------------------------------------------------------------------------------------

def _ddp_worker(rank, world, store_dir, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        res = {}
        for use_buf in (False, True):
            model = make_model()
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=False)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
            buf = ampx.GradBuffer(opt) if use_buf else None
            scaler = ampx.GradScaler("cpu", init_scale=2.0**8)
            gen = torch.Generator().manual_seed(10 + rank)
            grads, views = [], True
            for _ in range(3):
                for micro in range(2):
                    x = torch.randn(4, 8, generator=gen)
                    ctx = ddp.no_sync() if micro == 0 else _null()
                    with ctx, torch.autocast("cpu", dtype=torch.float16):
                        scaler.scale(ddp(x).float().square().mean()).backward()
                if buf is not None:
                    try:
                        assert_back_to_back(buf, opt)
                    except AssertionError:
                        views = False
                grads.append([p.grad.clone() for p in buf.params] if buf else
                             [p.grad.clone() for p in model.parameters() if p.requires_grad])
                scaler.clip_grad_norm_(opt, 0.1)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            res[use_buf] = {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
                            "views": views}
        try:
            ampx.GradBuffer(torch.nn.parallel.DistributedDataParallel(make_model(), gradient_as_bucket_view=True))
            res["refused"] = None
        except ValueError as e:
            res["refused"] = str(e)
        # built over the parameters (DDP not in sight): the hook refuses DDP's bucket views
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
        ampx.GradBuffer(ddp.module)
        res["hook_refused"] = None
        try:
            for _ in range(2):
                ddp(torch.randn(4, 8)).sum().backward()
        except RuntimeError as e:
            res["hook_refused"] = str(e)
    except Exception:
        import traceback

        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_ddp_copies_averaged_gradients_into_the_views(tmp_path):
    torch.multiprocessing.spawn(_ddp_worker, args=(2, str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}:\n{res.get('error')}"
        assert res[True]["views"], f"rank {r}: gradients left the buffer"
        assert "gradient_as_bucket_view=True" in res["refused"]
        assert "is a view into another buffer" in res["hook_refused"]
        for a, b in zip(itertools.chain(*res[True]["grads"]), itertools.chain(*res[False]["grads"])):
            assert_bits_equal(a, b)
        for a, b in zip(res[True]["params"], res[False]["params"]):
            assert_bits_equal(a, b)
    for a, b in zip(ranks[0][True]["params"], ranks[1][True]["params"]):
        assert_bits_equal(a, b)
