"""`stepwise demo`: the quickstart, headless, with learning you can see. A short SFT run teaches
made-up facts and then asks held-out questions about them (the taught answers come back); a short
RL run raises the share of correct answers to held-out sums, with a strict verifier. Progress bars,
each recipe's summary, and what the whole demo cost; before each run its estimate (the recipe's
`estimate(config)`: tokens by kind and cost, from the config alone), after it the estimate against
what the run spent. On the local backend (shared with your notebooks) or --base-url.

    stepwise demo                       # two to four minutes on a laptop CPU
    stepwise demo --sft-steps 24 --rl-steps 12 --base-url http://127.0.0.1:8000 --api-key tml-local

The defaults are the smallest runs that learn reliably (measured: docs/cookbook.md); the test
suite runs the demo with them (tests/test_recipes.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from workbench.recipes import common, rl, sft


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="stepwise demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=12)
    parser.add_argument("--rl-steps", type=int, default=6)
    parser.add_argument("--rl-eval-prompts", type=int, default=8, help="held-out problems scored before and after RL")
    parser.add_argument("--base-url", help="a running backend (default: the local one, started if needed)")
    parser.add_argument("--api-key", help="its API key (with --base-url)")
    parser.add_argument("--out", help="folder for the metrics JSONL files (default: a temporary folder)")
    parser.add_argument("--progress", type=lambda s: s.lower() in ("1", "true", "yes"), default=True, metavar="BOOL")
    args = parser.parse_args(argv)

    from workbench.client.connect import connect, current

    service_client = connect(args.base_url, args.api_key, name="stepwise demo", progress=args.progress)
    conn = current()
    out = Path(args.out or tempfile.mkdtemp(prefix="stepwise-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    endpoint = {"base_url": conn.base_url, "api_key": conn.api_key, "progress": args.progress}

    print(f"1/2 SFT: teach the model made-up facts ({args.sft_steps} steps)", flush=True)
    # lr 2e-3 and batch 8: the smallest run after which most held-out phrasings get the fact back.
    sft_config = sft.Config(**endpoint, steps=args.sft_steps, learning_rate=2e-3, eval_every=max(1, args.sft_steps // 2),
                            save_every=args.sft_steps, sample_questions=4, sample_max_tokens=20,
                            metrics_path=str(out / "sft.jsonl"))
    sft_estimate = planned(sft, sft_config)
    sft_summary = sft.run(sft_config, service_client=service_client)
    print(f"sft: {sft_estimate.versus(sft_summary.spent)}")
    answers = sft_summary.extra.get("samples", [])
    print("\nHeld-out questions about the taught facts, answered by the trained model:")
    for answer in answers:
        print(f"  {'✓' if answer['correct'] else '✗'} {answer['question']}\n      -> {answer['answer']}"
              f"   (taught: {answer['expect']})")

    print(f"\n2/2 RL: a strict verifier reward on an addition task ({args.rl_steps} steps)", flush=True)
    rl_config = rl.Config(**endpoint, steps=args.rl_steps, groups_per_batch=4, group_size=6, max_tokens=10,
                          eval_prompts=args.rl_eval_prompts, eval_samples=4, metrics_path=str(out / "rl.jsonl"))
    rl_estimate = planned(rl, rl_config)
    rl_summary = rl.run(rl_config, service_client=service_client)
    print(f"rl: {rl_estimate.versus(rl_summary.spent)}")

    session = common.fetch_usage(conn.base_url, conn.api_key, session_id=sft_summary.session_id)
    taught = sum(bool(a["correct"]) for a in answers)
    rose = rl_summary.final > rl_summary.initial
    print(f"\ndemo done: SFT taught {taught}/{len(answers)} held-out answers (eval loss {sft_summary.initial:.3f} -> "
          f"{sft_summary.final:.3f}); RL held-out reward {rl_summary.initial:.2f} -> {rl_summary.final:.2f}"
          + (" (rose)" if rose else f" (did not rise: try --rl-steps {2 * args.rl_steps})"))
    print(f"tokens: prefill {session['prefill_tokens']:,}, sample {session['sample_tokens']:,}, "
          f"train {session['train_tokens']:,}; cost ${session['cost']:.6f}")
    print(f"metrics: {out}")
    return {"sft": sft_summary, "rl": rl_summary, "usage": session,
            "configs": {"sft": sft_config, "rl": rl_config}, "estimates": {"sft": sft_estimate, "rl": rl_estimate}}


def planned(recipe, config):
    """The recipe's estimate for `config`, printed before it runs."""
    estimate = recipe.estimate(config)
    print(estimate, flush=True)
    return estimate
