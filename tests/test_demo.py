"""python -m ampx demo, in a short mode: it trains, prints its table and writes a PNG."""
import subprocess
import sys

import pytest

from ampx import demo

pytest.importorskip("matplotlib")


def test_demo_short_run(tmp_path, capsys):
    out = tmp_path / "demo.png"
    rc = demo.main(["--steps", "8", "--batch", "32", "--corpus-bytes", "60000", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr()
    table = text.out
    for run in ("float32", "torch AMP", "ampx", "ampx fp16"):
        assert run in table
    assert "val loss" in table and "loss scale range" in table and "ms/step" in table
    assert "[" in text.err and "8/8" in text.err  # a progress bar per run
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_demo_learns():
    args = ["--steps", "40", "--batch", "32", "--corpus-bytes", "100000", "--no-plot"]
    results = []
    orig = demo.train_one

    def spy(*a, **k):
        r = orig(*a, **k)
        results.append(r)
        return r

    demo.train_one = spy
    try:
        assert demo.main(args) == 0
    finally:
        demo.train_one = orig
    assert len(results) == 4
    uniform = demo.math.log(len(demo.VOCAB) + 1)
    for r in results:
        assert r["val_loss"] < uniform - 0.8, r["name"]  # far below guessing
    # fp16 starting at 2**24 overflows at first: the scaler must have skipped and backed off.
    fp16 = results[3]
    assert fp16["skipped"] >= 1 and min(fp16["scales"]) < demo.FP16_SCALER["init_scale"]


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--bogus"], ["--device", "tpu"], ["--steps", "x"]])
def test_demo_bad_options_give_usage_not_traceback(argv):
    p = subprocess.run([sys.executable, "-m", "ampx", "demo", *argv], capture_output=True, text=True)
    assert p.returncode == 2
    assert "usage:" in p.stderr and "Traceback" not in p.stderr


def test_main_usage():
    p = subprocess.run([sys.executable, "-m", "ampx", "train"], capture_output=True, text=True)
    assert p.returncode == 2 and "usage:" in p.stderr and "Traceback" not in p.stderr
