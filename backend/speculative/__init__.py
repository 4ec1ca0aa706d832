"""Speculative decoding, model-agnostic: ``drafters/`` (prompt lookup, draft model), ``verify.py`` (accept /
recover / bonus), ``sampling.py`` (logits to distributions, penalties), ``policy.py`` (γ from measured costs)
and ``stats.py`` (the one counter of acceptance, τ and S(γ) for a request). A leaf: never imports the engine.
"""
