"""Where ampx's CPU threads come from: torch's OpenMP team, or ampx's own pool.

Large calls split into tasks that run on the OpenMP runtime torch already loaded (so ampx and
torch share one set of threads) or, without one, on ampx's pthread pool. Both must give the
same bits; a forked child must never enter the parent's OpenMP team (GNU libgomp hangs there).
"""
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ampx
from ampx import ops

N = (1 << 20) + 333  # well above the parallel threshold (2**18), and not a multiple of a chunk


def _loaded_openmp():
    """The OpenMP runtime torch loaded: the one in torch's own wheel when there is one (a later
    import, of a framework or a compiled extension, may add the system's libgomp beside it;
    /proc/self/maps lists by address, not load order), else the first one mapped."""
    maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
    found = re.findall(r"\S*/(?:libgomp|libomp|libiomp5)[^/\s]*", maps)
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    own = [f for f in found if os.path.realpath(f).startswith(torch_dir)]
    return (own or found or [None])[0]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g) * 4)
    x[12345] = float("inf")
    x[N - 7] = float("nan")
    return x


def test_backend_is_torchs_openmp_runtime_when_loaded():
    runtime = _loaded_openmp()
    backend = ops.thread_backend()
    if os.environ.get("AMPX_THREADING") == "pool" or runtime is None:
        assert backend == "ampx pool"
    else:
        assert os.path.realpath(backend) == os.path.realpath(runtime)


_SCRIPT = textwrap.dedent("""
    import sys, torch, ampx
    from ampx import ops
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    n = (1 << 20) + 333
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[12345] = float("inf"); x[n - 7] = float("nan")
    y = x[:-10].clone()
    total, per = ops.norm([x[:12000], y, x[20000:]], ord=2, per_tensor=True)
    found = torch.zeros(1)
    ops.unscale_([x], torch.tensor([0.5]), found)
    torch.save({"backend": ops.thread_backend(), "total": total, "per": per, "x": x, "found": found},
               sys.argv[1])
""")


def test_openmp_team_and_pool_give_the_same_bits(tmp_path):
    outs = {}
    for mode in ("openmp", "pool"):
        path = tmp_path / f"{mode}.pt"
        env = dict(os.environ, AMPX_THREADING=mode)
        subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], check=True, env=env, timeout=120)
        outs[mode] = torch.load(path)
    assert outs["pool"]["backend"] == "ampx pool"
    if _loaded_openmp() is not None:
        assert outs["openmp"]["backend"] != "ampx pool"
    a, b = outs["openmp"], outs["pool"]
    assert torch.equal(a["x"].view(torch.int32), b["x"].view(torch.int32))
    assert torch.equal(a["total"].view(torch.int32), b["total"].view(torch.int32))
    assert torch.equal(a["per"].view(torch.int32), b["per"].view(torch.int32))
    assert float(a["found"]) == float(b["found"]) == 1.0
    # and both are right
    x = _data()
    torch.testing.assert_close(a["x"], x * 0.5, equal_nan=True, rtol=0, atol=0)


_FORK = textwrap.dedent("""
    import os, sys, torch, ampx
    from ampx import ops
    torch.set_num_threads(2)
    x = torch.ones(1 << 21)
    ops.mul_([x], 2.0)          # the parent uses the OpenMP team ...
    x.mul_(1.0)                 # ... and so does torch
    split = ops._SCALE | ops._WRITE
    ampx._C.scale_reduce("t", [x], split, factor=1.0, split=ops.SPLIT_FUSED, nthreads=2)  # and torch's cut
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ops.mul_([x], 0.5)  # two threads (AMPX_NUM_THREADS): must not enter the parent's team
            # nor may a call asking for torch's cut (it falls back to the pool's dynamic split)
            ampx._C.scale_reduce("t", [x], split, factor=1.0, split=ops.SPLIT_FUSED, nthreads=2)
            torch.set_num_threads(1)  # torch's own parallel ops would hang in this child
            ok = (bool(torch.all(x == 1.0)) and ops.thread_backend() == "ampx pool"
                  and ampx._C._last_split() == ops.SPLIT_DYNAMIC)
        finally:
            os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_runs_parallel_calls_on_the_pool():
    env = dict(os.environ, AMPX_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", _FORK], timeout=60, env=env)
    assert r.returncode == 0


def test_concurrent_callers_from_python_threads():
    xs = [torch.nan_to_num(_data(seed), nan=1.0, posinf=2.0) for seed in range(4)]
    expect = [ops.norm([x], ord=1) for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                t = ops.norm([xs[i]], ord=1)
                if not torch.equal(t, expect[i]):
                    errors.append((i, float(t), float(expect[i])))
        except Exception as e:  # pragma: no cover - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for x, e in zip(xs, expect):
        assert float(e) == pytest.approx(float(x.double().abs().sum()), rel=1e-6)
    assert ampx.ops.thread_backend()  # still answers


_FORK_TORCH = textwrap.dedent("""
    import os, sys, torch, ampx
    from ampx import ops
    torch.set_num_threads(2)
    ops.mul_([torch.ones(1 << 22)], 2.0)   # only ampx has used the OpenMP team
    pid = os.fork()
    if pid == 0:
        y = torch.ones(1 << 24)             # torch's parallel fill and sum: hung here before
        ok = float((y * 2).sum()) == 2.0 * (1 << 24) and torch.get_num_threads() == 1
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_of_an_ampx_parent_runs_torchs_parallel_ops():
    """A child forked after ampx used torch's OpenMP team: torch's own parallel ops ran into the
    team libgomp cannot carry across fork and hung; the child now runs them on one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("AMPX_THREADING", "AMPX_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", _FORK_TORCH], timeout=60, env=env)
    assert r.returncode == 0


_TWO_RUNTIMES = textwrap.dedent("""
    import sentencepiece  # a wheel with its own libgomp (renamed by auditwheel), loaded before torch's
    import torch, ampx
    from ampx import ops
    torch.set_num_threads(2)
    ops.norm([torch.ones((1 << 20) + 3)])
    print(ops.thread_backend())
""")


def test_a_second_openmp_runtime_loaded_first_is_not_taken_for_torchs():
    """With two runtimes loaded, ampx joins the one beside libtorch_cpu (the team torch's ops and
    torch.set_num_threads use), not the first one loaded: a foreign team would ignore torch's
    thread count and spin beside torch's own workers."""
    runtime = _loaded_openmp()
    if runtime is None or os.environ.get("AMPX_THREADING") == "pool":
        pytest.skip("torch loaded no OpenMP runtime here")
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    if not os.path.realpath(runtime).startswith(torch_dir):
        pytest.skip("this torch's OpenMP runtime is not in its wheel")
    pytest.importorskip("sentencepiece")
    r = subprocess.run([sys.executable, "-c", _TWO_RUNTIMES],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert os.path.realpath(r.stdout.strip()) == os.path.realpath(runtime), r.stdout
