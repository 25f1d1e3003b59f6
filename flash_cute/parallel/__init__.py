"""Context parallelism: attention over a sequence sharded across ranks (torch.distributed).

Built so far: the sequence layouts (`layouts`: contiguous, striped, zigzag; which global
positions each rank holds, sharding and reassembling, each layout's causal work per rank)
and the ring's overlap cost model (`cost.min_block_tokens`). docs/parallel.md describes both.
"""

from flash_cute.parallel.cost import min_block_tokens
from flash_cute.parallel.layouts import (
                                         LAYOUTS,
                                         causal_work,
                                         positions,
                                         shard,
                                         shard_multiple,
                                         unshard_parts,
)

__all__ = ["LAYOUTS", "causal_work", "min_block_tokens", "positions", "shard",
           "shard_multiple", "unshard_parts"]
