"""pagedkv's harness: a real paged KV pool under a real transformer, and the benchmarks.

Importing the package is light: torch and transformers load only in the modules that need
them, so the allocator benchmarks and ``harness.bench.fragmentation`` start without them.
"""
