"""The error family shared by spec and impl.

Bad configuration and bad arguments raise the built-in ``ValueError``; an unknown
request raises ``KeyError``. The one error of our own is ``BlockAllocationError``:
the pool has too few free blocks for the request. It is defined here (standard
library only) so that spec and impl raise the very same class.
"""


class BlockAllocationError(RuntimeError):
    """Not enough free blocks: the message names the blocks needed and the blocks free."""

    def __init__(self, request_id: str, blocks_needed: int, blocks_free: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {blocks_needed} more block(s) "
            f"but only {blocks_free} are free"
        )
        self.request_id = request_id
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free

    def __reduce__(self) -> tuple[type["BlockAllocationError"], tuple[str, int, int]]:
        # Keeps the error picklable (pytest-xdist and multiprocessing send it across).
        return (BlockAllocationError, (self.request_id, self.blocks_needed, self.blocks_free))
