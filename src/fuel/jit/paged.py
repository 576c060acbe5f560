"""Recognizing the paged-attention decode region, so a synthesizer can use a structural template.

Decides whether a request's region *is* paged attention: it must be the registry's own
paged-attention recipe with its open slots (``softmax_scale``, ``block_size``, ``index_dtype``,
and the soft-cap pair when present) filled by concrete values. Recognition unifies the region
against the recipe template tree, so a region that differs anywhere (another mask, another
gather, a missing scale) is not recognized and is declined rather than approximated.

Invariants: pure and total (returns :class:`PagedRegion` or ``None``); the extracted values are
exactly the ones in the region, so the template kernel computes the same function.

Also here, shared by the numba and the native synthesizers: :func:`sdpa_prefill`, the prefill
body of the numba kernel for a prompt chunk (torch only), and :func:`prefill_attention`, the
native kernel's (fuel's native flash attention where it runs, else the same SDPA call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuel.graph.dtype import DType
from fuel.graph.recipe import Bind, PatternNode, PatternOp, Quot, Slot
from fuel.graph.registry import SPECS, FusedOps, PagedAttn


@dataclass(frozen=True, slots=True)
class PagedRegion:
    softmax_scale: float
    block_size: int
    index_dtype: DType
    softcap: float | None
    half_kv: bool = False
    """Whether the caches hold another (half) precision than the query, widened as read."""


def unify(template: Any, value: Any, slots: dict[str, Any]) -> bool:
    """Whether ``value`` is ``template`` with its slots filled (``slots`` receives them)."""
    if isinstance(template, Slot):
        if template.name in slots:
            return slots[template.name] == value
        slots[template.name] = value
        return True
    if isinstance(template, Bind):
        return isinstance(value, Bind) and value.index == template.index
    if isinstance(template, PatternOp):
        return (isinstance(value, PatternOp) and value.tag is template.tag
                and len(value.operands) == len(template.operands)
                and [k for k, _ in value.attrs] == [k for k, _ in template.attrs]
                and all(unify(t, v, slots) for (_, t), (_, v) in zip(template.attrs, value.attrs))
                and all(unify(t, v, slots) for t, v in zip(template.operands, value.operands)))
    if isinstance(template, Quot):
        return isinstance(value, Quot) and unify(template.a, value.a, slots) \
            and unify(template.b, value.b, slots)
    if isinstance(template, tuple):
        return isinstance(value, tuple) and len(value) == len(template) \
            and all(unify(t, v, slots) for t, v in zip(template, value))
    return type(template) is type(value) and template == value


def match_paged(region: PatternNode) -> PagedRegion | None:
    """The paged-attention parameters of ``region``, or ``None`` when it is not that region."""
    template_of = SPECS[FusedOps.PAGED_ATTN].template
    for softcap, kv_dtype in ((None, None), (1.0, None), (None, DType.BF16), (1.0, DType.BF16)):
        slots: dict[str, Any] = {}  # (the cast's target is a slot: any half kv_dtype unifies)
        if unify(template_of(PagedAttn(0.0, 1, softcap, kv_dtype)), region, slots):
            scale, block, index = (slots.get(k) for k in ("softmax_scale", "block_size",
                                                            "index_dtype"))
            if not isinstance(scale, float) or not isinstance(block, int) or block < 1 \
                    or not isinstance(index, DType):
                return None
            cap = slots.get("softcap")
            if softcap is not None and (not isinstance(cap, float) or cap <= 0
                                        or slots.get("softcap_recip") != 1.0 / cap):
                return None
            if kv_dtype is not None and not isinstance(slots.get("dtype"), DType):
                return None
            return PagedRegion(scale, block, index, cap if softcap is not None else None,
                               kv_dtype is not None)
    return None


PREFILL_MIN_ROWS = 2
"""Query rows per sequence from which a paged-attention kernel runs :func:`sdpa_prefill`;
below it, its decode loop."""


def sdpa_prefill(q, k_cache, v_cache, block_table, context_lens, scale: float, out_dtype):
    """Paged attention for a prompt chunk (a verify step too) as one torch
    ``scaled_dot_product_attention`` call on torch's pool: the sequences' cached rows gathered
    through the block table, query row ``i`` of a sequence with context ``c`` seeing positions
    ``<= c - q_len + i`` (``is_causal`` when the chunk is the whole context of one sequence, an
    explicit mask otherwise), GQA by the kernel's own head grouping. No soft cap (SDPA has
    none)."""
    import torch

    batch, _, q_len, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    contexts = context_lens.to(torch.int64)
    longest = min(int(contexts.max()), block_table.shape[1] * block_size)
    blocks = -(-longest // block_size)
    table = block_table[:, :blocks].to(torch.int64).reshape(-1)

    def gather(cache):
        rows = cache.index_select(0, table).reshape(batch, blocks * block_size, kv_heads, head_dim)
        return rows[:, :longest].transpose(1, 2).to(q.dtype)

    keys, values = gather(k_cache), gather(v_cache)
    if batch == 1 and int(contexts[0]) == q_len == longest:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        last = contexts[:, None] - q_len + torch.arange(q_len)[None, :]
        mask = torch.arange(longest)[None, None, :] <= last[:, :, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.to(out_dtype).contiguous()


def prefill_attention(q, k_cache, v_cache, block_table, context_lens, scale: float, out_dtype):
    """A prompt chunk's paged attention as the native synthesizer's kernel runs it (and the
    ``cpu-local`` probe times it): the native library's flash attention
    (``NativeKernels.prefill_attn``: each sequence's cache rows gathered and widened once, blocks
    of 64 keys, online softmax; 2-3x SDPA here over up to 256 positions, about even at 1,024)
    where the library loads and takes the operands, else :func:`sdpa_prefill`. The same
    semantics either way; no soft cap."""
    from fuel.kernels import native

    lib = native.load()
    if not isinstance(lib, native.Unavailable):
        out = lib.prefill_attn(q, k_cache, v_cache, block_table, context_lens, scale)
        if out is not None:
            return out if out.dtype == out_dtype else out.to(out_dtype)
    return sdpa_prefill(q, k_cache, v_cache, block_table, context_lens, scale, out_dtype)
