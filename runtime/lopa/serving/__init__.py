"""Branch-parallel serving: a gRPC master driving the decoder over branch workers.

config      the YAML file both roles read (docs/lopa.yaml)
placement   which worker verifies which candidate (pure)
shard       a worker's share of a step: batched forward, staging, fused commit
collective  torch.distributed group join (bounded) and the fused broadcast
worker      the worker process: gRPC step stream over a ShardExecutor
distributed the master's Executor: one step message per worker per round
master      the async client API, queue, health
launcher    `lopa serve`: master + N workers on loopback
client      a small Python client
metrics     Prometheus metrics of both roles
"""
