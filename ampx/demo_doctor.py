"""``python -m ampx demo --doctor``: the overflow doctor on the demo's model.

Trains the demo's character-level model (ampx/demo.py) in float16 with ``ampx.GradScaler`` and an
``ampx.PrecisionMonitor`` (statistics every ``DOCTOR_EVERY`` steps), and half-way through makes
one named layer's output overflow float16 for one step (its output multiplied by 2^16 by a
forward hook, as a diverging activation would). It prints what the scaler's overflow report
says (the parameters, which name nearly everything, then the origin and the advice), the
headroom table of the last statistics step, and writes the exponent heatmap to ``--out``.
"""
import os

import torch

import ampx

from . import demo

DOCTOR_EVERY = 25
TARGET = "net.2"  # the hidden Linear


def _force(step_at):
    """A forward hook multiplying the output by 2^16 at one step (state in a dict it closes over)."""
    state = {"step": -1}

    def hook(module, args, out):
        if state["step"] == step_at:
            return out * 2.0 ** 16
        return None
    return state, hook


def run(args, device, train):
    """Trains, forces the overflow, prints the findings; returns (monitor, report)."""
    torch.manual_seed(args.seed)
    model = demo.CharMLP(args.context).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    policy = ampx.Policy("fp16", device=device, **demo.FP16_SCALER)
    scaler = policy.grad_scaler()
    monitor = scaler.monitor(model, every=DOCTOR_EVERY)
    bad = args.steps // 2
    state, hook = _force(bad)
    handle = dict(model.named_modules())[TARGET].register_forward_hook(hook, prepend=True)  # before the monitor's
    ce = torch.nn.functional.cross_entropy
    report = None
    try:
        for step, (x, y) in enumerate(demo.batches(train, args.context, args.batch, args.steps, args.seed)):
            state["step"] = step
            x, y = x.to(device), y.to(device)
            with policy.autocast():
                loss = ce(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, args.clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if step == bad:
                report = scaler.overflow_report()
    finally:
        handle.remove()
    return monitor, report, bad


def main(args, device, train):
    """The --doctor job: 0 when the origin found is the layer that was pushed, else 1."""
    print(f"ampx demo --doctor: {args.steps} float16 steps on {device}; at step {args.steps // 2} the output "
          f"of {TARGET} (a Linear) is pushed past float16's range")
    monitor, report, bad = run(args, device, train)
    if report is None:
        print("no overflow was reported at the forced step (nothing to explain)")
        return 1
    names = sorted(set(report.inf + report.nan))
    print(f"\nParameters with inf/NaN gradients at step {bad}: {len(names)} of "
          f"{sum(1 for _ in monitor._model.parameters())} ({', '.join(names[:6])}{' ...' if len(names) > 6 else ''})")
    o = report.origin
    print(f"Origin found by ampx: {o['phase']} pass, module {o['module']} ({o['module_type']}), {o['tensor']}, "
          f"{o['kind']} in {o['dtype']}")
    print(f"Advice: {report.advice}\n")
    print(monitor.report())
    if not args.no_plot:
        path = monitor.plot(args.out)
        print(f"\nwrote {os.path.abspath(path)}")
    monitor.remove()
    return 0 if (o["module"], o["phase"]) == (TARGET, "forward") else 1
