from __future__ import annotations

import pytest

from minima_test_support.server import e2e_device, launch


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """The README's serve path: the default model, Minima selected by the launcher's defaults."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    # SGLANG_DEBUG_MEMORY_POOL: SGLang's paged allocator asserts on double frees and duplicate pages.
    server = launch(["--enable-metrics", "--max-running-requests", "16"], log,
                    env={"SGLANG_DEBUG_MEMORY_POOL": "1"})
    print(f"\n[e2e] default server up in {server.startup_s:.1f}s on {server.url} (device {e2e_device()})")
    yield server
    server.stop()
