"""Hypothesis' shrunk steps, read out of a pytest run's output.

A fuzz worker's log holds pytest's whole report of a failure (tracebacks of Hypothesis'
own frames included); what a user needs to see, and what a worker records in the shared
tally, is the error and the steps that make it, as Hypothesis prints them::

    AssertionError: a block leaked
    state = CountingRefusedAllocateMachine()
    state.init_pool(total_blocks=1, block_size=1)
    ...
    state.teardown()
"""

import re

# pytest shows Hypothesis' notes as ``E       text``, or ``    | text`` inside an exception
# group (several distinct failures).
_MARGIN = re.compile(r"^\s*(?:E\s{7}|E$|\|\s?)")
_ERROR = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Failure)\b")
_FAILED_TEST = re.compile(r"^FAILED (\S+)")


def shrunk_steps(output: str) -> list[str]:
    """Each failing case's error line and steps (``state = ...`` to ``state.teardown()``),
    in the order pytest printed them, without repeats."""
    cases: list[str] = []
    error, steps = "", list[str]()
    for raw in output.splitlines():
        line = _MARGIN.sub("", raw).rstrip()
        if _ERROR.match(line):
            error = line
        elif line.startswith("state = "):
            steps = [line]
        elif steps:
            steps.append(line)
            if line == "state.teardown()":
                case = "\n".join([error, *steps] if error else steps)
                if case not in cases:
                    cases.append(case)
                steps = []
    return cases


def failed_tests(output: str) -> list[str]:
    """The node ids pytest's short summary lists as failed."""
    return [match[1] for line in output.splitlines() if (match := _FAILED_TEST.match(line))]
