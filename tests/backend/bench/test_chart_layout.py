"""The bench chart keeps every label whole (issue 36: a bar's label was cut off at the top of its panel): each
bar's "×/tok/s" label lies inside its axes, and the titles, tick labels and legend lie inside the saved image."""

from __future__ import annotations

from specchat.backend.bench.report import aggregate_with_overall, write_chart
from specchat.backend.bench.stats import Row, mark_equality


def _row(mode: str, prompt: str, family: str, wall: float) -> Row:
    ids = list(range(40))
    return Row(
        pair="p",
        family=family,
        category="c",
        prompt_id=prompt,
        mode=mode,
        order=0,
        prompt_tokens=10,
        token_ids=ids,
        wall_s=wall,
        ttft_s=0.1,
        finish_reason="length",
    )


def test_every_label_of_the_chart_is_drawn_whole(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    rows = []
    for family in ("qa", "rag", "a-family-with-a-rather-long-name"):
        for mode, wall in (("plain", 4.0), ("prompt-lookup", 1.0), ("suffix", 0.9), ("auto", 2.0), ("hf-plain", 5.0)):
            rows += [_row(mode, p, family, wall) for p in ("a", "b")]
    mark_equality(rows, greedy=True)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    write_chart(tmp_path / "speedup.png", aggregate_with_overall(rows))
    fig = figures[0]
    fig.canvas.draw()  # at the figure's own dpi (savefig drew at 120)
    renderer = fig.canvas.get_renderer()
    saved = fig.get_tightbbox(renderer)  # what bbox_inches="tight" keeps, in inches
    for ax in fig.axes:
        inside = ax.get_window_extent(renderer)
        for label in ax.texts:  # the tallest bar's label too (5.56×): under the top of its panel
            box = label.get_window_extent(renderer)
            assert box.y1 <= inside.y1 and box.y0 >= inside.y0, label.get_text()
        for text in [ax.title, *ax.get_xticklabels(), *ax.get_legend().get_texts()]:
            box = text.get_window_extent(renderer).transformed(fig.dpi_scale_trans.inverted())
            assert saved.x0 <= box.x0 and box.x1 <= saved.x1 and saved.y0 <= box.y0 and box.y1 <= saved.y1
        assert "\n" in ax.title.get_text()  # the long title wraps rather than running past the panel
