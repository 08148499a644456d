"""The master role (`lopa master`): the client APIs and the workers' side of each round.

A request passes through, in order:

api/         the doors: gRPC (grpc_service) and OpenAI HTTP (openai_http, openai_body) translate
             their own messages into an admission Ask, and the pipeline's events back
admission    the only place a request is checked: Ask -> the scheduler's Request (types, ranges,
             limits, prompt, stop policy)
dispatch     Requests -> the shared Scheduler (lopa.scheduling); per request a Ticket of events
events       what decoding tells a client, whatever the transport (Progress, Finished)
failures     every way a request fails and each API's answer for it: one table (failure_of)
streaming    committed text deltas of a stream (pure; each round's cost grows with its new ids)
group/       the worker group: one step stream per worker (links), the master's executor over
             them (distributed)

errors       the failures met on the master's side of the scheduler (group unavailable, worker lost)
keys         the API keys (LOPA_API_KEY) both APIs ask for
served       the served model's facts (name, tokenizer, length, usable limits)
observer     the scheduler's hooks -> Prometheus
server       the process: builds the pipeline, serves its doors, drains on SIGTERM (serve_master)
"""
