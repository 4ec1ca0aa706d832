"""The chat app starts whatever settings.json holds (issue 20 item 1): a bad file or field is one notification
naming the file and the field, the app runs on the defaults for what was bad; a settings save that fails
(read-only file, full disk) is said once, not at every change. Fails on the code before issue 20: a 5,000-digit
number, deep nesting or a list as the drafter raised in ``SpecchatApp.__init__`` (the app did not start), and a
read-only settings file was overwritten (root) or reported at every change."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from app_harness import make_app, notifications, ready

BAD_FILES = {
    "huge number": ('{"max_new_tokens": ' + "9" * 5000 + "}", "5000 digits"),
    "deep": ("[" * 50_000, "nested deeper than 32 levels"),
    "list as drafter": ('{"drafter": ["none"], "system_prompt": "kept"}', "'drafter'"),
    "infinity": ('{"temperature": Infinity}', "'temperature'"),
    "not UTF-8": (b'{"theme": "\xff"}', "not UTF-8"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
async def test_the_app_starts_on_a_bad_settings_file_with_one_notification(tmp_path, name: str) -> None:
    content, expected = BAD_FILES[name]
    path = tmp_path / "settings.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    app = make_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        found = [n for n in notifications(app) if "Settings file" in n]
        assert len(found) == 1 and str(path) in found[0] and expected in found[0], notifications(app)
        if name == "list as drafter":
            assert app.settings.system_prompt == "kept" and app.settings.drafters == {}


async def test_a_settings_save_that_fails_is_said_once(tmp_path) -> None:
    path = tmp_path / "settings.json"
    path.write_text("{}")
    os.chmod(path, 0o444)
    app = make_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        for temperature in (0.1, 0.2, 0.3):
            app.update_settings(replace(app.settings, temperature=temperature))
        await pilot.pause()
        found = [n for n in notifications(app) if "Settings not saved" in n]
        assert len(found) == 1 and "read-only (mode 0444)" in found[0], notifications(app)
        assert app.settings.temperature == 0.3 and path.read_text() == "{}"  # used now, file untouched
