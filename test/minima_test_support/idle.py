"""Wait (bounded) for a real server to be idle and check that nothing is left behind."""

from __future__ import annotations

import time

import requests


def _running(url: str) -> float:
    """Running + queued requests, from SGLang's own gauges (the server runs with --enable-metrics)."""
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")):
            total += float(line.split()[-1])
    return total


def assert_idle(url: str, timeout_s: float = 60) -> dict:
    """Bounded wait until no request runs and no page is held by a request, a reader or a
    conversion (pages only the prefix cache holds are idle); returns the minima section."""
    deadline = time.time() + timeout_s
    while True:
        minima = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]["minima"]
        rows = {k: v["pages"] for k, v in minima["memory"]["rows"].items()}
        busy = _running(url) + rows["recent"] + rows["anchor"] + rows["stale_hot"] + rows["held_hot"] + rows["held_tq3"]
        if busy == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert busy == 0, rows
    memory, pool = minima["memory"], minima["pool"]
    assert memory["accounted_bytes"] == memory["allocated_bytes"]
    cached = rows["hot_other"] + rows["stale"]
    assert rows["free_hot"] + rows["free_tq3"] + cached == pool["logical_pages"], rows
    assert minima["references"]["mismatched_pages"] == 0  # every count is its mapping (nothing converts between steps)
    assert minima["stats"]["retier"]["failed_pages"] == 0 and minima["stats"]["promote"]["failed_pages"] == 0
    return minima
