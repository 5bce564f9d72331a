"""What an ampx.GradScaler saves and loads: state_dict, load_state_dict and pickling.

Owns the checkpoint format (torch's five keys plus ampx's extras, which torch's scaler ignores)
and its rules: a dict is checked whole against the constructor's rules before anything changes,
and everything a resumed run needs to repeat the uninterrupted one bit for bit travels with it
(the hysteresis tracker, the growth timing, the clip_norm and on_min_scale settings, the clip route of each
optimizer, and the counters and scale history ``stats()`` reports). ``GradScaler``
(ampx/scaler.py) inherits ``CheckpointMixin``; torch's methods are named, not reached through
super(), for the reason given there.
"""
from collections import deque

import torch

from . import ops, settings

_TorchScaler = torch.amp.GradScaler


class CheckpointMixin:
    def _get_hysteresis_tracker(self):
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def state_dict(self):
        """torch's five keys, plus ampx's extras (ignored by torch.amp.GradScaler.load_state_dict)."""
        sd = _TorchScaler.state_dict(self)
        if not sd:
            return sd
        sd.update({
            "hysteresis": self._hysteresis,
            "consecutive_hysteresis": self._consecutive_hysteresis,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "dynamic": self._dynamic,
            "growth_timing": self.__dict__.get("_growth_timing", "torch"),
            "clip_norm": self.__dict__.get("_clip_norm", "exact"),
            "check_ranks": self.__dict__.get("_check_ranks", False),
            # (a run saved with "raise" must raise at the floor when resumed, not warn)
            "on_min_scale": self._on_min_scale,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
            # which clip route each optimizer's next step takes (it decides the last bits of
            # the gradients, so an exact resume needs it)
            "_clip_active": self._clip_hints(),
            # stats()' counters and scale history, so a resumed run reports what the
            # uninterrupted one would (ampx/telemetry.py owns the format)
            "telemetry": self._telemetry_state(),
        })
        return sd

    def _clip_hints(self):
        """Each optimizer's clip route in the order they took one, then the loaded hints no
        optimizer has taken yet (so saving right after loading keeps them all)."""
        taken = list(self.__dict__.get("_clip_active", {}).values())
        return taken + list(self.__dict__.get("_clip_hints_loaded", []))

    def load_state_dict(self, state_dict):
        """Loads a state_dict from ampx or from torch.amp.GradScaler (extras keep their values;
        without ampx's ``telemetry`` key, ``stats()``' counters and history are left as they are).

        The whole dict is checked against the constructor's rules before anything changes: a
        bad checkpoint raises one error naming the key and the rule, and leaves the scaler as
        it was (KeyError for a missing torch key, ValueError for a bad value)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            return _TorchScaler.load_state_dict(self, state_dict)  # torch's error for a disabled scaler's dict
        new = self._checked_state(state_dict)
        _TorchScaler.load_state_dict(self, state_dict)
        self._hysteresis = new["hysteresis"]
        self._consecutive_hysteresis = new["consecutive_hysteresis"]
        self._min_scale = new["min_scale"]
        self._max_scale = new["max_scale"]
        self._dynamic = new["dynamic"]
        self._growth_timing = new["growth_timing"]
        self._clip_norm = new["clip_norm"]
        self._check_ranks = new["check_ranks"]
        self._on_min_scale = new["on_min_scale"]
        self._init_hysteresis_tracker = new["_hysteresis_tracker"]
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(new["_hysteresis_tracker"])
        self._clip_active = {}
        self._clip_hints_loaded = new["_clip_active"]
        if new["telemetry"] is not None:
            self._load_telemetry(new["telemetry"])

    def _checked_state(self, sd):
        """ampx's settings as ``load_state_dict`` would leave them, after checking every key."""
        op = "ampx.GradScaler.load_state_dict"
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
            if key not in sd:
                raise KeyError(f"{op}: the state_dict has no {key!r} (torch's scaler keys are scale, "
                               "growth_factor, backoff_factor, growth_interval and _growth_tracker)")
        new = {"hysteresis": sd.get("hysteresis", self._hysteresis),
               "consecutive_hysteresis": sd.get("consecutive_hysteresis", self._consecutive_hysteresis),
               "min_scale": sd.get("min_scale", self._min_scale), "max_scale": sd.get("max_scale", self._max_scale),
               "dynamic": sd.get("dynamic", self._dynamic),
               "growth_timing": sd.get("growth_timing", self.__dict__.get("_growth_timing", "torch")),
               "clip_norm": sd.get("clip_norm", self.__dict__.get("_clip_norm", "exact")),
               "on_min_scale": sd.get("on_min_scale", self._on_min_scale)}
        new["_hysteresis_tracker"] = sd.get("_hysteresis_tracker", new["hysteresis"])

        def bad(key, rule):
            raise ValueError(f"{op}: state_dict[{key!r}] must be {rule}, not {sd.get(key)!r}")

        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale",
                "max_scale", "on_min_scale", "growth_timing", "clip_norm")
        settings.check_settings(
            op, {k: f"state_dict[{k!r}]" for k in keys} | {"init_scale": "state_dict['scale']"},
            init_scale=sd["scale"], growth_factor=sd["growth_factor"], backoff_factor=sd["backoff_factor"],
            growth_interval=sd["growth_interval"], hysteresis=new["hysteresis"], min_scale=new["min_scale"],
            max_scale=new["max_scale"], on_min_scale=new["on_min_scale"], growth_timing=new["growth_timing"],
            clip_norm=new["clip_norm"])
        settings.check_growth_tracker(op, "state_dict['_growth_tracker']", sd["_growth_tracker"],
                                      new["growth_timing"])
        new["check_ranks"] = sd.get("check_ranks", self.__dict__.get("_check_ranks", False))
        for key in ("consecutive_hysteresis", "dynamic", "check_ranks"):
            if not isinstance(new[key], bool):
                bad(key, "True or False")
        if self._sharded:
            new["check_ranks"] = False  # a sharded scaler agrees already (a DDP run resumed under FSDP)
        hints = sd.get("_clip_active", [])
        if not (isinstance(hints, (list, tuple)) and all(isinstance(h, bool) for h in hints)):
            bad("_clip_active", "a list of True/False")
        new["_clip_active"] = list(hints)
        # (a torch state_dict has no telemetry: the counters keep counting from where they are)
        new["telemetry"] = self._checked_telemetry(op, sd["telemetry"]) if "telemetry" in sd else None
        tracker = new["_hysteresis_tracker"]
        if not (ops._is_count(tracker) and 1 <= tracker <= new["hysteresis"]):
            bad("_hysteresis_tracker", f"an integer from 1 to hysteresis ({new['hysteresis']})")
        new.update(hysteresis=int(new["hysteresis"]), _hysteresis_tracker=int(tracker),
                   min_scale=float(new["min_scale"]), max_scale=float(new["max_scale"]))
        return new

    def __getstate__(self):
        if self.__dict__.get("_graph_pending"):
            # as torch refuses a pickle between step() and update() (its per-optimizer states)
            raise RuntimeError("A GradScaler instance may only be pickled at the beginning of an iteration, or at the "
                               "end after scaler.update(): this step's clip_grad_norm_/step ran inside a compiled "
                               "graph and its update() has not run yet.")
        if self._enabled:
            self._drain(wait=True)  # first, so the counts it brings in are in the copy below
        state = _TorchScaler.__getstate__(self)
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_hysteresis_tracker"] = None
        state["_flag_sources"] = {}
        # Names are keyed by id(parameter), which means nothing in another process (and could
        # match another object there): they do not travel; reports say so until watch() again.
        if state.get("_param_names"):
            state["_names_dropped"] = True
        state["_param_names"] = {}
        # optimizer ids mean nothing in another process: the clip hints travel as in state_dict
        state["_clip_hints_loaded"] = self._clip_hints()
        state["_clip_active"] = {}
        state["_pending"] = deque()
        # A compiled step's device-side telemetry was drained above; its buffers are remade
        # beside the scale, which torch's state leaves to be made again on first use.
        for key in ("_graph_log", "_graph_skip", "_graph_pending", "_graph_dirty"):
            state.pop(key, None)
        state["_last_grads"] = None
        # A monitor's hooks live on a model in this process: it does not travel (nor its model).
        state["_monitor"] = None
        state["_explain_model"] = None
        # A process group cannot be pickled; a sharded scaler comes back on the default group.
        state["process_group"] = None
        return state

    def __setstate__(self, state):
        _TorchScaler.__setstate__(self, state)
        # A pickle from before every per-optimizer key was declared carries torch's factory.
        self._per_optimizer_states = self._fresh_states()
