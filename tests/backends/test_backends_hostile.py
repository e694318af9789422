"""Backends against a hostile HTTP server (tests/hostile_http.py, real sockets on 127.0.0.1): every reply
is bounded in time (one overall deadline) and in size (gzip bombs included), and every malformed reply gives a
one-line error that names what is wrong, never a Python internal."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hostile_http import HostileServer

from cspan.backends.asr import HTTPTranscriber, OpenAITranscriber, transcriber_from_url
from cspan.backends.asr.base import MAX_TRANSCRIPT_CHARS
from cspan.backends.errors import RouterError, TranscriberError
from cspan.backends.retriever import Retriever
from cspan.backends.router import LLMRouter, RouteRequest, RouteResult
from cspan.backends.tools import ToolBank

CLIP = (0.1 * np.sin(np.linspace(0, 200, 16000)).astype(np.float32), 16000)
"""One second of a tone: something to upload."""


@pytest.fixture(scope="module")
def hostile():
    server = HostileServer().start()
    yield server
    server.stop()


def _openai(server: HostileServer, mode: str, **kwargs) -> OpenAITranscriber:
    return OpenAITranscriber(server.url(mode), api_key="", timeout_s=kwargs.pop("timeout_s", 5.0), **kwargs)


def _plain(server: HostileServer, mode: str, **kwargs) -> HTTPTranscriber:
    return HTTPTranscriber(server.url(mode, "/transcribe"), timeout_s=kwargs.pop("timeout_s", 5.0), **kwargs)


async def _fails(transcriber, pattern: str) -> TranscriberError:
    try:
        with pytest.raises(TranscriberError, match=pattern) as info:
            await transcriber.transcribe(*CLIP)
    finally:
        await transcriber.aclose()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    for internal in ("object has no attribute", "RecursionError", "ValueError", "KeyError", "TypeError"):
        assert internal not in message
    return info.value


@pytest.mark.parametrize("mode", ["trickle", "trickle_head", "stall"])
@pytest.mark.parametrize("kind", ["openai", "plain"])
async def test_a_slow_reply_fails_at_the_overall_deadline(hostile, mode, kind) -> None:
    make = _openai if kind == "openai" else _plain
    t0 = time.monotonic()
    error = await _fails(make(hostile, mode, timeout_s=0.6), r"no complete reply within 0\.6 s")
    elapsed = time.monotonic() - t0
    # a trickle sends a byte every 0.2 s, so httpx's per-read timeout never fires: only the deadline ends it
    assert elapsed < 3.0, elapsed
    assert error.status is None and error.endpoint.startswith(hostile.url(mode, ""))


@pytest.mark.parametrize("mode", ["huge_declared", "huge_chunked", "gzip_bomb", "gzip_bomb_chunked"])
async def test_an_oversized_reply_is_refused_without_reading_it_whole(hostile, mode) -> None:
    error = await _fails(_openai(hostile, mode, max_reply_bytes=256 * 1024), r"over the limit of 262144 bytes")
    assert error.status is None


async def test_the_default_limit_stops_a_gzip_bomb(hostile) -> None:
    # 64 MiB of spaces in ~65 KB: refused at 1 MiB of decoded bytes
    await _fails(_plain(hostile, "gzip_bomb"), r"over the limit of 1048576 bytes")


@pytest.mark.parametrize(
    ("mode", "pattern"),
    [
        ("nested", r"nested too deeply"),
        ("bigint", r"a number is longer than 4300 digits \(5001 digits\)"),
        ("nan", r"NaN is not a JSON number"),
        ("text_int", r"has 'text' as a number; a transcript needs 'text' as a string"),
        ("text_list", r"has 'text' as an array; a transcript needs"),
        ("text_null", r"has 'text' as null"),
        ("brotli", r"content coding 'br' is not supported"),
        ("bad_gzip", r"gzip body is damaged"),
    ],
)
async def test_a_malformed_reply_gives_a_clear_one_line_error(hostile, mode, pattern) -> None:
    await _fails(_openai(hostile, mode), pattern)


async def test_bad_word_timings_are_named(hostile) -> None:
    await _fails(_openai(hostile, "words_str", word_timestamps=True), r"'words' is a string, not a list")
    await _fails(
        _openai(hostile, "words_nan", word_timestamps=True),
        r"words\[0\] needs a string 'word' and times 'start' <= 'end' in seconds .*start=-1, end=\"soon\"",
    )


async def test_a_huge_valid_transcript_is_capped(hostile) -> None:
    for make in (_openai, _plain):
        t = make(hostile, "big_valid")
        transcript = await t.transcribe(*CLIP)
        await t.aclose()
        assert len(transcript.text) <= MAX_TRANSCRIPT_CHARS and transcript.text.endswith("...")
        assert transcript.text.startswith("hello hello ")
    t = _openai(hostile, "braces")
    transcript = await t.transcribe(*CLIP)
    await t.aclose()
    assert len(transcript.text) == MAX_TRANSCRIPT_CHARS and set(transcript.text[:-3]) == {"{"}


async def test_control_and_format_characters_never_reach_a_transcript(hostile) -> None:
    t = _openai(hostile, "control")
    transcript = await t.transcribe(*CLIP)
    await t.aclose()
    assert transcript.text == "[2J [31mwhat is the weather in London [0m"
    assert all(ch.isprintable() for ch in transcript.text)


@pytest.mark.parametrize("prefix", ["/v1", "/gateway/v1", "/a/b/v1/audio/transcriptions"])
async def test_transcriber_from_url_takes_v1_anywhere_in_the_path(hostile, prefix) -> None:
    t = transcriber_from_url(f"http://127.0.0.1:{hostile.port}/ok{prefix}", timeout_s=5.0)
    assert isinstance(t, OpenAITranscriber)
    assert t.endpoint.endswith("/v1/audio/transcriptions")
    if prefix != "/a/b/v1/audio/transcriptions":
        transcript = await t.transcribe(*CLIP)
        assert transcript.text == "What is the weather in London?"
    await t.aclose()


# --- the router LLM -------------------------------------------------------------------------------------------


@pytest.fixture
async def bank():
    bank = ToolBank()
    yield bank
    await bank.aclose()


async def _route(server: HostileServer, mode: str, bank: ToolBank, **kwargs) -> RouteResult:
    async with LLMRouter(server.url(mode), "m", bank, api_key="", **kwargs) as router:
        return await router.route(RouteRequest(question="what is the weather in London?"))


async def _router_fails(server: HostileServer, mode: str, bank: ToolBank, pattern: str, **kwargs) -> str:
    with pytest.raises(RouterError, match=pattern) as info:
        await _route(server, mode, bank, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "object has no attribute" not in message and "RecursionError" not in message
    return message


@pytest.mark.parametrize("mode", ["trickle", "stall"])
async def test_a_slow_router_reply_fails_at_the_deadline(hostile, bank, mode) -> None:
    t0 = time.monotonic()
    await _router_fails(hostile, mode, bank, r"within 0\.6 s", timeout_s=0.6)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("mode", ["huge_declared", "huge_chunked", "gzip_bomb", "gzip_bomb_chunked"])
async def test_an_oversized_router_reply_is_refused(hostile, bank, mode) -> None:
    await _router_fails(hostile, mode, bank, r"over the limit of 1048576 bytes")


@pytest.mark.parametrize(
    ("mode", "pattern"),
    [
        ("nested", r"not JSON \(arrays or objects are nested too deeply to parse\)"),
        ("bigint", r"not JSON \(a number is longer than 4300 digits"),
        ("nan", r"not JSON \(NaN is not a JSON number\)"),
        ("message_str", r"the message is a string, not an object"),
        ("choices_dict", r"without choices\[0\]\.message"),
        ("top_list", r"without choices\[0\]\.message"),
    ],
)
async def test_a_router_body_that_is_not_a_chat_completion_is_named(hostile, bank, mode, pattern) -> None:
    await _router_fails(hostile, mode, bank, pattern)


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("text_int", "router LLM sent the message content as a number, not text or a list of text parts"),
        ("calls_str", "router LLM sent tool_calls as a string, not a list of calls"),
        ("calls_dict", "router LLM sent tool_calls as an object, not a list of calls"),
        ("call_item_str", "router LLM sent tool_calls[0] with a string, not an object with 'function'"),
        ("fn_str", "router LLM sent tool_calls[0] with 'function' as a string, not an object with 'function'"),
        ("name_int", "router LLM made a tool call without a name (name is a number)"),
    ],
)
async def test_a_router_message_of_the_wrong_shape_is_named(hostile, bank, mode, error) -> None:
    result = await _route(hostile, mode, bank)
    assert result.reference is None and result.error == error


async def test_content_as_a_list_of_parts_is_an_answer(hostile, bank) -> None:
    result = await _route(hostile, "text_list", bank)
    assert (result.reference, result.source, result.error) == ("It is sunny.", "llm", None)


async def test_control_characters_of_a_router_answer_never_reach_a_span(hostile, bank) -> None:
    result = await _route(hostile, "control", bank)
    assert result.reference == "[2J [31mwhat is the weather in London [0m"


# --- the retriever: what a session sees -----------------------------------------------------------------------


async def test_a_trickling_transcriber_makes_a_late_span_under_the_retrieval_deadline(hostile, bank) -> None:
    transcriber = _openai(hostile, "trickle", timeout_s=10.0)
    async with LLMRouter(hostile.url("ok"), "m", bank, api_key="") as router:
        retriever = Retriever(transcriber, router, deadline_s=0.5)
        span = await retriever.retrieve(*CLIP)
    await transcriber.aclose()
    assert span.late and span.reference is None and span.stage == "asr"
    assert span.error is not None and span.error.startswith("retrieval missed its 0.5 s deadline in the asr step")


async def test_a_transcriber_deadline_shorter_than_the_retrieval_one_is_a_clear_error(hostile, bank) -> None:
    transcriber = _plain(hostile, "trickle_head", timeout_s=0.4)
    async with LLMRouter(hostile.url("ok"), "m", bank, api_key="") as router:
        span = await Retriever(transcriber, router, deadline_s=30.0).retrieve(*CLIP)
    await transcriber.aclose()
    assert not span.late and span.reference is None
    assert (
        span.error is not None and "transcriber failed" in span.error and "no complete reply within 0.4 s" in span.error
    )


async def test_control_characters_of_a_transcript_never_reach_the_question(hostile, bank) -> None:
    transcriber = _openai(hostile, "control")
    async with LLMRouter(hostile.url("ok"), "m", bank, api_key="") as router:
        span = await Retriever(transcriber, router).retrieve(*CLIP)
    await transcriber.aclose()
    assert span.question == "[2J [31mwhat is the weather in London [0m"


async def test_no_transcriber_says_so(hostile, bank) -> None:
    async with LLMRouter(hostile.url("ok"), "m", bank, api_key="") as router:
        span = await Retriever(None, router).retrieve(*CLIP)
    assert span.reference is None
    assert span.error == "no transcriber configured (--asr none): the question cannot be heard; pass --asr"
