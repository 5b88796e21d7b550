"""A model on the Hugging Face Hub: its ``config.json`` and its weights' bytes.

A name that is neither a path nor in the catalog, and reads as a Hub repo id (``org/name``),
is fetched here. Only ``config.json`` (kilobytes) and the safetensors headers (HTTP range
requests, through ``huggingface_hub.HfApi.get_safetensors_metadata``) are read, never a
weight. Everything goes through huggingface_hub and so follows its settings: its cache
(``HF_HOME``, ``HF_HUB_CACHE``), ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE=1`` (the
cache only) and its per-request timeouts (``HF_HUB_ETAG_TIMEOUT``,
``HF_HUB_DOWNLOAD_TIMEOUT``, seconds, 10 by default). What the headers say is kept beside
the cache (huggingface_hub's assets folder, by commit), so a repo read once plans offline.

Every failure is one line (ConfigError) that says what happened and how to pass a config
instead. Imports no torch.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvmem.errors import ConfigError, KvmemError, UnknownModelError
from kvmem.files import JSON_LIMIT, read_bounded
from kvmem.spec.layout import ModelSpec
from kvmem.spec.weights import CheckpointTensors, Tensor
from kvmem.units import format_bytes

CONFIG = "config.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")
# bits per element of the safetensors dtypes
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
# far above any checkpoint (DeepSeek-V3 is 0.7 TB): a header claiming more lies
_CHECKPOINT_LIMIT = 1 << 50
_ASSETS = "kvmem"


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub model repo id ``org/name`` (no URL, no ``..``)."""
    if len(name) > 96 or not _REPO_ID.match(name) or ".." in name or "--" in name:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_spec(repo_id: str, *, token: bool | None = None) -> ModelSpec:
    """The ModelSpec of the Hub repo ``repo_id``, with its checkpoint's tensor sizes when it
    has safetensors weights (else the planner estimates them from the config).

    ``token``: None sends ``HF_TOKEN`` as huggingface_hub does; False asks anonymously, as
    a server must for requests from others (public repos only)."""
    from kvmem.spec.config import spec_from_config

    if not is_repo_id(repo_id):
        raise UnknownModelError(f"unknown model {repo_id!r}: not a path, not in the catalog "
                                "and not a Hub repo id (org/name)")
    path = _fetch(repo_id, CONFIG, token)
    cfg = _read_config(repo_id, path)
    cfg.setdefault("_name_or_path", repo_id)
    spec = spec_from_config(cfg, name=repo_id)
    tensors = _checkpoint_tensors(repo_id, commit=path.parent.name, token=token)
    if tensors is None:
        return spec
    return replace(spec, extra={**spec.extra,
                                "checkpoint": CheckpointTensors(tensors, spec.weight_bits)})


def _pass_config(repo_id: str) -> str:
    return (f"pass its config instead: a local path to {repo_id.rsplit('/', 1)[-1]}/ "
            "(a directory holding config.json) or to a config.json")


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def _hub_error(repo_id: str, e: Exception) -> ConfigError:
    """One line for what huggingface_hub raised while reading ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    how = _pass_config(repo_id)
    if isinstance(e, GatedRepoError):
        return ConfigError(f"{repo_id} is a gated repo on the Hub: set HF_TOKEN to a token "
                           f"that has been granted access, or {how}")
    if isinstance(e, RepositoryNotFoundError):
        return ConfigError(f"no model repo {repo_id} on the Hub (a private one needs "
                           f"HF_TOKEN); {how}")
    if isinstance(e, (RevisionNotFoundError, RemoteEntryNotFoundError)):
        return ConfigError(f"{repo_id} on the Hub has no {CONFIG}; {how}")
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)) and _offline():
        return ConfigError(f"{repo_id} is not in the Hub cache and HF_HUB_OFFLINE is set; "
                           f"{how}")
    if isinstance(e, HfHubHTTPError) and e.response is not None:
        return ConfigError(f"the Hub answered {e.response.status_code} for {repo_id}; {how}")
    return ConfigError(f"reading {repo_id} from the Hub ({constants.ENDPOINT}) failed "
                       f"({_first_line(e)}); {how}")


@contextmanager
def _hub_calls(repo_id: str):
    """huggingface_hub calls without progress bars (a few KB), their errors as one line."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    quiet = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # the library's errors, and httpx's and the OS's beneath them
        raise _hub_error(repo_id, e) from None
    finally:
        if not quiet:
            enable_progress_bars()


def _fetch(repo_id: str, filename: str, token: bool | None) -> Path:
    """The cached path of ``filename`` of the repo: downloaded when the Hub has a newer one
    (refused before downloading when larger than a config can be), the cached copy when
    the Hub cannot be reached. One request without retries decides: a machine without
    network answers at once (or after ``HF_HUB_ETAG_TIMEOUT``), not after the library's
    backoff."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    with _hub_calls(repo_id):
        if _offline():
            return Path(hf_hub_download(repo_id, filename, local_files_only=True))
        try:
            size = get_hf_file_metadata(hf_hub_url(repo_id, filename), token=token,
                                        timeout=constants.HF_HUB_ETAG_TIMEOUT).size
        except HfHubHTTPError:
            raise
        except Exception as e:  # no answer: the cache, if it has the file
            try:
                return Path(hf_hub_download(repo_id, filename, local_files_only=True))
            except LocalEntryNotFoundError:
                raise ConfigError(f"cannot reach the Hub ({constants.ENDPOINT}) for {repo_id} "
                                  f"({_first_line(e)}) and it is not in the cache; "
                                  f"{_pass_config(repo_id)}") from None
        if size is not None and size > JSON_LIMIT:
            raise ConfigError(f"{repo_id}'s {filename} is {format_bytes(size)}, larger than "
                              f"a config can be; {_pass_config(repo_id)}")
        return Path(hf_hub_download(repo_id, filename, token=token))


def _read_config(repo_id: str, path: Path) -> dict[str, Any]:
    where = f"{repo_id}'s {CONFIG}"
    try:
        cfg = json.loads(read_bounded(path, where))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{where} is not valid JSON; {_pass_config(repo_id)}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where} is JSON but not an object (a {type(cfg).__name__}); "
                          f"{_pass_config(repo_id)}")
    return cfg


# ---------------------------------------------------------------- weights: safetensors headers

def _checkpoint_tensors(repo_id: str, commit: str,
                        token: bool | None) -> tuple[Tensor, ...] | None:
    """Every tensor of the repo's safetensors checkpoint at ``commit`` (None: it has none),
    from the assets cache, else from the headers on the Hub (then cached)."""
    from huggingface_hub import cached_assets_path

    try:
        cached = cached_assets_path(_ASSETS, namespace=repo_id, subfolder=commit) / "weights.json"
    except OSError:  # an unwritable cache: the headers are read every time
        cached = None
    if cached is not None and cached.is_file():
        try:
            listing = json.loads(read_bounded(cached, "cached weight listing"))["tensors"]
            return None if listing is None else tuple(
                Tensor(str(name), int(nbytes), int(ndim)) for name, nbytes, ndim in listing)
        except (KvmemError, ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is read again
    if _offline():
        return None  # the planner estimates the weights from the config
    tensors = _read_headers(repo_id, commit, token)
    if cached is not None:
        with suppress(OSError):  # kept for the next run only when the cache can be written
            cached.write_text(json.dumps({"tensors": tensors}))
    return tensors


def _read_headers(repo_id: str, commit: str, token: bool | None) -> tuple[Tensor, ...] | None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    with _hub_calls(repo_id):
        try:
            metadata = HfApi(token=token).get_safetensors_metadata(repo_id, revision=commit)
        except NotASafetensorsRepoError:
            return None
        except (SafetensorsParsingError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConfigError(f"{repo_id}: a safetensors header cannot be read "
                              f"({_first_line(e)}); {_pass_config(repo_id)}") from None
        tensors = []
        for filename, file_meta in metadata.files_metadata.items():
            for name, info in file_meta.tensors.items():
                tensors.append(_tensor(repo_id, filename, name, info.dtype, info.shape,
                                       info.data_offsets))
    total = sum(t.nbytes for t in tensors)
    if total > _CHECKPOINT_LIMIT:
        raise ConfigError(f"{repo_id}: its safetensors headers claim {format_bytes(total)} of "
                          f"weights, more than any checkpoint; {_pass_config(repo_id)}")
    return tuple(tensors)


def _tensor(repo_id: str, filename: str, name: str, dtype: Any, shape: Any,
            offsets: Any) -> Tensor:
    """One header entry, checked: a known dtype, a shape of sizes, and data offsets that
    span exactly the bytes the dtype and shape take."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{repo_id}: {filename}: tensor {name[:80]!r} {what}; "
                           f"{_pass_config(repo_id)}")

    bits = _DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        raise bad(f"has an unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, (list, tuple)) or len(shape) > 16 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad("has no valid shape")
    nbytes = -(-math.prod(shape) * bits // 8)
    if not (isinstance(offsets, (list, tuple)) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and offsets[1] - offsets[0] == nbytes):
        raise bad(f"has data offsets {str(offsets)[:60]} that do not span the {nbytes} bytes "
                  "its dtype and shape take")
    return Tensor(name, nbytes, len(shape))


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
