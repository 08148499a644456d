"""What the master and the worker roles both use.

config        the one YAML config file both roles read (docs/lopa.yaml)
model_dir     the model directory a role loads, the config completed from it, the KV length it allows
listen        binding a gRPC port exclusively, errors naming the config key
tls           optional TLS of the client API (server and channel credentials)
metrics       Prometheus metrics of both roles, each in its own registry
parent_watch  children of `lopa serve` die with it (the lifeline pipe)
device_choice model.device and workers.backend as a process runs them (`auto` resolved)
group_link    the master-worker link's security: the group secret and mutual TLS
log_limits    a repeated error logged once per interval, not a flood
vllm_metrics  the model-server protocol's metrics under vLLM's names
"""
