"""The conversation's edit-and-resend, branches and each chat's own pair (app/chat/conversation.py), on a real
history store."""

from __future__ import annotations

from specchat.app.chat.conversation import Conversation
from specchat.app.chat.history.store import ChatStore
from specchat.backend.api import RequestStats


def exchange(conv: Conversation, text: str, pair: str) -> None:
    conv.add_user(text, pair)
    turn, saver = conv.start_reply()
    saver.append(f"re: {text}")  # as the UI does while the reply streams
    conv.finish_reply(
        turn, saver, f"re: {text}", RequestStats(new_tokens=3), finish_reason="eos", pair=pair, complete=True
    )


def test_truncate_drops_a_message_and_everything_after_it_in_the_store_too(store: ChatStore) -> None:
    conv = Conversation(store, lambda message: None)
    exchange(conv, "one", "p")
    exchange(conv, "two", "p")
    conv.truncate(2)
    assert [t.content for t in conv.turns] == ["one", "re: one"]
    assert [m.content for m in store.messages(conv.chat_id)] == ["one", "re: one"]
    assert store.delete_messages_from(conv.chat_id, 10_000) == 0


def test_a_branch_copies_the_first_turns_into_a_new_chat_and_leaves_the_old_one(store: ChatStore) -> None:
    conv = Conversation(store, lambda message: None)
    exchange(conv, "one", "p")
    exchange(conv, "two", "p")
    old = conv.chat_id
    conv.branch(2, "p")
    assert conv.chat_id != old and conv.title == "one (branch)"
    assert [m.content for m in store.messages(conv.chat_id)] == ["one", "re: one"]
    assert store.messages(conv.chat_id)[1].stats["pair"] == "p"  # the reply's statistics come along
    assert len(store.messages(old)) == 4
    conv.branch(0, "p")  # from the very first message: an empty new chat, created with its first message
    assert conv.chat_id is None and conv.turns == []


def test_the_chat_pair_is_the_pairs_that_wrote_its_replies(store: ChatStore) -> None:
    conv = Conversation(store, lambda message: None)
    exchange(conv, "one", "small")
    assert store.chat(conv.chat_id).pair == "small"
    exchange(conv, "two", "big")
    assert store.chat(conv.chat_id).pair == "small, big"


def test_an_error_is_kept_with_the_reply(store: ChatStore) -> None:
    conv = Conversation(store, lambda message: None)
    conv.add_user("hi", "p")
    turn, saver = conv.start_reply()
    conv.finish_reply(
        turn,
        saver,
        "",
        RequestStats(),
        finish_reason="error",
        pair="p",
        complete=False,
        error="the model ran out of memory",
    )
    assert store.messages(conv.chat_id)[-1].stats["error"] == "the model ran out of memory"
