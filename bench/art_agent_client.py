"""OpenPipe ART 0.5.18 trains a calculator agent through Stepwise: run by bench/art_agent.py in ART's own venv.

ART's TinkerBackend speaks tinker 0.18.2 to the server at TINKER_BASE_URL. Each step: for each problem a group of
episodes, sampled through ART's own OpenAI-compatible server (which samples through the SDK), where the policy may
call a `calc` tool and then answers; the reward is graded (0.25 for a call, 0.25 for a call the calculator could
run, 0.5 for the final answer's number by its distance to the sum). Then
`backend.train` (ART's CISPO loss through forward_backward_custom, optim_step, save_state and a sampler checkpoint).

What ART needs around it here (docs/art.md): a stand-in for its Megatron model table (below); its renderer table does not know SmolLM2 (a ChatML model), so the
table is given the Qwen3-instruct renderer, whose ChatML turns and <tool_call> JSON match SmolLM2's template as
Stepwise renders tools; wandb and weave off; the tokenizer from the server's model folder (HF_HUB_OFFLINE=1).
Prints one JSON line per step: {"step", "reward", "tool_calls", "seconds"}.
"""

import argparse
import asyncio
import json
import random
import re
import time

import sys
import types


def megatron_free_model_table() -> None:
    """ART 0.5.18's TinkerBackend imports its Megatron model table (art.megatron.model_support) only for the LoRA
    target modules of a local GPU run, which a Tinker run does not use; the table imports megatron-bridge 0.4.0rc0,
    which the package index does not have. A stand-in that names the usual projections takes its place."""
    table = types.ModuleType("art.megatron.model_support")
    table.default_target_modules_for_model = lambda base_model, **_: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    sys.modules["art.megatron.model_support"] = table


megatron_free_model_table()

import art  # noqa: E402 - after the stand-in above
import art.tinker.renderers  # noqa: E402
import art.tinker.server  # noqa: E402
from art.tinker import TinkerBackend  # noqa: E402

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
# SmolLM2's chat template ignores `tools`, so the system turn describes the tool in the Hermes format that the
# Qwen3-instruct renderer parses back (the format Stepwise's own endpoints write for this model: tool_calls.py), and
# one worked example (plain messages: ART trains only on the policy's own choices) shows a call, its reply, an answer.
SYSTEM = ("You can call a calculator. To call it, write\n"
          '<tool_call>\n{"name": "calc", "arguments": {"expression": "12+34"}}\n</tool_call>\n'
          "Then answer with the number alone.")
EXAMPLE = [{"role": "user", "content": "What is 12 + 34?"},
           {"role": "assistant", "content": '<tool_call>\n{"name": "calc", "arguments": {"expression": "12+34"}}\n</tool_call>'},
           {"role": "tool", "content": "46"},
           {"role": "assistant", "content": "46"}]


def renderer_name(base_model: str) -> str:
    """ART's renderer table, with SmolLM2 (ChatML turns, <tool_call> JSON) mapped to the Qwen3-instruct renderer."""
    if base_model.startswith("HuggingFaceTB/SmolLM2"):
        return "qwen3_instruct"
    return original_renderer_name(base_model)


original_renderer_name = art.tinker.renderers.get_renderer_name
art.tinker.renderers.get_renderer_name = renderer_name
art.tinker.server.get_renderer_name = renderer_name


def calc(expression: str) -> str:
    if not re.fullmatch(r"[0-9+\-*/ ().]{1,40}", expression):
        return "error: only numbers and + - * / ( )"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the pattern above allows arithmetic only
    except Exception as e:  # noqa: BLE001 - a tool's error goes back to the model as its reply
        return f"error: {e}"


async def episode(model: art.TrainableModel, a: int, b: int, max_tokens: int) -> art.Trajectory:
    client = model.openai_client()
    trajectory = art.Trajectory(messages_and_choices=[
        {"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": f"What is {a} + {b}?"}], tools=TOOLS, reward=0.0)
    calls = ran = 0
    for _turn in range(2):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), tools=TOOLS, max_tokens=max_tokens,
            temperature=1.0)
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            calls += 1
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            result = calc(str(expression))
            ran += not result.startswith("error")
            trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # Graded, so that a group's episodes differ (ART skips a step whose groups all tie): a quarter for calling the
    # tool, a quarter for a call it could run, half for the final answer's last number by its distance to a + b.
    numbers = re.findall(r"-?\d+", choice.message.content or "")
    closeness = max(0.0, 1 - abs(int(numbers[-1]) - (a + b)) / (a + b)) if numbers else 0.0
    trajectory.reward = 0.25 * (calls > 0) + 0.25 * (ran > 0) + 0.5 * closeness
    trajectory.metrics["tool_calls"] = calls
    return trajectory


async def main(args) -> None:
    backend = TinkerBackend(in_process=True, path=args.art_path)
    model = art.TrainableModel(name="calc-agent", project="stepwise-bench", base_model=BASE_MODEL,
                               _internal_config=art.dev.InternalModelConfig(
                                   tinker_args=art.dev.TinkerArgs(renderer_name="qwen3_instruct",
                                                                  training_client_args={"rank": 8})))
    await model.register(backend)
    rng = random.Random(0)
    for step in range(args.steps):
        start = time.monotonic()
        problems = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(args.groups)]
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(episode(model, a, b, args.max_tokens) for _ in range(args.group_size))
             for a, b in problems], pbar_desc=f"step {step}")
        if args.show:
            for message in groups[0].trajectories[0].messages()[1 + len(EXAMPLE):]:
                print("   ", json.dumps(message)[:400], flush=True)
        rewards = [t.reward for g in groups for t in g.trajectories]
        calls = [t.metrics["tool_calls"] for g in groups for t in g.trajectories]
        await backend.train(model, groups, learning_rate=args.learning_rate)
        print(json.dumps({"step": step, "reward": sum(rewards) / len(rewards), "tool_calls": sum(calls) / len(calls),
                          "trained_step": await model.get_step(), "seconds": round(time.monotonic() - start, 1)}),
              flush=True)
    await backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--art-path", default=".art")
    parser.add_argument("--show", action="store_true", help="print one episode's messages each step")
    asyncio.run(main(parser.parse_args()))
