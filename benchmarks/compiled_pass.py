"""How fast the one-token pass of the int4 default runs when compiled ahead of time (AOTInductor), against the
compact forward (``backend/kernels/compact.py``) it would replace; not used by specchat itself (its figures:
``benchmarks/RESULTS.md``, "Time of one pass").

``--build`` exports the pass (the compact forward's operations for one token whose sequence's blocks are one
run, the 30 layers unrolled, the int4 kernels called inside) with ``torch.export`` and compiles it with
AOTInductor into ``--package`` (minutes on 2 cores, a C++ compiler needed); its RMSNorms stay the eager
kernel (:func:`rms_norm`). The weights and the KV cache are passed as inputs, not stored in the package; the
context length is a dynamic size. ``--run`` loads the package in a new process, counts the tokens (of 20) for
which its logits equal the compact forward's, and times it against the compact forward, interleaved, after a
prompt of ``--context`` random tokens:

    python benchmarks/compiled_pass.py --build [--package /tmp/specchat_pass.pt2]
    python benchmarks/compiled_pass.py --run [--package /tmp/specchat_pass.pt2] [--context 300] [--passes 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs

INT4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
PER_LAYER = 12  # tensors a layer passes in: 2 norms, 4 (packed, scales) pairs, its K and V pools


@torch.library.custom_op("specchat_probe::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` as an opaque op, so the compiled graph calls the eager kernel. Inductor's own RMSNorm
    rounds differently: with it, the logits equalled the compact forward's for 4-9 tokens of 10. With this, for
    more of them but not all (benchmarks/RESULTS.md): some other compiled operation still differs."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


class OneTokenPass(torch.nn.Module):
    """The compact forward's layers for one token; ``upto``'s length is the slot after the token (its K/V are
    written at ``len(upto) - 1``, and the keys from slot 0 up to it are attended)."""

    def __init__(self, forward) -> None:
        super().__init__()
        first = forward.layers[0]
        self.layers = len(forward.layers)
        self.hidden, self.eps = forward.hidden, first.eps1
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.q_width, self.kv_width, self.inter = first.q_width, first.kv_width, first.inter
        self.group, self.scaling = first.qkv.group_size, first.scaling

    def _layer(
        self,
        h,
        norm1,
        norm2,
        qkv_w,
        qkv_s,
        o_w,
        o_s,
        gu_w,
        gu_s,
        down_w,
        down_s,
        k_pool,
        v_pool,
        cos,
        signed_sin,
        end: int,
    ):
        n_q, n_kv, d = self.heads, self.kv_heads, self.head_dim
        x = rms_norm(h, norm1, self.eps)
        qkv = INT4(x.to(torch.bfloat16), qkv_w, self.group, qkv_s)
        qk = qkv[:, : self.q_width + self.kv_width].view(1, 1, n_q + n_kv, d).transpose(1, 2)
        v = qkv[:, self.q_width + self.kv_width :].view(1, 1, n_kv, d).transpose(1, 2)
        qk = qk * cos + qk.roll(d // 2, -1) * signed_sin
        q, k = qk[:, :n_q], qk[:, n_q:]
        k_pool[:, :, end - 1 : end].copy_(k)
        v_pool[:, :, end - 1 : end].copy_(v)
        keys, values = k_pool[0, :, :end].to(torch.float32), v_pool[0, :, :end].to(torch.float32)
        queries = q[0].transpose(0, 1).reshape(n_kv, n_q // n_kv, d)
        scores = torch.baddbmm(torch.zeros(1, 1, 1), queries, keys.transpose(1, 2), beta=0, alpha=self.scaling)
        attended = torch.bmm(torch.softmax(scores, dim=-1), values).reshape(1, self.q_width)
        h = h + INT4(attended.to(torch.bfloat16), o_w, self.group, o_s)
        x = rms_norm(h, norm2, self.eps)
        gate_up = INT4(x.to(torch.bfloat16), gu_w, self.group, gu_s)
        act = F.silu(gate_up[:, : self.inter].float()) * gate_up[:, self.inter :]
        return h + INT4(act.to(torch.bfloat16), down_w, self.group, down_s)

    def forward(self, h, cos, signed_sin, upto, *tensors):
        end = upto.shape[0]
        for i in range(self.layers):
            h = self._layer(h, *tensors[PER_LAYER * i : PER_LAYER * (i + 1)], cos, signed_sin, end)
        return h


def _setup(context: int):
    engine = load_engine(load_pairs()["smollm2-135m"])
    runner = engine.runner
    forward, cache = getattr(runner.forward_path, "fast", None), runner.cache
    if forward is None or any(layer.qkv is None or layer.gate_up is None or layer.window for layer in forward.layers):
        raise SystemExit(f"the default does not run the joined compact forward here ({runner.path})")
    tensors = []
    for i, layer in enumerate(forward.layers):
        tensors += [
            layer.norm1,
            layer.norm2,
            layer.qkv.packed,
            layer.qkv.scales_zeros,
            layer.o.packed,
            layer.o.scales_zeros,
            layer.gate_up.packed,
            layer.gate_up.scales_zeros,
            layer.down.packed,
            layer.down.scales_zeros,
            cache.k_layers[i],
            cache.v_layers[i],
        ]
    ids = torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = cache.new_sequence()
    runner.forward(seq, ids)
    seq.commit(context)
    seq.reserve(64)
    base = seq.block_table[0] * cache.block_size
    if seq.plan(1).read_start != base:
        raise SystemExit("the sequence's blocks are not one run; nothing to measure")

    def inputs(position: int, token: int | None = None):  # the token at ``position``, prepared as the compact
        h = forward.embed(torch.tensor([ids[5] if token is None else token])).float()  # forward prepares it
        cos, sin = forward.rotary(h[None], torch.tensor([[position]]))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = sin.shape[-1] // 2
        upto = torch.empty(base + position + 1, dtype=torch.uint8)
        return h, cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1), upto

    def head(h):
        return forward.run_head(F.rms_norm(h, (forward.hidden,), forward.final_norm, forward.final_eps)).float()

    return runner, seq, ids, OneTokenPass(forward), tensors, inputs, head


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--build", action="store_true")
    mode.add_argument("--run", action="store_true")
    parser.add_argument("--package", default="/tmp/specchat_pass.pt2")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--passes", type=int, default=60)
    args = parser.parse_args()
    runner, seq, ids, module, tensors, inputs, head = _setup(args.context)
    with torch.inference_mode():
        if args.build:
            start = time.perf_counter()
            length = torch.export.Dim("length", min=2, max=runner.cache.k_layers[0].shape[2] - 1)
            program = torch.export.export(
                module,
                (*inputs(args.context), *tensors),
                dynamic_shapes=({}, {}, {}, {0: length}, tuple([None] * len(tensors))),
            )
            exported = time.perf_counter()
            torch._inductor.aoti_compile_and_package(program, package_path=args.package)
            print(
                f"exported in {exported - start:.1f} s, compiled in {time.perf_counter() - exported:.1f} s: "
                f"{args.package}"
            )
            return 0
        start = time.perf_counter()
        compiled = torch._inductor.aoti_load_package(args.package)
        print(f"loaded in {time.perf_counter() - start:.1f} s")
        position, equal, largest = args.context, 0, 0.0
        probes = range(7, 49000, 2450)  # 20 tokens: agreeing on one, or on 10, said little
        for token in probes:
            compiled_logits = head(compiled(*inputs(position, token), *tensors))
            compact_logits = runner.forward(seq, [token]).logits
            equal += torch.equal(compiled_logits, compact_logits)
            largest = max(largest, (compiled_logits - compact_logits).abs().max().item())
        print(
            f"logits equal to the compact forward's for {equal} of {len(probes)} tokens (largest difference "
            f"{largest:.3g})"
        )
        times: dict[str, list[float]] = {"compiled": [], "compact": []}
        for _ in range(args.passes):  # both at the same position over the same keys
            start = time.perf_counter()
            head(compiled(*inputs(position), *tensors))
            times["compiled"].append(time.perf_counter() - start)
            start = time.perf_counter()
            runner.forward(seq, [ids[5]])
            times["compact"].append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(times["compiled"], times["compact"]))
    compiled_ms = statistics.median(times["compiled"]) * 1e3
    compact_ms = statistics.median(times["compact"]) * 1e3
    print(
        f"one-token pass at {args.context} tokens of context: compiled {compiled_ms:.1f}"
        f" ms, compact forward {compact_ms:.1f} ms (median); paired ratio {ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
