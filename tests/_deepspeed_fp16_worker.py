"""One fp16 DeepSpeed run on the CPU for tests/test_deepspeed.py (DeepSpeed's CPU accelerator
refuses fp16; its support check is forced here), with an inf injected into the gradient of the
parameter named "2.weight" at step 3.

    python _deepspeed_fp16_worker.py STAGE PORT ON_MIN_SCALE MODE [RANK/WORLD]

The config has a warm-up LR schedule (DeepSpeed's WarmupLR), recorded after each step.
ON_MIN_SCALE "unset" starts at scale 2**8; otherwise the policy's on_min_scale, starting at the
floor (scale 1 = min_loss_scale) so the overflow meets it. MODE "ampx": ampx.prepare and its
scaler; "stock": deepspeed.initialize with the policy's config and engine.backward/step.
MODE "ampx_public" is "ampx" with ZeRO 3's report read through DeepSpeed's public
safe_get_local_grad. RANK/WORLD (default 0/1) runs one rank of a gloo group; the inf then goes into rank 0's gradient
alone. Prints one line, "REC" + JSON, of what each step did.
"""
import json, os, sys
stage, port, on_min, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
rank, world = (sys.argv[5] if len(sys.argv) > 5 else "0/1").split("/")
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                  RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank)
import torch
from deepspeed.accelerator import get_accelerator
type(get_accelerator()).is_fp16_supported = lambda self: True
import deepspeed.comm.torch  # noqa: F401
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import ampx, logging
import ampx.deepspeed_scaler as _dss
views = []  # how many ZeRO 3 partitions were read as views (the test checks which route ran)
if mode == "ampx_public":  # ZeRO 3 read through DeepSpeed's public copy, not the view
    _dss._stage3_view = lambda param: None
    mode = "ampx"
else:
    _view = _dss._stage3_view

    def _counted(param):
        got = _view(param)
        if got is not None:
            views.append(1)
        return got
    _dss._stage3_view = _counted
warned = []
class _H(logging.Handler):
    def emit(self, r):
        warned.append(r.getMessage())
logging.getLogger("ampx").addHandler(_H())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
# on_min_scale set: start at the floor (scale 1 = DeepSpeed's min_loss_scale) so the overflow meets it
kw = {"init_scale": 2.0**8} if on_min == "unset" else {"on_min_scale": on_min, "init_scale": 1.0, "min_scale": 1.0}
policy = ampx.Policy("fp16", device="cpu", growth_interval=3, **kw)
base = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        # a warm-up schedule, so the LR moves every step DeepSpeed does not skip
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05,
                                                     "warmup_num_steps": 16, "warmup_type": "linear"}}}  # ampx.prepare sets 0.0 when unset (DeepSpeed would clip at 1.0)
if mode == "ampx":
    engine, opt, scaler = ampx.prepare(model, None, policy, backend="deepspeed", deepspeed_config=base)
else:
    import deepspeed
    cfg = dict(policy.deepspeed_config(base), train_batch_size=8 * int(world))
    del cfg["train_micro_batch_size_per_gpu"]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
def snapshot():
    """Every parameter as float32 (gathered under ZeRO 3, which partitions them)."""
    params = list(engine.module.parameters())
    if stage != 3:
        return [p.detach().float().clone() for p in params]
    import deepspeed
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]
target = dict(engine.module.named_parameters())["2.weight"]
bad = {3} if rank == "0" else set()
state = {"step": 0}
target.register_hook(lambda g: g * float("inf") if state["step"] in bad else g)
x, y = torch.randn(8, 8), torch.randn(8, 1)
rec = {"skipped": [], "changed": [], "scales": [], "reports": [], "lrs": []}
for step in range(8):
    state["step"] = step
    before = snapshot()
    out = engine(x.half()).float()
    loss = torch.nn.functional.mse_loss(out, y)
    skipped_before = engine.skipped_steps
    if mode == "stock":
        engine.backward(loss)
        engine.step()
    else:
        scaler.scale(loss).backward()
        try:
            scaler.step(opt)
        except RuntimeError as e:
            rec["raised"] = [step, str(e)]
            break
        scaler.update()
    after = snapshot()
    rec["params"] = [p.flatten().tolist() for p in after]
    rec["skipped"].append(engine.skipped_steps != skipped_before)
    rec["lrs"].append(engine.get_lr()[0])
    if mode == "stock":
        rec["scales"].append(float(engine.optimizer.cur_scale if hasattr(engine.optimizer, "cur_scale") else engine.optimizer.loss_scale))
        rec["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        continue
    rec["ampx_skipped"] = rec.get("ampx_skipped", []) + [scaler.last_step_skipped]
    rec["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
    rec["scales"].append(scaler.get_scale())
    r = scaler.overflow_report()
    rec["reports"].append(None if r is None else [r.step, list(r.inf), list(r.nan), r.note])
if mode == "stock":
    print("REC" + json.dumps(rec))
    sys.exit(0)
rec["stats"] = {k: v for k, v in scaler.stats().items() if k != "history"}
rec["history"] = scaler.stats()["history"]
rec["warned"] = warned
rec["views"] = len(views)
print("REC" + json.dumps(rec))
