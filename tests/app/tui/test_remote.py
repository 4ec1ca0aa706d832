"""The chat UI on a remote pair (the real wiring: ``default_engine_factory`` builds a RemoteEngine) against a real
`specchat serve` on 127.0.0.1: a reply with the server's statistics in the live line and the history, Esc
mid-stream, a server that dies mid-reply (a clear error, the partial reply kept in history), and the picker's
reachability column."""

from __future__ import annotations

from app_harness import notifications, reply_done, send, wait_for
from engine_fixtures import tiny_engine
from serve_fixtures import SlowEngine, closed_port, remote_pair, running_server, server_process

from specchat.app.chat.history.store import ChatStore
from specchat.app.chat.settings import Settings, save_settings
from specchat.app.cli.wiring import default_engine_factory, default_pair_info
from specchat.app.tui.app import SpecchatApp
from specchat.app.tui.widgets.message_view import AssistantMessage


def _app(tmp_path, pairs, *, max_new_tokens: int = 16) -> SpecchatApp:
    save_settings(Settings(temperature=0.0, max_new_tokens=max_new_tokens), tmp_path / "settings.json")
    return SpecchatApp(
        pairs,
        engine_factory=default_engine_factory("cpu"),
        pair_info=default_pair_info("cpu"),
        store=ChatStore(tmp_path / "history.sqlite3"),
        settings_path=tmp_path / "settings.json",
        log_path=tmp_path / "specchat.log",
        initial_pair="remote",
    )


async def test_a_remote_reply_shows_the_servers_statistics_and_is_saved(tmp_path):
    with running_server(tiny_engine()) as (_, url):
        app = _app(tmp_path, {"remote": remote_pair(tmp_path, url)})
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, what="the remote engine")
            await send(pilot, "w7 w8 w9 w7 w8 w9")
            await wait_for(pilot, lambda: not app.chat.generating and app.chat.query(AssistantMessage), timeout=60)
            await reply_done(pilot)
            view = app.chat.query_one(AssistantMessage)
            assert view.text.strip() and "tok/s" in view.totals and "prompt-lookup" in view.totals
            stored = app.store.messages(app.chat.conv.chat_id)[-1]
            assert stored.complete and stored.stats["new_tokens"] == 16 and stored.stats["drafted"] is not None
            assert not [n for n in notifications(app) if "error" in n.lower()]


async def test_escape_stops_a_remote_reply_and_keeps_it(tmp_path):
    engine = tiny_engine()
    with running_server(SlowEngine(engine, step_s=0.15)) as (server, url):
        app = _app(tmp_path, {"remote": remote_pair(tmp_path, url)}, max_new_tokens=300)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, what="the remote engine")
            await send(pilot, "w7 w8 w9")
            await wait_for(
                pilot,
                lambda: app.chat.query(AssistantMessage) and app.chat.query_one(AssistantMessage).text.strip(),
                timeout=30,
                what="the first tokens",
            )
            await pilot.press("escape")
            await reply_done(pilot)
            stored = app.store.messages(app.chat.conv.chat_id)[-1]
            assert stored.stats["finish_reason"] == "cancelled" and stored.content.strip()
            assert stored.stats["new_tokens"] < 300
        await wait_for_idle(server)
    assert engine.blocks_in_use() == 0


async def wait_for_idle(server) -> None:
    import asyncio

    for _ in range(200):
        if not server.owner.running:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the server's engine kept running after the client left")


async def test_a_server_that_dies_mid_reply_is_a_clear_error_and_the_partial_reply_is_kept(tmp_path):
    with server_process(step_s=0.3) as (proc, url):
        app = _app(tmp_path, {"remote": remote_pair(tmp_path, url)}, max_new_tokens=200)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, what="the remote engine")
            await send(pilot, "w7 w8 w9")
            await wait_for(
                pilot,
                lambda: app.chat.query(AssistantMessage) and app.chat.query_one(AssistantMessage).text.strip(),
                timeout=30,
                what="the first tokens",
            )
            proc.kill()
            await reply_done(pilot)
            assert any(n.startswith("Reply failed") and "partial reply is kept" in n for n in notifications(app))
            stored = app.store.messages(app.chat.conv.chat_id)[-1]
            assert stored.stats["finish_reason"] == "error" and stored.content.strip() and not stored.complete


async def test_the_picker_shows_remote_pairs_up_or_down(tmp_path):
    from specchat.app.tui.screens.picker import PairPickerScreen

    with running_server(tiny_engine()) as (_, url):
        pairs = {
            "remote": remote_pair(tmp_path, url),
            "gone": remote_pair(tmp_path, f"http://127.0.0.1:{closed_port()}/v1", name="gone"),
        }
        app = _app(tmp_path, pairs)
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, what="the remote engine")
            screen = PairPickerScreen(pairs, "remote", default_pair_info("cpu"))
            app.push_screen(screen)
            await wait_for(pilot, lambda: len(screen.info) == 2, timeout=30, what="the reachability checks")
            assert screen.info["remote"]["reachable"] and not screen.info["gone"]["reachable"]
            from textual.widgets import DataTable

            table = screen.query_one(DataTable)
            assert str(table.get_cell("remote", "fits")) == "up" and str(table.get_cell("gone", "fits")) == "DOWN"
            assert str(table.get_cell("remote", "memory")) == "server"
