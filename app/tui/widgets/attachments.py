"""What the next message carries, shown as one line above the prompt: files attached for context (``/file``), files
the reply may edit (``/edit``) and, while the last message is being edited and resent (Up in the empty input), the
turn it replaces.

Contract: it owns that state and draws it after every change; hidden while there is nothing. Attaching checks each
file now and raises :class:`~specchat.backend.errors.SpecchatError` (nothing attached then); :meth:`reattach`
notifies each file that can no longer be attached and attaches the rest. :meth:`message_for` builds the user turn
and leaves the attachments as they are: the caller :meth:`clear` s them once the message is sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from textual.widgets import Static

from specchat.backend.errors import SpecchatError

if TYPE_CHECKING:
    from specchat.app.chat.conversation import Turn
    from specchat.app.chat.editing import EditTarget


class AttachedFile(NamedTuple):
    name: str  # as the chip and the message show it
    context: str  # the text the model reads
    path: str  # absolute, kept in the history so Up can attach it again


class Attachments(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.files: list[AttachedFile] = []
        self.edits: list[EditTarget] = []
        self.resend_from: int | None = None  # the turn an edited last message replaces
        self.display = False

    def attach_file(self, path: str) -> None:
        """``/file PATH``: its text goes into the next message as context."""
        from specchat.app.chat.editing import build_file_context

        self.files.append(AttachedFile(Path(path).name, build_file_context(path), str(Path(path).absolute())))
        self.refresh_chip()

    def attach_edits(self, paths: list[str]) -> None:
        """``/edit PATH...``: each file (checked now: readable text, writable) becomes a target of the next reply;
        a file already attached is not added twice."""
        from specchat.app.chat.editing import check_writable, load_edit_target

        targets = []
        for path in paths:
            target = load_edit_target(path)
            check_writable(target)
            targets.append(target)
        known = {t.path for t in self.edits}
        self.edits.extend(t for t in targets if t.path not in known)
        self.refresh_chip()

    def reattach(self, turn: Turn) -> None:
        """Attach the files of ``turn`` again (as they are on disk now) in place of what is attached; problems are
        notified."""
        from specchat.app.chat.editing import build_file_context, load_edit_target

        self.files, self.edits = [], []
        for path in turn.paths("files"):
            try:
                self.files.append(AttachedFile(Path(path).name, build_file_context(path), path))
            except SpecchatError as error:
                self.notify(str(error), title="/file", severity="warning", timeout=8)
        for path in turn.paths("edit"):
            try:
                self.edits.append(load_edit_target(path))
            except SpecchatError as error:
                self.notify(str(error), title="/edit", severity="warning", timeout=8)

    def resend(self, index: int) -> None:
        """The next message replaces turn ``index`` and everything after it."""
        self.resend_from = index
        self.refresh_chip()

    def take_resend(self) -> int | None:
        """The turn the message being sent replaces, if any; asked once (the chip says so until :meth:`clear`)."""
        index, self.resend_from = self.resend_from, None
        return index

    def cancel_resend(self) -> None:
        """The next message is a new one after all (the input was emptied)."""
        if self.resend_from is not None:
            self.resend_from = None
            self.refresh_chip()

    def clear(self) -> None:
        """Detach everything (``/drop``, a sent message, another chat)."""
        self.files, self.edits, self.resend_from = [], [], None
        self.refresh_chip()

    def message_for(self, request: str) -> tuple[str, dict[str, Any]]:
        """The user turn that sends ``request`` with what is attached: (what the model reads, the turn's meta).
        Raises :class:`~specchat.app.chat.editing.EditError` when the files to edit cannot go into one prompt."""
        from specchat.app.chat.editing import build_edit_prompt

        files, edits = self.files, self.edits
        parts = [file.context for file in files]
        meta: dict[str, Any] = {}
        if edits:
            parts.append(build_edit_prompt(edits, request))
            meta["edit"] = [str(t.path) for t in edits]
        else:
            parts.append(request)
        if files or edits:
            meta["request"] = request
            meta["attachments"] = [file.name for file in files] + [t.shown for t in edits]
            if files:
                meta["files"] = [file.path for file in files]
        return "\n\n".join(parts), meta

    def refresh_chip(self) -> None:
        parts = [f"📎 {file.name}" for file in self.files]
        for target in self.edits:
            parts.append(f"✎ editing {target.shown}")
        if self.edits:
            parts[-1] += ": describe the change"
        if self.resend_from is not None:
            parts.insert(0, "↺ editing your last message: Enter sends it in place of the old one and its reply")
        self.update("  ".join(parts) + ("   (/drop detaches)" if parts else ""))
        self.display = bool(parts)
