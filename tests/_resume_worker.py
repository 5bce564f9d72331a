"""Runs the resume matrix of tests/test_resume.py in a process of its own.

    python _resume_worker.py full  OUT        every config, steps 0-6 uninterrupted
    python _resume_worker.py first OUT        every config, steps 0-3, then a checkpoint
    python _resume_worker.py rest  CKPT OUT   a fresh process: load each checkpoint, steps 3-6

OUT gets {config name: [final parameters]} (torch.save); CKPT is a 'first' OUT.
"""
import itertools
import sys

import torch

import ampx

STEPS, SPLIT = 6, 3
LOSS_FACTOR = [0.01, 0.01, 0.01, 10.0, 10.0, 0.01]  # clipping starts at step 3, across the split
OVERFLOW_AT = {1, 4}                                  # one skipped step on each side


def configs():
    opts = {"sgd": (torch.optim.SGD, {"lr": 0.05}), "sgd-foreach": (torch.optim.SGD, {"lr": 0.05, "foreach": True}),
            "adam": (torch.optim.Adam, {"lr": 1e-2}), "adamw-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
            "masters-nearest": (torch.optim.AdamW, {"lr": 1e-2}), "masters-sr": (torch.optim.AdamW, {"lr": 1e-2})}
    for (name, (cls, kw)), clip, scale in itertools.product(opts.items(), (None, 1.0), (2.0**10, 3000.0)):
        yield f"{name}/clip={clip}/scale={scale:g}", name, cls, kw, clip, scale


def build(name, cls, kw, scale):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = cls(model.parameters(), **kw)
    if name.startswith("masters"):
        opt = ampx.MasterWeights(opt, model=model, dtype=torch.bfloat16,
                                 rounding="stochastic" if name.endswith("sr") else "nearest", seed=5)
    scaler = ampx.GradScaler("cpu", init_scale=scale, growth_interval=2, hysteresis=2)
    return model, opt, scaler


def train(model, opt, scaler, clip, steps):
    for k in steps:
        g = torch.Generator().manual_seed(100 + k)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x.to(next(model.parameters()).dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y) * LOSS_FACTOR[k]
        scaler.scale(loss).backward()
        if k in OVERFLOW_AT:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if clip is not None:
            scaler.clip_grad_norm_(opt, clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def main(argv):
    mode, out = argv[0], argv[-1]
    saved = torch.load(argv[1], weights_only=False) if mode == "rest" else None
    results = {}
    for i, (key, name, cls, kw, clip, scale) in enumerate(configs()):
        model, opt, scaler = build(name, cls, kw, scale)
        if mode == "rest":
            ck = saved[key]
            if i % 2:  # both load orders
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["opt"])
            else:
                opt.load_state_dict(ck["opt"])
                model.load_state_dict(ck["model"])
            scaler.load_state_dict(ck["scaler"])
        steps = {"full": range(STEPS), "first": range(SPLIT), "rest": range(SPLIT, STEPS)}[mode]
        train(model, opt, scaler, clip, steps)
        if mode == "first":
            results[key] = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
        else:
            results[key] = [p.detach().clone() for p in model.parameters()] + [torch.tensor(scaler.get_scale())]
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1:])
