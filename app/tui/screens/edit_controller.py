"""The chat screen's ``/edit`` outcomes and ``/undo``: a non-visual widget that owns this session's applied edits.

Contract:
- ``/edit PATH [PATH...] [request]`` attaches files (the :class:`~specchat.app.tui.widgets.attachments.Attachments`
  hold them until the message is sent); the message asks for SEARCH/REPLACE blocks (``app/chat/editing.py``).
- When the reply ends, :meth:`EditController.offer` plans it (``app/chat/edit_plan.py``, nothing written): a
  refused plan becomes a note in the conversation and a notification, each saying why and that nothing was
  written. Otherwise the diff dialog shows every file — a symlink as ``link → real file``, flagged when the real
  file is outside the current folder — and notes (mixed line ends kept, a whole-file reply, code that no longer
  parses). Only Apply writes (``app/chat/edit_files.py``: backups, atomic writes); the note that follows shows
  ``git diff`` of each file git tracks. :meth:`EditController.undo` (``/undo``) puts back the last applied edit of
  this session, byte for byte, from its backups; earlier ones follow on the next ``/undo``.
- Notes go into the conversation it is given; they are shown in this session only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.widget import Widget

from specchat.app.tui.screens.dialogs import DiffScreen
from specchat.app.tui.widgets.edit_note import EditNote
from specchat.backend.errors import SpecchatError

if TYPE_CHECKING:
    from specchat.app.chat.conversation import Turn
    from specchat.app.chat.edit_files import AppliedEdit
    from specchat.app.chat.edit_plan import EditPlan
    from specchat.app.chat.editing import EditTarget
    from specchat.app.tui.widgets.conversation import ConversationView


def describe_target(target: EditTarget) -> str:
    """The file as the dialog names it: as typed, then ``→ real path`` for a symlink, flagged when the real
    file is outside the current folder."""
    if not target.link:
        return target.shown
    outside = "" if target.path.is_relative_to(Path.cwd()) else f" (outside the current folder {Path.cwd()})"
    return f"{target.shown} → {target.path}{outside}"


def plan_notes(plan: EditPlan) -> list[str]:
    notes = []
    for change in plan.changes:
        target, name = change.target, change.target.path.name
        if target.link:
            notes.append(f"{target.shown} is a symlink: the edit writes {target.path}.")
        if target.mixed_newlines:
            notes.append(
                f"{name} mixes CRLF and LF line ends: each line keeps its own, new lines get "
                f"{'CRLF' if target.newline == chr(13) + chr(10) else 'LF'}."
            )
        if change.how == "whole file":
            notes.append(
                f"The reply is a whole new {name} (not SEARCH/REPLACE blocks); it keeps every definition "
                "of the old one."
            )
        notes.extend(change.notes)
    return notes


def last_edit_turn(turns: Sequence[Turn]) -> Turn | None:
    """The last user turn, if it was an ``/edit`` request."""
    user = next((t for t in reversed(turns) if t.role == "user"), None)
    return user if user is not None and user.paths("edit") else None


class EditController(Widget):
    DEFAULT_CSS = "EditController { display: none; }"

    def __init__(self, conversation: ConversationView) -> None:
        super().__init__()
        self._conversation = conversation  # where the notes go
        self.applied: list[AppliedEdit] = []  # this session's applied edits, oldest first: /undo takes the last

    @work(exclusive=True, group="edit")
    async def offer(self, targets: list[EditTarget], reply_text: str, request: str = "") -> None:
        """Plan the reply against ``targets``, show the diff, and write the files if the user confirms."""
        from specchat.app.chat.edit_files import apply_plan, git_diff
        from specchat.app.chat.edit_plan import plan_edit, unified_diff

        plan = plan_edit(targets, reply_text, request)
        if not plan.ok:
            self._conversation.add_note(EditNote("refused", f"/edit refused: {plan.message()}"))
            self.notify(plan.message(), title="/edit refused", severity="warning", timeout=15)
            return
        sections = [(describe_target(c.target), unified_diff(c.target, c.text)) for c in plan.changes]
        if not await self.app.push_screen_wait(DiffScreen(sections, plan_notes(plan))):
            names = ", ".join(c.target.shown for c in plan.changes)
            self.notify(f"{names} left unchanged (Review edit in Ctrl+P shows it again).", title="/edit", timeout=5)
            return
        try:
            applied = apply_plan(plan)
        except SpecchatError as error:
            self._conversation.add_note(EditNote("refused", str(error)))
            self.notify(str(error), title="/edit", severity="error", timeout=12)
            return
        self.applied.append(applied)
        diffs = await asyncio.to_thread(lambda: [(f, git_diff(f.path)) for f in applied.files])
        shown = [(f"git diff {f.shown}", diff) for f, diff in diffs if diff]
        self._conversation.add_note(
            EditNote("applied", f"Applied to {applied.describe()} · /undo takes it back", shown)
        )
        self.notify(f"Wrote {', '.join(str(f.path) for f in applied.files)}.", title="Edit applied", timeout=6)

    def undo(self) -> None:
        """``/undo``: put back the files of the last applied edit from its backups."""
        from specchat.app.chat.edit_files import undo_edit

        if not self.applied:
            self.notify("Nothing to undo: no /edit was applied in this session.", title="/undo", timeout=5)
            return
        applied = self.applied[-1]
        try:
            restored = undo_edit(applied)
        except SpecchatError as error:
            self.notify(str(error), title="/undo", severity="error", timeout=12)
            return
        self.applied.pop()
        names = ", ".join(f"{f.shown} from {f.backup.name}" for f in applied.files)
        self._conversation.add_note(EditNote("undone", f"/undo restored {names}"))
        self.notify(f"Restored {len(restored)} file(s) as they were before the edit.", title="/undo", timeout=6)

    def last_request(self, turns: Sequence[Turn]) -> tuple[list[EditTarget], str] | None:
        """The files (reloaded from disk) and request of the last user turn, if it was an /edit request; a file
        that can no longer be loaded is notified (and None returned)."""
        from specchat.app.chat.editing import load_edit_target

        user = last_edit_turn(turns)
        if user is None:
            return None
        try:
            return [load_edit_target(path) for path in user.paths("edit")], user.request
        except SpecchatError as error:
            self.notify(str(error), title="/edit", severity="error", timeout=8)
            return None

    def review(self, turns: Sequence[Turn]) -> None:
        """Offer the last reply's edit again (it was cancelled, or the user wants to see it)."""
        found = self.last_request(turns)
        last = turns[-1] if turns else None
        if found is None or last is None or last.role != "assistant":
            self.notify("The last reply is not an answer to an /edit request.", severity="warning", timeout=5)
            return
        self.offer(found[0], last.content, found[1])
