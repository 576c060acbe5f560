"""Text ↔ token ids, and the chat template, for a model fuel runs.

Two sources. A GGUF stores its tokenizer as metadata (``tokenizer.ggml.model`` = ``gpt2`` for a
byte-level BPE: the token strings, the merges, per-token types, the special ids and
``tokenizer.chat_template``); :func:`tokenizer_from_gguf_metadata` rebuilds the equivalent
``tokenizers.Tokenizer``. A Hugging Face folder carries ``tokenizer.json`` (and the chat
template in ``tokenizer_config.json``); :func:`load_tokenizer` reads it as it is.

What is decided here:

- The pre-tokenizer follows ``tokenizer.ggml.pre``, the name llama.cpp's converter gives the
  original tokenizer's splitting rule. ``smollm`` (like ``starcoder``) splits every digit on its
  own, then applies the GPT-2 split; ``gpt2`` is the GPT-2 split alone; ``llama-bpe`` is Llama 3's
  split. A name not in :data:`PRE_TOKENIZER_SPLITS` is refused, never guessed: a wrong split
  silently changes every id.
- Control tokens (token type 3, e.g. ``<|im_start|>``) become special added tokens, matched whole
  and never split; user-defined ones (type 4) become plain added tokens.
- ``encode`` adds no BOS unless the model asks for one (``tokenizer.ggml.add_bos_token``);
  SmolLM2 does not.
- The chat template is rendered with jinja2 in a sandbox, the way transformers does
  (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``); a model without one has
  ``chat_template`` None and :meth:`Tokenizer.format_prompt` passes the text through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuel.errors import FuelError
from fuel.inputs import load_json, read_text
from fuel.runtime.gguf_loader import CorruptWeightsFile, WeightsFileMissing

if TYPE_CHECKING:
    import tokenizers

__all__ = [
    "ChatTemplateError",
    "PRE_TOKENIZER_SPLITS",
    "Tokenizer",
    "UnsupportedTokenizer",
    "load_tokenizer",
    "tokenizer_from_gguf_metadata",
]

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre → the regular expressions applied in order (each splits the pieces the
# previous one left), as llama.cpp's llama-vocab.cpp defines them. None = the GPT-2 split only.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (),
    "default": (),
    "smollm": (r"\p{N}",),
    "starcoder": (r"\p{N}",),
    "refact": (r"\p{N}",),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
}

_CONTROL, _USER_DEFINED = 3, 4


class UnsupportedTokenizer(FuelError):
    """A tokenizer description fuel cannot reproduce faithfully (``key`` names what)."""

    def __init__(self, source: str, key: str, detail: str):
        self.source = source
        self.key = key
        self.detail = detail
        super().__init__(f"{source}: key `{key}`: {detail}")


class ChatTemplateError(FuelError):
    """A chat template that is missing where one is required, or fails to render."""

    def __init__(self, source: str, detail: str):
        self.source = source
        self.detail = detail
        super().__init__(f"{source}: chat template: {detail}")


@dataclass(frozen=True, slots=True, eq=False)
class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: special ids and the chat template."""

    backend: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    source: str
    pad_token: str | None = None
    template_source: str | None = None
    """Where the chat template was read (``tokenizer_config.json``, key ``chat_template``, or
    ``chat_template.jinja``); errors rendering it name this. None: ``source``."""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        return self.token_id(self.pad_token)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) map to
        their ids. ``add_special_tokens`` adds a BOS only where the model asks for one."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        """An incremental decoder: feed ids one at a time, get text as soon as it is complete
        UTF-8 (a multi-byte character split across tokens is held back until whole)."""
        return TextStream(self, skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the model's template."""
        if self.chat_template is None:
            raise ChatTemplateError(self.source, "this model has no chat template")
        import jinja2

        try:
            template = _compiled_template(self.chat_template)
            return template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(self.template_source or self.source,
                                    f"{type(error).__name__}: {error}") from None

    def format_prompt(self, prompt: str) -> str:
        """A user prompt as the model expects it: through the chat template when there is one,
        unchanged otherwise."""
        if self.chat_template is None:
            return prompt
        return self.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)

    def save(self, folder: Path) -> None:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` with the special tokens and the
        chat template, as a Hugging Face folder has them."""
        self.backend.save(str(folder / "tokenizer.json"))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "chat_template": self.chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class TextStream:
    """Incremental detokenization for streaming output (see :meth:`Tokenizer.decode_stream`)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` completes (possibly empty)."""
        return self._stream.step(self._tokenizer.backend, token_id) or ""


@lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], *, source: str) -> Tokenizer:
    """Rebuild a GGUF's byte-level BPE tokenizer from its ``tokenizer.*`` metadata."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        raise UnsupportedTokenizer(source, "tokenizer.ggml.model", "the file carries no tokenizer")
    if kind != "gpt2":
        raise UnsupportedTokenizer(
            source, "tokenizer.ggml.model", f"{kind!r} is not supported (fuel reads byte-level BPE, `gpt2`)"
        )
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedTokenizer(
            source, "tokenizer.ggml.pre",
            f"pre-tokenizer {pre!r} is not mapped (known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})",
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in metadata:
            raise UnsupportedTokenizer(source, key, "required for a byte-level BPE tokenizer and missing")

    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise UnsupportedTokenizer(source, "tokenizer.chat_template",
                                   f"expected a string, got {type(template).__name__}")
    tokens = metadata["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UnsupportedTokenizer(source, "tokenizer.ggml.tokens", "expected a non-empty list of strings")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise UnsupportedTokenizer(source, "tokenizer.ggml.token_type",
                                   f"expected one type per token ({len(tokens)}), got "
                                   f"{len(types) if isinstance(types, list) else type(types).__name__}")
    raw_merges = metadata["tokenizer.ggml.merges"]
    if not isinstance(raw_merges, list) or not all(isinstance(m, str) for m in raw_merges):
        raise UnsupportedTokenizer(source, "tokenizer.ggml.merges", "expected a list of strings")
    merges = []
    for index, merge in enumerate(raw_merges):
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            raise UnsupportedTokenizer(source, "tokenizer.ggml.merges",
                                       f"merge {index} ({merge!r}) is not two tokens separated by one space")
        merges.append(pair)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token written with characters outside the byte alphabet is spelled out byte by byte, as
    # the byte-level model looks tokens up.
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    try:
        model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    except Exception as error:  # noqa: BLE001 — tokenizers raises a bare Exception for a bad BPE
        # e.g. "Token `zz` out of vocabulary": a merge naming a token the list lacks
        raise UnsupportedTokenizer(source, "tokenizer.ggml.merges",
                                   f"the BPE tokenizer does not build: {error}") from None
    backend = Backend(model)

    splits = PRE_TOKENIZER_SPLITS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if not splits:
        backend.pre_tokenizer = byte_level
    elif splits == (r"\p{N}",):
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()

    backend.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token, kind_ in zip(tokens, types) if kind_ == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(token, normalized=False, special=False) for token, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED]
    )

    def special(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if isinstance(index, bool) or not isinstance(index, int):
            raise UnsupportedTokenizer(source, f"tokenizer.ggml.{key}", f"is {index!r}, not a token id")
        if not 0 <= index < len(tokens):
            raise UnsupportedTokenizer(source, f"tokenizer.ggml.{key}", f"id {index} is outside the vocabulary")
        return tokens[index]

    bos = special("bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(
        backend=backend,
        bos_token=bos,
        eos_token=special("eos_token_id"),
        chat_template=template,
        source=source,
        pad_token=special("padding_token_id"),
    )


def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder (``tokenizer.json``), a GGUF file, or the folder
    :func:`fuel.runtime.weights.load_weights` read (``Weights.source.folder``)."""
    path = Path(source)
    if path.is_file():
        from fuel.runtime.gguf_loader import read_gguf

        return tokenizer_from_gguf_metadata(read_gguf(path).metadata, source=str(path))
    if not path.is_dir():
        raise WeightsFileMissing(str(path), "tokenizer source (GGUF file or model folder)")
    return _tokenizer_from_folder(path)


def _tokenizer_from_folder(folder: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise WeightsFileMissing(str(tokenizer_json), "tokenizer.json in the model folder")
    try:
        backend = Backend.from_file(str(tokenizer_json))
    except Exception as error:  # tokenizers raises a bare Exception on malformed JSON
        raise CorruptWeightsFile(str(tokenizer_json), f"not a readable tokenizer ({error})") from error
    config: dict[str, Any] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.exists():
        config = load_json(config_path, lambda detail: CorruptWeightsFile(str(config_path), detail))
        if not isinstance(config, dict):
            raise CorruptWeightsFile(str(config_path), "top level is not a JSON object")
    template = config.get("chat_template")
    template_file = folder / "chat_template.jinja"
    template_source = f"{config_path}: key `chat_template`"
    if template is None and template_file.exists():
        template = read_text(template_file, lambda detail: CorruptWeightsFile(str(template_file), detail))
        template_source = str(template_file)
    template = _chat_template(template, str(config_path))
    tokenizer = Tokenizer(
        backend=backend,
        bos_token=_token_text(config, "bos_token", str(config_path)),
        eos_token=_token_text(config, "eos_token", str(config_path)),
        chat_template=template,
        source=str(folder),
        pad_token=_token_text(config, "pad_token", str(config_path)),
        template_source=template_source,
    )
    if template is not None:
        try:
            _compiled_template(template)
        except Exception as error:  # jinja2.TemplateSyntaxError: the template itself is bad
            import jinja2

            if not isinstance(error, jinja2.TemplateError):
                raise
            raise ChatTemplateError(template_source, f"{type(error).__name__}: {error}") from None
    return tokenizer


def _chat_template(value: Any, file: str) -> str | None:
    """The template text: a string, or the ``default`` entry of a list of named templates."""
    if isinstance(value, list):
        # Several named templates: the default one is what generation uses.
        if not all(isinstance(entry, dict) for entry in value):
            raise CorruptWeightsFile(file, "key `chat_template`: a list of templates holds "
                                           "{\"name\", \"template\"} objects")
        value = next((entry.get("template") for entry in value if entry.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise CorruptWeightsFile(file, f"key `chat_template`: expected a string, got {type(value).__name__}")
    return value


def _token_text(config: Mapping[str, Any], key: str, file: str) -> str | None:
    """tokenizer_config.json writes a special token as a string or as ``{"content": ...}``."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise CorruptWeightsFile(file, f"key `{key}`: expected a token string, got {value!r}")
    return value
