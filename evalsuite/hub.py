"""A model named by a directory or by a Hugging Face Hub id (`org/name`) -> the local directory holding it.

Everything downstream (preflight's checks, the safetensors store, the checkpoint-reading loader) reads files
from a directory, so a Hub id is resolved once, by huggingface_hub itself: from the local cache when
HF_HUB_OFFLINE=1 (as `make` sets it), downloaded into that cache otherwise. Only the files a safetensors
checkpoint needs are fetched (no .bin, .gguf or other weight formats).
"""
from __future__ import annotations

import os

# weight formats evalsuite never reads; everything else (configs, tokenizer, safetensors) is fetched
IGNORED = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.tflite", "*.mlmodel"]


def is_hub_id(spec: str) -> bool:
    """`org/name` as the Hub spells repository ids (and nothing on disk by that name)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.exists(spec) or spec.count("/") != 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def local_model(spec: str, revision: str | None = None, flag: str = "--model DIR") -> str:
    """`spec` itself when it is a directory, else the cached (or, online, downloaded) snapshot of the Hub
    model `spec`. A name that is neither gets one line naming what to do (`flag`: how the user passes a model
    in the interface they are in, `--model DIR` or `pretrained=DIR`)."""
    if os.path.isdir(spec):
        return spec
    if not is_hub_id(spec):
        raise FileNotFoundError(f"no model directory {spec!r}: pass {flag} or a Hugging Face Hub id org/name, "
                                "or train the shipped ones with `make tiny-models`")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return snapshot_download(spec, revision=revision, ignore_patterns=IGNORED)
    except IncompleteSnapshotError as exc:  # its own message names the missing files and the remedy
        raise FileNotFoundError(str(exc).strip().splitlines()[0]) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{spec!r} is neither a model directory nor in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1: download it once with network access "
                f"(`hf download {spec}`, or run with HF_HUB_OFFLINE=0), or pass {flag}") from None
        raise FileNotFoundError(f"{spec!r} is not in the local Hugging Face cache and the Hub cannot be reached: "
                                f"connect and try again, or pass {flag}") from None
    except HfHubHTTPError as exc:  # not found, gated, private
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(f"Hugging Face Hub model {spec!r}: {first}; check the id (and `hf auth login` "
                                f"for a gated one), or pass {flag}") from None
