"""`specchat models` with many pairs (issue 47, class 5): it took 15 s for 10 pairs and did not finish 1,000 in
120 s, reading each pair's model file again and importing torch to estimate for the CPU. Now a file named by many
pairs is read once and the CPU estimate imports no torch (the figures: benchmarks/RESULTS.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from specchat.app.cli.main import main
from specchat.backend.models.facts import model_facts, spec_facts


def _many(tmp_path, n: int):
    models = tmp_path / "many.yaml"
    pair = "  - name: p{i}\n    description: pair {i}\n    target: {{source: packaged:smollm2-135m-instruct}}\n"
    models.write_text("pairs:\n" + "".join(pair.format(i=i) for i in range(n)), encoding="utf-8")
    return models


def test_a_file_named_by_many_pairs_is_read_once(tmp_path, capsys, monkeypatch) -> None:
    reads = []
    real = model_facts.facts_from_gguf
    monkeypatch.setattr(spec_facts, "facts_from_gguf", lambda path: reads.append(path) or real(path))
    monkeypatch.setattr(spec_facts, "_READ", {})
    assert main(["models", "--models", str(_many(tmp_path, 200)), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("not measured (specchat bench --pair p") == 200
    assert len(reads) == 1, reads


def test_1000_pairs_list_without_torch_in_seconds(tmp_path) -> None:
    models = _many(tmp_path, 1000)
    code = textwrap.dedent(
        f"""
        import sys, time
        from specchat.app.cli.main import main
        start = time.perf_counter()
        assert main(["models", "--models", {str(models)!r}, "--device", "cpu"]) == 0
        print("took", time.perf_counter() - start, file=sys.stderr)
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "p999" in done.stdout
    assert time.monotonic() - start < 20  # ~1.5 s on the 2-core test machine when quiet; generous when shared
