"""/edit's two answers by file size: the whole changed file drafted from the file (a prediction) against
SEARCH/REPLACE blocks, to set ``app/chat/editing.py``'s ``REWRITE_MAX_BYTES`` from a timing (issue 35).

The file is the running Python's own ``tracemalloc.py`` (3.11.7 here: a real module, the same bytes on any
machine with that Python), cut at a line boundary to each ``--sizes`` KiB; the request renames ``_format_size``
(defined near the top, called 3 times in the first 2 KiB and more further on) to ``format_byte_size``. Both
prompts come from ``editing.build_edit_prompt`` (``REWRITE_MAX_BYTES`` set above or below the cut so each form
is asked for) and the whole form's prediction from ``editing.edit_prediction``: the user message and the
``GenerationRequest(prediction=...)`` /edit sends (reply_controller.py), greedy, the pair's own drafter for both
(the prediction drafts where it matches), the engine's state forgotten before each run. Each reply is checked
with ``edit_plan.plan_edit`` (what /edit does before it shows the diff): "applies" when it gives the file a
change, and "renamed" when that change is the rename and nothing else.

``--max-new-tokens`` caps the blocks' reply (default: /edit's, the chat's ``max_new_tokens`` default); the whole
file's cap is raised to what the file needs (its prediction's tokens + 256, within the context), and the table
says whether the reply stayed within /edit's cap (``fits cap``). Time is from the call to the last event
(prefill included). Sizes run in order, the two forms alternating first per size.

    python benchmarks/rewrite_size.py --sizes 2 4 8 12
"""

from __future__ import annotations

import argparse
import inspect
import re
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

from specchat.app.chat import editing
from specchat.app.chat.edit_plan import plan_edit
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.limits import CHAT_MAX_NEW_TOKENS
from specchat.backend.models.catalog.config import get_pair, load_pairs

PAIR = "smollm2-135m"
OLD, NEW = "_format_size", "format_byte_size"
REQUEST = f"Rename the function `{OLD}` to `{NEW}`, and every call of it."


def cut(text: str, size: int) -> str:
    """The longest run of ``text``'s first whole lines that is at most ``size`` bytes."""
    out, used = [], 0
    for line in text.splitlines(keepends=True):
        used += len(line.encode("utf-8"))
        if used > size:
            break
        out.append(line)
    return "".join(out)


def run(engine, target: editing.EditTarget, whole: bool, cap: int) -> dict:
    editing.REWRITE_MAX_BYTES = 1 << 30 if whole else 0  # the form /edit asks for (read at call time)
    prompt = editing.build_edit_prompt([target], REQUEST)
    prediction = editing.edit_prediction([target])
    messages = [{"role": "user", "content": prompt}]
    if whole:
        assert prediction is not None
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt_tokens = len(ids["input_ids"] if isinstance(ids, dict) else ids)
        need = len(engine.tokenizer.encode(prediction, add_special_tokens=False)) + 256
        cap = max(cap, min(need, engine.context_length - prompt_tokens - 80))
    request = GenerationRequest(
        messages=messages, sampling=SamplingParams(temperature=0.0, max_new_tokens=cap), prediction=prediction
    )
    engine.forget_requests()
    start = time.perf_counter()
    events = list(engine.generate(request))
    wall = time.perf_counter() - start
    reply, last = "".join(e.text for e in events), events[-1]
    plan = plan_edit([target], reply, REQUEST)
    new = plan.changes[0].text if plan.ok else ""
    renamed = plan.ok and new == re.sub(rf"\b{OLD}\b", NEW, target.text)
    return {
        "wall": wall,
        "stats": last.stats,
        "finish": last.finish_reason,
        "ok": plan.ok,
        "renamed": renamed,
        "why": "" if plan.ok else plan.message()[:100],
        "cap": cap,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2, 4, 8, 12], help="KiB")
    parser.add_argument("--max-new-tokens", type=int, default=CHAT_MAX_NEW_TOKENS)
    args = parser.parse_args()
    source = Path(inspect.getsourcefile(tracemalloc) or "").read_text(encoding="utf-8")
    engine = load_engine(get_pair(load_pairs(None), PAIR))
    print(f"torch threads {torch.get_num_threads()}; file {inspect.getsourcefile(tracemalloc)}; request: {REQUEST}")
    list(
        engine.generate(
            GenerationRequest(
                messages=[{"role": "user", "content": "Say hello."}],
                sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
            )
        )
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, kib in enumerate(args.sizes):
            path = Path(tmp) / "tracemalloc.py"
            text = cut(source, int(kib * 1024))
            path.write_text(text, encoding="utf-8")
            target = editing.load_edit_target(path)
            uses = len(re.findall(rf"\b{OLD}\b", text))
            for whole in (True, False) if index % 2 == 0 else (False, True):
                r = run(engine, target, whole, args.max_new_tokens)
                s = r["stats"]
                form = "whole" if whole else "blocks"
                pred = (
                    f"pred {s.accepted_prediction_tokens}/{s.rejected_prediction_tokens}"
                    if s.accepted_prediction_tokens is not None
                    else "pred -"
                )
                line = (
                    f"{kib:5.1f} KiB ({len(text.encode()):6d} B, {uses} uses) {form:6s} prompt {s.prompt_tokens:5d} "
                    f"reply {s.new_tokens:5d} (cap {r['cap']}, fits {s.new_tokens <= args.max_new_tokens}) "
                    f"{r['wall']:7.2f} s prefill {s.prefill_s or 0:5.2f} s {s.new_tokens / r['wall']:6.1f} tok/s "
                    f"{pred} passes {(s.steps or 0) + 1} finish {r['finish']} applies {r['ok']} "
                    f"renamed {r['renamed']} {r['why']}"
                )
                print(line, flush=True)
                rows.append(line)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
