"""Minima-KV's memory side: page table, physical pools, tiered store, controller and SGLang glue."""
