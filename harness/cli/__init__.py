"""The command line: one-line errors for every script, and the main command's options and
report. Importing it loads no torch (the allocator benchmarks use ``parsing``)."""
