"""The master role (`lopa master`): the client API and the workers' side of each round.

server       the process: gRPC and health ports, the HTTP API, group wiring, drain (serve_master)
service      the gRPC client API (Generate, GenerateStream, model info)
http_api     the OpenAI-compatible HTTP API on the same event loop
openai_body  OpenAI request bodies -> GenerateRequest (pure)
requests     a client request -> validated job inputs (pure)
undecodable  requests whose bytes do not parse -> INVALID_ARGUMENT naming the field
jobs         gRPC jobs in, the shared Scheduler decides; chunks and outcomes back
streaming    committed deltas for GenerateStream (pure)
distributed  the master's Executor: one step message per worker per round
links        one step stream per worker, and the group state (attached or not)
"""
