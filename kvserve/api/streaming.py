"""Server-sent events for streamed completions and chat completions.

Order: (chat) one role chunk per choice, per-token deltas (RequestOutput.new_text, which never splits
a UTF-8 character and holds back possible stop-string prefixes; with tool calling, content and
`tool_calls` deltas from kvserve.api.tools.ToolCallStream), each choice's finish chunk, a
usage chunk when stream_options.include_usage is set, then `data: [DONE]`. A failure after the
stream began (a request's failure, or the stream's own: a cluster replica that died) is sent as an
OpenAI error event, then [DONE]. A client that goes away aborts its
requests (the generator is cancelled; `finally` posts the abort before the next engine step).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse

from kvserve.api import responses as R
from kvserve.api.backend import OutputStream
from kvserve.api.errors import kvserve_error_body
from kvserve.errors import KVServeError
from kvserve.request import RequestOutput
from kvserve.tokenizer import Tokenizer

DONE = "[DONE]"
STREAM_SHUTDOWN_GRACE_S = 4.0


def sse_response(events: AsyncIterator[dict[str, Any] | str]) -> EventSourceResponse:
    async def encoded() -> AsyncIterator[dict[str, str]]:
        async for event in events:
            yield {"data": event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))}

    # on shutdown, AsyncEngine.drain ends each stream with a result or an error event within
    # SHUTDOWN_GRACE_S; sse-starlette must not cut it first
    return EventSourceResponse(
        encoded(),
        ping=15,
        headers={"Cache-Control": "no-cache"},
        shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S,
    )


async def stream_events(
    job: R.Job, tok: Tokenizer, stream: OutputStream, include_usage: bool
) -> AsyncIterator[dict[str, Any] | str]:
    finals: dict[str, RequestOutput] = {}
    started: set[str] = set()
    try:
        if job.kind == "chat":
            for choice in job.choices:
                yield R.role_chunk(job, choice)
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
                try:
                    R.raise_for_failure(out)
                except KVServeError as e:
                    stream.abort("another choice failed")
                    yield kvserve_error_body(e)
                    yield DONE
                    return
            prefix = ""
            if out.request_id not in started:
                started.add(out.request_id)
                prefix = job.choice_of(out.request_id).echo_text
            if prefix or out.new_text or out.new_token_ids or out.finished:
                yield R.delta_chunk(job, tok, out, prefix)
        if include_usage:
            yield R.usage_chunk(job, finals)
        yield DONE
    except KVServeError as e:  # the stream itself broke (a cluster's replica died mid-stream)
        yield kvserve_error_body(e)
        yield DONE
    finally:
        if not stream.finished:
            stream.abort("client disconnected")
