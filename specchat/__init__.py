"""specchat: a terminal chat app with lossless speculative decoding.

The code lives in the repository's top-level ``app/`` (the Textual UI and CLI) and ``backend/`` (the
engine, which never imports Textual); they install as ``specchat.app`` and ``specchat.backend``.
"""

__version__ = "0.1.0"
