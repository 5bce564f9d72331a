"""Time per step of the demo's runs, ampx against torch AMP, measured as fairly as a busy machine allows.

Each round trains every selected run of ``python -m ampx demo`` for a few steps (same model, data
and seed as the demo), in an order that rotates from round to round so that no run always goes
first or follows the same neighbour; the timing leaves out each run's warm-up steps (as the
demo's table does). It prints, per run, the median ms/step with its spread (min, quartiles, max)
over the rounds, and per ampx/torch pair the median of the per-round ratios: the two runs of a
pair ran seconds apart in the same round, so the ratio cancels most of the machine's drift.

    python benchmarks/bench_demo.py                      # bf16 and fp16 pairs, 9 rounds
    python benchmarks/bench_demo.py --runs bf16 --rounds 21 --steps 100
"""
import argparse
import statistics
import sys
import time

import torch

from ampx import demo


def quartiles(xs):
    xs = sorted(xs)
    if len(xs) < 4:
        return xs[0], xs[-1]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="bf16,fp16", help="comma-separated: float32, bf16, fp16 (default bf16,fp16)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=60, help="steps per run per round (the first fifth, at most 20, "
                                                          "is warm-up and not timed)")
    ap.add_argument("--batch", type=int, default=demo.parser().get_default("batch"))
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    args = demo.parser().parse_args(["--steps", str(a.steps), "--batch", str(a.batch), "--no-plot"])
    runs, _, _ = demo.make_runs(device)
    wanted = set(a.runs.split(","))
    runs = [r for r in runs if ({"float32": "float32", "bfloat16": "bf16", "float16": "fp16"}[str(r["dtype"])[6:]]
                                in wanted)]
    data = demo.load_corpus(args.corpus_bytes)
    split = int(data.numel() * 0.9)
    train, val = data[:split], data[split:]
    times = {r["name"]: [] for r in runs}
    print(f"{len(runs)} runs x {a.rounds} rounds, {a.steps} steps each ({demo.warmup_steps(a.steps)} warm-up), "
          f"batch {a.batch}, {device}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    t_all = time.perf_counter()
    for k in range(a.rounds):
        order = runs[k % len(runs):] + runs[:k % len(runs)]
        if k % 2:
            order = order[::-1]
        for r in order:
            res = demo.train_one(r, train, val, args, device, bar=demo.NoProgress())
            times[r["name"]].append(res["ms_per_step"])
        print(f"round {k + 1}/{a.rounds}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in times.items()),
              file=sys.stderr, flush=True)
    print(f"\n{'run':<16}{'median':>9}{'min':>9}{'q1':>9}{'q3':>9}{'max':>9}   ms/step over {a.rounds} rounds")
    for name, v in times.items():
        q1, q3 = quartiles(v)
        print(f"{name:<16}{statistics.median(v):>9.3f}{min(v):>9.3f}{q1:>9.3f}{q3:>9.3f}{max(v):>9.3f}")
    print()
    for tag in ("bf16", "fp16"):
        t, x = times.get(f"torch AMP {tag}"), times.get(f"ampx {tag}")
        if t and x:
            ratios = [b / c for b, c in zip(x, t)]
            q1, q3 = quartiles(ratios)
            print(f"ampx {tag} / torch AMP {tag}, per round: median {statistics.median(ratios):.3f} "
                  f"(quartiles {q1:.3f} .. {q3:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}); "
                  f"ampx faster in {sum(r < 1 for r in ratios)}/{len(ratios)} rounds")
    print(f"\n({time.perf_counter() - t_all:.0f} s)")


if __name__ == "__main__":
    main()
