"""The model pair picker: a modal table of the pairs of models.yaml.

Contract: dismissed with the chosen pair's name, or None. Columns: pair, drafter, target source, estimated
memory and whether it fits, download size, gated, sized to the terminal: pair, drafter, memory, fits and
download always show whole (an 80-column terminal included); target and gated only where they fit (the line
under the table names the target and says when a pair is gated). Sizes are binary units, as `specchat
models` prints them (1.11 GiB). The estimates come from the app's ``pair_info(pair) ->
dict`` callable, run in a thread worker (the real one imports torch), one pair at a time, filling the table in
as they arrive. Keys of that dict, all optional: ``memory_bytes`` (int), ``free_bytes`` (int), ``fits``
(bool | None), ``download_bytes`` (int: still to download; 0 = nothing), ``gated`` (bool), ``error`` (str),
``speed`` (str: the expected speed from the bench's measurements, or "not measured ..."), ``slower`` (str |
None: why the pair is expected to be slower than plain decoding here; its row's drafter then reads "slower"); a
remote pair's (a server runs it: no memory estimate) has ``remote`` True, ``reachable`` (bool) and
``model_listed`` (bool | None) instead, shown as "server" and "up" / "DOWN" / "404" (model not listed).
Choosing a pair that needs a download asks first, saying how much; one that does not fit asks too, and so does
a remote pair whose server did not answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from specchat.app.tui.messages import PairInfoReady
from specchat.app.tui.screens.dialogs import ConfirmScreen
from specchat.app.tui.seams import PairInfo
from specchat.backend.redact import terminal_safe

if TYPE_CHECKING:
    from specchat.backend.models.catalog.config import PairConfig

COLUMNS = ("pair", "drafter", "target", "memory", "fits", "download", "gated")
FIXED_WIDTHS = {"memory": 8, "fits": 4, "download": 8, "gated": 5}  # "33.2 GiB", "yes"/"NO", "gated"
CELL_PADDING = 2  # a DataTable cell's padding, both sides
DIALOG_CHROME = 6  # the dialog's border and padding


def human_bytes(n: int | float | None) -> str:
    """Binary units with 3 significant digits (512 B, 1.11 GiB): the units of `specchat models`."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def column_widths(width: int, names: list[str], drafters: list[str], targets: list[str]) -> dict[str, int]:
    """The columns shown in a table ``width`` cells wide and their widths (see the module docstring)."""
    widths = {"pair": min(max(map(len, names), default=4) + 2, 30), "drafter": max(map(len, [*drafters, "drafter"]))}
    widths |= {k: FIXED_WIDTHS[k] for k in ("memory", "fits", "download")}
    room = width - sum(w + CELL_PADDING for w in widths.values())
    if room >= FIXED_WIDTHS["gated"] + CELL_PADDING:
        widths["gated"] = FIXED_WIDTHS["gated"]
        room -= FIXED_WIDTHS["gated"] + CELL_PADDING
    if room >= 12 + CELL_PADDING:
        widths["target"] = min(max(map(len, targets), default=6), room - CELL_PADDING)
    return {name: widths[name] for name in COLUMNS if name in widths}


def drafter_label(pair: PairConfig, *, long: bool = False) -> str:
    if long and pair.drafter == "draft-model" and pair.draft is not None:
        return f"draft model {pair.draft.source}"
    return str(pair.drafter)


class PairPickerScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, pairs: Mapping[str, PairConfig], current: str | None, pair_info: PairInfo | None) -> None:
        super().__init__(classes="dialog-screen")
        self.pairs, self.current, self.pair_info = pairs, current, pair_info
        self.info: dict[str, dict[str, Any]] = {}
        self.download_confirmed = False  # the user said yes to the chosen pair's download here
        self.widths: dict[str, int] = {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="picker"):
            yield Label("Choose a model pair  (Enter loads it · Esc cancels)", classes="dialog-title")
            yield DataTable(id="pairs", cursor_type="row", zebra_stripes=True)
            yield Static("", id="pair-description")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        dialog_width = min(130, self.app.size.width)  # styles.tcss: #picker is the terminal's width, up to 130
        pairs = list(self.pairs.values())
        self.widths = column_widths(
            dialog_width - DIALOG_CHROME,
            list(self.pairs),
            [drafter_label(p) for p in pairs],
            [p.target.source for p in pairs],
        )
        for column, width in self.widths.items():  # fixed widths: the estimates arrive later and must fit
            table.add_column(column, key=column, width=width)
        for name, pair in self.pairs.items():
            marker = "● " if name == self.current else "  "
            cells = {
                "pair": Text(marker + name),
                "drafter": Text(drafter_label(pair)),
                "target": Text(pair.target.source),
            }
            table.add_row(*(cells.get(column, "…") for column in self.widths), key=name)
        if self.current is not None and self.current in self.pairs:
            table.move_cursor(row=list(self.pairs).index(self.current))
        table.focus()
        if self.pair_info is not None:
            self._estimate()

    @work(thread=True, exclusive=True, group="pair-info", exit_on_error=False)
    def _estimate(self) -> None:
        pair_info = self.pair_info
        if pair_info is None:
            return
        for name, pair in self.pairs.items():
            try:
                info = dict(pair_info(pair))
            except Exception as error:  # noqa: BLE001 - an estimate failure is shown in the table, not fatal
                info = {"error": str(error) or type(error).__name__}
            self.post_message(PairInfoReady(name, info))

    def on_pair_info_ready(self, message: PairInfoReady) -> None:
        self.info[message.pair_name] = info = message.info
        table = self.query_one(DataTable)
        fits = info.get("fits")
        cells: dict[str, str | Text] = {
            "memory": human_bytes(info.get("memory_bytes")) if "error" not in info else "?",
            "fits": "?" if fits is None else "yes" if fits else "NO",
            "download": human_bytes(info["download_bytes"]) if info.get("download_bytes") else "—",
            "gated": "gated" if info.get("gated") else "",
        }
        if info.get("remote"):
            cells["memory"] = "server"
            cells["fits"] = (
                "DOWN" if not info.get("reachable") else "404" if info.get("model_listed") is False else "up"
            )
        if info.get("slower") and "drafter" in self.widths:  # seen without moving the cursor to it
            width = self.widths["drafter"]
            cells["drafter"] = Text(f"{drafter_label(self.pairs[message.pair_name])[: width - 2]} ▼", style="yellow")
        for column, value in cells.items():
            if column in self.widths:
                table.update_cell(message.pair_name, column, value)
        self._describe(table.cursor_row)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._describe(event.cursor_row)

    def _describe(self, row: int) -> None:
        names = list(self.pairs)
        if not 0 <= row < len(names):
            return
        pair = self.pairs[names[row]]
        # models.yaml's text and the estimates' (a server's error) shown without terminal escapes
        info: dict[str, Any] = {
            k: terminal_safe(v) if isinstance(v, str) else v for k, v in self.info.get(names[row], {}).items()
        }
        # Text, not markup: descriptions come from models.yaml and may contain [brackets]
        text = Text.assemble(
            (names[row], "bold"),
            f" — {terminal_safe(pair.description)}\n",
            f"target {terminal_safe(pair.target.source)} · drafter {drafter_label(pair, long=True)} · γ {pair.gamma}",
        )
        if info.get("gated"):
            text.append(" · gated: accept its licence on the Hugging Face hub first", style="yellow")
        if info.get("remote"):
            state = "answers" if info.get("reachable") else "does not answer"
            text.append(
                f"\nruns on its server, which {state}" + (f": {info['error']}" if info.get("error") else ""),
                style="yellow" if info.get("error") else "",
            )
        elif info.get("error"):
            text.append(f"\nestimate unavailable: {info['error']}", style="yellow")
        elif info.get("free_bytes") is not None:
            text.append(
                f"\nneeds about {human_bytes(info.get('memory_bytes'))}, "
                f"{human_bytes(info['free_bytes'])} free on {info.get('device', 'the device')}"
            )
        if info.get("speed"):
            text.append(f"\nexpected speed: {info['speed']}")
        if info.get("slower"):
            text.append(f"\n▼ {info['slower']}", style="yellow")
        self.query_one("#pair-description", Static).update(text)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self._choose(str(event.row_key.value))

    @work(exclusive=True, group="choose")
    async def _choose(self, name: str) -> None:
        info = self.info.get(name, {})
        checks = []
        if info.get("download_bytes"):
            gated = (
                " It is gated: accept its licence on the Hugging Face hub and log in first."
                if info.get("gated")
                else ""
            )
            checks.append(
                (
                    "Download needed",
                    f"{name} needs a download of {human_bytes(info['download_bytes'])} "
                    f"from the Hugging Face hub.{gated} Download it now?",
                    "Download",
                )
            )
        if info.get("remote") and info.get("error"):
            checks.append(("Server problem", f"{name}: {info['error']}. Open it anyway?", "Open anyway"))
        if info.get("fits") is False:
            checks.append(
                (
                    "It may not fit",
                    f"{name} needs about {human_bytes(info.get('memory_bytes'))} but only "
                    f"{human_bytes(info.get('free_bytes'))} is free. Try anyway?",
                    "Load anyway",
                )
            )
        for title, body, yes in checks:
            if not await self.app.push_screen_wait(ConfirmScreen(title, body, yes=yes)):
                return
        self.download_confirmed = bool(info.get("download_bytes"))
        self.dismiss(name)
