"""`specchat serve`: the local engine behind an OpenAI-compatible HTTP API, for editors, agents and specchat's own
remote pairs.

boundary.py (the one input boundary: a request body in, a checked request or a JSON error naming the field out),
owner.py (the engine's one owner: a bounded queue and a worker thread), wire.py (chunks and responses, with the
reply's speculation under vLLM's and llama-server's field names), server.py (the standard library's HTTP
server). It reaches the engine through ``specchat.backend.api.EngineAPI`` only; app/cli/serve.py builds the engine.
"""
