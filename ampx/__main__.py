"""``python -m ampx demo [options]``: see ampx/demo.py."""
import sys

USAGE = "usage: python -m ampx demo [--steps N] [--out PATH] [...]   (python -m ampx demo --help for all options)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        print("python -m ampx: error: a command is required (demo)", file=sys.stderr)
        return 2
    if argv[0] != "demo":
        print(USAGE, file=sys.stderr)
        print(f"python -m ampx: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    from .demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
