"""The Textual UI: ``app.py`` (the app: pairs, loading, screens), ``bridge.py`` (the worker thread that runs a
reply and hands its events to the UI thread), ``messages.py``, ``styles.tcss``, ``screens/`` and ``widgets/``.
"""
