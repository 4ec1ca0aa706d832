"""`specchat bench`: ``runner.py`` (modes over prompts, interleaved), ``hf.py`` (transformers baselines),
``suites.py`` (prompt sets, ``data/``), ``stats.py`` (rows and aggregates), ``report.py`` (tables, JSON, PNG) and
``synthetic.py`` / ``synthetic_models.py`` (random-weight models with real shapes). Depends on the engine only.
"""
