"""The master's client APIs: thin adapters between a transport and the request pipeline.

Each translates its own vocabulary (protobuf fields, OpenAI body fields, their error shapes) into
admission's `Ask` and the pipeline's events back (lopa.serving.master.events).

grpc_service  the gRPC API (Generate, GenerateStream, GetModelInfo)
grpc_parsing  requests whose bytes do not parse: INVALID_ARGUMENT naming the field
openai_body   OpenAI request bodies -> Ask (pure)
openai_http   the OpenAI-compatible HTTP API (aiohttp, on the master's event loop)
"""
