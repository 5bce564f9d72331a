"""One fp16 DeepSpeed run on the CPU for tests/test_deepspeed.py (DeepSpeed's CPU accelerator
refuses fp16; its support check is forced here), with an inf injected into the gradient of the
parameter named "2.weight" at step 3.

    python _deepspeed_fp16_worker.py STAGE PORT ON_MIN_SCALE MODE

ON_MIN_SCALE "unset" starts at scale 2**8; otherwise the policy's on_min_scale, starting at the
floor (scale 1 = min_loss_scale) so the overflow meets it. MODE "ampx": ampx.prepare and its
scaler; "stock": deepspeed.initialize with the policy's config and engine.backward/step.
Prints one line, "REC" + JSON, of what each step did.
"""
import json, os, sys
stage, port, on_min, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
from deepspeed.accelerator import get_accelerator
type(get_accelerator()).is_fp16_supported = lambda self: True
import deepspeed.comm.torch  # noqa: F401
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import ampx, logging
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
        "gradient_clipping": 0.0}  # ampx.prepare sets 0.0 when unset (DeepSpeed would clip at 1.0)
if mode == "ampx":
    engine, opt, scaler = ampx.prepare(model, None, policy, backend="deepspeed", deepspeed_config=base)
else:
    import deepspeed
    cfg = dict(policy.deepspeed_config(base), train_batch_size=8)
    del cfg["train_micro_batch_size_per_gpu"]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
target = dict(engine.module.named_parameters())["2.weight"]
bad = {3}
state = {"step": 0}
target.register_hook(lambda g: g * float("inf") if state["step"] in bad else g)
x, y = torch.randn(8, 8), torch.randn(8, 1)
rec = {"skipped": [], "changed": [], "scales": [], "reports": []}
for step in range(8):
    state["step"] = step
    before = [p.detach().float().clone() for p in engine.module.parameters()]
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
    after = [p.detach().float() for p in engine.module.parameters()]
    rec["params"] = [p.flatten().tolist() for p in after]
    rec["skipped"].append(engine.skipped_steps != skipped_before)
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
print("REC" + json.dumps(rec))
