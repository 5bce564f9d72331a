"""ampx.Policy: state a precision policy once; hand each backend its own mechanism.

A ``Policy`` names a compute dtype (bfloat16, float16 or float32), whether gradients need loss
scaling, and the scaler's settings under ampx.GradScaler's own keyword names. From it come the
pieces each training backend understands natively: ``torch.autocast`` plus ampx's scaler for
plain and DDP training, FSDP1's ``MixedPrecision``, FSDP2's ``MixedPrecisionPolicy``, and the
``fp16`` / ``bf16`` section of a DeepSpeed config (DeepSpeed's own loss scaler then does the
scaling).
"""
import math
import os
import platform
import warnings

import torch

from . import settings
from .scaler import GradScaler

__all__ = ["Policy", "PerformanceWarning"]

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SCALING = ("auto", "dynamic", "static", "none")
_BACKENDS = ("auto", "none", "ddp", "fsdp", "fsdp2", "deepspeed")
_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "growth_timing", "hysteresis",
                "consecutive_hysteresis", "min_scale", "max_scale", "on_min_scale", "clip_norm")


class PerformanceWarning(UserWarning):
    """A precision was honoured on hardware that runs it slowly (for example bf16 on a CPU
    without native bf16, where torch emulates it)."""


def _as_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cuda_capability(device):
    """(major, minor) of ``device``, or None when this machine cannot say (no CUDA build, no
    driver, or no such device): the policy is then for a machine other than this one."""
    try:
        if not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return None
        return torch.cuda.get_device_capability(index)
    except (AssertionError, RuntimeError):  # torch built without CUDA, or a broken driver
        return None


_BF16_OVERRIDE = "AMPX_CPU_BF16"


def _cpu_has_native_bf16():
    """True where the processor computes bfloat16 natively (AVX512-BF16 or AMX on x86, BF16 on Arm).

    ``AMPX_CPU_BF16=1`` or ``=0`` overrides the probe (CI forces it both ways, so no test can
    depend on the machine it happens to run on)."""
    forced = os.environ.get(_BF16_OVERRIDE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{_BF16_OVERRIDE}={forced!r}: expected 0 or 1 (or unset to probe the CPU)")
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
    """(native, reason) for bfloat16 compute on ``device``: native is True, False, or None when
    the hardware could not be checked from this machine."""
    if device.type == "cuda":
        cap = _cuda_capability(device)
        if cap is None:
            return None, (f"the hardware was not checked: this machine has no {device} "
                          "(CUDA unavailable or no such device)")
        major, minor = cap
        ok = major >= 8
        return ok, f"{device} has compute capability {major}.{minor}" + (" (native bf16 needs 8.0+)" if not ok else "")
    if device.type == "cpu":
        ok = _cpu_has_native_bf16()
        return ok, ("this CPU computes bf16 natively (AVX512-BF16/AMX or Arm BF16)" if ok
                    else "this CPU has no native bf16 (no AVX512-BF16, AMX or Arm BF16)")
    return None, f"the hardware was not checked: ampx does not know {device.type} devices"


def _parse_dtype(dtype):
    if isinstance(dtype, torch.dtype):
        if dtype not in _NAMES:
            raise ValueError(f"dtype must be bf16, fp16 or fp32, not {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto', 'bf16', 'fp16' or 'fp32', not {dtype!r}")


def _cpu_has_native_fp16():
    """True where the processor computes float16 natively (AVX512-FP16 or AMX-FP16)."""
    for name in ("_is_avx512_fp16_supported", "_is_amx_fp16_supported"):
        fn = getattr(torch.cpu, name, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # a probe that cannot run says nothing
            pass
    return False


def _check_explicit(dtype, device):
    """An explicit dtype is honoured wherever torch can run it. Returns a note for explain()
    when the hardware was not checked or runs the dtype slowly (the latter also warns)."""
    if dtype == torch.float32:
        return None
    name = _NAMES[dtype]
    if dtype == torch.bfloat16:
        native, why = _hardware_bf16(device)
    elif device.type == "cpu":
        native = _cpu_has_native_fp16()
        why = "this CPU has no native fp16 (no AVX512-FP16 or AMX-FP16)"
    else:
        native, why = _hardware_bf16(device)  # fp16 runs natively on every CUDA GPU; only ask whether it is here
        if native is not None:
            return None
    if native:
        return None
    if native is None:
        return why
    note = f"{why}, so torch emulates {name} there and it is usually slower than fp32"
    warnings.warn(f"ampx.Policy({name!r}, device={str(device)!r}): {note}; dtype='auto' picks the "
                  "fastest precision for this device", PerformanceWarning, stacklevel=3)
    return note


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
        consecutive_hysteresis, min_scale, max_scale, on_min_scale, growth_timing: the
            scaler's settings, as ``ampx.GradScaler`` names them. ``on_min_scale`` and
            ``growth_timing`` left as None take the backend's own behaviour: ampx's scaler's
            defaults ("warn", "torch"), and under DeepSpeed DeepSpeed's (see
            ``deepspeed_config``); set explicitly, they are honoured or refused.
        clip_norm: as ``ampx.GradScaler``'s ("exact" or "torch"), for the scaler ``grad_scaler()``
            builds, the disabled one of bf16 included (DeepSpeed clips by its own norm: not sent there).

    Raises:
        ValueError: an unknown dtype, loss_scaling or backend; loss scaling asked for with fp32.

    Warns:
        PerformanceWarning: an explicit bf16 or fp16 on hardware that only emulates it (a CPU
            without native bf16, a GPU older than compute capability 8.0 for bf16). The dtype is
            honoured all the same, as torch.autocast honours it.

    A policy for a device this machine does not have (``device="cuda"`` on a login node without
    GPUs) is built without a hardware check, so it can still produce every backend's
    configuration; ``explain()`` says the hardware was not checked. ``AMPX_CPU_BF16=0`` or ``=1``
    overrides the CPU's native-bf16 probe.
    """

    def __init__(self, dtype="auto", loss_scaling="auto", master_weights=False, backend="auto", *,
                 device=None, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, consecutive_hysteresis=False, min_scale=None,
                 max_scale=None, on_min_scale=None, growth_timing=None, clip_norm="exact"):
        self.device = _as_device(device)
        if loss_scaling not in _SCALING:
            raise ValueError(f"loss_scaling must be one of {_SCALING}, not {loss_scaling!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, not {backend!r}")
        self._reason = None   # why "auto" chose this dtype
        self._hardware = None  # what the hardware check found for an explicit dtype, if notable
        if isinstance(dtype, str) and dtype == "auto":
            self.dtype, self._reason = self._choose(self.device)
        else:
            self.dtype = _parse_dtype(dtype)
            self._hardware = _check_explicit(self.dtype, self.device)
        if loss_scaling == "auto":
            loss_scaling = "dynamic" if self.dtype == torch.float16 else "none"
        if self.dtype == torch.float32 and loss_scaling != "none":
            raise ValueError("loss scaling has no purpose with fp32; use loss_scaling='none'")
        self.loss_scaling = loss_scaling
        self.master_weights = bool(master_weights)
        self.backend = backend
        # on_min_scale and growth_timing left unset mean "the backend's own": ampx's scaler's
        # defaults, and DeepSpeed's behaviour under DeepSpeed (deepspeed_config refuses an
        # explicit one DeepSpeed cannot carry instead of dropping it).
        self._explicit = frozenset(k for k, v in (("on_min_scale", on_min_scale),
                                                  ("growth_timing", growth_timing)) if v is not None)
        on_min_scale = "warn" if on_min_scale is None else on_min_scale
        growth_timing = "torch" if growth_timing is None else growth_timing
        # The scaler's settings are checked here, by the scaler's rules, so a bad one is refused
        # when the policy is built rather than when a scaler or DeepSpeed config is made from it.
        settings.check_settings(
            "ampx.Policy", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
            on_min_scale=on_min_scale, growth_timing=growth_timing, clip_norm=clip_norm)
        if not isinstance(consecutive_hysteresis, bool):
            raise ValueError(f"ampx.Policy: consecutive_hysteresis must be True or False, not {consecutive_hysteresis!r}")
        self.scaler_kwargs = dict(init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval,
                                  hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
                                  min_scale=min_scale, max_scale=max_scale, on_min_scale=on_min_scale,
                                  growth_timing=growth_timing, clip_norm=clip_norm)

    # ---- choosing -----------------------------------------------------------------------

    @staticmethod
    def _choose(device):
        native, why = _hardware_bf16(device)
        if native:
            return torch.bfloat16, why
        if native is None and device.type == "cuda":
            warnings.warn(f"ampx.Policy.auto({str(device)!r}): {why}; assuming a GPU with native bf16 "
                          "(compute capability 8.0+). Pass dtype='fp16' for older GPUs.", stacklevel=4)
            return torch.bfloat16, why + "; assumed a GPU with native bf16 (compute capability 8.0+)"
        if native is None:
            return torch.float32, why
        if device.type == "cuda":
            return torch.float16, why + "; fp16 with dynamic loss scaling instead"
        return torch.float32, why + ", and 16-bit compute on such a CPU is emulated and slower than fp32"

    @classmethod
    def auto(cls, device=None, **kwargs):
        """The policy ampx recommends for ``device``: bf16 where it runs natively (CUDA compute
        capability 8.0+, CPUs with AVX512-BF16/AMX or Arm BF16), fp16 with dynamic loss scaling
        on older GPUs, fp32 on CPUs without native bf16 (torch emulates 16-bit compute there,
        slower than fp32). For a CUDA device this machine lacks it assumes bf16 and warns.
        Other arguments as for ``Policy``."""
        return cls("auto", device=device, **kwargs)

    def explain(self):
        """One or two sentences: what this policy does and why (and whether the hardware was
        checked: a policy for a device this machine lacks is built unchecked)."""
        name = _NAMES[self.dtype]
        scaling = {"dynamic": "with dynamic loss scaling", "static": "with static loss scaling",
                   "none": "without loss scaling"}[self.loss_scaling]
        what = (f"Trains on {self.device} in fp32 (no autocast)" if self.dtype == torch.float32
                else f"Trains on {self.device} with autocast to {name} {scaling}")
        why = f" because {self._reason}." if self._reason else " as asked."
        hardware = f" Note: {self._hardware}." if self._hardware else ""
        extra = " Keeps fp32 master weights." if self.master_weights else ""
        return what + why + hardware + extra

    def __repr__(self):
        # Safe on any instance, half-built ones included (a failing __init__ shows in tracebacks).
        def get(name):
            return getattr(self, name, "?")

        dtype = get("dtype")
        dtype = _NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
        return (f"Policy(dtype={dtype!r}, loss_scaling={get('loss_scaling')!r}, "
                f"master_weights={get('master_weights')}, backend={get('backend')!r}, "
                f"device={str(get('device'))!r})")

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

        What is and is not the same: DeepSpeed grows one step later than torch's rule (on the
        (w+1)-th clean step after the start or an overflow, then every w-th); a policy with
        ``growth_timing="deepspeed"`` gives an ``ampx.GradScaler`` that follows DeepSpeed's
        timing, and then the scale sequences agree exactly (tested against DeepSpeed's own
        DynamicLossScaler). DeepSpeed's ZeRO stage-0 fp16 optimizers have no hysteresis: for
        them (``zero_optimization.stage`` 0 or unset) a hysteresis other than 1, or
        consecutive_hysteresis, has no effect, and a warning says so.

        Args:
            base: the user's config dict (not modified); keys it already sets are kept, and a
                key it sets to a different value than the policy needs raises.

        Raises:
            ValueError: what DeepSpeed cannot express (growth/backoff other than 2/0.5, a max
                scale, an init_scale that is not a power of two, a fractional min_scale, an
                explicit growth_timing="torch" or on_min_scale DeepSpeed's stage does not
                follow), or a conflict with ``base``.
        """
        return self._deepspeed_config(base, scaler_carries_floor=False)

    def _deepspeed_config(self, base, scaler_carries_floor):
        """deepspeed_config; with scaler_carries_floor, an on_min_scale DeepSpeed does not follow
        is left to ampx's DeepSpeedScaler (ampx.prepare) instead of refused."""
        if base is not None and not isinstance(base, dict):
            raise TypeError(f"ampx.Policy.deepspeed_config: base must be a dict (DeepSpeed's config) or None, not "
                            f"{type(base).__name__}")
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
        stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
        if "growth_timing" in self._explicit and kw["growth_timing"] != "deepspeed":
            raise ValueError(f"DeepSpeed cannot express growth_timing={kw['growth_timing']!r}: its loss scaler "
                             "grows one step later (on the (w+1)-th clean step after the start or an overflow); "
                             "leave growth_timing unset or pass 'deepspeed'")
        own = deepspeed_floor_action(stage)
        if ("on_min_scale" in self._explicit and kw["on_min_scale"] != own and not scaler_carries_floor
                and self.loss_scaling == "dynamic"):
            does = ("raises" if own == "raise" else "keeps the scale at its floor without a word")
            raise ValueError(f"DeepSpeed's config cannot carry on_min_scale={kw['on_min_scale']!r}: with ZeRO stage "
                             f"{stage}, an overflow at min_loss_scale {does}. Pass on_min_scale={own!r} or leave it "
                             "unset, or use ampx.prepare(..., backend='deepspeed'), whose scaler carries it")
        section = {
            "enabled": True,
            "loss_scale": 0 if self.loss_scaling == "dynamic" else float(kw["init_scale"]),
            "initial_scale_power": int(power),
            "loss_scale_window": int(kw["growth_interval"]),
            "hysteresis": int(kw["hysteresis"]),
            "consecutive_hysteresis": bool(kw["consecutive_hysteresis"]),
            "min_loss_scale": int(min_scale),
        }
        if stage == 0 and (section["hysteresis"] != 1 or section["consecutive_hysteresis"]):
            warnings.warn(f"ampx.Policy.deepspeed_config: hysteresis={section['hysteresis']}, consecutive_hysteresis="
                          f"{section['consecutive_hysteresis']} have no effect with ZeRO stage 0: DeepSpeed's "
                          "stage-0 fp16 optimizers back off on every overflow (stages 1-3 honour them)",
                          stacklevel=2)
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


def deepspeed_floor_action(stage):
    """What DeepSpeed (0.19) does on an overflow at min_loss_scale, in on_min_scale's words: its
    ZeRO optimizers' DynamicLossScaler raises; its stage-0 fp16 optimizers stay at the floor."""
    return "ignore" if stage in (0, None) else "raise"
