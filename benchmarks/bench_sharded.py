"""The sharded scaler's step on gloo ranks: ampx vs torch's ShardedGradScaler.

Each rank holds a shard of every gradient (as ZeRO-style optimizers and FSDP do). Timed per
step, after backward: unscale, clip to a max global norm, optimizer step, scale update.

  torch: ShardedGradScaler.unscale_ (one all_reduce of the flag), the local norm, an
         all_reduce of its square (as FSDP1's clip_grad_norm_ does), the clip multiply,
         step, update: two collectives.
  ampx:  GradScaler(process_group=...).clip_grad_norm_ (one all_reduce carrying the flag
         and the sum of squares), step, update: one collective.

The ceiling column is an in-place multiply over this rank's gradients (one read and one
write of every byte, the least an unscale can cost); the collective count is measured by
wrapping torch.distributed's functions during the timed calls.

Usage: python benchmarks/bench_sharded.py [--ranks 2] [--repeats 15]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

CASES = [("10000 x 1000", [1000] * 10000), ("4 x 16M", [16 * 2**20] * 4)]


def _shards(sizes, rank, world, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        per = -(-n // world)
        lo, hi = min(n, rank * per), min(n, (rank + 1) * per)
        out.append(torch.randn(hi - lo, generator=g))
    return out


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _worker(rank, world, store, repeats, out):
    import ampx
    from _dist_workers import CountCollectives
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    for case, sizes in CASES:
        for opt_kind in ("fused", "foreach"):
            grads = _shards(sizes, rank, world, seed=rank)
            params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            kw = {"fused": True} if opt_kind == "fused" else {"foreach": True}
            opt = torch.optim.AdamW(params, lr=1e-6, **kw)
            # the optimizer's state exists before timing starts, for both
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()

            def reset():
                for p, g in zip(params, grads):
                    p.grad.copy_(g)

            t_scaler = ShardedGradScaler("cpu", init_scale=1024.0)
            t_scaler.scale(torch.ones(()))

            def torch_step():
                t_scaler.unscale_(opt)
                if opt_kind == "fused":
                    # torch's ShardedGradScaler makes found_inf shape (1,), which torch's CPU fused
                    # AdamW rejects ("output with shape [] doesn't match the broadcast shape [1]");
                    # reshaped here so that the baseline runs at all.
                    st = t_scaler._per_optimizer_states[id(opt)]
                    st["found_inf_per_device"] = {d: f.reshape(()) for d, f in st["found_inf_per_device"].items()}
                gs = [p.grad for p in params]
                local = torch.nn.utils.get_total_norm(gs, 2.0, foreach=True)
                sq = local.double() ** 2
                dist.all_reduce(sq)
                total = sq.sqrt().float()
                torch.nn.utils.clip_grads_with_norm_(gs, 1.0, total, foreach=True)
                t_scaler.step(opt)
                t_scaler.update()

            a_scaler = ampx.GradScaler("cpu", init_scale=1024.0, process_group=dist.group.WORLD)
            a_scaler.scale(torch.ones(()))

            def ampx_step():
                a_scaler.clip_grad_norm_(opt, 1.0)
                a_scaler.step(opt)
                a_scaler.update()

            def ceiling():
                torch._foreach_mul_([p.grad for p in params], 1.0)

            res = {}
            for name, fn in (("torch", torch_step), ("ampx", ampx_step), ("ceiling", ceiling)):
                reset()
                fn()  # warm-up
                with CountCollectives() as cc:
                    fn()
                times = []
                for _ in range(repeats):
                    reset()
                    times.append(_median_ms(fn, 1))
                res[name] = (statistics.median(times), cc.count)
            rows.append((case, opt_kind, res))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        torch.multiprocessing.spawn(_worker, args=(args.ranks, os.path.join(d, "store"), args.repeats, out),
                                    nprocs=args.ranks, join=True)
        rows = torch.load(out, weights_only=False)
    print(f"ranks={args.ranks} (gloo, CPU), threads/rank={max(1, (os.cpu_count() or 1) // args.ranks)}, "
          f"torch {torch.__version__}, median of {args.repeats} steps, ms per step (rank 0)")
    hdr = f"{'case':<14}{'optimizer':<10}{'torch ms':>10}{'ampx ms':>10}{'ampx/torch':>12}{'ceiling ms':>12}" \
          f"{'coll torch':>12}{'coll ampx':>11}"
    print(hdr)
    for case, opt_kind, res in rows:
        (tt, tc), (at, ac), (ct, _) = res["torch"], res["ampx"], res["ceiling"]
        print(f"{case:<14}{opt_kind + ' AdamW':<10}{tt:>10.2f}{at:>10.2f}{at / tt:>12.2f}{ct:>12.2f}{tc:>12}{ac:>11}")


if __name__ == "__main__":
    main()
