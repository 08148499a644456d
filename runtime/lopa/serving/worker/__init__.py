"""The worker role (`lopa worker`): one rank of the collective group, verifying its share of each round.

service     the worker process: load, join, serve the master's step stream over a ShardExecutor
collective  torch.distributed group join (bounded) and the fused broadcast
rendezvous  the collective's rendezvous through an authenticated store
kv_memory   whether the KV caches fit the device's free memory, checked before they are allocated
"""
