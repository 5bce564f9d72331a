"""``python -m ampx COMMAND [options]``: the jobs ampx runs from the command line.

Each job is a module with a ``main(argv)`` that returns an exit status; JOBS names them, with the
one line ``python -m ampx --help`` shows for each.
"""
import importlib
import sys

# name: (module, what it does in one line)
JOBS = {
    "demo": ("ampx.demo", "train one small language model five ways (float32; torch AMP and ampx, each in "
                          "bf16 and fp16) and compare loss, accuracy and time per step"),
}
USAGE = f"usage: python -m ampx {'|'.join(JOBS)} [options]"


def help_text():
    width = max(len(name) for name in JOBS)
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:<{width}}  {line}" for name, (_, line) in JOBS.items()]
    lines += ["", "python -m ampx COMMAND --help lists a command's options."]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if not argv or argv[0] not in JOBS:
        print(help_text(), file=sys.stderr)
        what = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"python -m ampx: error: {what} (one of: {', '.join(JOBS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(JOBS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
