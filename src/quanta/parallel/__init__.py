"""Tensor parallelism: one model split over the GPUs of one host (shard.py: which part each rank holds;
group.py: the collectives of a forward; launch.py: the processes)."""
