"""The Textual UI and the `specchat` command line. Never imports torch directly: it talks to the engine API."""
