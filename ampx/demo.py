"""``python -m ampx demo``: train one real model five ways and compare them.

The model is a small character-level language model (an MLP over the previous 32 characters)
trained on Python's own standard-library source code, which every Python installation carries:
real data, nothing downloaded. The same model, data and seed are trained

  1. in float32 (the reference),
  2. with torch AMP in bfloat16: ``torch.autocast``, no loss scaling, torch's clipping,
  3. with ampx in bfloat16: ``ampx.Policy("bf16")``, whose scaler is disabled (bf16 needs no
     loss scaling), so the loop is the same one an fp16 policy uses,
  4. with torch AMP in float16: ``torch.autocast`` + ``torch.amp.GradScaler``, ``unscale_`` and
     torch's clipping,
  5. with ampx in float16: ``ampx.Policy("fp16")``, ``ampx.GradScaler`` with the clipping folded
     into the optimizer step,

on the GPU when there is one, else on the CPU. The runs are interleaved, ten steps each in turn,
so that whatever else the machine does slows them alike and their times per step compare. It
first prints what ``ampx.Policy.auto`` would recommend on this machine (and any warning the
policies give, once), shows a progress bar with rate and ETA (tqdm's when it is installed, else
a plain line), then a table (final loss and accuracy, skipped steps, the range of loss scales
the steps ran with, median time per step after warm-up, overflowing parameters) with footnotes
taken from the same numbers, and writes a PNG with the loss curves and the loss-scale
trajectories, every run in its own color, line style and markers.

Every option is checked before the corpus is read or any training starts; a bad one exits with
status 2 and one ``python -m ampx demo: error: ...`` line.
"""
import argparse
import glob
import importlib.util
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings

import torch

import ampx

VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t"]  # printable ASCII, newline, tab
UNKNOWN = len(VOCAB)  # one more id for anything else
EMBED, HIDDEN = 16, 384  # CharMLP's sizes
EVAL_ROWS = 4096  # held-out windows scored at the end of each run

# The float16 runs start high and grow often, so that backing off and growing are both
# visible in a short run (torch's defaults, 2**16 and 2000 steps, would show a flat line).
# torch AMP's fp16 run uses the same settings, so the two scale trajectories can be compared.
FP16_SCALER = {"init_scale": 2.0**24, "growth_interval": 50}

# Upper bounds for the integer options (memory is checked separately, from the sizes).
LIMITS = {"steps": 1_000_000, "batch": 1_000_000, "context": 4096, "corpus_bytes": 1_000_000_000}


# ---- data and model ----------------------------------------------------------------------------

def _stdlib_sources():
    root = sysconfig.get_paths()["stdlib"]
    return root, sorted(glob.glob(os.path.join(root, "*.py")))


def load_corpus(max_bytes):
    """Text of the standard library's .py files (sorted, so every run reads the same), as ids."""
    root, files = _stdlib_sources()
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
    # Code points in one vectorised lookup (a Python loop over millions of characters is slow).
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
    lut = torch.full((128,), UNKNOWN, dtype=torch.long)
    for i, c in enumerate(VOCAB):
        lut[ord(c)] = i
    ids = torch.full_like(codes, UNKNOWN)
    ascii_ = codes < 128
    ids[ascii_] = lut[codes[ascii_]]
    return ids


class CharMLP(torch.nn.Module):
    """Predicts the next character from the previous `context` ones."""

    def __init__(self, context=32, embed=EMBED, hidden=HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(UNKNOWN + 1, embed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(context * embed, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, UNKNOWN + 1))

    def forward(self, x):
        return self.net(self.embed(x).flatten(1))


def batches(data, context, batch, steps, seed):
    """`steps` batches of (context windows, next characters), drawn with their own generator."""
    g = torch.Generator().manual_seed(seed)
    offs = torch.arange(context + 1)
    for _ in range(steps):
        s = torch.randint(0, data.numel() - context - 1, (batch,), generator=g)
        win = data[s[:, None] + offs]
        yield win[:, :-1], win[:, -1]


def evaluate(model, data, context, device, n=EVAL_ROWS):
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, data.numel() - context - 1, (n,), generator=g)
    win = data[starts[:, None] + torch.arange(context + 1)]
    x, y = win[:, :-1].to(device), win[:, -1].to(device)
    with torch.no_grad():
        logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def estimate_bytes(batch, context, runs=5):
    """A generous estimate of the peak memory the demo needs: the parameters and optimizer
    state of every run (they train interleaved, so all are alive at once) and one step's
    activations and their gradients, in float32 plus 16-bit copies."""
    vocab = UNKNOWN + 1
    params = vocab * EMBED + context * EMBED * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * vocab + vocab
    param_bytes = params * 4 * 6  # weights, grads, AdamW's two moments, 16-bit copies, slack
    per_row = (context + 1) * 8 * 3 + context * EMBED * 4 * 6 + HIDDEN * 4 * 12 + vocab * 4 * 8
    return runs * param_bytes + max(batch, EVAL_ROWS) * per_row


def available_bytes(device):
    """Memory free for one run on `device`, or None when it cannot be told."""
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except Exception:
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ---- progress ----------------------------------------------------------------------------------

def _status(run, loss):
    if loss is None:
        return ""
    return f"{run}: loss {loss:.3f}" if run else f"loss {loss:.3f}"


class PlainProgress:
    """A one-line progress report on stderr (rate and ETA), for when tqdm is not installed."""

    def __init__(self, label, total, stream=None):
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.status = 0, ""
        self.t0 = self.last = time.perf_counter()

    def update(self, n=1, loss=None, run=None):
        self.done += n
        self.status = _status(run, loss) or self.status
        now = time.perf_counter()
        if now - self.last >= 0.5 or self.done == self.total:
            self.last = now
            self._write(now)

    def _write(self, now):
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        status = f", {self.status}" if self.status else ""
        self.stream.write(f"\r{self.label}: {self.done}/{self.total} steps, {rate:.1f} steps/s, "
                          f"ETA {eta:.0f}s{status}  ")
        self.stream.flush()

    def close(self):
        if self.done < self.total:
            self._write(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()


class TqdmProgress:
    """tqdm's bar (rate and ETA) on stderr."""

    def __init__(self, tqdm, label, total):
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        self.bar = tqdm(total=total, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True,
                        mininterval=0.25 if tty else 5.0, leave=True)  # a log file gets fewer updates

    def update(self, n=1, loss=None, run=None):
        status = _status(run, loss)
        if status:
            self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(n)

    def close(self):
        self.bar.close()


def progress(label, total):
    """A progress bar: tqdm's when tqdm can be imported, else a plain line."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(label, total)
    return TqdmProgress(tqdm, label, total)


class NoProgress:
    def update(self, n=1, loss=None, run=None):
        pass

    def close(self):
        pass


# ---- the runs ----------------------------------------------------------------------------------

def _scale_used(scaler):
    """The loss scale this step runs with, without a host read (update() changes the scale
    tensor in place, so it is copied)."""
    s = scaler._get_scale_async()
    return s.detach().clone() if isinstance(s, torch.Tensor) else float(scaler.get_scale())


def make_runs(device):
    """The runs to compare, ampx's recommendation for `device`, and the warnings the policies
    gave (each once, as text, for main to print as one clean line).

    Each run is a dict: name, system ("float32", "torch" or "ampx"), dtype (torch dtype) and,
    for ampx, the ``ampx.Policy`` it follows. Raises ValueError where ampx cannot build a policy.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = ampx.Policy.auto(device)
        bf16 = ampx.Policy("bf16", device=device)
        fp16 = ampx.Policy("fp16", device=device, **FP16_SCALER)
    notes = []
    for w in caught:
        msg = str(w.message)
        if msg not in notes:
            notes.append(msg)
    runs = [{"name": "float32", "system": "float32", "dtype": torch.float32},
            {"name": "torch AMP bf16", "system": "torch", "dtype": torch.bfloat16},
            {"name": "ampx bf16", "system": "ampx", "dtype": bf16.dtype, "policy": bf16},
            {"name": "torch AMP fp16", "system": "torch", "dtype": torch.float16},
            {"name": "ampx fp16", "system": "ampx", "dtype": fp16.dtype, "policy": fp16}]
    return runs, auto, notes


def warmup_steps(steps):
    """Steps left out of the timing: the first ones pay for allocations and kernel set-up."""
    return min(20, steps // 5)


CHUNK = 10  # steps one run takes before the next run's turn


class Run:
    """One training run, taken a chunk of steps at a time so that the runs can be interleaved:
    whatever else the machine is doing then slows every run alike, and their times per step
    stay comparable.

    spec: a dict from ``make_runs`` (name, system, dtype and, for ampx, the policy).
    """

    def __init__(self, spec, train, args, device):
        self.spec, self.args, self.device = spec, args, device
        self.name, self.system, self.dtype = spec["name"], spec["system"], spec["dtype"]
        self.policy = spec.get("policy")
        torch.manual_seed(args.seed)
        self.model = CharMLP(args.context).to(device)
        self.params = list(self.model.parameters())
        fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, **fused)
        self.scaler = None
        if self.system == "torch" and self.dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(device.type, **FP16_SCALER)
        elif self.system == "ampx":
            # Disabled (is_enabled() False) when the policy has no loss scaling, as for bf16.
            self.scaler = self.policy.grad_scaler(named_parameters=self.model.named_parameters(),
                                                  history=args.steps)
        self.scaled = self.scaler is not None and self.scaler.is_enabled()
        self.data = batches(train, args.context, args.batch, args.steps, args.seed)
        self.done = 0
        self.warm = warmup_steps(args.steps)
        self.losses, self.scales = [], []
        self.times = []  # CPU: seconds of each step after warm-up; CUDA: per step, of each chunk

    def _step(self):
        args, model, opt, scaler = self.args, self.model, self.opt, self.scaler
        x, y = next(self.data)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        ce = torch.nn.functional.cross_entropy
        if self.system == "float32":
            loss = ce(model(x).float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, args.clip)
            opt.step()
        elif self.system == "torch":
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = ce(model(x).float(), y)
            if scaler is None:  # torch's bf16 recipe: no scaler
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, args.clip)
                opt.step()
            else:  # torch's fp16 recipe
                scaler.scale(loss).backward()
                self.scales.append(_scale_used(scaler))
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self.params, args.clip)
                scaler.step(opt)
                scaler.update()
        else:  # ampx: what the policy says, the same loop for bf16 and fp16
            with self.policy.autocast():
                loss = ce(model(x).float(), y)
            scaler.scale(loss).backward()
            if self.scaled:
                self.scales.append(_scale_used(scaler))
            scaler.clip_grad_norm_(opt, args.clip)  # unscale, inf check and clip in one pass
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())

    def steps(self, n):
        """Takes up to n more steps; returns how many it took and their mean loss."""
        n = min(n, self.args.steps - self.done)
        if n <= 0:
            return 0, None
        cuda = self.device.type == "cuda"
        first = self.done
        if cuda:
            torch.cuda.synchronize()
        t0 = last = time.perf_counter()
        for _ in range(n):
            self._step()
            if not cuda:
                now = time.perf_counter()
                if self.done >= self.warm:
                    self.times.append(now - last)
                last = now
            self.done += 1
        if cuda:  # steps overlap with the host's work: time the chunk
            torch.cuda.synchronize()
            if first >= self.warm or self.done == self.args.steps and not self.times:
                self.times.append((time.perf_counter() - t0) / n)
        return n, torch.stack(self.losses[-n:]).float().mean().item()

    def result(self, val):
        """Evaluates the trained model; the run's result dict."""
        scaler = self.scaler
        losses = torch.stack(self.losses).float().tolist()
        scales = torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in self.scales]).tolist() \
            if self.scales else []
        final_scale = float(scaler.get_scale()) if self.scaled else None
        val_loss, val_acc = evaluate(self.model, val, self.args.context, self.device)
        overflowed, skipped = [], 0
        if self.system == "ampx" and self.scaled:
            skipped = scaler.stats()["skipped_steps"]
            rep = scaler.overflow_report()
            if rep is not None:
                overflowed = sorted(set(rep.inf + rep.nan))
        elif self.scaled:
            # torch does not report skipped steps; each one backed the scale off.
            skipped = sum(1 for a, b in zip(scales, scales[1:] + [final_scale]) if b < a)
        # The median step, robust to other processes taking the cores for a while (on a GPU, the
        # median over chunks of steps).
        ms = statistics.median(self.times) * 1e3 if self.times else float("nan")
        return {"name": self.name, "system": self.system, "dtype": str(self.dtype).replace("torch.", ""),
                "losses": losses, "scales": scales, "final_scale": final_scale,
                "val_loss": val_loss, "val_acc": val_acc, "skipped": skipped, "overflowed": overflowed,
                "ms_per_step": ms, "timing": "chunk" if self.device.type == "cuda" else "step",
                "timed_steps": self.args.steps - self.warm, "warmup_steps": self.warm,
                "growth_interval": FP16_SCALER["growth_interval"] if self.scaled else None}


def train_one(spec, train, val, args, device, bar=None):
    """Trains one run on its own (benchmarks/bench_demo.py); returns its result dict."""
    run = Run(spec, train, args, device)
    bar = progress(spec["name"], args.steps) if bar is None else bar
    try:
        while run.done < args.steps:
            n, loss = run.steps(CHUNK)
            bar.update(n, loss=loss)
    finally:
        bar.close()
    return run.result(val)


def train_all(specs, train, val, args, device):
    """Trains the runs interleaved, CHUNK steps each in turn (every other round in reverse
    order, so that no run always follows the same one), under one progress bar."""
    runs = [Run(spec, train, args, device) for spec in specs]
    bar = progress(f"{len(runs)} runs", args.steps * len(runs))
    try:
        k = 0
        while runs[0].done < args.steps:
            for run in (runs if k % 2 == 0 else runs[::-1]):
                n, loss = run.steps(CHUNK)
                bar.update(n, loss=loss, run=run.name)
            k += 1
    finally:
        bar.close()
    return [run.result(val) for run in runs]


# ---- reporting ---------------------------------------------------------------------------------

def fmt_scale(s):
    """2^k for powers of two (as the scaler's are), else the number."""
    if s > 0 and math.isfinite(s):
        k = math.log2(s)
        if k == int(k):
            return f"2^{int(k)}"
    return f"{s:g}"


SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def scale_range(r):
    if not r["scales"]:
        return f"none ({SHORT[r['dtype']]})"
    return f"{fmt_scale(min(r['scales']))} .. {fmt_scale(max(r['scales']))}"


def scale_moves(r):
    """(backoffs, growths) over the run, from the scales used and the scale after the last step."""
    seq = r["scales"] + [r["final_scale"]]
    return (sum(1 for a, b in zip(seq, seq[1:]) if b < a), sum(1 for a, b in zip(seq, seq[1:]) if b > a))


def table(results):
    head = (f"{'run':<16}{'dtype':<10}{'val loss':>9}{'val acc':>9}{'skipped':>9}"
            f"{'loss scale used':>18}{'ms/step':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['name']:<16}{r['dtype']:<10}{r['val_loss']:>9.3f}{r['val_acc']:>9.3f}"
                     f"{r['skipped']:>9}{scale_range(r):>18}{r['ms_per_step']:>9.2f}")
    for r in results:
        if r["overflowed"]:
            lines.append(f"{r['name']}: parameters that overflowed on the last skipped step: "
                         + ", ".join(r["overflowed"]))
    return "\n".join(lines)


def footnotes(results):
    """What the table's scale and time columns mean, with the numbers taken from the runs."""
    out = []
    for r in results:
        if not r["scales"]:
            continue
        down, up = scale_moves(r)
        out.append(f"{r['name']}: the loss scale started at {fmt_scale(r['scales'][0])}, backed off "
                   f"{down} time(s) (each on a skipped step), grew {up} time(s) (after "
                   f"{r['growth_interval']} clean steps each), ran within {scale_range(r)} and ended at "
                   f"{fmt_scale(r['final_scale'])}.")
    if out:
        out.insert(0, f"Both fp16 runs start at {fmt_scale(FP16_SCALER['init_scale'])} and may grow every "
                      f"{FP16_SCALER['growth_interval']} clean steps, so that dynamic loss scaling shows "
                      "in a short run; the bf16 and fp32 runs use no loss scaling.")
    r0 = results[0]
    what = "the median step" if r0["timing"] == "step" else f"the median over chunks of {CHUNK} steps"
    out.append(f"ms/step: {what} of each run after its first {r0['warmup_steps']} warm-up step(s) "
               f"({r0['timed_steps']} timed). The runs were interleaved, {CHUNK} steps each in turn, so "
               "that a busy machine slows them alike; benchmarks/bench_demo.py repeats them for a spread.")
    return "\n".join(out)


STYLES = [  # (line style, marker): every run its own color, line style and markers
    ("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "P")]


def _width(i, n):
    return 3.4 - 2.2 * i / max(1, n - 1)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    scaled = [r for r in results if r["scales"]]
    for i, r in enumerate(results):
        ls, mk = STYLES[i % len(STYLES)]
        steps = len(r["losses"])
        every = max(1, steps // 8)
        k = 20
        cum = [0.0]
        for v in r["losses"]:
            cum.append(cum[-1] + v)
        sm = [(cum[j + 1] - cum[max(0, j - k + 1)]) / (j + 1 - max(0, j - k + 1)) for j in range(steps)]
        x = range(1, steps + 1)
        # Runs that coincide must still show: each has its own color, line style and markers,
        # the markers staggered between runs, and lines drawn from thick (first) to thin (last).
        style = dict(color=f"C{i}", linestyle=ls, marker=mk, markersize=6, alpha=0.9,
                     label=f"{r['name']} ({r['dtype']})")
        n = len(results)
        a.plot(x, sm, markevery=(i * every // n, every), linewidth=_width(i, n), **style)
        if r["scales"]:
            j, m = scaled.index(r), len(scaled)
            b.plot(x, r["scales"], drawstyle="steps-post", markevery=(j * every // m + every // (2 * m), every),
                   linewidth=_width(j, m), **style)
    a.set_xlabel("step")
    a.set_ylabel("training loss (20-step mean)")
    a.set_title("Loss (runs that coincide overlap: see the markers)", fontsize=11)
    a.legend()
    none = [f"{r['name']}" for r in results if not r["scales"]]
    b.set_xlabel("step")
    b.set_ylabel("loss scale used")
    b.set_yscale("log", base=2)
    b.set_title("Loss-scale trajectory")
    if none:
        b.text(0.98, 0.02, "no loss scaling: " + ", ".join(none), transform=b.transAxes, ha="right",
               va="bottom", fontsize=8, color="0.3")
    if b.lines:
        b.legend(loc="upper right")
    fig.tight_layout()
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    fig.savefig(path, dpi=100, format=ext or "png")  # no extension: a PNG under exactly that name
    plt.close(fig)


# ---- command line ------------------------------------------------------------------------------

def parser():
    ap = argparse.ArgumentParser(
        prog="python -m ampx demo",
        description="Train a character-level model on Python's standard library five ways: float32, "
                    "torch AMP and ampx in bfloat16, torch AMP and ampx in float16.")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    ap.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    ap.add_argument("--context", type=int, default=32, help="characters of context (default 32)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, > 0 (default 3e-3)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm, > 0 (default 1.0)")
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000,
                    help="characters of source to read (default 2000000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--device", default=None,
                    help="cpu or cuda (default: cuda when torch and ampx's CUDA kernels are available)")
    ap.add_argument("--out", default="ampx-demo.png", help="where to write the PNG (default ./ampx-demo.png)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--doctor", action="store_true",
                    help="instead: train in float16 with ampx.PrecisionMonitor, push one layer past float16's "
                         "range mid-run, print where ampx finds the overflow began and write the exponent "
                         "heatmap (default ./ampx-doctor.png)")
    return ap


def _gib(n):
    return f"{n / 2**30:.1f} GiB"


def validate(args):
    """Checks every option; returns (device, error message or None). Reads no corpus."""
    for name in ("steps", "batch", "context", "corpus_bytes"):
        v, flag = getattr(args, name), "--" + name.replace("_", "-")
        if v < 1:
            return None, f"{flag} must be >= 1, not {v}"
        if v > LIMITS[name]:
            return None, f"{flag} must be at most {LIMITS[name]:,}, not {v:,}"
    for name in ("lr", "clip"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            return None, f"--{name} must be a finite number > 0, not {v}"
    if not (0 <= args.seed < 2**63):
        return None, f"--seed must be between 0 and 2**63-1, not {args.seed}"
    need = 20 * (args.context + 1)  # the held-out tenth must hold whole windows
    if args.corpus_bytes < need:
        return None, f"--corpus-bytes must be at least {need:,} for --context {args.context} (20 windows)"
    gpu = torch.cuda.is_available() and ampx.cuda.is_available()
    if args.device is None:
        device = torch.device("cuda" if gpu else "cpu")
    elif args.device == "cpu" or (args.device == "cuda" and gpu):
        device = torch.device(args.device)
    else:
        return None, f"--device {args.device!r} is not available here (use cpu" + (" or cuda)" if gpu else ")")
    need, free = estimate_bytes(args.batch, args.context), available_bytes(device)
    if free is not None and need > free // 2:
        return None, (f"--batch {args.batch} with --context {args.context} needs about {_gib(need)} of memory "
                      f"on {device.type}, more than half of the {_gib(free)} available (use a smaller --batch "
                      "or --context)")
    if not args.no_plot:
        err = _check_out(args.out)
        if err:
            return None, err
    return device, None


def _check_out(out):
    path = os.path.abspath(out)
    if os.path.isdir(path):
        return f"--out {out!r} is a directory; give a file name such as {os.path.join(out, 'ampx-demo.png')!r}"
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        return f"--out {out!r}: the directory {folder!r} does not exist"
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        pass  # no PNG then; main says so
    else:
        kinds = FigureCanvasBase.get_supported_filetypes()
        if ext and ext not in kinds:
            return f"--out {out!r}: matplotlib cannot write .{ext} files (use .png, .pdf or .svg)"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".ampx-demo-", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"--out {out!r}: cannot write to {folder!r} ({e.strerror or e})"
    return None


def main(argv=None):
    ap = parser()
    try:
        args = ap.parse_args(argv)
        device, err = validate(args)
        if err:
            ap.error(err)  # usage, one error line, SystemExit(2)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)

    if args.doctor and args.out == "ampx-demo.png":
        args.out = "ampx-doctor.png"
    plot_ok = not args.no_plot and importlib.util.find_spec("matplotlib") is not None
    try:
        runs, auto, notes = make_runs(device)
    except ValueError as e:  # e.g. a malformed AMPX_CPU_BF16
        ap.print_usage(sys.stderr)
        print(f"python -m ampx demo: error: {e}", file=sys.stderr)
        return 2
    print(f"ampx demo: {args.steps} steps per run, batch {args.batch}, device {device}")
    print(f"What ampx recommends here (ampx.Policy.auto): {auto.explain()}")
    if auto.dtype == torch.float32:
        print("The bf16 and fp16 runs below are shown anyway, to compare mixed precision and loss scaling "
              "with float32 on the same model; on this processor they are emulated, so expect them to be "
              "slower than float32.")
    for note in notes:
        print(f"warning: {note}")
    if not args.no_plot and not plot_ok:
        print("note: matplotlib is not installed, so no PNG will be written (pip install matplotlib)")

    data = load_corpus(args.corpus_bytes)
    split = int(data.numel() * 0.9)
    if data.numel() - split < 2 * (args.context + 1):
        print(f"python -m ampx demo: error: the standard library gave only {data.numel():,} characters, "
              f"too few for --context {args.context}", file=sys.stderr)
        return 2
    train, val = data[:split], data[split:]
    if args.doctor:
        from . import demo_doctor

        args.no_plot = not plot_ok
        return demo_doctor.main(args, device, train)
    print(f"Data: {data.numel():,} characters of Python's standard library "
          f"({train.numel():,} to train on, {val.numel():,} held out)")
    sys.stdout.flush()
    try:
        results = train_all(runs, train, val, args, device)
    except KeyboardInterrupt:
        print("\npython -m ampx demo: interrupted", file=sys.stderr)
        return 130
    print()
    print(table(results))
    print(footnotes(results))
    if plot_ok:
        try:
            plot(results, args.out)
        except OSError as e:
            print(f"python -m ampx demo: error: could not write {args.out!r}: {e}", file=sys.stderr)
            return 1
        print(f"\nwrote {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
