"""A notebook's tinker clients get the served model's tokenizer from the backend they talk to, not from the Hub.

The SDK's `get_tokenizer()` runs `AutoTokenizer.from_pretrained(<base model name>)`, which asks the Hugging Face Hub:
without it (a laptop offline, a cluster behind a firewall) that waits ~45 s in retries before it fails or falls back
to whatever the cache holds, and a model the operator registered under a name of their own is not on the Hub at all.
connect() installs this: `get_tokenizer()` of a client bound to a Stepwise backend fetches the tokenizer files from
that backend's /hf route (kernel_backend/api/hub.py, which answers as the Hub does) into a cache per backend under
$STEPWISE_HOME/tokenizers/, and loads them from there. The files are the backend's own, so the tokens a notebook makes
are the tokens the backend trains on. A client of any other server keeps the SDK's own behaviour.

Plain scripts get the same without the workbench by setting HF_ENDPOINT=<backend>/hf (docs/tinker-surface.md).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from workbench.client.connection import stepwise_home

_connection_of: Any = None  # connect.connection_of: the Connection of a tinker client, or None


def install(connection_of) -> None:
    """Wrap the SDK's two get_tokenizer methods (once); `connection_of(client)` finds a client's Connection."""
    global _connection_of
    from tinker import SamplingClient, TrainingClient

    _connection_of = connection_of
    for cls, model_name in ((SamplingClient, lambda client: client.get_base_model()),
                            (TrainingClient, lambda client: client.get_info().model_data.model_name)):
        method = cls.get_tokenizer
        if not getattr(method, "_stepwise_wrapped", False):
            wrapped: Any = _from_backend(method, model_name)  # Any: a function given an attribute of ours
            wrapped._stepwise_wrapped = True
            setattr(cls, "get_tokenizer", wrapped)


def _from_backend(method, model_name):
    @functools.wraps(method)
    def get_tokenizer(self):
        conn = _connection_of(self) if _connection_of else None
        if conn is None:
            return method(self)
        return load(conn.base_url, model_name(self))

    return get_tokenizer


@functools.lru_cache(maxsize=32)  # the SDK caches its loads the same way: a tokenizer is built once per model
def load(base_url: str, model_name: str):
    """The tokenizer of `model_name` as the backend at `base_url` serves it."""
    from huggingface_hub import snapshot_download
    from transformers import AutoTokenizer

    repo = model_name.split(":")[0]  # the SDK's own rule: "name:variant" loads name's tokenizer
    cache = stepwise_home() / "tokenizers" / re.sub(r"[^A-Za-z0-9._-]+", "_", base_url.split("://")[-1])
    folder = snapshot_download(repo, endpoint=f"{base_url.rstrip('/')}/hf", cache_dir=cache, tqdm_class=_silent_tqdm())
    return AutoTokenizer.from_pretrained(folder)


def _silent_tqdm():
    """huggingface_hub's bar class with every bar off: a few MB from the backend are not worth the two bars
    ("Fetching 4 files", "Download complete: 3.5MB") the Hub's download would print under a notebook's cell, where
    they would sit beside the run's own progress. Only these downloads: the Hub's switch for all bars stays the user's."""
    from huggingface_hub.utils import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent
