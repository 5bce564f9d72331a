"""``python -m ampx demo``: train one real model four ways and compare them.

The model is a small character-level language model (an MLP over the previous 32 characters)
trained on Python's own standard-library source code, which every Python installation carries:
real data, nothing downloaded. The same model, data and seed are trained

  1. in float32 (the reference),
  2. with torch AMP: torch.autocast + torch.amp.GradScaler,
  3. with ampx: the dtype ampx.Policy.auto picks, ampx.GradScaler, clipping folded into the step,
  4. with ampx in float16, even where bfloat16 would be chosen, so loss scaling is visible,

on the GPU when there is one, else on the CPU. It prints a progress bar per run, then a table
(final loss and accuracy, skipped steps, loss-scale range, time per step, overflowing
parameters) and writes a PNG with the loss curves and the loss-scale trajectories.
"""
import argparse
import glob
import math
import os
import sys
import sysconfig
import time

import torch

import ampx

VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t"]  # printable ASCII, newline, tab
UNKNOWN = len(VOCAB)  # one more id for anything else


def load_corpus(max_bytes):
    """Text of the standard library's .py files (sorted, so every run reads the same)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise RuntimeError(f"no Python sources found under {root}")
    parts, size = [], 0
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    text = "".join(parts)[:max_bytes]
    table = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([table.get(c, UNKNOWN) for c in text], dtype=torch.long)


class CharMLP(torch.nn.Module):
    """Predicts the next character from the previous `context` ones."""

    def __init__(self, context=32, embed=16, hidden=384):
        super().__init__()
        self.embed = torch.nn.Embedding(UNKNOWN + 1, embed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(context * embed, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, UNKNOWN + 1))

    def forward(self, x):
        return self.net(self.embed(x).flatten(1))


def batches(data, context, batch, steps, seed):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - context - 1, (steps, batch), generator=g)
    offs = torch.arange(context + 1)
    for s in starts:
        win = data[s[:, None] + offs]
        yield win[:, :-1], win[:, -1]


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, label, total, stream=None, width=30):
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()

    def update(self, done, loss):
        frac = done / self.total
        bar = "#" * int(frac * self.width)
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        self.stream.write(f"\r{self.label:<12} [{bar:<{self.width}}] {done}/{self.total} "
                          f"loss {loss:.3f} {rate:.0f} it/s")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()


def evaluate(model, data, context, device, n=4096):
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, data.numel() - context - 1, (n,), generator=g)
    win = data[starts[:, None] + torch.arange(context + 1)]
    x, y = win[:, :-1].to(device), win[:, -1].to(device)
    with torch.no_grad():
        logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


# The float16 run starts high and grows often, so that backing off and growing are both
# visible in a short run (torch's defaults, 2**16 and 2000 steps, would show a flat line).
FP16_SCALER = {"init_scale": 2.0**24, "growth_interval": 50}


def train_one(name, mode, dtype, train, val, args, device):
    torch.manual_seed(args.seed)
    model = CharMLP(args.context).to(device)
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **fused)
    if mode == "torch":
        scaler = torch.amp.GradScaler(device.type)
    elif mode == "ampx":
        extra = FP16_SCALER if dtype == torch.float16 else {}
        scaler = ampx.GradScaler(device.type, named_parameters=model.named_parameters(), **extra)
    else:
        scaler = None
    losses, scales, skipped = [], [], 0
    bar = Progress(name, args.steps)
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(batches(train, args.context, args.batch, args.steps, args.seed)):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
        elif mode == "torch":
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(opt)
            scaler.update()
        else:
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, args.clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if scaler is not None:
            scales.append(scaler.get_scale())
        if step % 10 == 0 or step == args.steps - 1:
            bar.update(step + 1, sum(losses[-10:]) / len(losses[-10:]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    bar.close()
    val_loss, val_acc = evaluate(model, val, args.context, device)
    overflowed = []
    if mode == "ampx":
        skipped = scaler.stats()["skipped_steps"]
        rep = scaler.overflow_report()
        if rep is not None:
            overflowed = sorted(set(rep.inf + rep.nan))
    elif mode == "torch":
        # torch does not report skipped steps: count the backoffs it made.
        skipped = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
    return {"name": name, "losses": losses, "scales": scales, "val_loss": val_loss, "val_acc": val_acc,
            "skipped": skipped, "ms_per_step": elapsed / args.steps * 1e3, "overflowed": overflowed,
            "dtype": "float32" if dtype is None else str(dtype).replace("torch.", "")}


def table(results):
    head = f"{'run':<14}{'dtype':<10}{'val loss':>9}{'val acc':>9}{'skipped':>9}{'loss scale range':>22}{'ms/step':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        rng = "-" if not r["scales"] else f"{min(r['scales']):.0f} .. {max(r['scales']):.0f}"
        lines.append(f"{r['name']:<14}{r['dtype']:<10}{r['val_loss']:>9.3f}{r['val_acc']:>9.3f}"
                     f"{r['skipped']:>9}{rng:>22}{r['ms_per_step']:>9.1f}")
    for r in results:
        if r["overflowed"]:
            lines.append(f"{r['name']}: parameters that overflowed on the last skipped step: "
                         + ", ".join(r["overflowed"]))
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(results):
        k = 20
        sm = [sum(r["losses"][max(0, i - k):i + 1]) / len(r["losses"][max(0, i - k):i + 1])
              for i in range(len(r["losses"]))]
        a.plot(sm, label=f"{r['name']} ({r['dtype']})", color=f"C{i}")
        if r["scales"]:
            b.plot(r["scales"], label=r["name"], color=f"C{i}")
    a.set_xlabel("step")
    a.set_ylabel("training loss (20-step mean)")
    a.set_title("Loss")
    a.legend()
    b.set_xlabel("step")
    b.set_ylabel("loss scale")
    b.set_yscale("log", base=2)
    b.set_title("Loss-scale trajectory")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ampx demo", description="Train a character-level model on "
                                 "Python's standard library four ways: float32, torch AMP, ampx, ampx fp16.")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default 400)")
    ap.add_argument("--batch", type=int, default=128, help="batch size (default 128)")
    ap.add_argument("--context", type=int, default=32, help="characters of context (default 32)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm (default 1.0)")
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000, help="characters of source to read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None,
                    help="cpu or cuda (default: cuda when torch and ampx's CUDA kernels are available)")
    ap.add_argument("--out", default="ampx-demo.png", help="where to write the PNG (default ./ampx-demo.png)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    for name in ("steps", "batch", "context", "corpus_bytes"):
        if getattr(args, name) < 1:
            ap.print_usage(sys.stderr)
            print(f"python -m ampx demo: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    gpu = torch.cuda.is_available() and ampx.cuda.is_available()
    if args.device is None:
        device = torch.device("cuda" if gpu else "cpu")
    else:
        if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not gpu):
            ap.print_usage(sys.stderr)
            print(f"python -m ampx demo: error: --device {args.device!r} is not available here", file=sys.stderr)
            return 2
        device = torch.device(args.device)

    data = load_corpus(args.corpus_bytes)
    if data.numel() < 10 * (args.context + 1):
        print("python -m ampx demo: error: --corpus-bytes is too small for --context", file=sys.stderr)
        return 2
    split = int(data.numel() * 0.9)
    train, val = data[:split], data[split:]
    policy = ampx.Policy.auto(device)
    # A CPU without native bf16 gets fp32 from the policy; the demo still shows a 16-bit run.
    chosen = policy.dtype if policy.dtype != torch.float32 else torch.bfloat16
    print(f"ampx demo: {data.numel():,} characters of Python's standard library, {args.steps} steps per run, "
          f"device {device}")
    print(f"ampx.Policy.auto: {policy.explain()}")
    runs = [("float32", "none", None), ("torch AMP", "torch", chosen), ("ampx", "ampx", chosen),
            ("ampx fp16", "ampx", torch.float16)]
    results = [train_one(n, m, d, train, val, args, device) for n, m, d in runs]
    print()
    print(table(results))
    print(f"(ampx fp16 starts its loss scale at {FP16_SCALER['init_scale']:.0f} and may grow it every "
          f"{FP16_SCALER['growth_interval']} clean steps, to show dynamic loss scaling at work)")
    if not args.no_plot:
        try:
            plot(results, args.out)
            print(f"\nwrote {os.path.abspath(args.out)}")
        except ImportError:
            print("\n(matplotlib is not installed: no PNG written; pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
