"""Issue 47, class 9: the `Bearer` scheme in any case; HTTP-level errors without the parser's ``bytearray(b'...')``
reprs and with a hint that fits (a bad chunk is not told to "send a GET or POST"); vLLM's ``num_spec_tokens`` is the
configured γ; a remote reply whose server reported no count shows "—" tokens, as the README promises."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fake_engine import FakeEngine, FakePair
from faulty_server import chunk, faulty_server, sse, stream
from raw_http import exchange
from serve_fixtures import running_server

from specchat.app.cli.main import main
from specchat.app.tui.widgets.stats_bar import reply_totals
from specchat.backend.api import RequestStats

GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


AUTH = [("Bearer k3y", 200), ("bearer k3y", 200), ("BEARER  k3y", 200), ("Basic k3y", 401), ("Bearerk3y", 401),
        ("bearer wrong", 401)]  # fmt: skip


@pytest.mark.parametrize(("header", "status"), AUTH)
def test_the_bearer_scheme_is_matched_in_any_case(header: str, status: int) -> None:
    with running_server(FakeEngine(FakePair("tiny")), api_key="k3y") as (_, url):
        assert httpx.get(url + "/models", headers={"Authorization": header}, timeout=10).status_code == status


BAD_HTTP = [
    (b"GET / HTTP/1.1\r\nHost: x\r\nbad header\r\n\r\n", "'Name: value'"),
    (b"GE T / HTTP/1.1\r\nHost: x\r\n\r\n", "request line such as"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "HEX-SIZE"),
    (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdefgh\r\n",
        "HEX-SIZE",
    ),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", "'Name: value'"),
    (b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n", "'Name: value'"),
    (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", "use http://, not https://"),
    (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", "request line such as"),
]


@pytest.mark.parametrize(("data", "hint"), BAD_HTTP)
def test_http_errors_show_text_not_reprs_and_a_fitting_hint(data: bytes, hint: str) -> None:
    with running_server(FakeEngine(FakePair("tiny"))) as (_, url):
        answer = exchange(int(url.split(":")[2].split("/")[0]), data)
    message = json.loads(answer.raw.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert "bytearray(" not in message and not re.search(r"(?<!\w)b'", message) and hint in message, message
    if "HEX-SIZE" in hint:
        assert "send a GET or POST" not in message


@pytest.mark.parametrize(
    ("configured", "extra", "expected"),
    [(5, {}, 5), (5, {"specchat": {"gamma": 3}}, 3), (5, {"specchat": {"gamma": "auto"}}, 31),
     (5, {"specchat": {"drafter": "none"}}, 0)],
)  # fmt: skip
def test_num_spec_tokens_is_the_configured_gamma(configured: int, extra: dict, expected: int) -> None:
    with running_server(FakeEngine(FakePair("tiny"), reply="a b c"), spec_tokens=configured) as (_, url):
        body = httpx.post(url + "/chat/completions", json={**GOOD, **extra}, timeout=10).json()
    assert body["metrics"]["speculative_decoding"]["num_spec_tokens"] == expected


def test_a_remote_reply_without_usage_shows_a_dash(tmp_path, capsys) -> None:
    assert reply_totals(RequestStats(tokens_counted=False), "eos").startswith("— tokens")
    assert reply_totals(RequestStats(), "eos").startswith("0 tokens")
    with faulty_server() as server:
        server.behaviour = stream(sse(chunk("hello "), chunk("there", finish="stop"), b"[DONE]"))
        models = tmp_path / "remote.yaml"
        models.write_text(
            f"pairs:\n  - name: far\n    target: {{server: 'http://127.0.0.1:{server.port}/v1', model: m}}\n",
            encoding="utf-8",
        )
        assert main(["generate", "--models", str(models), "--pair", "far", "--prompt", "hi"]) == 0
    out, err = capsys.readouterr()
    assert "hello there" in out
    assert "— tokens, — tok/s" in out + err and "0 tokens" not in out + err
