"""Planted bugs in notebook 06's Task 2 (``block_hashes``) that more than one test module gives its checker."""

from __future__ import annotations

from labkit import BlockManager
from labkit.core.kv.block_manager import hash_block


class NotChained(BlockManager):
    """Hashes each full block on its own: equal blocks after different prefixes get equal hashes."""

    def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
        bs = self.block_size
        return [hash_block(None, tuple(token_ids[i * bs:(i + 1) * bs])) for i in range(len(token_ids) // bs)]


class HashesThePartialBlock(BlockManager):
    """Chained correctly; also hashes the partial last block."""

    def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
        out, parent = [], None
        for i in range(0, len(token_ids), self.block_size):
            parent = hash_block(parent, tuple(token_ids[i:i + self.block_size]))
            out.append(parent)
        return out
