"""The `specchat` command and the app's composition root: ``main.py`` parses arguments and dispatches to one
module per subcommand (``chat.py``: no subcommand, the chat UI; ``generate.py``, ``bench.py``, ``models.py``).
``wiring.py`` connects the UI to the real backend (engine factory, pair info, library output to the log file).
The only layer that imports backend modules beyond its API (loading, memory, hub, engine).
"""
