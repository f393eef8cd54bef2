"""`stepwise demo`: the quickstart, headless. A short SFT run, then a short RL run, on the embedded
backend (or --base-url), with progress bars, each recipe's summary, and what the whole demo cost.

    stepwise demo                       # about 5 minutes on a laptop CPU
    stepwise demo --sft-steps 4 --rl-steps 2 --base-url http://127.0.0.1:8000 --api-key tml-...
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
    parser.add_argument("--base-url", help="a running backend (default: start the embedded one)")
    parser.add_argument("--api-key", help="its API key (with --base-url)")
    parser.add_argument("--out", help="folder for the metrics JSONL files (default: a temporary folder)")
    args = parser.parse_args(argv)

    import workbench

    service_client = workbench.connect(args.base_url, args.api_key)
    conn = workbench.current()
    out = Path(args.out or tempfile.mkdtemp(prefix="stepwise-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    endpoint = {"base_url": conn.base_url, "api_key": conn.api_key}

    print(f"1/2 SFT: teach the model made-up facts ({args.sft_steps} steps)", flush=True)
    sft_summary = sft.run(sft.Config(**endpoint, steps=args.sft_steps, eval_every=max(1, args.sft_steps // 2),
                                     save_every=0, sample_questions=3, metrics_path=str(out / "sft.jsonl")),
                          service_client=service_client)
    print(f"\n2/2 RL: a verifier reward on an addition task ({args.rl_steps} steps)", flush=True)
    rl_config = rl.Config(**endpoint, steps=args.rl_steps, eval_prompts=args.rl_eval_prompts,
                          metrics_path=str(out / "rl.jsonl"))
    rl_summary = rl.run(rl_config, service_client=service_client)

    session = common.fetch_usage(conn.base_url, conn.api_key, session_id=sft_summary.session_id)
    print(f"\ndemo done: SFT eval loss {sft_summary.initial:.3f} -> {sft_summary.final:.3f}, "
          f"RL {rl_summary.metric} {rl_summary.initial:.2f} -> {rl_summary.final:.2f}")
    print(f"tokens: prefill {session['prefill_tokens']:,}, sample {session['sample_tokens']:,}, "
          f"train {session['train_tokens']:,}; cost ${session['cost']:.6f}")
    print(f"metrics: {out}")
    return {"sft": sft_summary, "rl": rl_summary, "usage": session}
