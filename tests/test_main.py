"""python -m ampx: --help lists every job with its line; a bad or missing command says which exist."""
import importlib
import subprocess
import sys

import pytest

from ampx.__main__ import JOBS, main


def test_help_lists_every_job_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split(None, 1) for ln in out.splitlines() if ln.startswith("  ")]
    assert {name: line for name, line in rows} == {name: line for name, (_, line) in JOBS.items()}


def test_every_job_module_has_a_main():
    for module, _ in JOBS.values():
        assert callable(importlib.import_module(module).main)


@pytest.mark.parametrize("argv,what", [(["train"], "unknown command 'train'"), ([], "a command is required")])
def test_bad_command_names_the_jobs(argv, what, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert out == "" and last.startswith("python -m ampx: error: " + what) and "demo" in last


def test_help_from_the_command_line():
    p = subprocess.run([sys.executable, "-m", "ampx", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == ""
    assert "commands:" in p.stdout and "demo" in p.stdout and len(p.stdout.splitlines()) >= 4
