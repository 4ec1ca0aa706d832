"""The help screen (F1 / ?): key bindings, commands, and what each statistic means."""

from __future__ import annotations

from rich.markdown import Markdown as RichMarkdown
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

HELP = """\
## Keys

| Key | Action |
|---|---|
| **Enter** | send the message |
| **↑** in the empty input | edit your last message and send it again (it replaces that message and its reply) |
| **Shift+Enter**, **Alt+Enter**, **Ctrl+J** | new line in the message (Ctrl+J works in every terminal) |
| **Esc** | stop the reply (the partial reply is kept); while a long prompt is read, after the current pass |
| **Ctrl+R** | regenerate the last reply (or answer the last message) |
| **Ctrl+N** | new chat |
| **F2** | choose the model pair |
| **F3** | settings (sampling, drafter, γ, system prompt) |
| **F4** | chat history: open, rename, delete, export |
| **Ctrl+T** | accepted-token view: colour the reply by where each token came from |
| **Ctrl+G** | details panel: per-position acceptance, expected vs measured speedup |
| **Ctrl+O** / **Ctrl+B** | copy the last reply / its last code block |
| **Tab**, **Shift+Tab** | move between the messages and the input |
| on a message | **c** copy it, **b** copy its code, **f** branch the chat from it (a new chat; the old one stays) |
| click a code block | copy it |
| **Ctrl+P** | command palette (every command, and the theme picker) |
| **F1**, **?** | this help |
| **Ctrl+Q** | quit |

## Commands (type them in the input)

- `/edit PATH [PATH...] [request]` — attach files to edit and say what to change (after the paths, on the
  next lines, or in your next message). The model answers with SEARCH/REPLACE blocks; each must match the
  file exactly once, or the edit is refused with the reason (a reply that is a whole file is accepted only if
  it keeps every definition you did not ask to remove). The change is shown as a diff; **Apply** writes the
  files, keeps a backup next to each, and shows `git diff` for a file git tracks. Quote a path with spaces:
  `/edit "my file.py" add type hints`.
- `/undo` — put back the files of the last applied edit, byte for byte, from their backups.
- `/file PATH [question]` — attach a file as read-only context to your (next) message.
- `/drop` — detach pending attachments. `/new` — new chat. `//text` sends `/text` literally.

## Statistics

- **tok/s** — tokens generated per second (live: over the last second; under a reply: the whole reply,
  prefill included).
- **acc** (acceptance rate) — drafted tokens the target model accepted ÷ tokens drafted.
- **τ** (mean accepted length) — tokens emitted per target forward pass (accepted drafts plus the one
  recovered or bonus token). Plain decoding is 1.0; higher is faster.
- **γ** — tokens drafted in the latest step (the policy adapts it unless fixed in the settings).
- **speculating / no draft this step / paused / plain decoding** — the latest step drafted γ tokens, the
  drafter found nothing to propose, the policy switched speculation off because it did not pay (or nothing
  was accepted), or no drafter is in use. Between replies the bar says what the last reply used.
- **Sparkline** — tokens/s over the last seconds of the reply.
- **Per-position acceptance** — how often draft position *i* is accepted when all earlier ones were.
- **Expected speedup** — the policy's formula with measured acceptance and timings;
  **spec ÷ plain steps** — tokens/s of speculating steps over plain steps in the same reply, shown once each
  kind has 8 steps (not the reply's speed-up: `specchat bench` measures that).
- **Accepted-token view colours** — green: accepted draft; yellow: recovered at a rejection;
  magenta: bonus token (all drafts accepted); plain: target token without speculation.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close")]

    def __init__(self) -> None:
        super().__init__(classes="dialog-screen")  # centred over the dimmed chat, as every dialog

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="help"):
            yield Label("specchat help  (Esc closes)", classes="dialog-title")
            with VerticalScroll(id="help-scroll"):
                # Rich's Markdown renders in one Static: far cheaper to open than a Markdown widget tree
                yield Static(RichMarkdown(HELP), id="help-text")
