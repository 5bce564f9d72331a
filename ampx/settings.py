"""The rules a GradScaler's settings follow, checked where they enter.

One set of rules for the three doors a setting comes through: ``GradScaler(...)``,
``GradScaler.load_state_dict`` and ``ampx.Policy`` (which hands its settings to the scaler and
to DeepSpeed's config later, so a bad one must be refused when the policy is built, not steps
later). The scale lives in a float32 tensor and the trackers in int32 ones, so every number
must fit its slot: a scale above float32's largest finite value would become inf, a tracker
past 2**31 - 1 would wrap inside the C update.

``SettingError`` is a ValueError that is also an AssertionError: torch's scaler raises
AssertionError for some of these (growth_factor <= 1, backoff_factor >= 1, a bad
``update(new_scale)``), and code written against torch may catch that.
"""
import math

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
INT32_MAX = 2**31 - 1
ON_MIN_SCALE = ("warn", "raise", "ignore")
GROWTH_TIMINGS = ("torch", "deepspeed")
CLIP_NORMS = ("exact", "torch")  # ampx/clip_dtype.py says what each means


class SettingError(ValueError, AssertionError):
    """A scaler setting outside its rule (a ValueError; also an AssertionError where torch's
    scaler raises one for the same setting, so code written for torch still catches it)."""


def is_real(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_count(x):
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


def _bad(op, name, value, rule, cls=ValueError):
    raise cls(f"{op}: {name} must be {rule}, not {value!r}")


def check_scale_value(op, name, value):
    """A loss scale: a normal float32 number > 0 (a zero or subnormal scale makes every
    unscaled gradient inf or NaN; one past float32's range is inf)."""
    if not (is_real(value) and FLOAT32_MIN_NORMAL <= value <= FLOAT32_MAX):
        _bad(op, name, value, f"a number from float32's smallest normal ({FLOAT32_MIN_NORMAL:.4g}) to its "
             f"largest ({FLOAT32_MAX:.4g}): 0 or a subnormal makes the unscaled gradients inf or NaN")


def check_settings(op, names=None, *, init_scale, growth_factor, backoff_factor, growth_interval,
                   hysteresis=1, min_scale=None, max_scale=None, on_min_scale="warn", growth_timing="torch",
                   clip_norm="exact", scaling=True):
    """Raises ValueError (``SettingError`` where torch raises AssertionError) naming ``op`` and
    the setting, for any setting the scaler cannot honour. ``names`` maps a setting to how the
    caller's user wrote it (``state_dict['scale']`` for a checkpoint). scaling=False (a disabled
    scaler): torch's own four settings go unchecked, as torch leaves them (a disabled scaler never
    reads them); ampx's own are checked either way."""
    names = names or {}

    def bad(key, value, rule, cls=ValueError):
        _bad(op, names.get(key, key), value, rule, cls)

    if scaling:
        _check_torch_settings(op, bad, names, init_scale, growth_factor, backoff_factor, growth_interval)
    return _check_ampx_settings(bad, hysteresis, min_scale, max_scale, on_min_scale, growth_timing, clip_norm)


def _check_torch_settings(op, bad, names, init_scale, growth_factor, backoff_factor, growth_interval):
    check_scale_value(op, names.get("init_scale", "init_scale"), init_scale)
    if not (is_real(growth_factor) and not math.isnan(growth_factor)):
        bad("growth_factor", growth_factor, "a finite number > 1")
    if not growth_factor > 1.0:  # torch's own words for its constructor, for code that compares them
        if names:
            bad("growth_factor", growth_factor, "a finite number > 1", SettingError)
        raise SettingError("The growth factor must be > 1.0.")
    if growth_factor == math.inf:
        bad("growth_factor", growth_factor, "a finite number > 1")
    if not (is_real(backoff_factor) and not math.isnan(backoff_factor)):
        bad("backoff_factor", backoff_factor, "a number in (0, 1)")
    if not backoff_factor < 1.0:
        if names:
            bad("backoff_factor", backoff_factor, "a number in (0, 1)", SettingError)
        raise SettingError("The backoff factor must be < 1.0.")
    if not backoff_factor > 0.0:
        bad("backoff_factor", backoff_factor, "a number in (0, 1) (0 or less makes the scale 0 or negative)")
    if not (is_count(growth_interval) and 1 <= growth_interval <= INT32_MAX):
        bad("growth_interval", growth_interval, f"an integer from 1 to {INT32_MAX} (the tracker is int32)")


def _check_ampx_settings(bad, hysteresis, min_scale, max_scale, on_min_scale, growth_timing, clip_norm):
    """The settings torch's scaler does not have; returns (min_scale, max_scale) as floats."""
    if not (is_count(hysteresis) and 1 <= hysteresis <= INT32_MAX):
        bad("hysteresis", hysteresis, f"an integer from 1 to {INT32_MAX} (the tracker is int32)")
    lo = 0.0 if min_scale is None else min_scale
    if not (is_real(lo) and 0.0 <= lo <= FLOAT32_MAX):
        bad("min_scale", min_scale, f"None or a number from 0 to float32's largest ({FLOAT32_MAX:.4g})")
    hi = math.inf if max_scale is None else max_scale
    if not (is_real(hi) and hi >= max(lo, FLOAT32_MIN_NORMAL)):
        bad("max_scale", max_scale, f"None, inf or a number >= min_scale ({lo!r}) and >= float32's smallest "
            f"normal ({FLOAT32_MIN_NORMAL:.4g})")
    if on_min_scale not in ON_MIN_SCALE:
        bad("on_min_scale", on_min_scale, f"one of {ON_MIN_SCALE}")
    if growth_timing not in GROWTH_TIMINGS:
        bad("growth_timing", growth_timing, f"one of {GROWTH_TIMINGS}")
    if clip_norm not in CLIP_NORMS:
        bad("clip_norm", clip_norm, f"one of {CLIP_NORMS} ('exact': ampx's exact norm, returned in torch's dtype; "
            "'torch': torch's own clip_grad_norm_, bit for bit)")
    return float(lo), float(hi)


def check_growth_tracker(op, name, value, growth_timing):
    """A loaded growth tracker: an integer from the timing's start (-1 for DeepSpeed's, else 0)
    to 2**31 - 2, so the update's increment cannot wrap the int32."""
    low = -1 if growth_timing == "deepspeed" else 0
    if not (is_count(value) and low <= value <= INT32_MAX - 1):
        _bad(op, name, value, f"an integer from {low} to {INT32_MAX - 1} (the tracker is int32)")


def scale_floor(min_scale):
    """The lowest scale a dynamic update may reach: min_scale, and never below float32's
    smallest normal number (below it the scale underflows to 0 and the unscale writes NaN)."""
    return max(min_scale, FLOAT32_MIN_NORMAL)
