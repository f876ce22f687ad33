"""benchmark/serving/server_log.py: SGLang's scheduler batch lines, read by the capacity benchmark
(decode windows) and the profile (logged throughput, the wait for the whole load decoding)."""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "serving"))

from minima_test_support.sglang_log import decode_line, scheduler_log  # noqa: E402
from server_log import BatchLine, batch_lines, decode_windows, log_throughput, prefill_batches, wait_for_rows  # noqa: E402


def test_batch_lines_read_each_kind_with_or_without_iteration_numbers():
    log = scheduler_log([500.0], [(8, 640.5)]) + decode_line(4, 400.0, queued=3) + "[t] Load weight end.\n"
    assert batch_lines(log) == [
        BatchLine("prefill", None, None, 6, 99999.0, 1),  # a line without the fields: None, not 0
        BatchLine("prefill", 0, 6, 256, 500.0, 2),
        BatchLine("decode", 8, 0, None, 640.5),  # "Decode batch [7], ..." (SGLANG_LOG_FORWARD_ITERS)
        BatchLine("decode", 4, 3, None, 400.0),
    ]
    assert decode_windows(log) == [(8, 640.5), (4, 400.0)]


def test_prefill_batches_count_the_sequences_each_ran_and_the_queue_left():
    # a partial line of 1 sequence (no queue field: not counted as leaving one) and three full ones of 2,
    # each leaving 6 queued: 4 batches, 7 sequences, 3 that left a queue; decode lines not counted
    assert prefill_batches(scheduler_log([1.0] * 3, [(8, 640.5)])) == (4, 1.8, 3)
    empty = "[t] Prefill batch, #new-seq: 5, #new-token: 9, #running-req: 3, #queue-req: 0, input throughput (token/s): 1.0\n"
    assert prefill_batches(empty * 2) == (2, 5.0, 0)
    assert prefill_batches(decode_line(4, 400.0)) == (0, 0.0, 0)


def test_logged_throughput_counts_full_batches_before_the_profile():
    decode = [(8, 100.0)] * 5 + [(8, 300.0), (4, 9999.0), (8, 500.0), (8, 700.0)]
    log = scheduler_log([50.0] * 5 + [10.0, 20.0, 30.0, 40.0], decode)
    log += "[t] Profiling starts. Traces will be saved to: x\n" + scheduler_log([1e6] * 20)  # profiled: left out
    got = log_throughput(log)
    # prefill: the 256-token batches, the first five dropped (the 6-token batch is not a full one)
    assert got["prefill"] == {"size": 256, "batches": 4, "median": 25.0, "q1": 12.5, "q3": 37.5}
    # decode: at the most running requests (8), first five dropped; the 4-row batch left out
    assert got["decode"] == {"size": 8, "batches": 3, "median": 500.0, "q1": 300.0, "q3": 700.0}
    assert log_throughput(scheduler_log([10.0] * 7)) == {}  # two batches after the warm-up: too few for quartiles


def _append_later(log: Path, lines: list[str], gap_s: float = 0.6) -> threading.Thread:
    def ramp():
        for text in lines:
            time.sleep(gap_s)
            with open(log, "a") as f:
                f.write(text)

    writer = threading.Thread(target=ramp)
    writer.start()
    return writer


def test_the_wait_ends_when_the_whole_batch_decodes(tmp_path):
    # SGLang's decode lines as the load ramps up: the wait ends at the first with the whole batch
    # running and none queued, not at a fixed time (2026-12-06: one arm profiled prefill steps)
    log = tmp_path / "server.log"
    log.write_text(decode_line(26))  # before the load (the server's warm-up, say): not counted
    start = log.stat().st_size
    t0 = time.time()
    writer = _append_later(log, [decode_line(1, queued=25), decode_line(5, queued=21), decode_line(26)])
    assert wait_for_rows(log, start, 26, timeout_s=60) == (26, 1)
    assert time.time() - t0 >= 1.5  # it waited for the third line
    writer.join()
    # settling: the whole batch on more than one line before the profile starts
    log.write_text("")
    t0 = time.time()
    writer = _append_later(log, [decode_line(26)] * 3)
    assert wait_for_rows(log, 0, 26, timeout_s=60, lines=3) == (26, 3)
    assert time.time() - t0 >= 1.7  # the third line, not the first
    writer.join()


def test_the_wait_reports_what_it_saw_at_the_deadline(tmp_path):
    log = tmp_path / "server.log"
    # a pool that never holds the batch: the running requests of the last line, no full line
    log.write_text(decode_line(26))
    writer = _append_later(log, [decode_line(5, queued=21)])
    assert wait_for_rows(log, log.stat().st_size, 26, timeout_s=5) == (5, 0)
    writer.join()
    assert wait_for_rows(log, log.stat().st_size, 26, timeout_s=0) == (0, 0)  # no line yet
    # settle lines short of the ask: the batch was whole on two of four
    log.write_text(decode_line(26) * 2)
    assert wait_for_rows(log, 0, 26, timeout_s=1, lines=4) == (26, 2)
    # a line still being written is not read until its newline arrives
    log.write_text(decode_line(26)[:40])
    writer = _append_later(log, [decode_line(26)[40:]], gap_s=1.2)
    assert wait_for_rows(log, 0, 26, timeout_s=30) == (26, 1)
    writer.join()
