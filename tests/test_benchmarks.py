"""The benchmark scripts still run (they are not tests of speed: benchmarks/RESULTS.md has those).

- ``gpu_check.py --cpu-smoke``: the issue-17 targets of the GPU check (views vs one tensor,
  separate tensors vs torch, the scaler's added time on LoRA / GPT-2 shapes) run their code on
  the CPU at small sizes, so that the GPU check cannot break unseen between the sessions that
  have a GPU. Every target must produce a row (no ERROR).
- ``bench_step.py --quick`` with ``--compare-split --cold``: the real-shape cases with every
  option of the step benchmark, one repetition each.
- ``bench_graph_step.py`` at a tiny size on dynamo's eager backend: its bit check holds.
"""
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _run(*args):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=BENCH)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_gpu_check_targets_run_on_the_cpu():
    text = _run("gpu_check.py", "--cpu-smoke")
    rows = [line for line in text.splitlines() if line.startswith(("10k x 1k", "LoRA", "GPT-2"))]
    assert len(rows) == 8 and not any("ERROR" in r for r in rows), text[-2000:]


def test_bench_step_runs_every_option():
    text = _run("bench_step.py", "--quick", "--shapes", "lora,gpt2", "--compare-split", "--cold",
                "--repeats", "1", "--inner", "1")
    cases = [line for line in text.splitlines() if line.startswith(("lora:", "gpt2:"))]
    assert len(cases) == 8, text[-2000:]
    assert text.count("(dynamic split)") == 8


def test_bench_graph_step_runs_and_checks_its_bits():
    text = _run("bench_graph_step.py", "--tensors", "4", "--numel", "300", "--repeats", "2", "--backend", "eager")
    assert "bit-identical after 3 steps: True" in text, text[-2000:]
    assert "compiled / eager ampx" in text
