"""Sharing by fork: a child request holds every block of its parent (parallel samples,
beams); whichever side later writes into a shared, partly filled last block gets a copy
of it first (copy-on-write, ``spec.growth``).

A fork stays in its parent's namespace: the child caches under the parent's salt and
tracks the parent's token ids, and there is no fork into another salt. So a table holds
a cached block only if it is cached under the table's salt
(``spec.invariants.is_salt_isolated``).
"""

from dataclasses import replace

from spec.blocks import add_references
from spec.errors import check_request_id, duplicate_request
from spec.state import AllocatorState, is_request_known, set_table, snapshot_request


def fork(state: AllocatorState, parent_id: str, child_id: str) -> AllocatorState:
    """Give ``child_id`` a table sharing every block of ``parent_id`` in every group (one more
    reference each, group 0's first), with the parent's ``skipped_blocks``, token ids and
    cache salt.

    Checks: a known parent (KeyError), a ``str`` child id (TypeError) that is new
    (ValueError). Takes no block.
    """
    snapshot_request(state, parent_id)
    check_request_id(child_id)
    if is_request_known(state, child_id):
        duplicate_request(child_id)
    for group, tables in enumerate(state.group_tables):
        parent = tables[parent_id]
        state = set_table(state, group, replace(parent, request_id=child_id))
        state = replace(state, ref_counts=add_references(state.ref_counts, parent.block_ids))
    if parent_id in state.token_ids:
        state = replace(state, token_ids=state.token_ids.set(child_id, state.token_ids[parent_id]))
    if parent_id in state.cache_salts:
        salt = state.cache_salts[parent_id]
        state = replace(state, cache_salts=state.cache_salts.set(child_id, salt))
    return state
