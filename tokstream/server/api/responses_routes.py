"""POST /v1/responses: the OpenAI Responses API, streamed as its semantic events or answered
with one response object. The body is read in responses_request.py, the answer written in
responses_output.py."""

from __future__ import annotations

import uuid

from starlette.responses import JSONResponse

from tokstream.server.api.api_request import read_request
from tokstream.server.api.responses_output import ResponseFormatter, response_body
from tokstream.server.api.responses_request import parse
from tokstream.server.api_errors import OPENAI, ApiError, api_route
from tokstream.server.streaming.responses import collect
from tokstream.server.streaming.sse import EventStreamResponse, stream_failure, wants_integrity
from tokstream.server.validation import parse_off_loop


@api_route(OPENAI)
async def create_response(request):
    server, tenant, body = await read_request(request)
    asked = await parse_off_loop(request, parse, body, server)
    prompt = asked.prompt
    request_id = f"resp_{uuid.uuid4().hex[:24]}"
    stream = server.submit(request_id, prompt, tenant, OPENAI)
    headers = {"x-request-id": request_id}
    if prompt.stream:
        formatter = ResponseFormatter(stream, body["model"], asked.fields, server.tokenizer,
                                      asked.logprobs, wants_integrity(
                                          request.headers, server.config.stream_integrity),
                                      prompt.tools)
        return EventStreamResponse(stream, formatter, server.registry,
                                   server.config.ping_interval_s, headers)
    batch = await collect(stream, request.receive, server.registry)
    failure = stream_failure(stream)
    if failure is not None:
        raise ApiError(*failure, retry_after=5 if failure[0] == "overloaded_error" else None)
    return JSONResponse(response_body(stream, batch, body["model"], asked.fields,
                                      server.tokenizer, asked.logprobs, prompt.tools),
                        headers=headers)
