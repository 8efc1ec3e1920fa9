"""The ``--dtype`` names pagedkv's commands take, and the torch dtype each stands for: one
table the main command and the benchmarks share, below the CLI so that a benchmark (and the
GPU check, which runs on machines with torch and transformers alone) need not import the
main command and, through it, the event publisher's ``zmq``."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
