"""Run tinker-cookbook 0.5.8's supervised training against a Tinker-compatible server.

This script is run by the *cookbook* virtual environment's python
(its own venv, tests/client_venvs.py: `python tests/client_venvs.py build tinker-cookbook`), never by the
project's main venv: tinker-cookbook 0.5.8 pins transformers<=5.5.4.

It writes a small local JSONL of chat conversations (a made-up fact), registers the
server's tokenizer (a local directory) with `tinker_cookbook.tokenizer_utils.register_tokenizer`,
builds a `FromConversationFileBuilder` dataset with the `qwen3_instruct` renderer (its
`<|im_start|>role\\n...<|im_end|>` format is token-for-token SmolLM2's chat template when
the conversation has a system message) and runs `tinker_cookbook.supervised.train.main`
for --steps steps. The cookbook writes `metrics.jsonl` (one line per step, with
`train_mean_nll`) and `checkpoints.jsonl` (the final checkpoint) into --log-path.

Usage:
    ~/.cache/stepwise/tinker-cookbook-<key>/bin/python tests/cookbook_sft.py --base-url http://127.0.0.1:8000 \\
        --api-key tml-test --tokenizer-dir ~/.cache/stepwise/models/HuggingFaceTB--SmolLM2-135M-Instruct \\
        --log-path /tmp/sft-run --steps 3

    ~/.cache/stepwise/tinker-cookbook-<key>/bin/python tests/cookbook_sft.py --self-check --tokenizer-dir DIR   # no server

Exit status: 0 when train.main returned and metrics.jsonl has --steps finite train_mean_nll
values (the last line printed is a JSON summary); 1 on any failure (traceback on stderr);
2 on bad arguments or a --log-path holding an earlier run; 3 when nothing listens at
--base-url (checked first, since the SDK would otherwise retry for about five minutes).

Every HTTP call is made by the tinker 0.38.0 SDK on behalf of supervised.train: client/config,
client/dynamic_config, create_session, create_model, get_info, forward_backward (protobuf),
optim_step, save_weights, save_weights_for_sampler, retrieve_future, and in runs longer than
10 s session_heartbeat and telemetry. train.main never closes its ServiceClient, so
sessions/{id}/finish is not called.

The command line, the offline set-up and the exit codes are shared with tests/cookbook_rl.py
(the RL twin) in tests/cookbook_common.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from cookbook_common import (
    EXIT_USAGE,
    SYSTEM_PROMPT,
    add_common_args,
    chat_template_ids,
    check_common_args,
    fresh_log_path,
    read_metrics,
    run_as_script,
    setup,
)

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
    add_common_args(p, steps=3, learning_rate=1e-4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-conversations", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    args = p.parse_args(argv)
    check_common_args(p, args)
    if args.batch_size < 1 or args.num_conversations < args.batch_size:
        p.error("need --num-conversations >= --batch-size >= 1")
    return args


def write_conversations(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": conversation(i)}) + "\n")


def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
        {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]},
    ]


def self_check(model_name: str, renderer_name: str, max_length: int) -> int:
    """Render one conversation with the cookbook and compare with the HF chat template."""
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tok = get_tokenizer(model_name)  # the registered factory
    msgs = conversation(0)
    renderer = renderers.get_renderer(renderer_name, tok)
    model_input, weights = renderer.build_supervised_example(msgs)
    ids = [int(t) for t in model_input.to_ints()]
    ref = chat_template_ids(tok, msgs)
    trained = tok.decode([t for t, w in zip(ids, weights.tolist()) if w > 0])
    datum = conversation_to_datum(msgs, renderer, max_length)
    report = {
        "tokenizer": type(tok).__name__,
        "special_ids": dict(zip(["<|im_start|>", "<|im_end|>"], tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))),
        "renderer_tokens": len(ids),
        "matches_chat_template_prefix": ids == ref[: len(ids)],
        "text": tok.decode(ids),
        "trained_text": trained,
        "datum_length": datum.model_input.length,
        "stop_sequences": renderer.get_stop_sequences(),
    }
    print(json.dumps(report))
    ok = report["matches_chat_template_prefix"] and trained.startswith(ANSWERS[0])
    if not ok:
        print("error: renderer output does not match the tokenizer's chat template", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    if (code := setup(args)) is not None:
        return code

    if args.self_check:
        return self_check(args.model_name, args.renderer, args.max_length)

    log_path = fresh_log_path(args.log_path)
    if log_path is None:
        return EXIT_USAGE

    import asyncio

    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

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
    run_as_script(main)
