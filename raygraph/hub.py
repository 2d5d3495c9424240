"""`--model org/name`: a Hugging Face hub id, resolved to a local snapshot by the driver
before Ray starts (workers on this node read the path it returns; on a multi-node cluster
the path must exist on every node: a shared --download-dir). huggingface_hub itself honours
HF_TOKEN, HF_HUB_OFFLINE=1 and HF_HUB_CACHE."""

from __future__ import annotations

import os
import re

from raygraph.config import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# the files raygraph reads: configs, weights, tokenizers (no *.bin, *.pth, *.gguf, ...)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def resolve_model(model: str, revision: str | None = None,
                  download_dir: str | None = None, weights: bool = True) -> str:
    """A local directory as an absolute path; a hub id as its downloaded (or cached)
    snapshot, without its *.safetensors unless `weights` (dummy weights need only the
    configs). ConfigError in one line when the id cannot be had."""
    if os.path.isdir(model) or not HUB_ID.match(model):
        return os.path.abspath(model)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model {model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=ALLOW_PATTERNS if weights else
                                 [p for p in ALLOW_PATTERNS if p != "*.safetensors"])
    except GatedRepoError:
        why = "the repository is gated (accept its terms on huggingface.co, set HF_TOKEN)"
    except RepositoryNotFoundError:
        why = "no such repository (or a private one: set HF_TOKEN)"
    except RevisionNotFoundError:
        why = "the repository has no such revision"
    except LocalEntryNotFoundError:
        why = ("not in the download cache, and the hub cannot be reached (HF_HUB_OFFLINE=1 "
               "or no network)")
    except Exception as e:  # network, disk, permissions: the library's own first line
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    raise ConfigError(f"cannot get {what}: not a local directory; from the Hugging Face "
                      f"hub: {why}")
