"""The Textual UI: ``app.py`` (the app: pairs, loading, screens), ``seams.py`` (the typed callables it is built
with: engine factory, pair estimates), ``bridge.py`` (the worker thread that runs a reply and hands its events to
the UI thread), ``messages.py``, ``styles.tcss``, ``screens/`` and ``widgets/``. From the backend it imports only
``api``, ``errors``, ``paths`` and ``files``.
"""
