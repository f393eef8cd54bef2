"""The evaluation tools researchers already use, pointed at a running backend: each real client from
a venv of its own (tests/client_venvs.py), offline, on tasks defined on local JSONL files.

- lm-evaluation-harness 0.4.13 `local-completions`, with tokenized_requests True (token lists, one
  request at a time) and False (texts, four prompts a request): a multiple-choice task scored by
  loglikelihood (accuracy above chance, and each choice's loglikelihood what compute_logprobs gives,
  so the accuracy is what our own ranking gives), a perplexity task (loglikelihood_rolling, again
  compute_logprobs's numbers) and a generation task (generate_until, its stop strings held);
- inspect-ai's `openai-api` provider on a json_dataset task with the match scorer, logprobs on;
- the official `anthropic` SDK on /v1/messages: a plain message, a streamed one, a checkpoint that
  learned a made-up fact, stop sequences, a bad key (401), another tenant's checkpoint (404) and an
  image (400), in Anthropic's error shape (tool use: tests/test_tool_calls.py).
Every request is on the usage ledger.

All of it on the real SmolLM2 (real_model_server, not the tiny stand-in the protocol tests use): the clients
score a real model here, accuracy above chance and a taught answer among what they report.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

import client_venvs
from client_venvs import client_env
from conftest import wait_for_venv
from test_openai import QUESTION
from test_service import BASE

pytestmark = pytest.mark.clients

EASY = [("What colour is the sky on a clear day?", ["blue", "green", "purple"]),
        ("How many legs does a dog have?", ["four", "nine", "twelve"]),
        ("What is the opposite of hot?", ["cold", "loud", "square"]),
        ("What do bees make?", ["honey", "steel", "glass"]),
        ("Which animal says moo?", ["a cow", "a fish", "a snake"]),
        ("What is frozen water called?", ["ice", "sand", "smoke"]),
        ("What do you use to write on paper?", ["a pen", "a spoon", "a shoe"]),
        ("Where do fish live?", ["in water", "in fire", "in clouds"]),
        ("What is 2 plus 2?", ["4", "17", "90"]),
        ("What colour is grass?", ["green", "black", "white"])]  # the first choice is right
TEXTS = ["The cat sat on the mat. It was a sunny day and the birds were singing.",
         "Water boils at one hundred degrees Celsius at sea level."]
SUMS = [("What is 2 plus 2?", "4"), ("What is 3 plus 1?", "4"), ("What is 1 plus 1?", "2")]


def run(command: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command[:3])} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done


def ledger_cursor(server) -> int:
    cursor = 0
    while True:
        page = httpx.get(server.base_url + "/api/v1/usage", params={"after": cursor},
                         headers={"X-API-Key": server.api_key}).json()
        if not page["series"]:
            return cursor
        cursor = page["cursor"]


def ledger_rows(server, after: int) -> list[dict]:
    rows = []
    while True:
        page = httpx.get(server.base_url + "/api/v1/usage", params={"after": after},
                         headers={"X-API-Key": server.api_key}).json()
        if not page["series"]:
            return rows
        rows, after = rows + page["series"], page["cursor"]


@pytest.fixture(scope="module")
def model_dir(stepwise_home) -> Path:
    """The default model's folder: its tokenizer is the one lm-eval must tokenize with."""
    return stepwise_home / "models" / BASE.replace("/", "--")


@pytest.fixture(scope="module")
def server(real_model_server):
    """The backend the clients talk to: the real default model's."""
    return real_model_server


@pytest.fixture(scope="module")
def sampler(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    return client.create_sampling_client(base_model=BASE)


def compute_logprobs(sampler, prompts: list[list[int]]) -> list[list[float | None]]:
    futures = [sampler.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]
    return [f.result() for f in futures]


# ---- lm-evaluation-harness ---------------------------------------------------------------------------


def lm_eval_tasks(folder: Path) -> None:
    """Three tasks on local JSONL files, as docs/evaluate.md writes them."""
    def write(name: str, rows: list[dict], yaml: str) -> None:
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                             f"    test: {folder / name}.jsonl\ntest_split: test\n" + yaml)

    write("easy_mc", [{"question": q, "choices": c, "answer": 0} for q, c in EASY],
          'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
          'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n')
    write("easy_ppl", [{"text": t} for t in TEXTS],
          'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
          "metric_list:\n  - metric: word_perplexity\n")
    write("easy_gen", [{"question": q, "answer": a} for q, a in SUMS],
          'output_type: generate_until\ndoc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{answer}}"\n'
          'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
          "metric_list:\n  - metric: exact_match\n")


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-lists", "texts"])
def test_lm_eval_scores_like_compute_logprobs(tokenized, server, sampler, tokenizer, model_dir, tmp_path):
    python = wait_for_venv(client_venvs.client("lm-eval"))
    lm_eval_tasks(tmp_path)
    tasks = ["easy_mc", "easy_ppl" if tokenized else "easy_gen"]
    args = (f"model={BASE},base_url={server.base_url}/v1/completions,tokenizer={model_dir},"
            f"tokenizer_backend=huggingface,tokenized_requests={tokenized},num_concurrent=1,max_retries=1,max_length=2048")
    before = ledger_cursor(server)
    run([str(python), "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
         "--batch_size", "1" if tokenized else "4", "--tasks", ",".join(tasks), "--include_path", str(tmp_path),
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=tmp_path, env=client_env(OPENAI_API_KEY=server.api_key))

    # Multiple choice: each choice's loglikelihood is the sum of compute_logprobs over its tokens,
    # split as lm-eval splits them: the context's tokens, then what tokenizing context + choice whole
    # has after as many tokens (so a merge across the boundary does not shift the choice).
    scored = samples(tmp_path / "out", "easy_mc")
    pairs = [(s["arguments"][f"gen_args_{i}"]["arg_0"], s["arguments"][f"gen_args_{i}"]["arg_1"])
             for s in scored for i in range(len(s["doc"]["choices"]))]
    contexts = [tokenizer(context)["input_ids"] for context, _ in pairs]
    sent = [c + tokenizer(context + choice)["input_ids"][len(c):] for c, (context, choice) in zip(contexts, pairs)]
    ours = [sum(lps[len(c):]) for lps, c in zip(compute_logprobs(sampler, sent), contexts)]
    theirs = [float(r[0]) for s in scored for r in s["filtered_resps"]]
    assert theirs == pytest.approx(ours, abs=1e-3)
    picks = [max(range(3), key=lambda i, k=k: ours[3 * k + i]) for k in range(len(scored))]
    accuracy = sum(pick == 0 for pick in picks) / len(picks)
    assert [s["acc"] for s in scored] == [float(pick == 0) for pick in picks]
    assert accuracy > 1 / 3, accuracy  # above chance on ten easy questions

    if tokenized:  # perplexity: every token of the text, the first one after lm-eval's prefix token
        rolled = samples(tmp_path / "out", "easy_ppl")
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ours = compute_logprobs(sampler, [[prefix] + tokenizer(t)["input_ids"] for t in TEXTS])
        assert [float(s["filtered_resps"][0]) for s in rolled] == pytest.approx([sum(lps[1:]) for lps in ours], abs=1e-3)
        requests = len(pairs) + len(TEXTS)
    else:  # generation: greedy answers, cut at the task's stop string
        answers = [s["filtered_resps"][0] for s in samples(tmp_path / "out", "easy_gen")]
        assert len(answers) == len(SUMS) and all(a.strip() and "\n" not in a for a in answers), answers
        requests = len(pairs) + len(SUMS)
    completions = [r for r in ledger_rows(server, before) if r["request_type"] == "Completion"]
    assert len(completions) == requests and all(r["prefill_tokens"] > 0 and r["cost"] > 0 for r in completions)


# ---- inspect-ai ------------------------------------------------------------------------------------


INSPECT_TASK = '''\
from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import match
from inspect_ai.solver import generate


@task
def sums():
    return Task(dataset=json_dataset("sums.jsonl"), solver=[generate()], scorer=match(numeric=True),
                config=GenerateConfig(max_tokens=8, temperature=0, seed=0, logprobs=True, top_logprobs=2))
'''


def test_inspect_ai_runs_a_task_against_the_chat_endpoint(server, tmp_path):
    python = wait_for_venv(client_venvs.client("inspect-ai"))
    (tmp_path / "sums.jsonl").write_text("".join(
        json.dumps({"input": f"{q} Reply with only the number.", "target": a}) + "\n" for q, a in SUMS))
    (tmp_path / "sums.py").write_text(INSPECT_TASK)
    before = ledger_cursor(server)
    inspect = str(Path(python).with_name("inspect"))
    env = client_env(LOCAL_API_KEY=server.api_key, LOCAL_BASE_URL=server.base_url + "/v1")
    run([inspect, "eval", "sums.py", "--model", f"openai-api/local/{BASE}", "--log-dir", "logs", "--display", "plain"],
        cwd=tmp_path, env=env)
    (log,) = (tmp_path / "logs").glob("*.eval")
    report = json.loads(run([inspect, "log", "dump", str(log)], cwd=tmp_path, env=env).stdout)
    assert report["status"] == "success"
    accuracy = report["results"]["scores"][0]["metrics"]["accuracy"]["value"]
    assert 0 <= accuracy <= 1
    for sample in report["samples"]:
        choice = sample["output"]["choices"][0]
        tokens = choice["logprobs"]["content"]
        assert tokens and all(t["logprob"] <= 0 and len(t["top_logprobs"]) == 2 for t in tokens)
        # greedy: the token taken is the likeliest
        assert all(math.isclose(t["top_logprobs"][0]["logprob"], t["logprob"], abs_tol=1e-5) for t in tokens)
        assert "".join(t["token"] for t in tokens).strip() == choice["message"]["content"].strip()
    chats = [r for r in ledger_rows(server, before) if r["request_type"] == "ChatCompletion"]
    assert len(chats) == len(SUMS)


# ---- the anthropic SDK on /v1/messages -------------------------------------------------------------


ANTHROPIC_SCRIPT = '''\
import json, sys
import anthropic

base_url, key, other_key, base, trained, question = sys.argv[1:]
client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
greedy = {"extra_body": {"temperature": 0}}  # this SDK has no temperature argument; the route takes one
out = {}
ask = [{"role": "user", "content": question}]
plain = client.messages.create(model=base, max_tokens=20, messages=ask, **greedy)
out["plain"] = plain.model_dump()
with client.messages.stream(model=base, max_tokens=20, messages=ask, **greedy) as stream:
    out["streamed_text"] = "".join(stream.text_stream)
    out["streamed"] = stream.get_final_message().model_dump()
out["trained"] = client.messages.create(model=trained, max_tokens=20, messages=ask, **greedy,
                                        system="You answer questions about pets.").model_dump()
out["stopped"] = client.messages.create(model=trained, max_tokens=20, messages=ask, **greedy,
                                        stop_sequences=["Quib"]).model_dump()
blocks = [{"role": "user", "content": [{"type": "text", "text": question}]}]
out["blocks"] = client.messages.create(model=trained, max_tokens=20, messages=blocks, **greedy).model_dump()
def refused(call):
    try:
        call()
    except anthropic.APIStatusError as e:
        return {"status": e.status_code, "body": e.body}
    return None
out["bad_key"] = refused(lambda: anthropic.Anthropic(base_url=base_url, api_key="tml-wrong", max_retries=0)
                         .messages.create(model=base, max_tokens=5, messages=ask))
out["other_tenant"] = refused(lambda: anthropic.Anthropic(base_url=base_url, api_key=other_key, max_retries=0)
                              .messages.create(model=trained, max_tokens=5, messages=ask))
image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
out["image"] = refused(lambda: client.messages.create(model=base, max_tokens=5,
                                                      messages=[{"role": "user", "content": [image]}]))
print(json.dumps(out))
'''


def test_the_anthropic_sdk_chats_with_a_checkpoint(server, real_trained_path, tmp_path):
    python = wait_for_venv(client_venvs.client("anthropic"))
    (tmp_path / "messages.py").write_text(ANTHROPIC_SCRIPT)
    other = server.make_key("someone-else")
    before = ledger_cursor(server)
    done = run([str(python), "messages.py", server.base_url, server.api_key, other, BASE, real_trained_path,
                QUESTION], cwd=tmp_path, env=client_env())
    out = json.loads(done.stdout)

    plain = out["plain"]
    assert plain["type"] == "message" and plain["role"] == "assistant" and plain["id"].startswith("msg_")
    (block,) = plain["content"]
    assert block["type"] == "text" and block["text"] and "Quibbleton" not in block["text"]  # the base does not know
    assert plain["stop_reason"] in ("end_turn", "max_tokens") and plain["usage"]["input_tokens"] > 5
    streamed = out["streamed"]
    assert out["streamed_text"] == streamed["content"][0]["text"] == block["text"]  # greedy: the same answer
    assert streamed["usage"]["output_tokens"] == plain["usage"]["output_tokens"]
    assert "Quibbleton" in out["trained"]["content"][0]["text"]  # what the checkpoint learned
    assert "Quibbleton" in out["blocks"]["content"][0]["text"]
    stopped = out["stopped"]
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "Quib"
    assert "Quib" not in stopped["content"][0]["text"]

    for case, status, kind in (("bad_key", 401, "authentication_error"), ("other_tenant", 404, "not_found_error"),
                               ("image", 400, "invalid_request_error")):
        refusal = out[case]
        assert refusal["status"] == status, (case, refusal)
        assert refusal["body"]["type"] == "error" and refusal["body"]["error"]["type"] == kind, (case, refusal)
    assert "'image' are not supported" in out["image"]["body"]["error"]["message"]

    messages = [r for r in ledger_rows(server, before) if r["request_type"] == "Message"]
    assert len(messages) == 5 and all(r["sample_tokens"] > 0 and r["cost"] > 0 for r in messages)
