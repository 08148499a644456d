"""Branch-parallel serving: a gRPC master driving the decoder over branch workers, by role.

master/     `lopa master`: the client API (gRPC + OpenAI HTTP), the request queue, health, and the
            master's Executor that spreads each round over the workers
worker/     `lopa worker`: joins the collective group and serves the master's step stream over a
            ShardExecutor (lopa.execution.shard)
shared/     what both roles read: the YAML config, the model directory, port binding, TLS,
            Prometheus metrics, the launcher's lifeline
launcher    `lopa serve`: a master + N workers as subprocesses on loopback
ports       the free ports `lopa serve` picks for them (LOPA_PORT_RANGE confines them)
client      a small Python client of the master
"""
