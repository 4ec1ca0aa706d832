"""Markdown export of a stored chat (app/chat/history/export.py): the document, a folder as the target, and a
target that cannot be written."""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.app.chat.history.export import export_markdown, suggested_path
from specchat.app.chat.history.records import StoreError
from specchat.app.chat.history.store import ChatStore
from specchat.backend import paths


def test_export_markdown(store: ChatStore, tmp_path: Path) -> None:
    chat = store.create_chat("Fix my loop / please", "smollm2-135m")
    store.add_message(chat, "user", "Why does `for i in range(3)` stop at 2?")
    store.add_message(
        chat,
        "assistant",
        "Because range excludes the end.\n\n```python\nprint(list(range(3)))\n```\n",
        stats={"tokens": 42, "tokens_per_s": 31.25, "acceptance_rate": 0.6667, "per_position": [1, 2]},
    )
    store.add_message(chat, "assistant", "Half a rep", complete=False)

    out = export_markdown(store, chat, tmp_path / "chat.md")
    assert out == tmp_path / "chat.md"
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Fix my loop / please\n")
    assert "`smollm2-135m`" in text and "3 messages" in text
    assert "## You · " in text and "## Assistant · " in text
    assert "Why does `for i in range(3)` stop at 2?" in text
    assert "```python\nprint(list(range(3)))\n```" in text
    assert "*tokens: 42 · tokens_per_s: 31.2 · acceptance_rate: 0.667*" in text  # lists are left out
    assert "Half a rep\n\n*(reply interrupted: partial text)*" in text
    assert text.index("stop at 2?") < text.index("Because range") < text.index("Half a rep")

    into_folder = export_markdown(store, chat, tmp_path)
    assert into_folder == tmp_path / "Fix-my-loop-please.md"
    assert into_folder.read_text(encoding="utf-8") == text

    with pytest.raises(StoreError, match=r"could not export the chat to .*no-such-dir.*Choose a folder"):
        export_markdown(store, chat, tmp_path / "no-such-dir" / "x.md")


def test_a_failed_export_leaves_no_temporary_file(
    store: ChatStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat = store.create_chat("c", "p")
    store.add_message(chat, "user", "hi")
    folder = tmp_path / "out"
    folder.mkdir()

    def boom(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(StoreError, match=r"could not export the chat to .*c\.md: No space left on device\. Choose"):
        export_markdown(store, chat, folder / "c.md")
    assert list(folder.iterdir()) == []


def test_the_proposed_export_path_is_the_documents_folder_and_a_new_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("SPECCHAT_EXPORT_DIR", raising=False)
    monkeypatch.setattr(paths.platformdirs, "user_documents_dir", lambda: str(tmp_path / "Documents"))
    monkeypatch.setattr(paths.Path, "home", lambda: tmp_path / "home")
    assert paths.documents_dir() == tmp_path / "home"  # no documents folder: the home folder, never the cwd
    (tmp_path / "Documents").mkdir()
    assert paths.documents_dir() == tmp_path / "Documents"
    assert suggested_path("Fix: the /undo bug?") == tmp_path / "Documents" / "Fix-the-undo-bug.md"
    (tmp_path / "Documents" / "Fix-the-undo-bug.md").write_text("mine")
    assert suggested_path("Fix: the /undo bug?").name == "Fix-the-undo-bug-2.md"  # never replaces a file
    monkeypatch.setenv("SPECCHAT_EXPORT_DIR", str(tmp_path / "out"))
    assert paths.documents_dir() == tmp_path / "out"
