"""The command line, the top floor: ``python -m harness`` (``main``), the ``pagedkv`` console
script and its subcommands, and what only they print (the report, the block map, where
``--events`` go). Nothing else in ``harness`` imports it; what the commands share (one-line
errors, settings, limits, dtypes, output files) sits below it. Importing the package loads
no torch."""
