"""Fuzzing on many machines: workers as Ray tasks, one example database and one tally in Redis.

``pagedkv fuzz --ray ... --database redis://...`` drives these modules; Ray and redis-py
come with the ``cluster`` extra and load only when a command needs them.
"""
