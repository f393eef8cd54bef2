"""OpenPipe ART trains a tool-using agent through Stepwise: two steps of bench/art_agent_client.py against `serve`.

ART 0.5.18's TinkerBackend (tinker 0.18.2, which reads ForwardBackwardOutput as JSON: issue 52) against a backend
started here in a fresh home on the default model (SmolLM2-135M-Instruct), as a plain `stepwise serve` on loopback.
The client (in ART's own venv, built here on first use: ~8 GB, ~10 minutes) samples a calculator agent's episodes
through ART's OpenAI-compatible server, then trains with ART's CISPO loss (forward, then forward_backward_custom, and
an optim_step per packed sequence). Each step runs in a new ART process, so every step after the first resumes
from ART's last checkpoint (create_training_client_from_state_with_optimizer). Each step's reward, tool calls per
episode and seconds are printed, then what the server billed.

    .venv/bin/python bench/art_agent.py                 # 2 steps of 2 groups x 4 episodes (~5 min once built)
    .venv/bin/python bench/art_agent.py --steps 4 --groups 4

docs/art.md says what a user sets to do the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchenv import load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import httpx  # noqa: E402

from kernel_backend.config import Settings  # noqa: E402
from kernel_backend.venvs import Venv  # noqa: E402

HERE = Path(__file__).resolve().parent
ART_VENV = Venv("openpipe-art", HERE / "art-requirements.txt", "import art, art.tinker.server, art.tinker.backend",
                Settings().cache_dir, build_command="python bench/art_agent.py (builds it on first use)")


def art_env(server) -> dict[str, str]:
    """What ART needs around it on a machine without network or wandb: docs/art.md."""
    from client_venvs import client_env

    return client_env(TINKER_BASE_URL=server.base_url, TINKER_API_KEY=server.api_key, WANDB_MODE="disabled",
                      WEAVE_DISABLED="true", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for the client's run")
    args = parser.parse_args()

    from servers import start_server

    python = ART_VENV.python() or ART_VENV.build(say=lambda m: print(m, flush=True))
    home = Path(tempfile.mkdtemp(prefix="stepwise-bench-art-"))
    models = Path.home() / ".cache" / "stepwise" / "models"
    if models.is_dir():  # the default model converted once already
        (home / "models").symlink_to(models, target_is_directory=True)
    # A plain `serve`, as a user runs it: not the embedded backend (get_info's tokenizer_id is a folder for a
    # loopback client all the same), with a key of its own as any deployment has.
    server = start_server(home, env={"STEPWISE_EMBEDDED": "0", "STEPWISE_LOCAL_KEY": "tml-art-bench"}, timeout=600)
    print(f"ART {args.steps} steps of {args.groups} x {args.group_size} episodes against {server.base_url}; {load_line()}",
          flush=True)
    try:
        start = time.perf_counter()
        steps = []
        for run in range(args.steps):  # one ART process per step: each after the first resumes from ART's checkpoint
            proc = subprocess.Popen(
                [str(python), str(HERE / "art_agent_client.py"), "--steps", "1", "--groups", str(args.groups),
                 "--group-size", str(args.group_size), "--art-path", str(home / "art"), "--show"],
                cwd=home, env=art_env(server), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:  # ART's own progress bars and logs, as it prints them
                print(line, end="", flush=True)
                if line.startswith('{"step"'):
                    steps.append(json.loads(line))
            proc.wait(timeout=args.timeout)
            if proc.returncode != 0 or len(steps) != run + 1:
                sys.exit(f"ART's run {run + 1} failed (exit {proc.returncode})")
        wall = time.perf_counter() - start
        if [s["trained_step"] for s in steps] != list(range(1, args.steps + 1)):
            sys.exit(f"ART's steps did not follow on from its checkpoints: {steps}")
        usage = httpx.get(f"{server.base_url}/api/v1/usage", params={"limit": 10_000},
                          headers={"X-API-Key": server.api_key}).json()["series"]
        kinds = sorted({row["request_type"] for row in usage})
        trained = sum(row["request_type"] == "ForwardBackward" for row in usage)
        if trained == 0 or not any(row["request_type"] == "LoadWeights" for row in usage):
            sys.exit(f"ART did not train ({trained} forward_backward) or did not resume: {sorted(kinds)}")
        print(f"\n{args.steps} steps in {wall:.0f} s (each a new ART process; each after the first resumed with "
              f"its optimizer state); rewards {[s['reward'] for s in steps]}, tool calls/episode "
              f"{[s['tool_calls'] for s in steps]}; billed requests: "
              + ", ".join(f"{k} {sum(r['request_type'] == k for r in usage)}" for k in kinds))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
