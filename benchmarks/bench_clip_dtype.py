"""How far ampx's exact clip (the default clip_norm="exact") is from torch's clip_grad_norm_ on
bf16 gradients, and that clip_norm="torch" is not (README, "Drop-in scaler").

Two bf16 runs, the same data and start, 20 steps of AdamW clipped at max_norm (torchtune's
recipe: bf16 parameters, no loss scaling, so a disabled scaler): a 2-layer MLP and a tiny
transformer language model, their losses multiplied (by 20 and 4) so that the clip acts on most steps. For each: the relative difference of the norms (ampx's float32 exact
value against torch's bf16 one) at step 1 and the largest over the run, and the relative
difference of all parameters after 1 and 20 steps.

    python benchmarks/bench_clip_dtype.py [--steps 20] [--max-norm 1.0]
"""
import argparse

import torch

import ampx


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=512, dim=128, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True), layers)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.blocks(self.emb(x)))


def batches(kind, steps):
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return [(torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)) for _ in range(steps)]
    return [(torch.randint(0, 512, (8, 33), generator=g),) * 2 for _ in range(steps)]


def loss_of(kind, model, batch):
    if kind == "mlp":
        x, y = batch
        return 20 * torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)  # (x20: every step clips)
    tokens = batch[0]
    logits = model(tokens[:, :-1]).float()
    return 4 * torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def run(kind, how, steps, max_norm):
    torch.manual_seed(0)
    model = (mlp() if kind == "mlp" else TinyLM()).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = None if how is None else ampx.GradScaler("cpu", enabled=False, clip_norm=how)
    norms, snaps = [], []
    for batch in batches(kind, steps):
        loss = loss_of(kind, model, batch)
        loss.backward()
        if scaler is None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            opt.step()
        else:
            norm = scaler.clip_grad_norm_(opt, max_norm)
            norms.append(float(scaler._last_norm if how == "exact" else norm))  # exact: the float32 value
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        snaps.append(torch.cat([p.detach().double().flatten() for p in model.parameters()]))
    return norms, snaps


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-norm", type=float, default=1.0)
    args = ap.parse_args()
    for kind in ("mlp", "tiny transformer"):
        key = "mlp" if kind == "mlp" else "lm"
        ref_n, ref_p = run(key, None, args.steps, args.max_norm)
        for how in ("exact", "torch"):
            n, p = run(key, how, args.steps, args.max_norm)
            dn = [abs(a - b) / b for a, b in zip(n, ref_n)]
            print(f"{kind:17s} clip_norm={how!r:8s} norm step 1: {n[0]:.6g} vs torch {ref_n[0]:.6g} "
                  f"(rel {dn[0]:.2e}, max over {args.steps} steps {max(dn):.2e}); params rel diff after 1 step "
                  f"{rel(p[0], ref_p[0]):.2e}, after {args.steps}: {rel(p[-1], ref_p[-1]):.2e}; "
                  f"clipped steps {sum(x > args.max_norm for x in ref_n)}/{args.steps}")


if __name__ == "__main__":
    main()
