"""``GradScaler(check_ranks=True)``: ranks that agree on skipping a step under DDP.

Under DDP every rank checks its own copy of the all-reduced gradients. A non-finite value that
appears on one rank only after the reduction (a rank-local hardware fault, a hook that writes
after it) makes that rank skip the step while the others take it, and the replicas part
silently (torch's scaler too). With ``check_ranks=True`` the scaler's one gradient pass of the
step (unscale_, the clip, or a fused optimizer's check) all-reduces its overflow flag over the
default group with MAX, through the same collective the sharded mode uses
(``sharding.agree``, here without a norm: DDP's norm is already the same on every rank), so
every rank skips together. A rank that raises before that collective sends an overflow in it
(``sharding.refusals_shared``), as in the sharded mode. A clip with ``error_if_nonfinite=True``
raises on every rank once the agreed flag is set, not only on the rank whose norm is non-finite
(``GradScaler._check_clip_norm``).

Cost: one all-reduce of two float64 elements (the flag and the monitor's rank code) per step.
With 2 gloo ranks on one shared 2-core CPU host (benchmarks/bench_rank_check.py, a small MLP),
clip + step + update took about 0.4-0.5 ms a step without it and 1.0-1.9 ms with it; the bare
all-reduce is about 180 us there, the rest is the wait for the slower rank.

Without an initialised process group the setting does nothing (a script run on one process
and under torchrun alike). With ``process_group`` (the sharded mode, which already agrees on
the flag and the norm in its own collective) it is refused rather than ignored, so that nobody
counts on a second check that would never run.
"""


def checked(op, check_ranks, sharded):
    """The check_ranks setting as the scaler keeps it, after its rules."""
    if not isinstance(check_ranks, bool):
        raise ValueError(f"{op}: check_ranks must be True or False, not {check_ranks!r}")
    if check_ranks and sharded:
        raise ValueError(f"{op}: check_ranks=True adds nothing with process_group= (the sharded scaler's "
                         "collective already makes every rank of the group skip together): drop check_ranks")
    return check_ranks
