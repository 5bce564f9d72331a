"""The README's shell commands run as written: they use the project's Python (.venv/bin/python),
never a bare `python` or `pip` that may have no torch, and every script they name exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BASH = [ln.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
        for ln in block.splitlines()]


def test_shell_blocks_use_the_project_python():
    commands = [c for c in BASH if c]
    assert commands
    for c in commands:
        first = c.split()[0]
        # torchrun launches the user's own train.py, in the user's environment
        assert first in ("bash", ".venv/bin/python", "source", "torchrun"), f"README.md runs {c!r} with {first!r}"


def test_every_named_script_exists():
    named = set(re.findall(r"\b((?:scripts|benchmarks)/[\w./-]+\.(?:sh|py))", README))
    assert "scripts/check_torch.sh" in named and "scripts/run.sh" in named
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing


def test_inline_python_commands_use_the_project_python():
    """`python -m ...` or `python benchmarks/...` in the text must say which Python."""
    bare = re.findall(r"`python (?:-m |benchmarks/|setup\.py)[^`]*`", README)
    assert not bare, bare
