"""What Minima reports: bytes per tier (memory_report), the /server_info section (server_info) and the
Prometheus metrics (metrics). Each reads the store and its counters (``mem_cache.stats``); nothing
in mem_cache imports this package."""
