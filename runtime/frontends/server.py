"""`blockspec serve`: an OpenAI-compatible HTTP server over one `SpeculativeLlama` (FastAPI).

Endpoints: POST /v1/chat/completions, POST /v1/completions (SSE with "stream": true,
ending in `data: [DONE]`), GET /v1/models. One model and one context, so requests are
served one at a time in arrival order: an asyncio lock is held for each whole request,
a streamed one included, while the model runs in a worker thread and the event loop
stays free. Bad JSON, unknown fields and bad values get a 400 with an OpenAI-style
`{"error": {"message", "type", ...}}` body; a prompt that does not fit the context too.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from blockspec.runtime.errors import BlockspecError


class _Request(BaseModel):
    """Sampling fields shared by both endpoints. Unknown fields are rejected, so a client
    never silently gets behaviour it did not ask for."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=0.8, ge=0.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description="only 1 is supported")
    user: str | None = None
    # OpenAI penalties we do not implement: accepted only at their neutral value
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)

    def sampling(self) -> dict:
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repeat_penalty=self.repeat_penalty, stop=self.stop, seed=self.seed)


class CompletionRequest(_Request):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=0)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=0.2, ge=0.0)

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


def make_app(llm, model_id: str | None = None) -> FastAPI:
    """The app serving `llm` (a SpeculativeLlama) under the id `model_id`."""
    from pathlib import Path

    model_id = model_id or Path(llm.model_path).name
    created = int(time.time())
    lock = asyncio.Lock()
    app = FastAPI(title="blockspec", description="OpenAI-compatible speculative decoding server; "
                  "requests are served one at a time.")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request: Request, exc: RequestValidationError):
        return _error(400, _describe(exc))

    @app.exception_handler(BlockspecError)
    async def _blockspec_error(_request: Request, exc: BlockspecError):
        return _error(400, str(exc))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "blockspec"}]}

    async def respond(start, check, stream: bool):
        """Run `start()` (a llama call) under the lock, or with `stream` send its chunks as
        SSE. `check()` rejects a prompt that cannot fit before any output is sent."""
        await run_in_threadpool(check)
        if not stream:
            async with lock:
                return await run_in_threadpool(start)
        return StreamingResponse(_sse(lock, start), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        def start():
            return llm.create_completion(req.prompt, max_tokens=req.max_tokens, stream=req.stream,
                                         model=model_id, **req.sampling())

        return await respond(start, lambda: llm.check_prompt(prompt=req.prompt), req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]

        def start():
            return llm.create_chat_completion(messages, max_tokens=req.max_tokens, stream=req.stream,
                                              model=model_id, **req.sampling())

        return await respond(start, lambda: llm.check_prompt(messages=messages), req.stream)

    return app


async def _sse(lock: asyncio.Lock, start):
    """SSE body: one `data:` event per chunk, then `data: [DONE]`. The lock is held until the
    stream ends or the client goes away; the chunk iterator is then closed, which trims
    the model's cache to what was emitted."""
    async with lock:
        chunks = await run_in_threadpool(start)
        try:
            while True:
                chunk = await run_in_threadpool(next, chunks, None)
                if chunk is None:
                    break
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except BlockspecError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
        finally:
            # worker threads are not abandoned on cancellation, so no next() is running here
            chunks.close()


def run_server(*, model: str | None = None, drafter: str | None = None, method: str | None = None,
               drafter_backend: str | None = None, block_size: int | str | None = None, blockpilot: str | None = None,
               n_ctx: int = 4096, verbose: bool = False,
               acceptance: str = "rejection",
               host: str = "127.0.0.1", port: int = 8000, model_alias: str | None = None, adapt: bool = False) -> None:
    import uvicorn

    from blockspec.runtime.frontends.llama_api import SpeculativeLlama

    with SpeculativeLlama(model, drafter_path=drafter, method=method, drafter_backend=drafter_backend,
                          block_size=block_size, blockpilot=blockpilot, n_ctx=n_ctx, verbose=verbose,
                          acceptance=acceptance, adapt=adapt) as llm:
        app = make_app(llm, model_alias)
        uvicorn.run(app, host=host, port=port, log_level="info" if verbose else "warning")
