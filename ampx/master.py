"""fp32 master weights for a model whose parameters live in bfloat16 or float16.

``MasterWeights(optimizer)`` wraps any torch optimizer built over the model's parameters. The
optimizer then steps float32 copies (the masters) instead of the low-precision parameters:

1. gradients reach the masters through one fused kernel call (``ops.cast_``: bf16/fp16 -> fp32,
   multiplied by the scaler's ``inv_scale`` and checked for inf/NaN in the same pass, when an
   ``ampx.GradScaler`` drives the step; plainly converted otherwise);
2. the wrapped optimizer steps the masters;
3. one more kernel call writes the masters back into the model's parameters, rounded to nearest
   (ties to even) or, for bfloat16, stochastically (unbiased; seeded and reproducible).

Parameters of the optimizer that are already float32 (or float64) are stepped as they are.
``state_dict()`` holds the optimizer's state over the masters plus the masters themselves, so
checkpoints keep full precision.
"""
from collections import OrderedDict

import torch

from . import _C, ops

__all__ = ["MasterWeights"]

_LOW = (torch.float16, torch.bfloat16)


def _is_u64(x):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64


class MasterWeights(torch.optim.Optimizer):
    """Steps fp32 master copies of an optimizer's bf16/fp16 parameters.

    Args:
        optimizer: a torch optimizer over the model's parameters. State it already holds for a
            bf16/fp16 parameter (Adagrad creates some at once) moves to the master, with its
            floating tensors converted to float32.
        model: optional; with ``dtype``, the whole model (parameters and floating buffers) is
            cast to ``dtype`` after the masters are taken from its current values.
        dtype: optional torch.bfloat16 or torch.float16: cast the optimizer's float32
            parameters (or, with ``model``, the whole model) to it, keeping their exact float32
            values as the masters. Without it the parameters must already be bf16/fp16 and the
            masters start from their values.
        rounding: "nearest" or "stochastic" (bfloat16 parameters only) for the write-back.
        seed: the seed of stochastic rounding (the offset is the step count).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer, or is already wrapped.
        ValueError: a bad ``rounding``/``dtype``, stochastic
            rounding asked for float16 parameters (naming the parameter), or no parameter is
            bf16/fp16 (nothing to keep masters for).

    It is a ``torch.optim.Optimizer``: LR schedulers, ``ampx.GradScaler`` and hooks work with it.
    ``param_groups`` and ``state`` are the wrapped optimizer's (holding the masters).
    """

    def __init__(self, optimizer, *, model=None, dtype=None, rounding="nearest", seed=0):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"MasterWeights wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, MasterWeights):
            raise TypeError("this optimizer already keeps master weights")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', not {rounding!r}")
        if dtype is not None and dtype not in _LOW:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype}")
        if not _is_u64(seed):
            raise ValueError(f"seed must be an integer in [0, 2**64), not {seed!r}")
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self.rounding = rounding
        self.seed = seed
        self._dtype = dtype
        self._steps = 0
        self._rng = None  # CUDA stochastic rounding: [seed, offset] on the device (see _device_rng)
        self._rng_key = None  # (seed, offset, device) the eager steps expect it to hold
        self._grads_ready = False
        self._model_params = []  # the low-precision parameters, in optimizer order
        self._masters = []  # their float32 masters, same order
        self._others = []  # parameters stepped as they are (float32/float64)
        # Everything that can refuse is checked before the first parameter is cast or adopted.
        every = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(self._low_dtype(p) for p in every):
            raise ValueError("MasterWeights: none of the optimizer's parameters is bfloat16 or float16 "
                             "(pass dtype=torch.bfloat16 or torch.float16 to cast them)")
        self._check_rounding(every)
        with torch.no_grad():
            for group in optimizer.param_groups:
                group["params"] = self._adopt(group["params"])
            if model is not None and dtype is not None:
                model.to(dtype)

    def _low_dtype(self, p):
        """The low-precision dtype parameter p will have here, or None if it is stepped as is."""
        if self._dtype is not None and p.dtype == torch.float32:
            return self._dtype
        return p.dtype if p.dtype in _LOW else None

    def _check_rounding(self, params, first=0):
        if self.rounding != "stochastic":
            return
        low = [p for p in params if self._low_dtype(p) is not None]
        for i, p in enumerate(low):
            if self._low_dtype(p) != torch.bfloat16:
                raise ValueError(f"MasterWeights: stochastic rounding writes bfloat16, but parameter "
                                 f"{first + i} of shape {tuple(p.shape)} is {self._low_dtype(p)} (nothing was cast)")

    def _adopt(self, params):
        out = []
        for p in params:
            if self._dtype is not None and p.dtype == torch.float32:
                master = p.detach().clone(memory_format=torch.contiguous_format)
                p.data = p.data.to(self._dtype)
            elif p.dtype in _LOW:
                master = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            else:
                self._others.append(p)
                out.append(p)
                continue
            state = self.optimizer.state.pop(p, None)
            if state is not None:
                self.optimizer.state[master] = {
                    k: (v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point()
                        and v.dtype in _LOW else v)
                    for k, v in state.items()}
            self._model_params.append(p)
            self._masters.append(master)
            out.append(master)
        return out

    # ---- the optimizer's tables are the wrapped optimizer's -------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def masters(self):
        """The float32 masters, in the order of the low-precision parameters."""
        return list(self._masters)

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._patch_step_function()

    def __repr__(self):
        return f"MasterWeights({self.optimizer!r}, rounding={self.rounding!r})"

    def add_param_group(self, param_group):
        """As ``torch.optim.Optimizer.add_param_group``; its low-precision parameters get
        masters. Checked first, by torch's rules on the model's parameters (a set refused, no
        non-leaf, none already held), so a refusal leaves every list and parameter as it was."""
        if not isinstance(param_group, dict):
            raise TypeError(f"MasterWeights.add_param_group: param_group must be a dict, not {type(param_group).__name__}")
        param_group = dict(param_group)
        params = param_group.get("params")
        if isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                            "of tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self._check_new_params(params)
        self._check_rounding(params, len(self._model_params))
        kept = (len(self._model_params), len(self._masters), len(self._others), dict(self.optimizer.state),
                [(p, p.data) for p in params])
        try:
            with torch.no_grad():
                param_group["params"] = self._adopt(params)
            self.optimizer.add_param_group(param_group)
        except BaseException:
            self._undo_adopt(*kept)
            raise

    def _check_new_params(self, params):
        held = {id(p) for p in self._model_params + self._masters + self._others}
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"MasterWeights.add_param_group: params[{i}] is a {type(p).__name__}, not a Tensor")
            if not self.defaults.get("differentiable", None) and not (p.is_leaf or p.retains_grad):
                raise ValueError(f"MasterWeights.add_param_group: params[{i}]: can't optimize a non-leaf Tensor")
            if id(p) in held or id(p) in seen:
                raise ValueError(f"MasterWeights.add_param_group: params[{i}] (shape {tuple(p.shape)}) appears in "
                                 "more than one parameter group (torch's optimizers refuse it too)")
            seen.add(id(p))

    def _undo_adopt(self, n_model, n_masters, n_others, state, data):
        del self._model_params[n_model:], self._masters[n_masters:], self._others[n_others:]
        self.optimizer.state.clear()
        self.optimizer.state.update(state)
        for p, d in data:
            p.data = d

    # ---- gradients: model -> masters -----------------------------------------------------

    def _ampx_grads(self):
        """(params, grads, devices) the scaler passes over: the low-precision parameters'
        gradients (still in the model), then those of the parameters stepped as they are;
        devices as ``_C.collect_grads`` gives it (None: all on one device)."""
        return _C.collect_grads([{"params": self._model_params + self._others}])

    def _ampx_unscaled_grads(self):
        """(params, grads, devices) as ``_ampx_grads``, after a scaler's unscale_: the masters'
        gradients (the cast ones), then those of the parameters stepped as they are."""
        return _C.collect_grads([{"params": self._masters + self._others}])

    def _ampx_cast_grads_(self, factor=None, found_inf=None, flags=None):
        """Model gradients -> master gradients (times ``factor``, checked into found_inf/flags)
        in one kernel call; the other parameters' gradients are scaled in place. flags, if
        given, has one byte per gradient in ``_ampx_grads`` order."""
        src, dst = [], []
        for p, m in zip(self._model_params, self._masters):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            src.append(p.grad)
            dst.append(m.grad)
        rest = [p.grad for p in self._others if p.grad is not None]
        k = len(src)
        with torch.no_grad():
            if src:
                ops.cast_(src, dst, inv_scale=factor, found_inf=found_inf,
                          flags=None if flags is None else flags[:k])
            if rest and (factor is not None or found_inf is not None):
                ops.unscale_(rest, 1.0 if factor is None else factor, found_inf,
                             flags=None if flags is None else flags[k:])
        self._grads_ready = True

    def _ampx_scale_master_grads_(self, factor):
        """Multiplies the master gradients (already cast) and the other gradients by factor."""
        grads = [m.grad for m in self._masters if m.grad is not None]
        grads += [p.grad for p in self._others if p.grad is not None]
        with torch.no_grad():
            ops.mul_(grads, factor)

    # ---- step and write-back ---------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Casts the gradients to the masters (unless a scaler did), steps the wrapped
        optimizer, and writes the masters back into the model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grads_ready:
            self._ampx_cast_grads_()
        self.optimizer.step()
        self._write_back(self.rounding, self._steps, advance=True)
        self._steps += 1
        self._grads_ready = False
        return loss

    def _write_back(self, rounding, offset, advance=False):
        """Masters -> model parameters. Stochastic rounding on CUDA takes its seed and offset
        from a device tensor and, with ``advance``, moves the offset on there, so a step
        captured in a CUDA graph draws new bits at every replay."""
        if rounding != "stochastic" or not self._rng_on_device():
            ops.cast_(self._masters, self._model_params, rounding=rounding, seed=self.seed, offset=offset % 2**64)
            return
        rng = self._device_rng(offset % 2**64, self._model_params[0].device)
        ops.cast_(self._masters, self._model_params, rounding=rounding, rng=rng)
        if advance:
            rng[1:].add_(1)  # int64 wraps as the uint64 offset does
            self._rng_key = (self.seed, (offset + 1) % 2**64, rng.device)

    def _rng_on_device(self):
        """Whether stochastic rounding's key lives in a device tensor (CUDA parameters)."""
        return bool(self._model_params) and self._model_params[0].is_cuda

    def _device_rng(self, offset, device):
        """The [seed, offset] tensor on `device`, (re)written from the host only when eager
        bookkeeping says it should hold another value (a new seed, a loaded checkpoint): after
        CUDA-graph replays it is ahead of the host's count, and the device's count wins."""
        if self._rng is None or self._rng_key != (self.seed, offset, device):
            signed = torch.tensor([v - 2**64 if v >= 2**63 else v for v in (self.seed, offset)], dtype=torch.int64)
            if self._rng is not None and self._rng.device == torch.device(device):
                # In place: a captured graph keeps reading (and advancing) this very tensor, so
                # rebinding it would leave the graph on freed memory.
                self._rng.copy_(signed)
            else:
                self._rng = signed.to(device)
            self._rng_key = (self.seed, offset, device)
        return self._rng

    def _offset(self):
        """The step count: stochastic rounding's next offset (the device's, after graph replays)."""
        if self._rng is None or self._rng_key[1] != self._steps % 2**64:
            return self._steps
        return int(self._rng[1].item()) % 2**64

    def zero_grad(self, set_to_none=True):
        """Clears the model's gradients and the masters' (as ``Optimizer.zero_grad``)."""
        for p in self._model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:  # as Optimizer.zero_grad: a view (GradBuffer, DDP buckets) refuses detach_()
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._grads_ready = False

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self):
        """The wrapped optimizer's state_dict (over the masters) plus the float32 masters."""
        sd = self.optimizer.state_dict()
        sd["ampx_master_weights"] = {
            "masters": [m.detach().clone() for m in self._masters],
            "steps": self._offset(),
            "rounding": self.rounding,
            "seed": self.seed,
        }
        return sd

    def load_state_dict(self, state_dict):
        """Loads a ``state_dict()`` of a MasterWeights over the same parameters. The model's
        parameters are then written from the masters exactly as the saved run last wrote them
        (the same rounding, and for stochastic rounding the same seed and offset), so they match
        the saved model bit for bit whether the model is loaded before or after this."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("ampx_master_weights", None)
        if extra is None:
            raise ValueError("this state_dict has no 'ampx_master_weights' entry: it was not saved by "
                             "MasterWeights.state_dict()")
        masters = extra["masters"]
        if len(masters) != len(self._masters):
            raise ValueError(f"the state_dict holds {len(masters)} masters, this optimizer {len(self._masters)}")
        for i, (m, saved) in enumerate(zip(self._masters, masters)):
            if not (isinstance(saved, torch.Tensor) and saved.is_floating_point() and saved.device.type != "meta"):
                raise ValueError(f"master {i}: saved as {saved!r:.60}, not a floating tensor with data; nothing was loaded")
            if m.shape != saved.shape:
                raise ValueError(f"master {i}: saved shape {tuple(saved.shape)}, expected {tuple(m.shape)}")
        steps, seed = extra.get("steps", 0), extra.get("seed", self.seed)
        rounding = extra.get("rounding", self.rounding)
        if (rounding not in ("nearest", "stochastic") or not _is_u64(steps) or not _is_u64(seed)):
            raise ValueError(f"ampx_master_weights holds rounding={rounding!r}, steps={steps!r}, seed={seed!r}: not a "
                             "MasterWeights checkpoint (rounding 'nearest' or 'stochastic', steps and seed integers "
                             "in [0, 2**64)); nothing was loaded")
        steps, seed = int(steps), int(seed)
        self.optimizer.load_state_dict(state_dict)
        self._steps, self.seed = steps, seed
        with torch.no_grad():
            for m, saved in zip(self._masters, masters):
                m.copy_(saved)
            # The last write-back of the saved run: step steps-1's, with its rounding and offset.
            if rounding == "stochastic" and steps > 0:
                # Rewritten from the checkpoint whatever the device tensor holds (graph replays
                # may have moved it past any host count).
                if self._rng is not None:
                    self._rng_key = None
                self._write_back("stochastic", steps - 1)
            else:
                self._write_back("nearest", 0)
