"""Context parallelism: attention over a sequence sharded across ranks (torch.distributed).

* `ring_attention`: K/V blocks round a ring, partials merged by their LSE in float32 (or
  float64), in the contiguous, striped or zigzag layout (`layouts`).
* `ulysses_attention`: two all-to-alls that trade the sequence shard for a head shard.
* `hybrid_attention`: Ulysses inside one dim of a 2-D DeviceMesh, the ring across the other.
* `shard` / `unshard`: a rank's part of a full tensor, and back.
* `local`: the attention each rank runs (the operators, or exact float64 for tests).
* `cost.min_block_tokens`: the shard length at which the ring's transfers hide.

docs/guide/parallel.md describes the layouts, the cost model and the usage.
"""

from flash_cute.parallel.cost import min_block_tokens
from flash_cute.parallel.layouts import (
    LAYOUTS,
    causal_work,
    positions,
    shard_multiple,
    unshard_parts,
)
from flash_cute.parallel.local import Float64Local, OperatorLocal
from flash_cute.parallel.ring import ring_attention
from flash_cute.parallel.sharding import shard, unshard
from flash_cute.parallel.ulysses import hybrid_attention, hybrid_positions, ulysses_attention

__all__ = ["LAYOUTS", "Float64Local", "OperatorLocal", "causal_work", "hybrid_attention",
           "hybrid_positions", "min_block_tokens", "positions", "ring_attention", "shard",
           "shard_multiple", "ulysses_attention", "unshard", "unshard_parts"]
