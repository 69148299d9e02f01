"""CIERA's log lines in ``pretrain_gpt.py``: the selection decisions of a log interval fold into
one line by default; ``--ciera-log-buckets`` prints each decision as it is made."""

import logging

from megatron.ciera.app.logging_utils import SelectionLog

REASON_RAW = "raw 1086.0 us; compressing is not faster: delta 1241.3 us (484736 B/rank, world 2)"


def _logger(handler: SelectionLog) -> logging.Logger:
    lg = logging.getLogger("test.ciera.selection")
    lg.handlers[:] = [handler]
    lg.setLevel(logging.INFO)
    lg.propagate = False
    return lg


def test_one_line_per_interval_names_the_choices_and_why_raw():
    printed = []
    handler = SelectionLog(each=False, out=printed.append)
    lg = _logger(handler)
    for name in ("dense0.bucket0", "dense0.bucket1"):
        lg.info("%s: selection -> %s (%s)", name, "raw", REASON_RAW)
    lg.info("%s: selection -> %s (%s)", "expert0.bucket0", "delta", "delta 1.0 us vs raw 2.0 us")
    assert printed == []  # held until the log interval
    line = handler.interval_line()
    assert line.startswith("CIERA selection: raw on 2 buckets, delta on 1 bucket (raw: compressing is not faster")
    assert "--ciera-selection always" in line and "\n" not in line
    assert handler.interval_line() is None  # nothing new since


def test_log_buckets_prints_each_decision_with_its_times():
    printed = []
    handler = SelectionLog(each=True, out=printed.append)
    _logger(handler).info("%s: selection -> %s (%s)", "dense0.bucket0", "raw", REASON_RAW)
    assert printed == [f"CIERA dense0.bucket0: selection -> raw ({REASON_RAW})"]
    assert handler.interval_line() is None
