"""`specchat serve`: the local engine behind an OpenAI-compatible HTTP API, for editors, agents and specchat's own
remote pairs.

boundary.py (the one input boundary: a request body in, a checked request or a JSON error naming the field out),
owner.py (the engine's one owner: a bounded queue and a worker thread), wire.py (chunks and responses, with the
reply's speculation under vLLM's and llama-server's field names), routes.py (the Starlette routes: auth, body
limits, replies, /metrics), protocol.py (uvicorn's HTTP/1.1 connection with a service's guards: a connection
cap, timeouts, JSON refusals, half-closed clients), access.py (one log line per request), server.py (uvicorn).
It reaches the engine through ``specchat.backend.api.EngineAPI`` only; app/cli/serve.py builds the engine.
"""
