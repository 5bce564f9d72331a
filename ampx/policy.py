"""ampx.Policy: state a precision policy once; hand each backend its own mechanism.

A ``Policy`` names a compute dtype (bfloat16, float16 or float32), whether gradients need loss
scaling, and the scaler's settings under ampx.GradScaler's own keyword names. From it come the
pieces each training backend understands natively: ``torch.autocast`` plus ampx's scaler for
plain and DDP training, FSDP1's ``MixedPrecision``, FSDP2's ``MixedPrecisionPolicy``, and the
``fp16`` / ``bf16`` section of a DeepSpeed config (DeepSpeed's own loss scaler then does the
scaling).
"""
import math
import platform

import torch

from .scaler import GradScaler

__all__ = ["Policy"]

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SCALING = ("auto", "dynamic", "static", "none")
_BACKENDS = ("auto", "none", "ddp", "fsdp", "fsdp2", "deepspeed")
_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                "consecutive_hysteresis", "min_scale", "max_scale", "on_min_scale")


def _as_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cuda_capability(device):
    return torch.cuda.get_device_capability(device)


def _cpu_has_native_bf16():
    """True where the processor computes bfloat16 natively (AVX512-BF16 or AMX on x86, BF16 on Arm)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    for name in probes:
        fn = getattr(torch.cpu, name, None)
        if fn is not None:
            try:
                if fn():
                    return True
            except Exception:  # a probe that cannot run says nothing
                pass
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            with open("/proc/cpuinfo") as f:
                return any(line.startswith("Features") and " bf16" in line for line in f)
        except OSError:
            return False
    return False


def _hardware_bf16(device):
    """(supported, reason) for bfloat16 compute on `device`."""
    if device.type == "cuda":
        major, minor = _cuda_capability(device)
        ok = major >= 8
        return ok, f"{device} has compute capability {major}.{minor}" + (" (bf16 needs 8.0+)" if not ok else "")
    if device.type == "cpu":
        ok = _cpu_has_native_bf16()
        return ok, ("this CPU computes bf16 natively (AVX512-BF16/AMX or Arm BF16)" if ok
                    else "this CPU has no native bf16 (no AVX512-BF16, AMX or Arm BF16)")
    return False, f"ampx does not know {device.type} devices"


class Policy:
    """A precision policy for training, turned into each backend's native configuration.

    Args:
        dtype: "auto", "bf16", "fp16" or "fp32" (a torch dtype works too). "auto" picks with
            ``Policy.auto`` rules for ``device``.
        loss_scaling: "auto" (dynamic for fp16, none otherwise), "dynamic", "static" (the scale
            stays at ``init_scale``) or "none".
        master_weights: keep float32 master copies of low-precision parameters (see the
            master-weights support; recorded here so every backend sees the same request).
        backend: "auto", "none", "ddp", "fsdp", "fsdp2" or "deepspeed" (used by ``ampx.prepare``).
        device: where training runs (default: cuda if available, else cpu).
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
        consecutive_hysteresis, min_scale, max_scale, on_min_scale: the scaler's settings, as
            ``ampx.GradScaler`` names them.

    Raises:
        ValueError: an unknown dtype, loss_scaling or backend; bf16 asked for on a device
            without native bf16; loss scaling asked for with fp32.
    """

    def __init__(self, dtype="auto", loss_scaling="auto", master_weights=False, backend="auto", *,
                 device=None, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, consecutive_hysteresis=False, min_scale=None,
                 max_scale=None, on_min_scale="warn"):
        self.device = _as_device(device)
        if loss_scaling not in _SCALING:
            raise ValueError(f"loss_scaling must be one of {_SCALING}, not {loss_scaling!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, not {backend!r}")
        self._reason = None
        if isinstance(dtype, str) and dtype == "auto":
            self.dtype, self._reason = self._choose(self.device)
        else:
            if isinstance(dtype, torch.dtype):
                if dtype not in _NAMES:
                    raise ValueError(f"dtype must be bf16, fp16 or fp32, not {dtype}")
                self.dtype = dtype
            elif isinstance(dtype, str) and dtype in _DTYPES:
                self.dtype = _DTYPES[dtype]
            else:
                raise ValueError(f"dtype must be 'auto', 'bf16', 'fp16' or 'fp32', not {dtype!r}")
            if self.dtype == torch.bfloat16:
                ok, why = _hardware_bf16(self.device)
                if not ok:
                    raise ValueError(f"bf16 was asked for, but {why}; use dtype='fp16' (with loss "
                                     "scaling) or dtype='auto'")
        if loss_scaling == "auto":
            loss_scaling = "dynamic" if self.dtype == torch.float16 else "none"
        if self.dtype == torch.float32 and loss_scaling != "none":
            raise ValueError("loss scaling has no purpose with fp32; use loss_scaling='none'")
        self.loss_scaling = loss_scaling
        self.master_weights = bool(master_weights)
        self.backend = backend
        self.scaler_kwargs = dict(init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval,
                                  hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
                                  min_scale=min_scale, max_scale=max_scale, on_min_scale=on_min_scale)

    # ---- choosing -----------------------------------------------------------------------

    @staticmethod
    def _choose(device):
        ok, why = _hardware_bf16(device)
        if ok:
            return torch.bfloat16, why
        if device.type == "cuda":
            return torch.float16, why + "; fp16 with dynamic loss scaling instead"
        return torch.float32, why + ", and fp16 on a CPU is emulated and slower than fp32"

    @classmethod
    def auto(cls, device=None, **kwargs):
        """The policy ampx recommends for ``device``: bf16 where it runs natively (CUDA compute
        capability 8.0+, CPUs with AVX512-BF16/AMX or Arm BF16), fp16 with dynamic loss scaling
        on older GPUs, fp32 on CPUs without native bf16. Other arguments as for ``Policy``."""
        return cls("auto", device=device, **kwargs)

    def explain(self):
        """One or two sentences: what this policy does and why."""
        name = _NAMES[self.dtype]
        scaling = {"dynamic": "with dynamic loss scaling", "static": "with static loss scaling",
                   "none": "without loss scaling"}[self.loss_scaling]
        what = (f"Trains on {self.device} in fp32 (no autocast)" if self.dtype == torch.float32
                else f"Trains on {self.device} with autocast to {name} {scaling}")
        why = f" because {self._reason}." if self._reason else " as asked."
        extra = " Keeps fp32 master weights." if self.master_weights else ""
        return what + why + extra

    def __repr__(self):
        return (f"Policy(dtype={_NAMES[self.dtype]!r}, loss_scaling={self.loss_scaling!r}, "
                f"master_weights={self.master_weights}, backend={self.backend!r}, device={str(self.device)!r})")

    # ---- what each backend gets ---------------------------------------------------------

    def autocast(self):
        """``torch.autocast`` for this device and dtype (disabled for fp32)."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def grad_scaler(self, **overrides):
        """An ``ampx.GradScaler`` configured from the policy. Without loss scaling it is a disabled
        scaler: the same API, doing nothing, so the training loop never changes."""
        kw = dict(self.scaler_kwargs)
        kw.update(overrides)
        enabled = self.loss_scaling != "none"
        return GradScaler(self.device.type, enabled=enabled, dynamic=self.loss_scaling != "static", **kw)

    def master_weights_optimizer(self, optimizer, model=None, *, rounding="nearest", seed=0):
        """With ``master_weights=True``: ``ampx.MasterWeights`` over ``optimizer``; the model (or,
        without one, the optimizer's parameters) is cast to the policy's dtype after its float32
        values are kept as the masters. Otherwise the optimizer unchanged."""
        if not self.master_weights:
            return optimizer
        if self.dtype == torch.float32:
            raise ValueError("master_weights=True needs dtype bf16 or fp16: with fp32 the parameters "
                             "already are their own masters")
        from .master import MasterWeights

        return MasterWeights(optimizer, model=model, dtype=self.dtype, rounding=rounding, seed=seed)

    def fsdp_mixed_precision(self):
        """FSDP1's ``MixedPrecision`` (None for fp32): parameters cast to the compute dtype before
        the all-gather, gradients reduced in fp32."""
        if self.dtype == torch.float32:
            return None
        from torch.distributed.fsdp import MixedPrecision

        return MixedPrecision(param_dtype=self.dtype, reduce_dtype=torch.float32, buffer_dtype=self.dtype)

    def fsdp2_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` (None for fp32) for ``fully_shard(..., mp_policy=...)``."""
        if self.dtype == torch.float32:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def deepspeed_config(self, base=None):
        """The user's DeepSpeed config with this policy's ``fp16`` or ``bf16`` section merged in.

        DeepSpeed's own loss scaler does the scaling, so every setting is mapped onto its keys:
        init_scale -> ``initial_scale_power`` (must be a power of two), growth_interval ->
        ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, min_scale ->
        ``min_loss_scale`` (an integer in DeepSpeed; its floor of 1 when unset), static scaling ->
        ``loss_scale``.
        The dynamic keys are always named: with none named DeepSpeed silently starts at 2**32
        without hysteresis.

        Args:
            base: the user's config dict (not modified); keys it already sets are kept, and a
                key it sets to a different value than the policy needs raises.

        Raises:
            ValueError: what DeepSpeed cannot express (growth/backoff other than 2/0.5, a max
                scale, an init_scale that is not a power of two, a fractional min_scale), or a
                conflict with ``base``.
        """
        cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (base or {}).items()}
        if self.dtype == torch.float32:
            for key in ("fp16", "bf16"):
                if cfg.get(key, {}).get("enabled"):
                    raise ValueError(f"the policy trains in fp32 but the base config enables {key}")
            return cfg
        if self.dtype == torch.bfloat16:
            if cfg.get("fp16", {}).get("enabled"):
                raise ValueError("the policy trains in bf16 but the base config enables fp16 "
                                 "(DeepSpeed cannot enable both)")
            if self.loss_scaling != "none":
                raise ValueError("DeepSpeed's bf16 mode has no loss scaling; use loss_scaling='none'")
            return self._merge(cfg, "bf16", {"enabled": True})
        if cfg.get("bf16", {}).get("enabled"):
            raise ValueError("the policy trains in fp16 but the base config enables bf16 "
                             "(DeepSpeed cannot enable both)")
        kw = self.scaler_kwargs
        if kw["growth_factor"] != 2.0 or kw["backoff_factor"] != 0.5:
            raise ValueError(f"DeepSpeed cannot express growth_factor={kw['growth_factor']} / "
                             f"backoff_factor={kw['backoff_factor']}: its loss scaler always doubles "
                             "and halves")
        if kw["max_scale"] is not None:
            raise ValueError("DeepSpeed cannot express max_scale: its loss scaler has no upper bound")
        power = math.log2(kw["init_scale"]) if kw["init_scale"] > 0 else float("nan")
        if not power.is_integer():
            raise ValueError(f"DeepSpeed needs init_scale to be a power of two (initial_scale_power); "
                             f"{kw['init_scale']} is not")
        if self.loss_scaling == "none":
            raise ValueError("DeepSpeed's fp16 mode always scales the loss; use loss_scaling='static' "
                             "with init_scale=1.0 for no scaling")
        min_scale = 1 if kw["min_scale"] is None else kw["min_scale"]
        if float(min_scale) != int(min_scale):
            raise ValueError(f"DeepSpeed's min_loss_scale is an integer; min_scale={min_scale} cannot be "
                             "expressed")
        section = {
            "enabled": True,
            "loss_scale": 0 if self.loss_scaling == "dynamic" else float(kw["init_scale"]),
            "initial_scale_power": int(power),
            "loss_scale_window": int(kw["growth_interval"]),
            "hysteresis": int(kw["hysteresis"]),
            "consecutive_hysteresis": bool(kw["consecutive_hysteresis"]),
            "min_loss_scale": int(min_scale),
        }
        return self._merge(cfg, "fp16", section)

    @staticmethod
    def _merge(cfg, key, section):
        mine = cfg.get(key, {})
        for k, v in section.items():
            if k in mine and mine[k] != v:
                raise ValueError(f"the base config sets {key}.{k}={mine[k]!r}, but the policy needs {v!r}")
        merged = dict(section)
        merged.update(mine)
        cfg[key] = merged
        return cfg

