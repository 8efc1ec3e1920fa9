"""Benchmarks, each a script with a fixed seed, a warm-up and medians: ``allocator``,
``prefix`` and ``fragmentation`` need no torch; ``decode`` runs the model."""
