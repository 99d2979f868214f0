"""The Hugging Face hub as the scripts reach it (`--data gsm8k`, a hub id as `--model`): can it be reached now?

huggingface_hub retries a failed request 5 times with backoff: about 25 s where the hub's name does not resolve,
more than a minute where a firewall drops the packets. So one plain request, bounded by HF_HUB_ETAG_TIMEOUT
(10 s), asks first whether the hub answers at all, and the callers end in one line when it does not. In offline
mode (HF_HUB_OFFLINE=1; HF_DATASETS_OFFLINE=1 for data sets) nothing is asked: the libraries read their local
cache, and a miss there is the one line. Light: huggingface_hub only, no torch."""
import os

from .paths import first_line

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
USE_THE_CACHE = "with a copy already in the hub cache, HF_HUB_OFFLINE=1 reads it"


def offline_reason() -> str:
    """'HF_HUB_OFFLINE=1 and no copy in the local hub cache' (the variables that are set): why an offline load
    failed."""
    set_vars = [v for v in OFFLINE_VARS if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    return f"{'='.join(set_vars[:1]) or 'offline mode'}{'=1' if set_vars else ''} and no copy in the local hub cache"


def no_answer() -> str | None:
    """Why the hub does not answer, in a few words ('https://huggingface.co does not answer: timed out'), or None
    when it does (any HTTP status below 500)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        status = get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT).status_code
    except Exception as e:  # httpx's connect, DNS, TLS, proxy and timeout errors
        return f"{constants.ENDPOINT} does not answer: {first_line(e)}"
    return f"{constants.ENDPOINT} answers HTTP {status}" if status >= 500 else None


def model_unavailable(model: str) -> str | None:
    """Why the hub id `model` cannot be fetched now, or None: the hub answers, or (offline) its config.json is in
    the local hub cache."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.is_offline_mode():
        try:
            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a valid repo id: it cannot be in the cache either
            cached = None
        return None if isinstance(cached, str) else offline_reason()
    return no_answer()
