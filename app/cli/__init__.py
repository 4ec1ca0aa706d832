"""The `specchat` command: ``main.py`` parses arguments and dispatches to one module per subcommand
(``generate.py``, ``bench.py``, ``models.py``; no subcommand opens the chat UI). ``wiring.py`` connects the UI
to the real backend (engine factory, pair info, library output to the log file).
"""
