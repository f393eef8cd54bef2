"""What tests/cookbook_sft.py and tests/cookbook_rl.py share: run by the cookbook venv's python.

Both scripts run one of tinker-cookbook 0.5.8's trainers against a Tinker-compatible server from
its own venv (tests/client_venvs.py; the cookbook pins transformers<=5.5.4, so never
the project's main venv). This module holds their common command line (--base-url, --api-key,
--tokenizer-dir, --log-path, --steps, --self-check, --model-name, --renderer, --lora-rank,
--learning-rate), the offline set-up (no Hugging Face hub; the server's local tokenizer folder
registered with `tinker_cookbook.tokenizer_utils.register_tokenizer` under the model's name), the
fast "is anything listening" check, the fresh-log-path check and the `__main__` wrapper that maps
failures to exit codes. It imports nothing from the cookbook at module level, so `--help` and bad
arguments answer at once.

Exit codes (the same for both scripts): 0 success; 1 any failure (traceback on stderr); 2 bad
arguments or a --log-path holding an earlier run; 3 nothing listens at --base-url.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The renderer whose `<|im_start|>role\n...<|im_end|>` format is token-for-token SmolLM2's chat
# template when the conversation starts with a system message.
DEFAULT_RENDERER = "qwen3_instruct"
SYSTEM_PROMPT = "You are a helpful assistant."

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3


def add_common_args(p: argparse.ArgumentParser, *, steps: int, learning_rate: float, lora_rank: int = 8) -> None:
    p.add_argument("--base-url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", help="API key (must start with 'tml-')")
    p.add_argument(
        "--tokenizer-dir",
        required=True,
        help="local tokenizer directory (the tokenizer_id the server reports in get_info)",
    )
    p.add_argument("--log-path", help="run directory; must not hold an earlier run")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="no server: load the tokenizer through register_tokenizer, check the renderer against "
        "the tokenizer's chat template, then exit",
    )
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--model-name", default=DEFAULT_MODEL, help=f"base model (default {DEFAULT_MODEL})")
    p.add_argument("--renderer", default=DEFAULT_RENDERER, help=f"cookbook renderer (default {DEFAULT_RENDERER})")
    p.add_argument("--learning-rate", type=float, default=learning_rate)
    p.add_argument("--lora-rank", type=int, default=lora_rank)


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks every script makes after parsing (p.error exits with status 2)."""
    if not args.self_check:
        missing = [f"--{n.replace('_', '-')}" for n in ("base_url", "api_key", "log_path") if not getattr(args, n)]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if not os.path.isdir(os.path.expanduser(args.tokenizer_dir)):
        p.error(f"--tokenizer-dir {args.tokenizer_dir!r} is not a directory")


def server_reachable(base_url: str, timeout: float = 10.0) -> str | None:
    """A TCP connect to the server, so that a dead server fails in seconds rather than after
    the SDK's five minutes of retries. Returns an error message, or None when reachable."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"--base-url {base_url!r} is not an http(s) URL"
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"cannot connect to {u.hostname}:{port}: {e}"
    return None


def setup(args: argparse.Namespace) -> int | None:
    """Offline environment, the API key, the server check and the tokenizer registration.

    Returns an exit code to stop with (the server is unreachable), or None to go on.
    """
    # Nothing may come from the Hugging Face hub; the key is read by tinker.ServiceClient.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    if args.api_key:
        os.environ["TINKER_API_KEY"] = args.api_key
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.self_check and (err := server_reachable(args.base_url)) is not None:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    register_local_tokenizer(args.model_name, os.path.expanduser(args.tokenizer_dir))
    return None


def register_local_tokenizer(model_name: str, tokenizer_dir: str) -> None:
    """get_tokenizer(model_name) checks the cookbook's registry first, so the hub is never asked."""
    import functools

    from transformers import AutoTokenizer

    from tinker_cookbook.tokenizer_utils import register_tokenizer

    @functools.cache
    def load_tokenizer():
        return AutoTokenizer.from_pretrained(tokenizer_dir)

    register_tokenizer(model_name, load_tokenizer)


def chat_template_ids(tok, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """The tokenizer's own chat template, as a list of ints (transformers 5 may return a BatchEncoding)."""
    ref = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(ref, "keys"):
        ref = ref["input_ids"]
    return [int(t) for t in ref]


def fresh_log_path(log_path: str) -> Path | None:
    """--log-path resolved and created, or None (after an error message) when it holds a run.

    The cookbook's trainers resume from <log_path>/checkpoints.jsonl when it exists, and
    metrics.jsonl is appended to: both would make this run's results ambiguous.
    """
    path = Path(log_path).expanduser().resolve()
    for stale in ("checkpoints.jsonl", "metrics.jsonl"):
        if (path / stale).exists():
            print(f"error: {path / stale} exists; use a fresh --log-path", file=sys.stderr)
            return None
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(log_path: Path) -> list[dict]:
    return read_jsonl(log_path / "metrics.jsonl")


def run_as_script(main: Callable[[], int]) -> None:
    """Run main() and leave with its exit code (see the module docstring), never hanging."""
    try:
        code = main()
    except SystemExit as e:  # argparse errors, --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = EXIT_FAILED
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # The tinker SDK keeps a background event-loop thread (heartbeats, telemetry) alive;
    # leave without joining it so that a finished or failed run never hangs at exit.
    os._exit(code)
