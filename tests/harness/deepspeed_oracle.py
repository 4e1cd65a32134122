"""Real DeepSpeed, the oracle for its config's defaults and its schedules: installed by the test extra
without building its ops, imported on the CPU accelerator (no probing for one) with its log quiet."""
import logging
import os


def real_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probing on a CPU machine
    import deepspeed as ds

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return ds
