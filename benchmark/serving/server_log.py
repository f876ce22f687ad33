"""SGLang's scheduler batch lines, parsed in one place for the serving benchmarks.

SGLang 0.5.23 (scheduler_components/metrics_reporter.py) logs a line per logged batch:
``Prefill batch[ [iter]], #new-seq: .., #new-token: N, ..., #running-req: R, #queue-req: Q, ...,
input throughput (token/s): X`` and ``Decode batch[ [iter]], #running-req: R, ..., gen throughput
(token/s): X, #queue-req: Q, ...``. The capacity benchmark reads the decode windows, the profile the
logged throughput and the wait for its whole load decoding. Pure Python, tested in test/benchmark.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"(Prefill|Decode) batch(?: \[\d+\])?, ([^\n]*)")
_FIELD = re.compile(r"(#[\w-]+|(?:input|gen) throughput \(token/s\)): ([\d.]+)")
WARM_UP = 5
"""Full batches that log_throughput drops first (JIT builds, allocator growth)."""


@dataclass(frozen=True)
class BatchLine:
    kind: str  # "prefill" or "decode"
    running: int | None  # requests running (None: a line without the field)
    queued: int | None
    new_tokens: int | None  # prefill lines
    throughput: float | None  # input (prefill) or gen (decode) tokens/s
    new_seqs: int | None = None  # prefill lines: sequences in the forward (a chunked request's every chunk)


def batch_lines(text: str) -> list[BatchLine]:
    out = []
    for m in _LINE.finditer(text):
        fields = dict(_FIELD.findall(m[2]))

        def count(name: str) -> int | None:
            return int(fields[name]) if name in fields else None

        tput = fields.get("input throughput (token/s)", fields.get("gen throughput (token/s)"))
        out.append(BatchLine(m[1].lower(), count("#running-req"), count("#queue-req"), count("#new-token"),
                             float(tput) if tput is not None else None, count("#new-seq")))
    return out


def prefill_batches(text: str) -> tuple[int, float, int]:
    """(prefill batches, mean sequences a batch: ``#new-seq``, where a chunked request counts once per
    chunk, batches that left a queue: ``#queue-req`` > 0 after them) of the log's prefill lines; (0,
    0.0, 0) without one. Many small batches that leave no queue mean requests admitted as they arrive,
    each batch a forward the running decode waits for; a capacity-bound server admits from a full
    queue, in fewer, larger ones."""
    lines = [b for b in batch_lines(text) if b.kind == "prefill" and b.new_seqs is not None]
    if not lines:
        return 0, 0.0, 0
    queued = sum(1 for b in lines if b.queued)
    return len(lines), round(sum(b.new_seqs for b in lines) / len(lines), 1), queued


def decode_windows(text: str) -> list[tuple[int, float]]:
    """(running requests, generation tok/s) of each decode line, in order."""
    return [(b.running, b.throughput) for b in batch_lines(text)
            if b.kind == "decode" and b.running is not None and b.throughput is not None]


def log_throughput(text: str) -> dict:
    """The server's logged throughput before its profile: per kind (prefill, decode), the batches at
    the largest size the log shows (new tokens, running requests) after the first WARM_UP, their
    median and quartiles in tokens/s. A kind with fewer than 3 such batches is left out."""
    lines = batch_lines(text.split("Profiling starts", 1)[0])
    out = {}
    for kind, size_of in (("prefill", lambda b: b.new_tokens), ("decode", lambda b: b.running)):
        rows = [(size_of(b), b.throughput) for b in lines
                if b.kind == kind and size_of(b) is not None and b.throughput is not None]
        if not rows:
            continue
        size = max(n for n, _ in rows)
        xs = [t for n, t in rows if n == size][WARM_UP:]
        if len(xs) >= 3:
            q1, median, q3 = statistics.quantiles(xs, n=4)
            out[kind] = {"size": size, "batches": len(xs), "median": round(median, 1),
                         "q1": round(q1, 1), "q3": round(q3, 1)}
    return out


def wait_for_rows(log_path: Path, start: int, batch: int, timeout_s: float, lines: int = 1) -> tuple[int, int]:
    """Wait until ``lines`` decode lines (from byte ``start`` of the server's log) have shown ``batch``
    requests running and none queued, at most ``timeout_s``. Returns (the running requests of the
    last decode line then, 0 before any; the lines that showed the whole batch). A fixed wait profiled
    prefill steps in one arm and decode steps in the other on 2026-12-06 (26 prompts of 4K on a
    Llama-class model prefill for longer than 20 s); ``lines`` > 1 lets the step settle after the
    wave's prefill (Minima: its pages converted)."""
    deadline = time.time() + timeout_s
    rows, full, tail = 0, 0, ""
    with open(log_path, errors="replace") as f:
        f.seek(start)
        while True:
            text = tail + f.read()
            cut = text.rfind("\n") + 1  # a line still being written is read again next time
            for b in batch_lines(text[:cut]):
                if b.kind == "decode" and b.running is not None:
                    rows = b.running
                    full += (b.running, b.queued) == (batch, 0)
            tail = text[cut:]
            if full >= lines or time.time() >= deadline:
                return rows, full
            time.sleep(1)
