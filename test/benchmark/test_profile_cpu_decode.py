"""benchmark/serving/profile_cpu_decode.py's summary of py-spy's collapsed stacks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "serving"))

from profile_cpu_decode import summarize  # noqa: E402


def test_inclusive_and_self_shares_of_collapsed_stacks():
    raw = "\n".join([
        "main (a.py:1);ModelRunner.forward (m.py:2);lut_tq3_batch_decode (l.py:3);code_ints (p.py:4) 6",
        "main (a.py:1);ModelRunner.forward (m.py:2);lut_hot_batch_decode (l.py:9) 3",
        "main (a.py:1);Scheduler.flush_pending_backups (r.py:5) 1",
    ])
    s = summarize(raw)
    assert s["samples"] == 10
    assert s["focus_inclusive_pct"]["TQ3 pages (lut_tq3_batch_decode)"] == 60.0
    assert s["focus_inclusive_pct"]["the whole forward (ModelRunner.forward)"] == 90.0
    assert s["focus_inclusive_pct"]["lifecycle (flush_pending_backups)"] == 10.0  # a method matches by its name
    assert s["top_self_pct"] == {"code_ints": 60.0, "lut_hot_batch_decode": 30.0, "Scheduler.flush_pending_backups": 10.0}
    assert s["top_inclusive_pct"]["main"] == 100.0
