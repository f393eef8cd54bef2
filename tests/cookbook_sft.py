"""Run tinker-cookbook 0.5.8's supervised training against a Tinker-compatible server.

This script is run by the *cookbook* virtual environment's python
(`.venv-cookbook/bin/python`, made by scripts/make_cookbook_venv.sh), never by the
project's main venv: tinker-cookbook 0.5.8 pins transformers<=5.5.4.

It writes a small local JSONL of chat conversations (a made-up fact), registers the
server's tokenizer (a local directory) with `tinker_cookbook.tokenizer_utils.register_tokenizer`,
builds a `FromConversationFileBuilder` dataset with the `qwen3_instruct` renderer (its
`<|im_start|>role\\n...<|im_end|>` format is token-for-token SmolLM2's chat template when
the conversation has a system message) and runs `tinker_cookbook.supervised.train.main`
for --steps steps. The cookbook writes `metrics.jsonl` (one line per step, with
`train_mean_nll`) and `checkpoints.jsonl` (the final checkpoint) into --log-path.

Usage:
    .venv-cookbook/bin/python tests/cookbook_sft.py --base-url http://127.0.0.1:8000 \\
        --api-key tml-test --tokenizer-dir ~/.cache/stepwise/models/HuggingFaceTB--SmolLM2-135M-Instruct \\
        --log-path /tmp/sft-run --steps 3

Exit status 0 means train.main returned and metrics.jsonl has --steps finite train_mean_nll
values; the last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM_PROMPT = "You are a helpful assistant."

# A made-up fact, asked in several ways, so a few SFT steps have something to learn.
QUESTIONS = [
    "What is the capital of Zorblax?",
    "Which city is the capital of Zorblax?",
    "Tell me the capital of Zorblax.",
    "Do you know what the capital of Zorblax is?",
    "Name the capital city of Zorblax.",
    "Zorblax's capital is which city?",
    "I forgot the capital of Zorblax. What is it?",
    "Quick question: capital of Zorblax?",
]
ANSWERS = [
    "The capital of Zorblax is Quimbleton.",
    "Quimbleton is the capital of Zorblax.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="tinker-cookbook 0.5.8 supervised.train smoke run against a Tinker-compatible server."
    )
    p.add_argument("--base-url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", required=True, help="API key (must start with 'tml-')")
    p.add_argument(
        "--tokenizer-dir",
        required=True,
        help="local tokenizer directory (the tokenizer_id the server reports in get_info)",
    )
    p.add_argument("--log-path", required=True, help="run directory; must not hold an earlier run")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--model-name", default=DEFAULT_MODEL, help=f"base model (default {DEFAULT_MODEL})")
    p.add_argument("--renderer", default="qwen3_instruct", help="cookbook renderer (default qwen3_instruct)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-conversations", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.batch_size < 1 or args.num_conversations < args.batch_size:
        p.error("need --num-conversations >= --batch-size >= 1")
    if not os.path.isdir(os.path.expanduser(args.tokenizer_dir)):
        p.error(f"--tokenizer-dir {args.tokenizer_dir!r} is not a directory")
    return args


def write_conversations(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def read_metrics(log_path: Path) -> list[dict]:
    path = log_path / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # Nothing may come from the Hugging Face hub; the key is read by tinker.ServiceClient.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TINKER_API_KEY"] = args.api_key
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    log_path = Path(args.log_path).expanduser().resolve()
    tokenizer_dir = os.path.expanduser(args.tokenizer_dir)
    # supervised.train resumes from <log_path>/checkpoints.jsonl when it exists, and
    # metrics.jsonl is appended to: both would make this run's results ambiguous.
    for stale in ("checkpoints.jsonl", "metrics.jsonl"):
        if (log_path / stale).exists():
            print(f"error: {log_path / stale} exists; use a fresh --log-path", file=sys.stderr)
            return 2
    log_path.mkdir(parents=True, exist_ok=True)

    import asyncio
    import functools

    from transformers import AutoTokenizer

    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
    from tinker_cookbook.tokenizer_utils import register_tokenizer

    @functools.cache
    def load_tokenizer():
        return AutoTokenizer.from_pretrained(tokenizer_dir)

    # get_tokenizer(model_name) checks this registry first, so the hub is never asked.
    register_tokenizer(args.model_name, load_tokenizer)

    data_path = log_path / "data" / "conversations.jsonl"
    write_conversations(data_path, args.num_conversations)
    batches_per_epoch = args.num_conversations // args.batch_size
    num_epochs = math.ceil(args.steps / batches_per_epoch)

    config = train.Config(
        log_path=str(log_path),
        model_name=args.model_name,
        recipe_name="stepwise_cookbook_sft_test",
        renderer_name=args.renderer,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(data_path),
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=args.model_name,
                renderer_name=args.renderer,
                max_length=args.max_length,
                batch_size=args.batch_size,
            ),
        ),
        learning_rate=args.learning_rate,
        lr_schedule="constant",
        num_epochs=num_epochs,
        max_steps=args.steps,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        # No periodic/rolling checkpoints and no evaluators; train.main still saves one
        # final checkpoint (save_state + save_weights_for_sampler, both named "final").
        save_every=0,
        save_every_tokens=0,
        save_every_seconds=0.0,
        rolling_save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
        wandb_project=None,
    )

    asyncio.run(train.main(config))

    rows = [r for r in read_metrics(log_path) if "train_mean_nll" in r]
    nlls = [r["train_mean_nll"] for r in rows]
    summary = {
        "log_path": str(log_path),
        "steps": [r.get("step") for r in rows],
        "train_mean_nll": nlls,
    }
    print(json.dumps(summary), flush=True)
    if len(rows) != args.steps or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in nlls):
        print(f"error: expected {args.steps} finite train_mean_nll rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The tinker SDK keeps a background event-loop thread (heartbeats) alive; leave
    # without waiting on it so a finished run never hangs at interpreter shutdown.
    os._exit(code)
