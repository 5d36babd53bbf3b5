"""The no-reuse baseline: Hugging Face transformers behind a tiny OpenAI-compatible chat server.

Every request is prefilled from scratch (a fresh DynamicCache per request, nothing kept across
requests) and decoded with a plain greedy/temperature loop. Requests run one at a time behind a
lock: this is what a user gets from `model.generate` in a web handler, no batching.

    python scripts/peers/hf_server.py --model DIR --port 8200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


class GreedyModel:
    """One model, one request at a time; `generate` yields token ids as they are chosen."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.eos_ids = {self.tokenizer.eos_token_id} | set(
            _as_list(self.model.generation_config.eos_token_id)
        )
        self.lock = threading.Lock()

    def encode_chat(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, on_token, ignore_eos: bool = False
    ) -> str:
        """Calls on_token(id) per new token; returns the finish reason."""
        with self.lock:
            cache = DynamicCache()
            input_ids = torch.tensor([prompt_ids])
            for _ in range(max_tokens):
                out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
                logits = out.logits[0, -1].float()
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    token_id = int(torch.multinomial(probs, 1))
                else:
                    token_id = int(torch.argmax(logits))
                if token_id in self.eos_ids and not ignore_eos:
                    return "stop"
                on_token(token_id)
                input_ids = torch.tensor([[token_id]])
            return "length"


def _as_list(x) -> list:
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])


def build_app(engine: GreedyModel, model_name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt_ids = engine.encode_chat(body["messages"])
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        stream = _run(engine, prompt_ids, max_tokens, temperature, bool(body.get("ignore_eos")))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            sse = _sse(stream, rid, model_name, len(prompt_ids), usage)
            return StreamingResponse(sse, media_type="text/event-stream")
        text, n, finish = "", 0, "length"
        async for kind, value in stream:
            if kind == "text":
                text, n = text + value, n + 1
            elif kind == "error":
                return JSONResponse({"error": {"message": value, "type": "server_error"}}, 500)
            else:
                finish = value
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                ],
                "usage": _usage(len(prompt_ids), n),
            }
        )

    return app


async def _run(
    engine: GreedyModel, prompt_ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool = False
):
    """Runs generation in a thread; yields ("text", delta) per token, then ("finish", reason) or
    ("error", message).

    Text deltas come from re-decoding the generated ids, holding back an incomplete UTF-8 tail.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def work() -> None:
        try:
            reason = engine.generate(
                prompt_ids,
                max_tokens,
                temperature,
                lambda t: loop.call_soon_threadsafe(queue.put_nowait, t),
                ignore_eos,
            )
            end = ("finish", reason)
        except Exception as exc:  # noqa: BLE001 - reported to the client, not swallowed
            end = ("error", f"{type(exc).__name__}: {exc}")
        loop.call_soon_threadsafe(queue.put_nowait, end)

    threading.Thread(target=work, daemon=True).start()
    token_ids: list[int] = []
    sent = ""
    while isinstance(item := await queue.get(), int):
        token_ids.append(item)
        text = engine.tokenizer.decode(token_ids, skip_special_tokens=True)
        delta = "" if text.endswith("\ufffd") else text[len(sent) :]
        sent += delta
        yield "text", delta
    yield item


async def _sse(stream, rid: str, model_name: str, num_prompt_tokens: int, usage: bool):
    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    n = 0
    async for kind, value in stream:
        if kind == "text":
            n += 1
            yield chunk({"content": value})
        elif kind == "error":
            yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
        else:
            yield chunk({}, value)
    if usage:
        body = {"id": rid, "object": "chat.completion.chunk", "model": model_name, "choices": []}
        body["usage"] = _usage(num_prompt_tokens, n)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def _usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument("--served-model-name", default="hf")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    args = p.parse_args()
    engine = GreedyModel(args.model, getattr(torch, args.dtype))
    app = build_app(engine, args.served_model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
