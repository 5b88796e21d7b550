"""Find a model's files: the embedded default, a checkpoint directory, or a GGUF file.

>>> files = resolve_model(None)          # the embedded SmolLM2-135M-Instruct
>>> files = resolve_model("/models/qwen3")  # config.json + *.safetensors + tokenizer.json
>>> files = resolve_model("model.gguf")  # converted once into the cache directory
>>> model.load_weights(files.weights())
"""

from __future__ import annotations

from kvmem.engine.loader.files import ModelFiles, ModelLoadError, open_checkpoint_dir

EMBEDDED_NAMES = ("smollm2", "embedded", "default")


def resolve_model(source: str | None, *, load_format: str = "auto") -> ModelFiles:
    """The model files for ``source``: None or an embedded name, a directory, or a .gguf file.

    ``load_format="dummy"``: a directory needs no weight files (random weights, see
    ``kvmem.engine.loader.dummy``).

    GGUF files (the embedded model is one) are dequantised and converted on first use
    into ``$KVMEM_CACHE_DIR`` (default ``~/.cache/kvmem``)/models/<name>-<digest>/.
    """
    from pathlib import Path

    from kvmem.engine.loader import gguf_convert

    if source is None or str(source).lower() in EMBEDDED_NAMES:
        gguf = gguf_convert.embedded_gguf()
        return open_checkpoint_dir(gguf_convert.cached_conversion(gguf), name=gguf.stem)
    path = Path(source).expanduser()
    if path.is_dir():
        return open_checkpoint_dir(path, need_weights=load_format != "dummy")
    if path.is_file() and path.suffix == ".gguf":
        return open_checkpoint_dir(gguf_convert.cached_conversion(path), name=path.stem)
    if path.is_file():
        raise ModelLoadError(f"{path}: not a model (give a checkpoint directory or a .gguf file)")
    raise ModelLoadError(f"model {source!r} not found (give a checkpoint directory, a .gguf "
                         f"file, or 'smollm2' for the embedded model)")


LOAD_FORMATS = ("auto", "dummy")

__all__ = ["EMBEDDED_NAMES", "LOAD_FORMATS", "ModelFiles", "ModelLoadError", "resolve_model"]
