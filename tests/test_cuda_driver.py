"""The CUDA host layer (csrc/cuda_driver.c) against a stand-in driver, without a GPU.

tests/fake_libcuda.c is built into a shared library that ampx opens instead of libcuda.so.1
(AMPX_LIBCUDA names it). Each case runs in a fresh interpreter, since the driver is opened once
per process. Covered:
  * ``is_available()`` is true only once a kernel has been loaded and launched on that device,
    per device, and a success is not probed again;
  * a driver older than the CUDA release that built the fatbin is refused before loading, with
    the driver that is needed; every load and init error a user can fix says how;
  * a device's kernels load once however many threads ask, with the GIL released meanwhile;
  * a forked child forgets the parent's driver state (no stale context or module handle is
    used) and, when CUDA cannot start there, says to use 'spawn'.
What only a real GPU shows (a real load, JIT and launch) is in test_cuda.py's GPU tests and
benchmarks/gpu_check.sh. Cost: one C compile and ~6 interpreters, about 15 s.
"""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cc = sysconfig.get_config_var("CC") or "cc"
    out = str(tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1")
    cmd = cc.split() + ["-shared", "-fPIC", "-O1", "-Wall", "-o", out, os.path.join(HERE, "fake_libcuda.c")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no C compiler for the fake driver: {r.stderr[-300:]}")
    return out


# Runs before each case's own code: ampx with the fake driver and a stand-in fatbin built by
# CUDA 12.9 (the fake driver never reads it), and a helper reading the fake's call counts.
_PRELUDE = """
import ctypes, json, os, sys, threading, time
import ampx, ampx.cuda
from ampx import _C
_C.cuda_set_image((b"fatbin stand-in", SASS_TOOLKIT, PTX_TOOLKIT, "SASS for sm_80, sm_90 and PTX for compute_80"))
ampx.cuda._image_loaded = True
ampx.cuda._built = lambda: True
fake = ctypes.CDLL(os.environ["AMPX_LIBCUDA"])
def counts():
    buf = (ctypes.c_int * 5)()
    fake.fake_cu_counts(buf)
    return dict(zip(["init", "load", "launch", "stale", "blocking_stream"], buf))
"""


def run_case(lib, body, toolkit=12090, **env):
    """Runs `body` after _PRELUDE in a fresh interpreter; returns what it prints as JSON."""
    code = _PRELUDE.replace("SASS_TOOLKIT", str(toolkit)).replace("PTX_TOOLKIT", str(toolkit))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CU_")}
    full_env.update({"AMPX_LIBCUDA": lib, "PYTHONPATH": ROOT}, **{k: str(v) for k, v in env.items()})
    r = subprocess.run([sys.executable, "-c", code + textwrap.dedent(body)], capture_output=True, text=True,
                       env=full_env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_available_only_after_a_launch_on_that_device(fake_driver):
    out = run_case(fake_driver, """
        r = {"reason1": ampx.cuda.unavailable_reason(1), "ok0": ampx.cuda.is_available(0),
             "after0": counts()}
        r["ok0_again"] = ampx.cuda.is_available(0)
        r["again"] = counts()
        print(json.dumps(r))
    """, FAKE_CU_DEVICES=2, FAKE_CU_LAUNCH_RC="0,719")
    # Device 1 loads but its launch fails: not available, with the launch named.
    assert "ampx_k_probe" in out["reason1"] and "719" in out["reason1"], out
    assert "restart the process" in out["reason1"] and "CUDA_LAUNCH_BLOCKING=1" in out["reason1"], out
    assert out["ok0"] is True and out["ok0_again"] is True
    # One load per device; the probe kernel ran on each once; a success is not probed again.
    assert out["after0"]["load"] == 2 and out["after0"]["launch"] == 2, out
    assert out["again"] == out["after0"], out
    assert out["after0"]["blocking_stream"] == 0  # the probe stays off the legacy stream


def test_a_device_whose_kernels_do_not_load_is_unavailable(fake_driver):
    out = run_case(fake_driver, """
        print(json.dumps({"r": ampx.cuda.unavailable_reason(0), "c": counts()}))
    """, FAKE_CU_LOAD_RC=209, FAKE_CU_CC=75)
    assert "compute capability 7.5" in out["r"] and "8.0 or newer" in out["r"], out
    assert out["c"]["load"] == 0  # refused before the driver is asked

    out = run_case(fake_driver, """
        print(json.dumps({"r": ampx.cuda.unavailable_reason(0), "c": counts()}))
    """, FAKE_CU_LOAD_RC=209, FAKE_CU_CC=110)
    assert "CUDA_ERROR_NO_BINARY_FOR_GPU" in out["r"] and "To fix:" in out["r"], out
    assert "compute capability 11.0" in out["r"] and out["c"]["launch"] == 0, out


@pytest.mark.parametrize("toolkit,driver,needed,have", [
    (12090, 11080, "CUDA 12.0 (R525 or newer)", "CUDA 11.8"),
    (13000, 12040, "CUDA 13.0 (R580 or newer)", "CUDA 12.4"),
])
def test_a_driver_older_than_the_build_says_which_driver_is_needed(fake_driver, toolkit, driver, needed, have):
    out = run_case(fake_driver, """
        print(json.dumps({"r": ampx.cuda.unavailable_reason(0), "c": counts()}))
    """, toolkit=toolkit, FAKE_CU_DRIVER=driver)
    assert needed in out["r"] and have in out["r"] and "update the NVIDIA driver" in out["r"], out
    assert out["c"]["load"] == 0, out


def test_an_older_driver_of_the_same_major_release_still_loads(fake_driver):
    # SASS from CUDA 12.9 loads on any 12.x driver (minor-version compatibility).
    out = run_case(fake_driver, "print(json.dumps(ampx.cuda.is_available(0)))", FAKE_CU_DRIVER=12020)
    assert out is True


def test_every_fixable_load_error_says_how_to_fix_it(fake_driver):
    out = run_case(fake_driver, """
        r = {}
        for rc in (2, 200, 209, 218, 221, 222, 500, 900):
            os.environ["FAKE_CU_LOAD_RC"] = str(rc)
            r[rc] = ampx.cuda.unavailable_reason(0)
        os.environ["FAKE_CU_LOAD_RC"] = "0"
        r["recovered"] = ampx.cuda.is_available(0)
        print(json.dumps(r))
    """, FAKE_CU_DRIVER=12040)
    for rc in ("2", "200", "209", "218", "221", "222", "500", "900"):
        assert f"error {rc}" in out[rc] and "To fix:" in out[rc], (rc, out[rc])
    for rc in ("200", "209", "218", "222"):  # a missing target or an old driver: the whole story
        assert "CUDA 12.9 (R575 or newer)" in out[rc] and "this driver is for CUDA 12.4" in out[rc], out[rc]
        assert "Device 0 has compute capability 9.0; ampx's fatbin holds SASS for sm_80, sm_90" in out[rc]
    assert "update the NVIDIA driver" in out["222"]
    assert "empty_cache" in out["2"] and "compute capability" not in out["2"]
    assert out["recovered"] is True  # failures are not cached


def test_every_fixable_init_error_says_how_to_fix_it(fake_driver):
    # The driver opens once per process: each code gets a forked child (which starts afresh).
    out = run_case(fake_driver, """
        r = {}
        for rc in (3, 34, 100, 803, 804):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.environ["FAKE_CU_INIT_RC"] = str(rc)
                os.write(write, (ampx.cuda.unavailable_reason(0) or "").encode())
                os._exit(0)
            os.close(write)
            r[rc] = os.read(read, 4096).decode()
            os.waitpid(pid, 0)
        print(json.dumps(r))
    """)
    for rc, words in (("3", "spawn"), ("34", "stubs"), ("100", "CUDA_VISIBLE_DEVICES"), ("803", "reboot"),
                      ("804", "forward-compatibility")):
        assert f"error {rc}" in out[rc] and "To fix:" in out[rc] and words in out[rc], (rc, out[rc])


def test_no_driver_library_says_how_to_fix_it(tmp_path):
    env = dict(os.environ, AMPX_LIBCUDA=str(tmp_path / "missing.so"), PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", "import ampx.cuda, ampx._C as C; "
                        "C.cuda_set_image((b'x', 12090, 12090)); ampx.cuda._image_loaded = True; "
                        "ampx.cuda._built = lambda: True; print(ampx.cuda.unavailable_reason(0))"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "could not be loaded" in r.stdout and "install the NVIDIA driver" in r.stdout, r.stdout


def test_kernels_load_once_per_device_without_the_gil(fake_driver):
    out = run_case(fake_driver, """
        ticks = [0]
        stop = threading.Event()
        def spin():
            while not stop.is_set():
                ticks[0] += 1
        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.05)
        b0, t0 = ticks[0], time.perf_counter()
        time.sleep(0.3)  # the spinner's rate with the GIL free (this thread sleeps)
        rate = (ticks[0] - b0) / (time.perf_counter() - t0)
        results = []
        def ask():
            results.append(ampx.cuda.is_available(0))
        askers = [threading.Thread(target=ask) for _ in range(4)]
        before = ticks[0]
        t0 = time.perf_counter()
        for t in askers:
            t.start()
        ask()  # this thread too: it waits in C, on ampx's lock or in the load, without the GIL
        during = ticks[0] - before
        took = time.perf_counter() - t0
        for t in askers:
            t.join()
        stop.set()
        spinner.join()
        print(json.dumps({"results": results, "share": during / (rate * took), "took": took, "c": counts()}))
    """, FAKE_CU_LOAD_MS=600)
    assert out["results"] == [True] * 5
    assert out["c"]["load"] == 1 and out["c"]["launch"] == 1, out
    assert out["took"] >= 0.5, out
    # With the GIL held for the 600 ms load, the spinning thread would count only in the
    # switch intervals around it (a few percent of its free rate).
    assert out["share"] > 0.4, out


def test_a_forked_child_starts_from_a_fresh_driver_state(fake_driver):
    out = run_case(fake_driver, """
        assert ampx.cuda.is_available(0)
        parent = counts()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            ok = ampx.cuda.is_available(0)
            child = counts()
            os.write(write, json.dumps({"ok": ok, "child": child}).encode())
            os._exit(0)
        os.close(write)
        got = json.loads(os.read(read, 4096).decode())
        os.waitpid(pid, 0)
        # A second child whose driver cannot start: the message says why and what to do.
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.environ["FAKE_CU_INIT_RC"] = "3"
            os.write(write, (ampx.cuda.unavailable_reason(0) or "").encode())
            os._exit(0)
        os.close(write)
        got["reason"] = os.read(read, 4096).decode()
        os.waitpid(pid, 0)
        got["parent"] = parent
        got["parent_after"] = counts()
        got["parent_ok"] = ampx.cuda.is_available(0)
        print(json.dumps(got))
    """)
    # The child ran cuInit, loaded and probed again: nothing of the parent's was reused...
    assert out["ok"] is True, out
    assert out["child"]["init"] == out["parent"]["init"] + 1, out
    assert out["child"]["load"] == out["parent"]["load"] + 1, out
    assert out["child"]["launch"] == out["parent"]["launch"] + 1, out
    assert out["child"]["stale"] == 0, out  # ...and no handle of the parent's was used
    assert "forked" in out["reason"] and "spawn" in out["reason"], out
    assert out["parent_ok"] is True and out["parent_after"] == out["parent"], out


@pytest.mark.parametrize("toolkit, needed", [(12090, "CUDA 12.0 (R525 or newer)"), (13000, "CUDA 13.0 (R580 or newer)")])
def test_a_driver_lacking_an_entry_point_names_the_driver_the_build_needs(tmp_path, toolkit, needed):
    """A libcuda without one of the entry points ampx uses: the advice names the driver the
    fatbin's toolkit needs (R580 for a CUDA 13 build), not a fixed one."""
    cc = sysconfig.get_config_var("CC") or "cc"
    src, lib = tmp_path / "empty.c", str(tmp_path / "libcuda.so.1")
    src.write_text("int not_a_driver_entry_point(void) { return 0; }\n")
    r = subprocess.run(cc.split() + ["-shared", "-fPIC", "-o", lib, str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no C compiler for the stand-in library: {r.stderr[-300:]}")
    env = dict(os.environ, AMPX_LIBCUDA=lib, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", "import ampx.cuda, ampx._C as C; "
                        f"C.cuda_set_image((b'x', {toolkit}, {toolkit})); ampx.cuda._image_loaded = True; "
                        "ampx.cuda._built = lambda: True; print(ampx.cuda.unavailable_reason(0))"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "too old for ampx" in r.stdout and f"update the NVIDIA driver (to one for {needed})" in r.stdout, r.stdout
