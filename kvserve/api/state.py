"""ServerState: what every route of the app shares (api/server.py): the config and backend, the model's
names, the threads that keep tokenizing and large bodies off the event loop, and whether a request used
cache_salt."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from kvserve.api.backend import Backend, OutputStream
from kvserve.api.errors import parse_body
from kvserve.api.protocol import ChatMessage, Tool
from kvserve.api.tools import check_messages
from kvserve.config import ServeConfig
from kvserve.errors import ModelNotFoundError
from kvserve.request import Request

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)


@dataclass
class ServerState:
    config: ServeConfig
    backend: Backend
    model_name: str
    started: int
    # keeps encoding and chat templating off the event loop (the Tokenizer itself is safe from any thread)
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
    )
    # parses and validates the bodies that can be large (a json_schema of 400 KB), off the event loop:
    # five such bodies at once held a stream's chunks back 84 ms on the loop (docs/reliability.md)
    body_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvserve-body")
    )
    salted: bool = False  # a request used cache_salt: /v1/stats may withhold per-chunk rows (api/stats.py)

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def info(self) -> Any:
        return self.backend.info

    @property
    def vocab_size(self) -> int:
        return int(self.info.vocab_size)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise ModelNotFoundError(
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Tokenizer work on the tokenizer thread, so that the event loop keeps serving."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, functools.partial(fn, *args))

    async def body(self, http: HTTPRequest, model: type[B]) -> B:
        """The route's body as `model`, parsed and validated on the body thread (parse_body)."""
        raw = await http.body()
        return await self.on_body_thread(parse_body, raw, http.headers.get("content-type"), model)

    async def on_body_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Work on a parsed body that grows with it (a schema's canonical text), off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.body_thread, functools.partial(fn, *args))

    async def chat_ids(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool, tools: Sequence[Tool] = ()
    ) -> list[int]:
        check_messages(messages)
        return await self.off_loop(
            self.tokenizer.apply_chat_template,
            [m.as_dict() for m in messages],
            add_generation_prompt,
            [t.model_dump(exclude_none=True) for t in tools],
        )

    async def submit(self, requests: list[Request]) -> OutputStream:
        self.salted = self.salted or any(r.cache_salt is not None for r in requests)
        return await self.backend.submit(requests)
