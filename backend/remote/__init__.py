"""Remote pairs: a pair whose target is a server speaking the OpenAI chat completions API (vLLM, SGLang,
llama-server, `specchat serve`), used through the same :class:`~specchat.backend.api.EngineAPI` as the local engine.

client.py (:class:`RemoteEngine`: the streaming client, cancellation, errors; ``check_server``: the reachability
check), stats.py (each server's speculation statistics mapped into RequestStats fields; absent ones stay None).
"""
