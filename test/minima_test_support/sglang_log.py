"""SGLang 0.5.23's scheduler batch lines, as its metrics reporter writes them, for the tests of the
serving benchmarks' log readers (benchmark/serving/server_log.py)."""

from __future__ import annotations


def decode_line(running: int, tok_s: float = 1.0, queued: int = 0, iters: int | None = None) -> str:
    at = f" [{iters}]" if iters is not None else ""
    return (f"[t] Decode batch{at}, #running-req: {running}, #token: 9, token usage: 0.9, cuda graph: True, "
            f"gen throughput (token/s): {tok_s}, #queue-req: {queued}\n")


def scheduler_log(prefill_tok_s: list[float], decode: list[tuple[int, float]] = ()) -> str:
    """A partial prefill batch (abridged: without the #running-req / #queue-req fields), full ones as
    0.5.23 writes them, then decode batches."""
    lines = ["[t] Prefill batch, #new-seq: 1, #new-token: 6, #cached-token: 0, token usage: 0.00, "
             "cuda graph: False, input throughput (token/s): 99999.0\n"]
    lines += [f"[t] Prefill batch, #new-seq: 2, #new-token: 256, #cached-token: 0, token usage: 0.02, #running-req: 0, "
              f"#queue-req: 6, #pending-token: 1792, cuda graph: True, input throughput (token/s): {t}\n"
              for t in prefill_tok_s]
    return "".join(lines) + "".join(decode_line(n, t, iters=7) for n, t in decode)
