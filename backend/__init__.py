"""The in-process inference backend (imported as ``specchat.backend``; never imports Textual).

Folders, each owning one concern; dependencies point one way (bench -> engine -> speculative, kv, kernels, models):

- ``api.py``: what a request asks for and what each decoding step reports (no torch): the seam every
  consumer and any other engine implementation shares; ``limits.py``: every limit and default, and their checks;
- ``engine/``: the engine (lock, conversations), one request's prefill / propose / verify / commit loop, the
  model runner, prompt rendering and detokenisation;
- ``kv/``: the paged KV cache (block bookkeeping, storage) and the attention that reads it;
- ``speculative/``: speculation: drafters, verification, sampling, the γ policy and the request statistics;
- ``models/``: models.yaml, loading (hub, GGUF conversion), memory estimates, library output capture;
- ``kernels/``: device-specific fast paths (CUDA graphs, packed CPU linears);
- ``bench/``: `specchat bench` (runner, transformers baseline, suites, report, synthetic models);
- ``errors.py`` (user-facing exceptions) and ``paths.py`` (where files live) are shared leaves.
"""
