"""The OpenAI-compatible judge against a real HTTP server on 127.0.0.1: prompts, parsing, retries, CLI use."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cspan.bench import fdb_v3
from cspan.bench.errors import JudgeError
from cspan.bench.judge import (
    INTERRUPTION_SYSTEM_PROMPT,
    InterruptionRating,
    OpenAIJudge,
    chat_completions_url,
    interruption_user_message,
    parse_interruption_rating,
    parse_verdict,
)


class ChatServer:
    """A chat-completions server that answers from a queue: a string -> HTTP 200 with that message content,
    ``(status, body)`` -> that status, ``(status, body, headers)`` -> that status with those headers. It records every
    request body, its headers and the time it came."""

    def __init__(self) -> None:
        self.replies: list[str | tuple] = []
        self.times: list[float] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                server.requests.append(json.loads(self.rfile.read(length)))
                server.headers.append(dict(self.headers))
                server.times.append(time.monotonic())
                reply = server.replies.pop(0) if server.replies else (500, "no reply queued")
                extra: dict[str, str] = {}
                if isinstance(reply, tuple):
                    status, body, *more = reply
                    extra = more[0] if more else {}
                else:
                    status = 200
                    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[ChatServer]:
    srv = ChatServer()
    yield srv
    srv.close()


def test_chat_completions_url() -> None:
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"


def test_rating_parser_last_match_wins() -> None:
    reply = "Analysis: first.\nI would rate the AI's response as 2\nAnalysis: second look.\nI would rate the AI's response as 5"
    parsed = parse_interruption_rating(reply)
    assert parsed is not None and (parsed.rating, parsed.analysis) == (5, "second look.")
    assert parse_interruption_rating("Rating: 4") is None


def test_rate_interruption_sends_the_benchmark_prompt(server: ChatServer) -> None:
    server.replies = ["Analysis: On topic.\nI would rate the AI's response as 4."]
    with OpenAIJudge(server.url, "gpt-4-turbo", api_key="k-test") as judge:
        rating = judge.rate_interruption("ctx text", "interrupt text", "response text")
    assert (rating.rating, rating.analysis) == (4, "On topic.")
    (body,) = server.requests
    assert body["model"] == "gpt-4-turbo" and body["seed"] == 0
    assert "temperature" not in body  # the reference leaves the server's default
    assert body["messages"][0] == {"role": "system", "content": INTERRUPTION_SYSTEM_PROMPT}
    user = body["messages"][1]["content"]
    assert user == interruption_user_message("ctx text", "interrupt text", "response text")
    assert "- Contextual user turn: ctx text\n" in user and "- AI's response: response text\n" in user
    assert server.headers[0]["Authorization"] == "Bearer k-test"


def test_rate_interruption_asks_again_then_gives_up(server: ChatServer) -> None:
    server.replies = ["I think it is fine.", "Analysis: ok\nI would rate the AI's response as 3"]
    judge = OpenAIJudge(server.url, "m", max_attempts=2, backoff_s=0)
    assert judge.rate_interruption("c", "i", "r").rating == 3
    assert len(server.requests) == 2
    server.replies = ["no format", "still no format"]
    with pytest.raises(JudgeError, match="never answered in the format"):
        judge.rate_interruption("c", "i", "r")
    judge.close()


def test_http_errors(server: ChatServer) -> None:
    judge = OpenAIJudge(server.url, "m", max_attempts=3, backoff_s=0)
    server.replies = [(503, "busy"), "Analysis: a\nI would rate the AI's response as 1"]
    assert judge.rate_interruption("c", "i", "r").rating == 1
    server.replies = [(404, '{"error": {"message": "model not found"}}')]
    with pytest.raises(JudgeError, match="HTTP 404"):
        judge.chat([{"role": "user", "content": "x"}])
    assert len(server.requests) == 3  # the 404 was not retried
    judge.close()


def test_retry_after_is_waited(server: ChatServer) -> None:
    """A 429's Retry-After sets the wait before the next try when it is longer than the back-off."""
    judge = OpenAIJudge(server.url, "m", max_attempts=2, backoff_s=0)
    server.replies = [(429, "slow down", {"Retry-After": "1"}), "Analysis: a\nI would rate the AI's response as 2"]
    assert judge.rate_interruption("c", "i", "r").rating == 2
    assert len(server.times) == 2
    assert 0.9 <= server.times[1] - server.times[0] < 5.0
    judge.close()


def test_unreachable_judge() -> None:
    judge = OpenAIJudge("http://127.0.0.1:9/v1", "m", max_attempts=2, backoff_s=0, timeout_s=2)
    with pytest.raises(JudgeError, match="failed after 2 attempt"):
        judge.chat([{"role": "user", "content": "x"}])


def test_verdict_parsing() -> None:
    assert parse_verdict('```json\n{"correct": true, "explanation": "same city"}\n```').correct is True
    assert parse_verdict('{"correct": false}').explanation == ""
    with pytest.raises(JudgeError):
        parse_verdict("yes")
    with pytest.raises(JudgeError):
        parse_verdict('{"correct": "yes"}')


def test_v3_argument_judge_and_fallback(server: ChatServer) -> None:
    judge = OpenAIJudge(server.url, "gpt-4o", max_attempts=1)
    matcher = fdb_v3.JudgeArgumentMatcher(judge)
    server.replies = ['```json\n{"correct": true, "explanation": "Vegas is Las Vegas"}\n```']
    verdict = matcher("search_flights", {"destination": "Las Vegas"}, {"destination": "Vegas"})
    assert (verdict.correct, verdict.method) == (True, "judge")
    body = server.requests[-1]
    assert body["temperature"] == 0 and body["max_tokens"] == 200 and body["model"] == "gpt-4o"
    prompt = body["messages"][0]["content"]
    assert 'Expected arguments: {"destination": "Las Vegas"}' in prompt and "Function: search_flights" in prompt
    # A reply that does not parse falls back to the exact rule (here: a mismatch).
    server.replies = ["I believe so"]
    fallback = matcher("search_flights", {"destination": "Las Vegas"}, {"destination": "Vegas"})
    assert (fallback.correct, fallback.method) == (False, "exact")
    server.replies = ['{"correct": false, "explanation": "did not do it"}']
    assert judge.judge_response("Book the flight.", "Okay, booked.").correct is False
    assert 'Expected Task/Action: "Book the flight."' in server.requests[-1]["messages"][0]["content"]
    judge.close()


def _unrated_interruptions(tmp_path: Path, fixtures_dir: Path) -> Path:
    """A copy of the fixture's user-interruption task under ``tmp_path/data``, its rating removed (skip if absent)."""
    src = fixtures_dir / "fdb-v1" / "user_interruption_example"
    if not src.is_dir():
        pytest.skip(f"fixture not found: {src}")
    data = tmp_path / "data" / "synthetic_user_interruption"
    shutil.copytree(src, data)
    (data / "1" / "rating.json").unlink()
    return data


def _score(tmp_path: Path, *args: str) -> int:
    """``cspan bench fdb-v1 score`` of ``tmp_path/data`` into ``tmp_path/scores`` with ``args``; its exit status."""
    from cspan.core.cli import main

    return main(
        ["bench", "fdb-v1", "score", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "scores"), *args]
    )


def test_cli_rates_interruptions_with_the_judge(server: ChatServer, tmp_path: Path, fixtures_dir: Path) -> None:

    data = _unrated_interruptions(tmp_path, fixtures_dir)
    server.replies = ["Analysis: Talks about fiction books as asked.\nI would rate the AI's response as 5"]
    rc = _score(tmp_path, "--judge-url", server.url, "--judge-key-env", "CSPAN_TEST_NO_SUCH_KEY")
    assert rc == 0
    assert json.loads((data / "1" / "rating.json").read_text()) == {
        "analysis": "Talks about fiction books as asked.",
        "rating": 5,
    }
    summary = json.loads((tmp_path / "scores" / "synthetic_user_interruption" / "summary.json").read_text())
    assert summary["metrics"]["rating"] == 5.0 and summary["metrics"]["tor"] == 1.0
    assert summary["config"]["judge"]["model"] == "gpt-4-turbo"
    user = server.requests[0]["messages"][1]["content"]
    assert "- User interrupting turn: Can we talk about something else? How about fiction books?" in user
    assert "To Kill a Mockingbird" in user
    assert "Authorization" not in server.headers[0]


def test_a_judge_that_keeps_failing_is_taken_as_down(server: ChatServer) -> None:
    judge = OpenAIJudge(server.url, "m", max_attempts=2, backoff_s=0)
    server.replies = ["fine"]
    assert judge.chat([{"role": "user", "content": "x"}]) == "fine" and judge.trouble() is None
    # from now on HTTP 503 (no reply queued): each request tries twice, then fails
    for _ in range(2):
        with pytest.raises(JudgeError, match="failed after 2 attempt"):
            judge.chat([{"role": "user", "content": "x"}])
    assert len(server.requests) == 1 + 2 * 2 and judge.down is not None
    # two requests in a row failed: later ones fail at once, without a request
    with pytest.raises(JudgeError, match="is taken as down"):
        judge.chat([{"role": "user", "content": "x"}])
    assert len(server.requests) == 5
    assert (judge.answered, judge.failed) == (1, 3)
    assert "was taken as down after 1 answered request(s)" in (judge.trouble() or "")
    judge.close()
    # a success in between resets the count; a judge that never answered says so
    other = OpenAIJudge(server.url, "m", max_attempts=1, backoff_s=0, down_after=3)
    server.replies = [(500, "x"), "ok", (500, "x"), (500, "x")]
    for expected in (JudgeError, "ok", JudgeError, JudgeError):
        if expected is JudgeError:
            with pytest.raises(JudgeError):
                other.chat([{"role": "user", "content": "x"}])
        else:
            assert other.chat([{"role": "user", "content": "x"}]) == expected
    assert other.down is None and other.trouble() is None
    other.close()
    never = OpenAIJudge("http://127.0.0.1:9/v1", "m", max_attempts=1, backoff_s=0, down_after=5)
    with pytest.raises(JudgeError):
        never.chat([{"role": "user", "content": "x"}])
    assert "every request to the judge" in (never.trouble() or "")
    never.close()


def test_a_judge_that_never_replies_in_the_format_makes_the_command_fail(
    server: ChatServer, tmp_path: Path, fixtures_dir: Path
) -> None:
    """A judge that answers every request but never in its prompt's format (a model that does not follow it):
    every judgement fails, the summary says why, and the command exits with status 1, as for a judge that is down
    (was: status 0, so a script took the run for judged)."""

    _unrated_interruptions(tmp_path, fixtures_dir)
    server.replies = ["Sure! The response seems fine to me."] * 2
    rc = _score(
        tmp_path, "--judge-url", server.url, "--judge-attempts", "2", "--judge-key-env", "CSPAN_TEST_NO_SUCH_KEY"
    )
    assert rc == 1 and len(server.requests) == 2
    summary = json.loads((tmp_path / "scores" / "synthetic_user_interruption" / "summary.json").read_text())
    assert any("was in the format its prompt asks for (1 judgement(s))" in n for n in summary["notes"])
    # one usable reply among unusable ones: judged, no trouble
    judge = OpenAIJudge(server.url, "m", max_attempts=1, backoff_s=0)
    server.replies = ["no rating", "Analysis: fine.\nI would rate the AI's response as 4"]
    with pytest.raises(JudgeError, match="never answered in the format"):
        judge.rate_interruption("c", "i", "r")
    assert "format its prompt asks for" in (judge.trouble() or "")
    assert judge.rate_interruption("c", "i", "r").rating == 4 and judge.trouble() is None
    judge.close()


def test_a_rating_outside_0_to_5_is_not_in_the_format() -> None:
    assert parse_interruption_rating("Analysis: great.\nI would rate the AI's response as 7") is None
    assert parse_interruption_rating("Analysis: x.\nI would rate the AI's response as 10.") is None
    # the last match wins, in range or not
    two = "Analysis: a.\nI would rate the AI's response as 4\nAnalysis: b.\nI would rate the AI's response as 6"
    assert parse_interruption_rating(two) is None
    for rating in (0, 5):
        parsed = parse_interruption_rating(f"Analysis: edge.\nI would rate the AI's response as {rating}")
        assert parsed is not None and parsed.rating == rating
    with pytest.raises(ValidationError, match="less than or equal to 5"):
        InterruptionRating(analysis="a", rating=6)


def test_a_rating_outside_0_to_5_is_asked_again_then_counted_unusable(server: ChatServer) -> None:
    judge = OpenAIJudge(server.url, "m", max_attempts=2, backoff_s=0)
    server.replies = [
        "Analysis: on topic.\nI would rate the AI's response as 8",
        "Analysis: ok.\nI would rate the AI's response as 3",
    ]
    assert judge.rate_interruption("c", "i", "r").rating == 3
    assert (len(server.requests), judge.usable, judge.unusable) == (2, 1, 0)
    server.replies = [
        "Analysis: a.\nI would rate the AI's response as 9",
        "Analysis: b.\nI would rate the AI's response as 6",
    ]
    with pytest.raises(JudgeError, match=r"with N from 0 to 5 in 2 tries; last reply: .*as 6"):
        judge.rate_interruption("c", "i", "r")
    assert (len(server.requests), judge.usable, judge.unusable) == (4, 1, 1)
    judge.close()


def test_a_judge_that_only_rates_outside_0_to_5_makes_the_command_fail(
    server: ChatServer, tmp_path: Path, fixtures_dir: Path
) -> None:
    """Every reply in the format but rated 7: no rating is kept or written, the summary says nothing was judged and
    the command exits with status 1, as for a judge that never replies in the format."""

    data = _unrated_interruptions(tmp_path, fixtures_dir)
    server.replies = ["Analysis: Perfect.\nI would rate the AI's response as 7"] * 2
    rc = _score(
        tmp_path, "--judge-url", server.url, "--judge-attempts", "2", "--judge-key-env", "CSPAN_TEST_NO_SUCH_KEY"
    )
    assert rc == 1 and len(server.requests) == 2
    assert not (data / "1" / "rating.json").exists()
    summary = json.loads((tmp_path / "scores" / "synthetic_user_interruption" / "summary.json").read_text())
    assert summary["metrics"]["rating"] is None
    assert any("was in the format its prompt asks for (1 judgement(s))" in n for n in summary["notes"])
    samples = json.loads((tmp_path / "scores" / "synthetic_user_interruption" / "samples.json").read_text())
    assert [(s["rating"], s["judge_failed"]) for s in samples] == [(None, True)]


def test_a_stored_rating_outside_0_to_5_is_refused(tmp_path: Path, fixtures_dir: Path, capsys) -> None:

    data = _unrated_interruptions(tmp_path, fixtures_dir)
    (data / "1" / "rating.json").write_text(json.dumps({"analysis": "hand-edited", "rating": 9}))
    rc = _score(tmp_path, "--reuse-ratings")
    assert rc == 1
    err = capsys.readouterr().err
    assert f"{data / '1' / 'rating.json'}: rating 9 is outside the judge's 0-5" in err, err


def test_a_judge_of_its_own_rating_outside_0_to_5_fails_the_sample(tmp_path: Path, fixtures_dir: Path) -> None:
    """A judge object other than :class:`OpenAIJudge` (the :class:`~cspan.bench.fdb_v1.InterruptionJudge` protocol)
    that returns 6: the sample is judge_failed, out of the mean, and no rating.json is written."""
    from cspan.bench import fdb_v1
    from cspan.bench.fdb_v1 import TaskKind

    data = _unrated_interruptions(tmp_path, fixtures_dir)

    class Lenient:
        def rate_interruption(self, context: str, interrupt: str, response: str) -> Any:
            return InterruptionRating.model_construct(analysis="too kind", rating=6)

    score = fdb_v1.score_task(data, TaskKind.USER_INTERRUPTION, judge=Lenient(), write_ratings=True)
    (sample,) = score.samples
    assert (sample.rating, sample.judge_failed) == (None, True)
    assert score.summary.metrics["rating"] is None
    assert any("the judge rated 6, outside 0-5" in n for n in score.summary.notes)
    assert not (data / "1" / "rating.json").exists()


def test_a_judge_that_never_answers_times_out() -> None:
    import socket

    # accepts connections (the kernel's backlog) and never answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        judge = OpenAIJudge(url, "m", max_attempts=2, backoff_s=0, timeout_s=0.2)
        for _ in range(2):
            with pytest.raises(JudgeError, match="ReadTimeout"):
                judge.chat([{"role": "user", "content": "x"}])
        with pytest.raises(JudgeError, match="is taken as down"):
            judge.chat([{"role": "user", "content": "x"}])
        judge.close()


@pytest.mark.parametrize(
    "settings", [{"max_attempts": 0}, {"timeout_s": 0}, {"timeout_s": float("nan")}, {"down_after": 0}]
)
def test_judge_settings_out_of_range(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        OpenAIJudge("http://127.0.0.1:9/v1", "m", **settings)
