"""A remote pair's secrets never reach what specchat shows (issue 47, class 2): a server that echoes the API key
("invalid key: Bearer sk-…") in an error, an error chunk, the reply itself, a page that is not an event stream,
or its model list gets it masked, as given or percent-encoded; so do the URL's password and query values."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from faulty_server import Conn, chunk, faulty_server, response, sse, stream
from serve_fixtures import remote_pair

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import RemoteError
from specchat.backend.models.catalog.config import RemoteSpec
from specchat.backend.redact import Secrets, terminal_safe
from specchat.backend.remote.client import RemoteEngine, check_server

KEY = "sk-test-0123456789abcdef"
PASSWORD = "pw-4242"
TOKEN = "tok-9999"


def _echo(status: int, template: str, kind: str = "application/json") -> object:
    """Answers ``template`` with {auth} replaced by the request's Authorization header, as some servers do."""

    def run(conn: Conn) -> None:
        head = conn.request.split(b"\r\n\r\n")[0].decode()
        auth = next(
            line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith("authorization")
        )
        conn.send(response(status, template.replace("{auth}", auth).encode(), {"Content-Type": kind}))

    return run


BEHAVIOURS = {
    "401 JSON echo": _echo(401, json.dumps({"error": {"message": "invalid key: {auth}"}})),
    "500 text echo": _echo(500, "boom for {auth} at http://u:" + PASSWORD + "@host?token=" + TOKEN, "text/plain"),
    "400 percent-encoded": _echo(400, json.dumps({"detail": "bad " + quote(KEY, safe="")})),
    "200 JSON not a stream": _echo(200, json.dumps({"note": "key {auth}"})),
    "200 text page": _echo(200, "hello {auth}", "text/plain"),
    "error chunk": lambda conn: stream(sse(chunk("a"), {"error": {"message": f"refused {KEY}"}}))(conn),
    "key in the reply": lambda conn: stream(sse(chunk(f"your key is {KEY} ok"), chunk("", finish="stop")))(conn),
    "key split by an escape": lambda conn: stream(sse(chunk(f"{KEY[:6]}\x1b[0m{KEY[6:]}"), chunk("", finish="stop")))(
        conn
    ),
    "key in the drafter": lambda conn: stream(
        sse(chunk("a", specchat={"stats": {"drafter": KEY}}), chunk("", finish="stop", specchat={"drafter": KEY}))
    )(conn),
}


@pytest.fixture(scope="module")
def faulty():
    with faulty_server() as server:
        yield server


def _clean(text: str) -> None:
    for secret in (KEY, PASSWORD, TOKEN, quote(KEY, safe=""), KEY[6:]):
        assert secret not in text, text


@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_an_echoed_secret_is_masked(faulty, tmp_path, monkeypatch, name) -> None:
    monkeypatch.setenv("TEST_REMOTE_KEY", KEY)
    faulty.behaviour = BEHAVIOURS[name]
    url = f"'http://u:{PASSWORD}@127.0.0.1:{faulty.port}/v1?token={TOKEN}'"
    engine = RemoteEngine(remote_pair(tmp_path, url, kind="vllm", api_key_env="TEST_REMOTE_KEY"))
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_new_tokens=8))
    shown: list[str] = []
    try:
        for event in engine.generate(request):
            shown += [event.text, event.message or "", event.drafter, *event.token_texts]
            if event.stats is not None:
                shown.append(str(event.stats.drafter))
    except RemoteError as error:
        shown.append(str(error))
    finally:
        engine.close()
    assert any("***" in text for text in shown), shown
    for text in shown:
        _clean(text)


def test_the_reachability_check_masks_an_echoed_key(faulty, monkeypatch) -> None:
    monkeypatch.setenv("TEST_REMOTE_KEY", KEY)
    faulty.behaviour = BEHAVIOURS["401 JSON echo"]
    spec = RemoteSpec(server=f"http://127.0.0.1:{faulty.port}/v1", model="m", api_key_env="TEST_REMOTE_KEY")
    error = check_server(spec, "p", timeout_s=2.0)["error"]
    assert error and "***" in error
    _clean(error)


def test_secrets_mask_the_longest_first_and_skip_short_values() -> None:
    secrets = Secrets(["abcd", "abcdefgh", "x", None, ""])
    assert secrets.mask("abcdefgh abcd x") == "*** *** x"
    assert terminal_safe("a\x1b]0;title\x07b\x1b[31mc\x9b2Jd\re\x00") == "abcde"
