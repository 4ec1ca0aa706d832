"""The native model from Python: ``torch.classes.specchat.NativeModel`` (``csrc/model.h``) owned by a Python object,
filled by name, bound to the engine's paged KV cache, and run one pass at a time.

Contract:
- :class:`Architecture` is everything of a model's configuration the C++ pass needs (``backend/models/
  native_arch.py`` makes it from a transformers or light config). :class:`NativeModel(arch)` creates the C++
  object; weights go in with :meth:`NativeModel.set_weight` (``embed``, ``head``; none: the head is the
  embedding) and :meth:`NativeModel.set_layer_weight` (``q k v qkv o gate up gate_up down``), each a
  :func:`qweight` (the file's blocks, or float weights, as stored); vectors with :meth:`set_final_norm` and
  :meth:`set_layer_vector` (``attn_norm ffn_norm post_attn_norm post_ffn_norm q_norm k_norm q_bias k_bias
  v_bias``). :meth:`bind` attaches a ``PagedKVCache`` (float16, bfloat16 or float32 pools), makes the rotary
  tables for as many positions as it has slots, and checks the whole model (a clear error names what is missing).
- :meth:`forward(seq, ids, logits_to_keep, parents=None, taps=())` reserves ``len(ids)`` slots of ``seq`` (no
  commit), runs one pass and returns ``(logits [logits_to_keep, vocab] float32, [one [n, hidden] float32 tensor
  per tap])``. ``parents`` (a tree of drafts after the pending token ``ids[0]``, ``parents[i]`` draft i's
  parent among the drafts, -1 for the pending token) as ``runner.forward_paged`` defines it; a tap ``l`` is the
  residual stream after layer ``l`` for every row, ``layers`` the final norm's output (what the head reads).
- :meth:`forward_batch(parts, taps=())` runs the rows of several sequences (each a :class:`PassPart`, its rows as
  :meth:`forward` takes them) in one pass, so the weights are read once for all of them; it returns each
  part's ``(logits, taps)`` as :meth:`forward` would have, bit for bit.
- A row's logits (and taps) are bit for bit those a one-token pass gives it, whatever the pass around it: other
  rows of its sequence, or other sequences' rows.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from specchat.backend.kernels.native_types import GGML_TYPES as GGML_TYPES  # re-exported: its loader reads it here
from specchat.backend.kernels.rope import cos_sin_tables
from specchat.backend.kv.kv_cache import PagedKVCache, Sequence

TYPE_NAMES = {value: name for name, value in GGML_TYPES.items()}
_FLOAT_TYPES = {torch.float32: GGML_TYPES["F32"], torch.float16: GGML_TYPES["F16"], torch.bfloat16: GGML_TYPES["BF16"]}


@dataclass(frozen=True)
class Rotary:
    """One rotary table's frequencies: ``inv_freq`` [rot_dim / 2] float32 and the cos/sin scaling."""

    inv_freq: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class Architecture:
    """What the native pass needs of a configuration (``backend/models/loading/native_arch.py`` fills it)."""

    family: str  # transformers' model_type
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rot_dim: int  # values of a head that rotate (partial_rotary_factor)
    inter: int
    vocab: int
    layers: int
    eps: float
    act: str  # "silu" | "gelu_tanh"
    norm_add_one: bool  # gemma's RMSNorm multiplies by (1 + w)
    embed_scale: float  # gemma: √hidden (as float32), else 1
    attn_scale: float
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    windows: tuple[int | None, ...]  # per layer: sliding window in keys, None for full attention
    rope_of_layer: tuple[int, ...]  # per layer: index into rotaries
    rotaries: tuple[Rotary, ...]


def qweight(data: torch.Tensor, ggml_type: int, rows: int, cols: int) -> torch.ScriptObject:
    """A ``torch.classes.specchat.QWeight`` holding a copy of ``data`` (uint8 blocks, as stored)."""
    made: torch.ScriptObject = torch.classes.specchat.QWeight(
        data.contiguous().view(torch.uint8).reshape(-1), ggml_type, rows, cols
    )
    return made


def float_qweight(weight: torch.Tensor) -> torch.ScriptObject:
    """A float32 / float16 / bfloat16 matrix as a QWeight of its own type (the weights as stored, no rounding)."""
    if weight.dtype not in _FLOAT_TYPES:
        raise ValueError(f"a {weight.dtype} weight (float32, float16 or bfloat16 only)")
    return qweight(weight.detach().contiguous(), _FLOAT_TYPES[weight.dtype], weight.shape[0], weight.shape[1])


@dataclass(frozen=True)
class PassPart:
    """One sequence's rows in a batched pass: ``ids`` [n] long after ``seq``'s committed tokens and ``offset``
    more (written by an earlier piece of the same long pass, not committed), the logits of its last ``keep``,
    ``parents`` a tree of drafts as :meth:`NativeModel.forward` takes it."""

    seq: Sequence
    ids: torch.Tensor
    keep: int
    parents: list[int] | None = None
    offset: int = 0


class NativeModel:
    """See the module docstring."""

    def __init__(self, arch: Architecture) -> None:
        self.arch = arch
        self.obj = torch.classes.specchat.NativeModel()
        for name, value in (
            ("hidden", arch.hidden),
            ("heads", arch.heads),
            ("kv_heads", arch.kv_heads),
            ("head_dim", arch.head_dim),
            ("rot_dim", arch.rot_dim),
            ("inter", arch.inter),
            ("vocab", arch.vocab),
            ("eps", float(arch.eps)),
            ("embed_scale", float(arch.embed_scale)),
            ("attn_scale", float(arch.attn_scale)),
            ("attn_softcap", float(arch.attn_softcap)),
            ("final_softcap", float(arch.final_softcap)),
            ("norm_add_one", int(arch.norm_add_one)),
            ("act", arch.act),
        ):
            self.obj.set(name, value)
        for layer in range(arch.layers):
            self.obj.add_layer()
            window = arch.windows[layer]
            self.obj.set_layer(layer, "window", -1 if window is None else int(window))
            self.obj.set_layer(layer, "rope", int(arch.rope_of_layer[layer]))
        self.cache: PagedKVCache | None = None
        self.embed_weight: Any = None  # a QWeight (torch.classes.specchat)
        self.head_weight: Any = None  # a QWeight, or None: the head is the embedding
        self.final_norm: torch.Tensor | None = None  # [hidden] float32, as set

    def set_weight(self, name: str, weight: torch.ScriptObject) -> None:
        self.obj.set_weight(name, weight)
        if name == "embed":
            self.embed_weight = weight  # draft heads embed their tokens with it (:meth:`embed`)
        elif name == "head":
            self.head_weight = weight  # train-head starts a head's output layer from its rows (:meth:`output_rows`)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids`` [n] as the pass starts from them: [n, hidden] float32 (the stored rows,
        times √hidden for gemma)."""
        if self.embed_weight is None:
            raise RuntimeError("NativeModel.embed: the embedding was not set")
        rows: torch.Tensor = self.embed_weight.rows_of(ids.reshape(-1).to(torch.long))
        scale = float(self.arch.embed_scale)
        return rows if scale == 1.0 else rows * scale

    def set_layer_weight(self, layer: int, name: str, weight: torch.ScriptObject) -> None:
        self.obj.set_layer_weight(layer, name, weight)

    def set_final_norm(self, weight: torch.Tensor) -> None:
        self.final_norm = weight.float().reshape(-1).clone()
        self.obj.set_tensor("final_norm", self.final_norm)

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The output layer's rows of ``ids`` [n]: [n, hidden] float32, de-quantised from the stored blocks (the
        embedding's rows, unscaled, when the head is tied to it)."""
        weight = self.head_weight if self.head_weight is not None else self.embed_weight
        if weight is None:
            raise RuntimeError("NativeModel.output_rows: the output layer was not set")
        rows: torch.Tensor = weight.rows_of(ids.reshape(-1).to(torch.long))
        return rows

    def final_norm_scale(self) -> torch.Tensor | None:
        """What the final RMSNorm multiplies by, [hidden] float32 (1 + w where the architecture adds one)."""
        if self.final_norm is None:
            return None
        return self.final_norm + 1.0 if self.arch.norm_add_one else self.final_norm.clone()

    def set_layer_vector(self, layer: int, name: str, value: torch.Tensor) -> None:
        self.obj.set_layer_tensor(layer, name, value.float().reshape(-1))

    def check(self) -> None:
        """RuntimeError naming the first missing or misshapen weight (no cache needed)."""
        self.obj.check()

    def bind(self, cache: PagedKVCache) -> None:
        """Attach ``cache`` (its pools) and the rotary tables for its slots; check everything (see above)."""
        first = -1
        for rotary in self.arch.rotaries:
            cos, sin = cos_sin_tables(rotary.inv_freq, rotary.scaling, cache.num_slots)
            index = int(self.obj.add_rope(cos, sin))
            first = index if first < 0 else first
        for layer, rope in enumerate(self.arch.rope_of_layer):  # this cache's tables (a model bound again)
            self.obj.set_layer(layer, "rope", first + int(rope))
        self.obj.bind_cache(cache.k, cache.v)
        self.obj.finish()
        self.cache = cache

    def forward(
        self,
        seq: Sequence,
        ids: torch.Tensor,  # [n] long
        logits_to_keep: int,
        parents: list[int] | None = None,
        taps: Seq[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # ([logits_to_keep, vocab], [[n, hidden]] * len(taps))
        n = ids.numel()
        seq.reserve(n)
        plan = seq.plan(n)
        rows = None
        if parents is not None:
            rows = torch.tensor([-1, *(p + 1 for p in parents)], dtype=torch.long)
        run = plan.read_start is not None
        logits, tapped = self.obj.forward(
            ids,
            plan.start,
            plan.read_start if run else -1,
            None if run else plan.read_slots,
            rows,
            logits_to_keep,
            list(taps),
        )
        return logits, list(tapped)

    def forward_batch(self, parts: Seq[PassPart], taps: Seq[int] = ()) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Several sequences' rows in one pass (see the module docstring); each sequence at most once."""
        if len({id(part.seq) for part in parts}) != len(parts):
            raise ValueError("NativeModel.forward_batch: a sequence appears twice in one pass")
        layout, slots, trees, ids = [], [], [], []
        empty = torch.empty(0, dtype=torch.long)
        for part in parts:
            n = part.ids.numel()
            part.seq.reserve(part.offset + n)
            plan = part.seq.plan(n, part.offset)
            run = plan.read_start is not None
            layout.append((n, plan.start, plan.read_start if run else -1, part.keep))
            slots.append(empty if run else plan.read_slots)
            parents = part.parents
            trees.append(empty if parents is None else torch.tensor([-1, *(p + 1 for p in parents)], dtype=torch.long))
            ids.append(part.ids.reshape(-1))
        logits, tapped = self.obj.forward_batch(
            torch.cat(ids), torch.tensor(layout, dtype=torch.long), slots, trees, list(taps)
        )
        out: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        kept = rows = 0
        for n, _, _, keep in layout:
            out.append((logits[kept : kept + keep], [t[rows : rows + n] for t in tapped]))
            kept, rows = kept + keep, rows + n
        return out

    def profile(self) -> dict[str, float]:
        """Seconds spent in kernels, attention and elementwise steps since :meth:`reset_profile` (while
        ``profiling`` is on), with the passes and rows counted."""
        return dict(self.obj.profile())

    def set_profiling(self, on: bool) -> None:
        self.obj.set("profile", int(on))

    def reset_profile(self) -> None:
        self.obj.reset_profile()
