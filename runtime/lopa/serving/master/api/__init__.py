"""The master's client APIs: thin adapters between a transport and the request pipeline.

Each translates its own vocabulary (protobuf fields, OpenAI body fields, their error shapes) into
admission's `Ask` and the pipeline's events back (lopa.serving.master.events).

grpc_service      the gRPC API (Generate, GenerateStream, GetModelInfo)
grpc_parsing      requests whose bytes do not parse: INVALID_ARGUMENT naming the field
grpc_keys         the API keys on the gRPC API (UNAUTHENTICATED without one)
openai_body       OpenAI request bodies -> Ask (pure)
openai_http       the OpenAI-compatible HTTP API (aiohttp, on the master's event loop)
openai_stream     its answers: choices, usage, LoPA stats, logprobs, server-sent events
openai_errors     its error answers in OpenAI's shape (a failure's row of failures.py)
openai_tokens     vLLM's /tokenize and /detokenize
api_keys          the API keys on the HTTP API (401 without one)
bounded_json      JSON bodies parsed at a bounded cost
http_site         the HTTP port, bounded: connections, their idle time, their errors
connection_guard  its connection slots: who holds one, who gives way to a new connection
"""
