"""The independent numerics oracle: Hugging Face ``transformers`` on the same weights.

fuel's own kernels are checked against ``LlamaForCausalLM`` built from the very tensors fuel
loads (:class:`~fuel.runtime.weights.Weights`) and the same ``config.json``, in float32 with
``attn_implementation="eager"``. Nothing is fetched: the model is constructed from a
``LlamaConfig`` and the tensors are loaded with ``load_state_dict``.

What always holds:

- The oracle's parameters are the loaded tensors' values in float32 (a bf16 ``Weights`` is
  widened, so the oracle is always the f32 reference).
- A tied model's ``lm_head`` is the embedding matrix (checked after loading).
- Every tensor the model has is loaded from the checkpoint, and every checkpoint tensor is used
  (else :class:`~fuel.runtime.weights.WeightsMismatch`).
- One oracle per weights folder and process (:func:`oracle_for`), since building one costs
  seconds.

``transformers`` is imported only here and only when an oracle is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fuel.runtime.weights import Weights, WeightsMismatch

if TYPE_CHECKING:
    import torch

__all__ = ["Oracle", "oracle_for"]

_ORACLES: dict[tuple[str, str], Oracle] = {}


class Oracle:
    """A transformers ``LlamaForCausalLM`` over fuel's weights, with the queries tests need."""

    def __init__(self, weights: Weights):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = {key: value for key, value in weights.config.items() if key not in ("torch_dtype", "dtype")}
        llama_config = LlamaConfig(**config)
        llama_config._attn_implementation = "eager"
        # Random init of 135M parameters is wasted work: build on the meta device, then adopt
        # the loaded tensors in place (assign=True).
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config)
        state = {name: tensor.to(torch.float32) for name, tensor in weights.tensors.items()}
        result = model.load_state_dict(state, strict=False, assign=True)
        missing = set(result.missing_keys)
        if weights.tied_embeddings:
            missing.discard("lm_head.weight")
        if missing or result.unexpected_keys:
            shapes = dict(model.state_dict().items())
            raise WeightsMismatch(
                str(weights.source.path),
                {name: tuple(shapes[name].shape) for name in missing},
                {name: tuple(weights.tensors[name].shape) for name in result.unexpected_keys},
                {},
            )
        if weights.tied_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # Buffers that are not in a checkpoint (rotary inverse frequencies) were made on the
        # meta device; rebuild the rotary module on the CPU.
        model.model.rotary_emb = LlamaRotaryEmbedding(config=llama_config)
        self.model = model.eval()
        self.config = weights.config
        # transformers renamed `past_key_values` to `cache` (argument and output) in 5.x.
        self._cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, ids: Sequence[int], cache: Any = None) -> tuple[torch.Tensor, Any]:
        """Logits ``[len(ids), vocab]`` of one forward pass continuing ``cache`` (None: a fresh
        sequence), and the cache after it."""
        import torch

        kwargs = {self._cache_name: cache} if cache is not None else {}
        out = self.model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=True, **kwargs)
        return out.logits[0], getattr(out, self._cache_name)

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """``[len(ids), vocab]`` float32 logits of one forward pass over ``ids`` (no cache):
        row ``i`` predicts token ``i + 1``."""
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
        return out.logits[0]

    def step_logits(self, prompt: Sequence[int], continuation: Sequence[int]) -> list[torch.Tensor]:
        """Logits as an incremental decoder sees them: the prefill's last row, then one row per
        token of ``continuation`` fed through the transformers KV cache (``len + 1`` rows, each
        ``[vocab]``)."""
        import torch

        rows: list[torch.Tensor] = []
        with torch.inference_mode():
            logits, cache = self._forward(prompt)
            rows.append(logits[-1])
            for token in continuation:
                logits, cache = self._forward([token], cache)
                rows.append(logits[-1])
        return rows

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, *, stop: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of ``prompt``: up to ``max_new_tokens`` ids, ending early after a
        token in ``stop`` (which is included)."""
        import torch

        produced: list[int] = []
        with torch.inference_mode():
            logits, cache = self._forward(prompt)
            while len(produced) < max_new_tokens:
                token = int(torch.argmax(logits[-1]))
                produced.append(token)
                if token in stop or len(produced) == max_new_tokens:
                    break
                logits, cache = self._forward([token], cache)
        return produced

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()


def oracle_for(weights: Weights) -> Oracle:
    """The process-wide oracle for these weights (keyed by the folder they were read from)."""
    key = (str(weights.source.folder), weights.dtype.value)
    if key not in _ORACLES:
        _ORACLES[key] = Oracle(weights)
    return _ORACLES[key]
