"""Two gloo ranks; rank 1 never enters rank 0's all_reduce (tests of megatron.ciera.app.failfast).

    STALL_MODE=backend  the process group's own timeout (2 s) fires first: the error path reports
    STALL_MODE=watchdog the group's timeout is long (60 s); the watchdog (2 s) ends rank 0
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

from megatron.ciera.app import failfast, watchdog as watchdog_lib

if __name__ == "__main__":
    backend = os.environ["STALL_MODE"] == "backend"
    timeout = datetime.timedelta(seconds=2 if backend else 60)
    dist.init_process_group("gloo", timeout=timeout)
    group = dist.new_group([0, 1], timeout=timeout)
    watchdog = watchdog_lib.Watchdog(timeout_s=2.0, period_s=0.2, grace_s=30.0 if backend else 0.0).start()
    try:
        t = torch.ones(4)
        dist.all_reduce(t, group=group)  # both ranks: collective 1 of the group
        if dist.get_rank() == 1:
            time.sleep(30)  # never arrives in time
        dist.all_reduce(t, group=group)
    except BaseException as exc:  # noqa: BLE001
        failfast.exit_on_error(exc, watchdog=watchdog)
