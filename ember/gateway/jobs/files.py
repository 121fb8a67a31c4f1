"""OpenAI's Files API, as far as the Batch API needs it, kept in the job store's SQLite file (its SQL
in store_batches.py):

    POST   /v1/files                 multipart: file (JSONL) + purpose "batch"; validated line by line
    GET    /v1/files                 this key's files
    GET    /v1/files/{id}            the file object
    GET    /v1/files/{id}/content    the bytes (batch input, output and error files)
    DELETE /v1/files/{id}

A batch input line is `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from ember.gateway.errors import GatewayError, bad_request
from ember.gateway.jobs.runtime import ENDPOINTS, JobsRuntime, is_endpoint, not_found
from ember.gateway.request_body import parse_request_body

UPLOAD_PURPOSES = ("batch",)


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch_lines(content: bytes, max_requests: int) -> list[BatchLine]:
    """Every request of a batch input file, or a 400 naming the first bad line and why."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The file is not UTF-8 text.", param="file") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue

        def bad(reason: str, number: int = number, param: str = "file") -> GatewayError:
            return bad_request(f"Line {number} of the batch file: {reason}", param, "invalid_batch_line")

        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad(f"not valid JSON ({exc}).") from None
        if not isinstance(item, dict):
            raise bad("must be a JSON object.")
        unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
        if unknown:
            raise bad(f"unknown field(s) {', '.join(unknown)}.")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise bad("'custom_id' must be a non-empty string.")
        if custom_id in seen:
            raise bad(f"custom_id {custom_id!r} is used more than once; each must be unique.")
        seen.add(custom_id)
        if item.get("method") != "POST":
            raise bad("'method' must be \"POST\".")
        if not is_endpoint(item.get("url")):
            raise bad(f"'url' must be one of {', '.join(ENDPOINTS)}, got {item.get('url')!r}.")
        body = item.get("body")
        if not isinstance(body, dict):
            raise bad("'body' must be a JSON object.")
        try:
            request = parse_request_body(ENDPOINTS[item["url"]], body)
        except GatewayError as exc:
            raise bad(f"in 'body', {exc.message}", param=f"body.{exc.param}") from None
        if request.stream:
            raise bad("'body.stream' must not be true: batch requests are not streamed.")
        lines.append(BatchLine(custom_id, item["url"], body))
        if len(lines) > max_requests:
            raise bad(f"a batch may hold at most {max_requests} requests.")
    if not lines:
        raise bad_request("The batch file holds no requests.", param="file", code="empty_file")
    return lines


def build_router(runtime: JobsRuntime) -> APIRouter:
    router = APIRouter()
    limits = runtime.config.batch

    @router.post("/v1/files")
    async def upload(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("Upload the file as multipart/form-data with fields 'file' and 'purpose'.")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_file_bytes + 65536:
            raise GatewayError(
                413, f"Files may be at most {limits.max_file_bytes} bytes.", code="file_too_large"
            )
        try:
            form = await request.form(max_files=1, max_fields=8, max_part_size=limits.max_file_bytes)
        except Exception as exc:  # noqa: BLE001 - the multipart parser raises several types
            raise bad_request(f"Could not parse the multipart body: {exc}") from None
        try:
            upload = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("The 'file' field is missing or not a file.", param="file")
            if purpose not in UPLOAD_PURPOSES:
                raise bad_request(f"'purpose' must be 'batch', got {purpose!r}.", param="purpose")
            content = await upload.read()
            filename = upload.filename or "upload.jsonl"
        finally:
            await form.close()
        if len(content) > limits.max_file_bytes:
            raise GatewayError(
                413, f"Files may be at most {limits.max_file_bytes} bytes.", code="file_too_large"
            )
        parse_batch_lines(content, limits.max_requests)
        now = runtime.now()
        stored = await runtime.batch_store.add_file(principal.key_id, filename, purpose, content, now)
        return JSONResponse(stored.to_public())

    @router.get("/v1/files")
    async def list_files(request: Request) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        files = await runtime.batch_store.list_files(principal.key_id)
        return JSONResponse({"object": "list", "data": [f.to_public() for f in files], "has_more": False})

    @router.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        stored = await runtime.batch_store.get_file(file_id, principal.key_id)
        if stored is None:
            raise not_found("file", file_id)
        return JSONResponse(stored.to_public())

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        content = await runtime.batch_store.file_content(file_id, principal.key_id)
        if content is None:
            raise not_found("file", file_id)
        return Response(content, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Response:
        principal = runtime.authenticate(request.headers.get("authorization"), "batch")
        if not await runtime.batch_store.delete_file(file_id, principal.key_id):
            raise not_found("file", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    return router
