"""How the multi-process test workers (tests/_*_worker.py, run as scripts) end.

``end_group()``: every rank ends torch.distributed's group together. Left up, it is torn down at
interpreter exit, where gloo can abort the process ("terminate called without an active
exception", seen in CI). ``exit_now()``: once everything the test reads is written, leave
without interpreter finalization, where gloo's worker threads can still hold tensors and abort
the process (torch's known gloo shutdown crash, seen in CI once in each of these workers).
"""
import os
import sys

import torch.distributed as dist


def end_group():
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another still talks
        dist.destroy_process_group()


def exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
