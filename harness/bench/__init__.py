"""The benchmarks, each a script (``python -m harness.bench.NAME``, most of them also
``pagedkv bench NAME``) with a fixed seed, a warm-up and medians, and the traces and
methods they share: the allocator's (``allocator``, ``host_prefix``, ``api_cost``,
``fragmentation``) need no torch; ``decode``, ``speculation``, ``attention`` and
``preemption`` run the model or its kernels."""
