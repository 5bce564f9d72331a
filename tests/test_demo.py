"""python -m ampx demo, in short runs: its table, its footnotes, its PNG, its progress bar, and
the options it refuses before it reads the corpus or trains anything."""
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import ampx
from ampx import demo

pytest.importorskip("matplotlib")

RUNS = ("float32", "torch AMP bf16", "ampx bf16", "torch AMP fp16", "ampx fp16")
SHORT = ["--corpus-bytes", "60000", "--no-plot"]


def spy_runs(monkeypatch):
    """Collects the results of the runs main() trains."""
    results = []
    orig = demo.train_all

    def spy(*a, **k):
        r = orig(*a, **k)
        results.extend(r)
        return r

    monkeypatch.setattr(demo, "train_all", spy)
    return results


def table_rows(out):
    """{run name: its table line} from the demo's stdout."""
    rows = {}
    for line in out.splitlines():
        for name in RUNS:
            if line.startswith(name + " ") and re.match(rf"{re.escape(name)}\s+(float32|bfloat16|float16)\s", line):
                rows[name] = line
    return rows


def test_demo_short_run(tmp_path, capsys):
    out = tmp_path / "demo.png"
    rc = demo.main(["--steps", "8", "--batch", "16", "--corpus-bytes", "60000", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr()
    rows = table_rows(text.out)
    assert set(rows) == set(RUNS)
    assert "val loss" in text.out and "loss scale used" in text.out and "ms/step" in text.out
    assert "Policy.auto" in text.out  # what ampx would recommend here
    # one tqdm bar over the interleaved runs, with its rate and ETA
    assert re.search(r"5 runs: 100%\|.*\| 40/40 \[\d\d:\d\d<00:00, +[\d.]+(step/s|s/step)", text.err)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_demo_learns_and_scales(monkeypatch, capsys):
    """Every run learns; the fp16 runs back off from 2**24 (skipping steps) and grow again."""
    results = spy_runs(monkeypatch)
    monkeypatch.setitem(demo.FP16_SCALER, "growth_interval", 15)  # grow within a short run
    assert demo.main(["--steps", "50", "--batch", "16", *SHORT]) == 0
    assert [r["name"] for r in results] == list(RUNS)
    uniform = math.log(len(demo.VOCAB) + 1)
    for r in results:
        assert r["val_loss"] < uniform - 0.8, r["name"]  # far below guessing
        assert all(math.isfinite(v) for v in r["losses"]), r["name"]
    for r in results[3:]:
        down, up = demo.scale_moves(r)
        assert r["skipped"] >= 1 and down == r["skipped"], r["name"]
        assert up >= 1, r["name"]
    assert "ampx fp16" in capsys.readouterr().out


def test_footnote_matches_table(monkeypatch, capsys):
    """The scale each step ran with is recorded before update(), so the first one is the
    configured init_scale, and the footnote's numbers are the table's."""
    results = spy_runs(monkeypatch)
    assert demo.main(["--steps", "12", "--batch", "16", *SHORT]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    init = demo.FP16_SCALER["init_scale"]
    for r in results:
        if r["dtype"] != "float16":
            continue
        assert len(r["scales"]) == 12
        assert r["scales"][0] == init  # the first step ran with init_scale
        lo, hi = demo.fmt_scale(min(r["scales"])), demo.fmt_scale(max(r["scales"]))
        assert hi == demo.fmt_scale(init)
        assert f"{lo} .. {hi}" in rows[r["name"]]
        assert re.search(rf"\s{r['skipped']}\s+{re.escape(lo)} \.\. ", rows[r["name"]])
        note = next(line for line in out.splitlines() if line.startswith(r["name"] + ": the loss scale"))
        down, up = demo.scale_moves(r)
        assert f"started at {demo.fmt_scale(init)}," in note
        assert f"backed off {down} time(s)" in note and f"grew {up} time(s)" in note
        assert f"within {lo} .. {hi}" in note and f"ended at {demo.fmt_scale(r['final_scale'])}." in note
    assert "Both fp16 runs start at " + demo.fmt_scale(init) in out


def test_bf16_runs_have_no_loss_scaling(monkeypatch, capsys):
    results = spy_runs(monkeypatch)
    made = []
    orig = ampx.Policy.grad_scaler

    def grad_scaler(self, **kw):
        s = orig(self, **kw)
        made.append((self.dtype, s.is_enabled()))
        return s

    monkeypatch.setattr(ampx.Policy, "grad_scaler", grad_scaler)
    assert demo.main(["--steps", "4", "--batch", "8", *SHORT]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert made == [(torch.bfloat16, False), (torch.float16, True)]  # each ampx run from its Policy
    for r in results:
        if r["dtype"] != "float16":
            assert r["scales"] == [] and r["skipped"] == 0 and r["final_scale"] is None
    assert "none (bf16)" in rows["ampx bf16"]
    assert "none (bf16)" in rows["torch AMP bf16"] and "none (fp32)" in rows["float32"]


def test_timing_leaves_out_warmup(monkeypatch, capsys):
    results = spy_runs(monkeypatch)
    assert demo.main(["--steps", "10", "--batch", "8", *SHORT]) == 0
    out = capsys.readouterr().out
    for r in results:
        assert r["warmup_steps"] == demo.warmup_steps(10) == 2 and r["timed_steps"] == 8
        assert r["ms_per_step"] > 0
    assert "after its first 2 warm-up step(s) (8 timed)" in out


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    assert isinstance(demo.progress("x", 3), demo.PlainProgress)
    assert demo.main(["--steps", "4", "--batch", "8", *SHORT]) == 0
    err = capsys.readouterr().err
    assert "%|" not in err
    assert re.search(r"5 runs: 20/20 steps, [\d.]+ steps/s, ETA 0s, [a-zA-Z0-9 ]+: loss \d\.\d\d\d", err), err


def test_progress_with_tqdm():
    pytest.importorskip("tqdm")
    assert isinstance(demo.progress("x", 3), demo.TqdmProgress)


# ---- options refused up front -------------------------------------------------------------------

BAD = [
    (["--lr", "-1"], "--lr"), (["--lr", "0"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--clip", "-1"], "--clip"), (["--clip", "0"], "--clip"), (["--clip", "nan"], "--clip"),
    (["--out", "/no/such/dir/x.png"], "does not exist"), (["--out", "demo.notaformat"], "cannot write"),
    (["--batch", "100000000"], "--batch"), (["--batch", "500000"], "memory"), (["--batch", "0"], "--batch"), (["--steps", "0"], "--steps"),
    (["--steps", "2000000"], "--steps"), (["--context", "0"], "--context"), (["--context", "100000"], "--context"),
    (["--corpus-bytes", "0"], "--corpus-bytes"), (["--corpus-bytes", "500"], "--corpus-bytes"),
    (["--seed", "-1"], "--seed"), (["--device", "tpu"], "--device"), (["--steps", "x"], "--steps"),
    (["--lr", "fast"], "--lr"), (["--bogus"], "--bogus"),
]


@pytest.mark.parametrize("argv,what", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_refused_before_anything(argv, what, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)

    def never(*a, **k):
        raise AssertionError("the demo went on past a bad option")

    monkeypatch.setattr(demo, "load_corpus", never)
    monkeypatch.setattr(demo, "train_all", never)
    monkeypatch.setattr(demo, "Run", never)
    assert demo.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing started: no header, no progress, no table
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("python -m ampx demo: error: ") and what in errors[0]
    assert lines[-1] == errors[0] and all(line.startswith("usage:") or line.startswith(" ") for line in lines[:-1])
    assert "Traceback" not in err


def test_out_directory_not_writable(monkeypatch, capsys, tmp_path):
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(demo.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(demo, "load_corpus", None)
    assert demo.main(["--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "cannot write to" in err and "Permission denied" in err
    # ... and --no-plot needs no writable directory
    assert demo.validate(demo.parser().parse_args(["--no-plot", "--out", "/no/such/dir/x.png"]))[1] is None


def test_out_is_a_directory(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--lr", "-1"], ["--clip", "-1"], ["--out", "/no/such/dir/x.png"],
                                  ["--batch", "100000000"]])
def test_bad_options_from_the_command_line(argv):
    p = subprocess.run([sys.executable, "-m", "ampx", "demo", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("usage: python -m ampx demo") and lines[-1].startswith("python -m ampx demo: error: ")
    assert "Traceback" not in p.stderr and sum("error:" in line for line in lines) == 1


def test_cpu_without_native_bf16(tmp_path):
    """Policy.auto picks fp32 there and says why; the demo shows the 16-bit runs anyway, says
    so, and shows the Policy's warning once as one clean line (no file path, no class name)."""
    env = dict(os.environ, AMPX_CPU_BF16="0")
    env.pop("PYTHONWARNINGS", None)
    p = subprocess.run([sys.executable, "-m", "ampx", "demo", "--steps", "2", "--batch", "4", "--corpus-bytes",
                        "20000", "--no-plot"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "in fp32" in p.stdout and "no native bf16" in p.stdout
    assert "shown anyway" in p.stdout
    warn = [line for line in p.stdout.splitlines() if line.startswith("warning: ampx.Policy('bf16'")]
    assert len(warn) == 1, p.stdout
    assert "Warning" not in p.stderr and "warnings.warn" not in p.stderr and ".py:" not in p.stderr
    assert "Warning" not in p.stdout


def test_no_warning_escapes(monkeypatch, capsys):
    monkeypatch.setenv("AMPX_CPU_BF16", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert demo.main(["--steps", "2", "--batch", "4", *SHORT]) == 0
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().out.count("warning: ampx.Policy('bf16'") == 1


def test_bad_environment_refused(monkeypatch, capsys):
    monkeypatch.setenv("AMPX_CPU_BF16", "maybe")
    monkeypatch.setattr(demo, "load_corpus", None)
    assert demo.main(["--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("python -m ampx demo: error: AMPX_CPU_BF16=")
    assert "Traceback" not in err


def test_out_without_extension_is_a_png(tmp_path, capsys):
    out = tmp_path / "plot"
    assert demo.main(["--steps", "2", "--batch", "4", "--corpus-bytes", "20000", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "plot.png").exists()
    assert f"wrote {out}" in capsys.readouterr().out


def test_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "x.png"
    assert demo.main(["--steps", "2", "--batch", "4", "--corpus-bytes", "20000", "--out", str(out)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out and not out.exists()


def test_train_one_alone():
    """What benchmarks/bench_demo.py runs: one run on its own, without a bar."""
    data = demo.load_corpus(20000)
    train, val = data[:18000], data[18000:]
    args = demo.parser().parse_args(["--steps", "6", "--batch", "4"])
    runs, _, _ = demo.make_runs(torch.device("cpu"))
    r = demo.train_one(runs[-1], train, val, args, torch.device("cpu"), bar=demo.NoProgress())
    assert r["name"] == "ampx fp16" and len(r["losses"]) == 6 and r["scales"][0] == demo.FP16_SCALER["init_scale"]
    assert r["ms_per_step"] > 0 and r["timed_steps"] == 5


@pytest.mark.parametrize("argv,rc", [(["train"], 2), ([], 2), (["--help"], 0)])
def test_main_usage(argv, rc, capsys):
    from ampx.__main__ import main

    assert main(argv) == rc
    out, err = capsys.readouterr()
    assert "usage: python -m ampx demo" in (out if rc == 0 else err)
    if rc:
        assert out == "" and err.strip().splitlines()[-1].startswith("python -m ampx: error: ")


def test_main_from_the_command_line():
    p = subprocess.run([sys.executable, "-m", "ampx", "train"], capture_output=True, text=True)
    assert p.returncode == 2 and "usage:" in p.stderr and "Traceback" not in p.stderr


def test_demo_doctor_finds_the_layer_it_pushed(tmp_path, capsys):
    """``--doctor``: the forced overflow in net.2 is reported as a forward overflow there, while
    the parameters' report names every parameter; the table and the PNG are written."""
    out = tmp_path / "doctor.png"
    rc = demo.main(["--doctor", "--steps", "60", "--batch", "16", "--corpus-bytes", "60000", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "Origin found by ampx: forward pass, module net.2 (Linear), output 0, inf in float16" in text
    assert re.search(r"Parameters with inf/NaN gradients at step 30: 7 of 7", text)
    assert "Advice: net.2 (Linear) output 0 overflowed float16" in text
    assert "fp16 headroom" in text and "statistics of step 50" in text
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
