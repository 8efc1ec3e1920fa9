"""Dynamo's in-process ``dynamo.llm.RadixTree``, fed pagedkv's stream one step at a time.

Run by ``tests/events/test_dynamo_radix_tree.py`` with ``.venv-dynamo/bin/python`` (Dynamo's
wheel lives in a venv of its own), so this file imports nothing of pagedkv. One JSON
object per line on stdin, one answer per line on stdout:
- ``{"new": true}``: start a new, empty tree; answers ``{}``;
- ``{"events": [...]}``: apply each event, given as ``{"stored": {"block_hash", "parent",
  "tokens"}}``, ``{"removed": block_hash}`` or ``{"cleared": true}``; answers
  ``{"hashes": [...], "refused": [...]}``: every block hash the tree holds after them,
  and the error of each event the tree refused (``apply_event`` raises ``RuntimeError``
  for a store whose parent it lacks, where the standalone indexer logs it and goes on).

Each event becomes the JSON ``RadixTree.apply_event`` takes (Dynamo's own ``KvCacheEvent``),
as Dynamo's ZeroMQ listener turns vLLM's events into it: a store keeps our block hash,
our parent hash, and Dynamo's own hash of the block's tokens
(``compute_block_hash_for_seq``), which is what its prefix queries walk.
"""

import json
import sys
from typing import Any

from dynamo.llm import RadixTree, compute_block_hash_for_seq  # type: ignore[import-not-found]

WORKER = 1


def dynamo_event(event_id: int, event: dict[str, Any]) -> dict[str, Any]:
    """Our event as Dynamo's ``KvCacheEvent`` JSON."""
    if "stored" in event:
        stored = event["stored"]
        tokens = stored["tokens"]
        (tokens_hash,) = compute_block_hash_for_seq(tokens, len(tokens))
        block = {"block_hash": stored["block_hash"], "tokens_hash": tokens_hash}
        data: object = {"stored": {"parent_hash": stored["parent"], "blocks": [block]}}
    elif "removed" in event:
        data = {"removed": {"block_hashes": [event["removed"]]}}
    else:
        data = "cleared"
    return {"event_id": event_id, "data": data}


def held_hashes(tree: Any) -> list[int]:
    """Every block hash in ``tree``'s dump."""
    hashes: list[int] = []
    for line in tree.dump_tree_as_events():
        stored = json.loads(line)["event"]["data"]["stored"]
        hashes.extend(block["block_hash"] for block in stored["blocks"])
    return sorted(hashes)


def main() -> None:
    tree = RadixTree()
    event_id = 0
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("new"):
            tree = RadixTree()
            answer: dict[str, object] = {}
        else:
            refused = []
            for event in request["events"]:
                event_id += 1
                try:
                    tree.apply_event(WORKER, json.dumps(dynamo_event(event_id, event)).encode())
                except RuntimeError as error:
                    refused.append(str(error))
            answer = {"hashes": held_hashes(tree), "refused": refused}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
