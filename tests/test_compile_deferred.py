"""ampx defers torch.compiler.disable until torch._dynamo is imported (ampx/compile_guard.py):
``import ampx`` must not import dynamo, and the scaler's host-driven calls must still run
eagerly under torch.compile however dynamo came in. Each case is a fresh process, since the
pytest process has long imported dynamo.

What shows that a call ran eagerly rather than traced: a foreach Adam's step, which dynamo
traces into other ops than eager's (tests/test_torch_ops.py, test_compiled_foreach_adam_gives_eager_bits),
gives eager's bits only when it runs inside ampx's disabled step."""
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import math, sys
    mode = sys.argv[1]
    import torch
    if mode == "dynamo_first":
        import torch._dynamo
    import ampx
    from ampx import compile_guard
    assert ("torch._dynamo" in sys.modules) == (mode == "dynamo_first"), mode
    assert compile_guard._LOADED == (mode == "dynamo_first")
    plain = ampx.GradScaler.__dict__["unscale_"]  # (already the disabled version when dynamo came first)
    if mode == "unseen":  # dynamo loaded where the watch cannot see it
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, compile_guard._DynamoWatch)]

    def train(compiled, steps=4):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        scaler = ampx.GradScaler("cpu", init_scale=2.0**15, growth_interval=2)
        xs = [torch.randn(16, 8) for _ in range(steps)]
        xs[2][0, 0] = math.inf  # one skipped step

        def train_step(x):
            loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        step = torch.compile(train_step, backend="eager") if compiled else train_step
        for x in xs:
            step(x)
        return [p.detach().clone() for p in model.parameters()] + [scaler._scale.clone()]

    if mode == "watched":  # the watch makes them the moment dynamo's import ends, before any trace
        torch.compile(train)  # (imports dynamo)
        assert compile_guard._LOADED and ampx.GradScaler.__dict__["unscale_"] is not plain
    if mode == "unseen":
        import torch._dynamo  # unseen by the watch: nothing made yet
        assert not compile_guard._LOADED
        first = train(True)  # meets the marked calls first: runs them as dynamo runs any frame
        assert compile_guard._LOADED and compile_guard._RUNNERS is not None
    compiled = train(True)  # watched: torch.compile imports dynamo, and the watch makes them then
    assert compile_guard._LOADED and compile_guard._RUNNERS is not None
    assert (ampx.GradScaler.__dict__["unscale_"] is plain) == (mode == "dynamo_first")  # replaced once
    eager = train(False)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "the step was traced into"
    if mode == "unseen":  # correct, rounded as dynamo's traced foreach Adam rounds
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(eager, first))

    # under fullgraph=True the break is an error that says why (once the disabled versions exist)
    torch._dynamo.reset()
    scaler = ampx.GradScaler("cpu")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    try:
        torch.compile(lambda: scaler.unscale_(opt), fullgraph=True, backend="eager")()
    except Exception as e:
        text = str(e)
    else:
        raise AssertionError("fullgraph unscale_ compiled")
    assert "torch.compiler.disable" in text, text
    assert not compile_guard._TAKES_REASON or "ampx.GradScaler.unscale_() runs eagerly" in text, text
    print("OK", mode)
""")


@pytest.mark.parametrize("mode", ["watched", "unseen", "dynamo_first"])
def test_host_driven_calls_run_eagerly_however_dynamo_came_in(mode):
    """watched: dynamo imported after ampx, by torch.compile (the import watch makes the disabled
    versions then); unseen: imported with the watch removed, then a compiled step first (the
    first marked call to notice makes them: that step is correct, the next ones eager's bits);
    dynamo_first: imported before ampx (made at import, as before)."""
    p = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and f"OK {mode}" in p.stdout, p.stderr[-4000:]


def test_import_ampx_does_not_import_dynamo():
    """The 1.8 s that torch.compiler.disable's import of torch._dynamo cost every process that
    imports ampx (about 40% of the import) is spent only by one that compiles."""
    code = ("import sys, ampx, ampx.integrations, ampx.doctor; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "[]", p.stdout
