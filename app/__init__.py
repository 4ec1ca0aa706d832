"""The command line and the Textual UI (imported as ``specchat.app``; never imports torch directly).

``cli/`` (argument parsing, one module per subcommand: the composition root that builds engines) -> ``tui/``
(the Textual app, screens, widgets, the engine bridge) -> ``chat/`` (conversation, settings, editing, history)
-> the engine API (``specchat.backend.api``). Only ``cli/`` imports other backend modules; tui/ and chat/ get
what they need of them as callables (tui/seams.py). tests/app/test_layers.py checks these rules.
"""
