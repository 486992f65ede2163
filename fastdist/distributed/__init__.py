"""Process group, rank queries and collectives that also work in a one-process world."""

from fastdist.distributed.collectives import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    broadcast_tensors,
    destroy_groups,
    gather_object,
    new_gloo_group,
    rank_zero_first,
    rank_zero_only,
)
from fastdist.distributed.env import (
    agreed_backend,
    default_backend,
    get_local_rank,
    get_node_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    is_master,
    is_multi_node,
)

__all__ = [
    "all_gather_object",
    "all_reduce_sum",
    "agreed_backend",
    "barrier",
    "broadcast_object",
    "broadcast_tensors",
    "default_backend",
    "destroy_groups",
    "gather_object",
    "get_local_rank",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_master",
    "is_multi_node",
    "new_gloo_group",
    "rank_zero_first",
    "rank_zero_only",
]
