"""``size_class``: the one bucketing of problem sizes shared by the Judge's producer (the
profiler, which stores measurements) and its consumer (the cost provider, which looks them up).

Decided here: two problems share a measurement exactly when their size classes are equal.

- Most ops: ``e<E>`` where E = log2(elements), rounded to the nearest integer (so 3000 and
  4096 share ``e12``; 5793 is the boundary with ``e13``).
- Matmul-shaped ops (matmul, linear): ``mm:b<B>:m<M>:k<K>:n<N>`` — the same rounding per
  dimension, because a 1×4096×4096 GEMV and a 64×512×512 GEMM have equal element counts and
  nothing else in common.
- Attention: ``attn:b<B>:h<H>:q<Q>:k<K>:d<D>`` for batch, query heads, query rows, key rows and
  head dimension (decode's q=1 against 4096 keys is not prefill's 64 against 64).

Invariants: pure and total for non-negative sizes; 0 buckets as ``z`` (an empty problem is its
own class). Rounding is exact integer arithmetic, never floating-point log.
"""

from __future__ import annotations


def log2_bucket(value: int) -> str:
    """round(log2(value)) as text, exactly; ``z`` for 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"size must be a non-negative int, got {value!r}")
    if value == 0:
        return "z"
    floor = value.bit_length() - 1
    # value >= 2**floor * sqrt(2)  <=>  value**2 >= 2**(2*floor + 1): round up.
    return str(floor + 1 if value * value >= 1 << (2 * floor + 1) else floor)


def size_class_elements(elements: int) -> str:
    return f"e{log2_bucket(elements)}"


def size_class_matmul(*, batch: int, m: int, k: int, n: int) -> str:
    return f"mm:b{log2_bucket(batch)}:m{log2_bucket(m)}:k{log2_bucket(k)}:n{log2_bucket(n)}"


def size_class_attention(*, batch: int, heads: int, q_len: int, k_len: int, head_dim: int) -> str:
    return (
        f"attn:b{log2_bucket(batch)}:h{log2_bucket(heads)}:q{log2_bucket(q_len)}"
        f":k{log2_bucket(k_len)}:d{log2_bucket(head_dim)}"
    )


def size_class(
    *,
    elements: int | None = None,
    matmul: tuple[int, int, int, int] | None = None,
    attention: tuple[int, int, int, int, int] | None = None,
) -> str:
    """Exactly one of: ``elements``; ``matmul=(batch, m, k, n)``;
    ``attention=(batch, heads, q_len, k_len, head_dim)``."""
    given = [x is not None for x in (elements, matmul, attention)]
    if sum(given) != 1:
        raise ValueError("size_class takes exactly one of elements, matmul, attention")
    if elements is not None:
        return size_class_elements(elements)
    if matmul is not None:
        batch, m, k, n = matmul
        return size_class_matmul(batch=batch, m=m, k=k, n=n)
    assert attention is not None
    batch, heads, q_len, k_len, head_dim = attention
    return size_class_attention(
        batch=batch, heads=heads, q_len=q_len, k_len=k_len, head_dim=head_dim
    )
