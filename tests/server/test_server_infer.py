"""`cspan infer` end to end on the tiny checkpoint, with the embedded transcriber and router (real components)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from stub_backends import StubBackend

from cspan.core.cli import build_parser
from cspan.core.errors import AudioInputError
from cspan.core.settings import settings_from_args
from cspan.server.infer import run_infer
from cspan.server.output import InferOutput

LEAD, TAIL = 1.0, 2.0
LEAD_FRAMES, TAIL_FRAMES = math.ceil(LEAD * 12.5), math.ceil(TAIL * 12.5)  # silences round up to whole frames


def _args(ckpt: Path, inp: Path, out: Path, *extra: str):
    argv = [
        "infer",
        "--input-wav", str(inp),
        "--output-wav", str(out / "out.wav"),
        "--output-text", str(out / "out.json"),
        "--checkpoint", str(ckpt),
        "--lead-silence", str(LEAD),
        "--tail-silence", str(TAIL),
        "--device", "cpu",
        "--seed", "7",
        "--quiet",
        *extra,
    ]  # fmt: skip
    return settings_from_args(build_parser().parse_args(argv))


def _infer(ckpt: Path, inp: Path, out: Path, *extra: str):
    return asyncio.run(run_infer(_args(ckpt, inp, out, *extra)))


@pytest.fixture(scope="module")
def knowledge(tmp_path_factory) -> Path:
    k = tmp_path_factory.mktemp("knowledge")
    (k / "london.md").write_text(
        "# London\n\nThe weather in London today is cloudy with light rain and 14 degrees.\n"
        "London is the capital of the United Kingdom.\n"
    )
    return k


@pytest.fixture(scope="module")
def weather_run(tiny_checkpoint_dir, fixtures_dir, knowledge, tmp_path_factory):
    out = tmp_path_factory.mktemp("weather")
    inp = fixtures_dir / "audio" / "question_weather_24k.wav"
    result = _infer(
        tiny_checkpoint_dir, inp, out,
        "--asr", "sphinx", "--router", "local", "--knowledge", str(knowledge), "--force-ret-at", "3.0",
    )  # fmt: skip
    return inp, out, result


def test_weather_question_goes_through_the_full_loop(weather_run):
    inp, out, result = weather_run
    audio, sr = sf.read(out / "out.wav", dtype="float32")
    info = sf.info(inp)
    n_input = -(-info.frames // 1920)
    expected = (LEAD_FRAMES + n_input + TAIL_FRAMES) * 1920
    assert sr == 24_000 and audio.shape == (expected, 2)
    assert sf.info(out / "out.wav").subtype == "PCM_16"
    # the user channel is the input, placed after the lead silence
    lead = LEAD_FRAMES * 1920
    src, _ = sf.read(inp, dtype="float32")
    np.testing.assert_allclose(audio[lead : lead + len(src), 0], src, atol=1 / 32767 + 1e-6)

    doc = InferOutput.model_validate_json((out / "out.json").read_text())
    questions = [e for e in doc.events if e.type == "question"]
    assert questions and "weather" in questions[0].text.lower()
    spans = [e for e in doc.events if e.type == "span"]
    assert len(spans) == 1
    span = spans[0]
    assert "cloudy with light rain" in span.text and span.source.startswith("local")
    assert span.n_frames > 0 and span.injected_at > span.asked_at

    # the span's tokens went through the engine's inject_span: the report's ids are [12] + spm(text) + [13]
    reports = result.conversation.span_reports
    assert len(reports) == 1
    tok = result.engine.tokenizer
    assert list(reports[0].ids) == [12, *tok.encode(span.text), 13]
    assert reports[0].n == span.n_frames
    # and the KV stream holds them: the first frame reads the P-frame prefix (positions 0..P), then one position per
    # frame plus the span's columns
    frames = int(doc.duration_s * 12.5)
    prefix_frames = int(result.engine.prefix_end[0])
    assert int(result.engine.positions[0]) == prefix_frames + frames + reports[0].n


def test_event_times_are_written_rounded(weather_run):
    """The times in the JSON are written to the microsecond: frame * 0.08 in floating point would read
    3.7600000000000002 at frame 47."""
    _, out, _ = weather_run
    raw = json.loads((out / "out.json").read_text())
    assert all(event["t"] == round(event["frame"] * 0.08, 6) for event in raw["events"])
    keys = ("t", "start_s", "end_s", "asked_at", "injected_at")
    items = [*raw["events"], *raw["agent_words"], *raw["user_transcripts"]]
    times = [item[key] for item in items for key in keys if isinstance(item.get(key), float)]
    assert len(times) > 50 and any(t == 3.76 for t in times)
    assert [t for t in times if len(repr(t).partition(".")[2]) > 6] == []


def test_given_span_is_injected_without_any_backend(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    inp = fixtures_dir / "audio" / "greeting_24k.wav"
    text = "The weather in Sydney is 24 degrees."
    result = _infer(tiny_checkpoint_dir, inp, tmp_path, "--asr", "none", "--router", "none", "--span", f"1.0:{text}")
    spans = [e for e in result.output.events if e.type == "span"]
    assert [(s.text, s.source, s.frame) for s in spans] == [(text, "given", LEAD_FRAMES + 12)]
    assert list(result.conversation.span_reports[0].ids) == [12, *result.engine.tokenizer.encode(text), 13]


def test_spans_and_forced_rets_from_the_environment_take_one_plain_value(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    """docs/OPERATORS.md: a repeatable flag's variable takes one value as it is (commas included), or a JSON list;
    CSPAN_SPAN="0.5:From env" was refused with pydantic-settings' 'error parsing value for field "span"'."""
    inp = fixtures_dir / "audio" / "greeting_24k.wav"
    text = "From the environment, with a comma"

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CSPAN_")}
        return subprocess.run(
            [sys.executable, "-m", "cspan.core.cli", "infer", "--input-wav", str(inp),
             "--output-wav", str(tmp_path / "out.wav"), "--output-text", str(tmp_path / "out.json"),
             "--checkpoint", str(tiny_checkpoint_dir), "--lead-silence", str(LEAD), "--tail-silence", str(TAIL),
             "--device", "cpu", "--asr", "none", "--router", "none", "--db", ":memory:", "--quiet"],
            capture_output=True, text=True, timeout=300, env={**clean, **env},
        )  # fmt: skip

    out = run(CSPAN_SPAN=f"1.0:{text}", CSPAN_FORCE_RET_AT="0.5")
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["settings"]["span"] == [f"1.0:{text}"] and doc["settings"]["force_ret_at"] == [0.5]
    spans = [(e["text"], e["source"], e["frame"]) for e in doc["events"] if e["type"] == "span"]
    assert spans == [(text, "given", LEAD_FRAMES + 12)]
    assert [e["forced"] for e in doc["events"] if e["type"] == "ret"][:1] == [True]

    out = run(CSPAN_FORCE_RET_AT="[0.5, 1.5]")  # several: a JSON list
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "out.json").read_text())["settings"]["force_ret_at"] == [0.5, 1.5]

    out = run(CSPAN_FORCE_RET_AT="0.5,1.5")  # not a list form: said so, with the form that is
    assert out.returncode == 2
    assert out.stderr == (
        "cspan infer: error: --force-ret-at / CSPAN_FORCE_RET_AT: Input should be a valid number, unable to parse "
        "string as a number (got '0.5,1.5'); several values are the flag repeated, or a JSON list in "
        "CSPAN_FORCE_RET_AT: '[0.5, 1.5]'\n"
    )


def _strip_wall_clock(doc: dict) -> dict:
    doc = dict(doc)
    doc.pop("timing")
    for e in doc["events"]:
        for k in ("prefill_ms", "backend_s", "asr_s"):
            e.pop(k, None)
    return doc


def test_same_seed_twice_gives_identical_outputs(tiny_checkpoint_dir, fixtures_dir, knowledge, tmp_path):
    inp = fixtures_dir / "audio" / "question_weather_24k.wav"
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        _infer(
            tiny_checkpoint_dir, inp, out,
            "--asr", "sphinx", "--router", "local", "--knowledge", str(knowledge), "--force-ret-at", "3.0",
        )  # fmt: skip
        runs.append(out)
    assert (runs[0] / "out.wav").read_bytes() == (runs[1] / "out.wav").read_bytes()
    a, b = (json.loads((r / "out.json").read_text()) for r in runs)
    for d in (a, b):
        d["settings"].pop("output_wav"), d["settings"].pop("output_text"), d.pop("output_wav")
    assert _strip_wall_clock(a) == _strip_wall_clock(b)
    assert any(e["type"] == "span" for e in a["events"])


def test_backend_latency_does_not_change_an_offline_run(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    """Issue 22: offline, backend latency acts on the frame clock only. The same command twice against one
    transcriber + router server, once answering at once and once slower than the deadline (wall clock), writes the
    same WAV bytes and the same JSON but for timing; the reference lands span_delay_s after it was asked."""
    inp = fixtures_dir / "audio" / "question_weather_24k.wav"
    with StubBackend() as backend:
        runs = []
        for name, delay in (("fast", 0.0), ("slow", 1.2)):
            backend.delay_s = delay
            extra = ("--asr", backend.url, "--router", f"{backend.url}/v1", "--force-ret-at", "3.0")
            _infer(tiny_checkpoint_dir, inp, tmp_path / name, *extra, "--span-deadline-s", "1.0")
            runs.append(tmp_path / name)
        assert any(p.endswith("/transcribe") for p in backend.posts) and any("chat" in p for p in backend.posts)
        # and a reference due after the deadline on the frame clock is late, with its question
        backend.delay_s = 0.0
        late_run = _infer(
            tiny_checkpoint_dir, inp, tmp_path / "late", *extra, "--span-delay-s", "1.2", "--span-deadline-s", "1.0"
        )
    assert (runs[0] / "out.wav").read_bytes() == (runs[1] / "out.wav").read_bytes()
    a, b = (json.loads((r / "out.json").read_text()) for r in runs)
    for d in (a, b):
        d["settings"].pop("output_wav"), d["settings"].pop("output_text"), d.pop("output_wav")
    assert _strip_wall_clock(a) == _strip_wall_clock(b)
    spans = [e for e in a["events"] if e["type"] == "span"]
    assert [(e["text"], e["question"]) for e in spans] == [
        ("The weather in London is cloudy with light rain and 14 degrees.", "what is the weather in london today")
    ]
    assert spans[0]["injected_at"] - spans[0]["asked_at"] == pytest.approx(0.8)
    late = [e for e in late_run.output.events if e.type == "late"]
    assert [(e.question, e.seconds >= 1.2) for e in late] == [("what is the weather in london today", True)]


def test_48k_stereo_flac_uses_the_same_duration_logic(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    """The input's frames are counted as the resampler makes them. 149761 samples at 48 kHz are 74880.5 at 24 kHz:
    soxr gives 74881 (half up, 40 frames), the float duration rounded half to even gave 74880 (39 frames), and the
    run failed at its last frame with an IndexError traceback."""
    import soxr

    from cspan.core.audio import iter_frames

    src, sr = sf.read(fixtures_dir / "audio" / "greeting_24k.wav", dtype="float32")
    up = soxr.resample(src, sr, 48_000)[:149_761]
    flac = tmp_path / "in.flac"
    sf.write(flac, np.stack([np.zeros_like(up), up], axis=1), 48_000, format="FLAC")
    result = _infer(tiny_checkpoint_dir, flac, tmp_path, "--asr", "none", "--router", "none", "--channel", "1")
    audio, out_sr = sf.read(tmp_path / "out.wav", dtype="float32")
    n_input = len(list(iter_frames(flac, channel=1)))
    assert n_input == 40 and -(-round(len(up) / 48_000 * 24_000) // 1920) == 39  # the case the old count missed
    assert out_sr == 24_000
    assert audio.shape[0] == (LEAD_FRAMES + n_input + TAIL_FRAMES) * 1920
    assert result.output.duration_s == pytest.approx(audio.shape[0] / 24_000)
    assert np.abs(audio[:, 0]).max() > 0.05  # the right (speech) channel was used


@pytest.mark.parametrize("case", ["missing", "empty", "garbage", "silent", "too_long"])
def test_bad_inputs_fail_and_write_nothing(tiny_checkpoint_dir, tmp_path, case):
    inp = tmp_path / "in.wav"
    extra: list[str] = []
    if case == "empty":
        inp.write_bytes(b"")
    elif case == "garbage":
        inp.write_bytes(b"not audio at all" * 100)
    elif case == "silent":
        sf.write(inp, np.zeros(48_000, dtype=np.float32), 24_000)
    elif case == "too_long":
        sf.write(inp, 0.1 * np.random.default_rng(0).standard_normal(24_000 * 3).astype(np.float32), 24_000)
        extra = ["--max-seconds", "2"]
    out = tmp_path / "out"
    with pytest.raises(AudioInputError) as err:
        _infer(tiny_checkpoint_dir, inp, out, *extra)
    assert str(inp) in str(err.value)
    assert not (out / "out.wav").exists() and not (out / "out.json").exists()


def test_bad_input_through_the_cli_exits_1_with_the_error(tiny_checkpoint_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "infer", "--input-wav", str(tmp_path / "nope.wav"),
         "--output-wav", str(tmp_path / "o.wav"), "--checkpoint", str(tiny_checkpoint_dir), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1
    assert "nope.wav" in out.stderr and "no such file" in out.stderr
    assert not (tmp_path / "o.wav").exists()


def test_failing_router_gives_no_span_and_a_complete_output(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    """A router that answers (the start-up check passes) but fails every request: the run survives it."""
    inp = fixtures_dir / "audio" / "question_weather_24k.wav"
    with StubBackend(chat_status=500) as router:
        result = _infer(
            tiny_checkpoint_dir, inp, tmp_path,
            "--asr", "sphinx", "--router", f"{router.url}/v1", "--force-ret-at", "1.0", "--force-ret-at", "3.0",
        )  # fmt: skip
    kinds = [e.type for e in result.output.events]
    assert "span" not in kinds
    no_spans = [e for e in result.output.events if e.type == "no_span"]
    assert len(no_spans) >= 1 and all("500" in (e.error or "") for e in no_spans)
    audio, _ = sf.read(tmp_path / "out.wav")
    assert audio.shape[0] == int(result.output.duration_s * 24_000)
    InferOutput.model_validate_json((tmp_path / "out.json").read_text())


def test_output_paths_are_checked_before_any_work(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    from cspan.core.errors import CspanError, SettingsError

    inp = tmp_path / "in.wav"
    inp.write_bytes((fixtures_dir / "audio" / "greeting_24k.wav").read_bytes())
    folder = tmp_path / "adir"
    folder.mkdir()
    db = folder / "memory.sqlite"  # an existing Context DB (a fresh user trial overwrote one with the JSON)
    db.write_bytes(b"SQLite format 3\x00 keep me")
    cases = [
        (["--output-wav", str(folder)], "is a directory"),
        (["--output-wav", str(inp)], "is the --input-wav recording"),
        (["--output-wav", str(tmp_path / "x.wav"), "--output-text", str(tmp_path / "x.wav")], "the same file"),
        (["--span", "60:too late"], "past the end"),
        (["--force-ret-at", "60"], "past the end"),
        (["--router", "notaurl"], "--router"),
        (["--db", str(db), "--output-text", str(db)], "is the Context DB"),
        (["--db", f"sqlite:///{db}", "--output-text", f"{db}-wal"], "is the Context DB"),  # sqlite:////ABS
    ]
    for extra, message in cases:
        argv = ["infer", "--input-wav", str(inp), "--output-wav", str(tmp_path / "o.wav"),
                "--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--quiet", *extra]  # fmt: skip
        with pytest.raises(CspanError, match=message) as err:
            asyncio.run(run_infer(settings_from_args(build_parser().parse_args(argv))))
        if "past the end" not in message and "--router" not in message:  # a bad setting: exit status 2
            assert isinstance(err.value, SettingsError), (message, err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "in.wav"]
    assert db.read_bytes() == b"SQLite format 3\x00 keep me"
    assert inp.read_bytes() == (fixtures_dir / "audio" / "greeting_24k.wav").read_bytes()


def test_an_output_over_the_voice_recording_or_the_settings_file_is_refused(
    tiny_checkpoint_dir, fixtures_dir, tmp_path, capsys, monkeypatch
):
    """The voice recording (``--voice FILE``) and the settings file (``--config``, or ``CSPAN_CONFIG``) are read by
    the run like the input: an output naming one would silently replace it (both were overwritten before)."""
    from cspan.core.cli import main

    speech = (fixtures_dir / "audio" / "question_weather_24k.wav").read_bytes()
    inp, voice = tmp_path / "in.wav", tmp_path / "voice.wav"
    inp.write_bytes(speech)
    voice.write_bytes(speech)
    config = tmp_path / "infer.toml"
    config.write_text('db = ":memory:"\n')
    base = ["infer", "--input-wav", str(inp), "--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--quiet"]
    cases = [
        (["--output-wav", str(voice), "--voice", str(voice)], "--output-wav", "--voice"),
        (["--output-wav", str(tmp_path / "o.wav"), "--output-text", str(config), "--config", str(config)],
         "--output-text", "--config"),
    ]  # fmt: skip
    for extra, flag, source in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert f"{flag} " in err and f"is the {source} file" in err and "refusing to overwrite" in err, err
    monkeypatch.setenv("CSPAN_CONFIG", str(config))
    assert main([*base, "--output-wav", str(tmp_path / "o.wav"), "--output-text", str(config)]) == 2
    assert "is the --config file" in capsys.readouterr().err
    assert voice.read_bytes() == speech and config.read_text() == 'db = ":memory:"\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.wav", "infer.toml", "voice.wav"]


def test_kv_dtype_reaches_the_engine_of_infer_and_serve(tiny_checkpoint_dir, tiny_checkpoint, fixtures_dir, tmp_path):
    """``--kv-dtype``: declared once for both commands with the engine's choices; an FP8 cache runs a whole
    ``cspan infer`` (a given span read) and is what ``cspan serve`` builds."""
    import typing

    import torch

    from cspan.core.plan import KV_DTYPES
    from cspan.core.settings import SettingsError
    from cspan.server.app import build_engine
    from cspan.server.settings_common import ModelSettings

    field = ModelSettings.model_fields["kv_dtype"]
    assert typing.get_args(field.annotation) == KV_DTYPES and field.default == "auto"
    text = "The weather in Sydney is 24 degrees."
    result = _infer(
        tiny_checkpoint_dir, fixtures_dir / "audio" / "greeting_24k.wav", tmp_path,
        "--asr", "none", "--router", "none", "--span", f"1.0:{text}", "--kv-dtype", "fp8",
    )  # fmt: skip
    assert result.engine.kv_dtype == torch.float8_e4m3fn
    assert [e.text for e in result.output.events if e.type == "span"] == [text]
    assert (tmp_path / "out.wav").stat().st_size > 0 and json.loads((tmp_path / "out.json").read_text())["events"]
    serve = settings_from_args(build_parser().parse_args(["serve", "--kv-dtype", "fp8", "--max-sessions", "2"]))
    _, engine = build_engine(serve, tiny_checkpoint)
    assert engine.kv_dtype == torch.float8_e4m3fn and engine.batch_size == 2
    with pytest.raises(SettingsError, match=r"--kv-dtype / CSPAN_KV_DTYPE"):
        settings_from_args(build_parser().parse_args(["serve", "--kv-dtype", "int4"]))


def test_the_default_persona_is_one_identity(weather_run):
    """`cspan infer` and `cspan serve` without --text-prompt read "You are Ada, ... You are moshi, ...": two
    identities in one persona. The run's JSON shows the persona it read: one."""
    from cspan.server.serve_settings import ServeSettings

    _, out, _ = weather_run
    persona = json.loads((out / "out.json").read_text())["settings"]["text_prompt"]
    assert persona == (
        "You are Ada, a calm and friendly voice assistant. You help people plan their day and find things out, and "
        "you handle everyday requests too, such as looking things up, the weather, times and directions."
    )
    assert persona.count("You are") == 1 and "moshi" not in persona.lower()
    assert ServeSettings.model_fields["text_prompt"].default == persona  # cspan serve's default is the same text


def test_the_output_says_which_voice_spoke_and_which_tools_were_in_effect(weather_run):
    """`settings` is what was asked (`voice` and `tools` null: not given); `persona` names the voice that spoke (the
    default: the first voice of voices/) and `tools` the tool sets in effect (the default ones)."""
    from cspan.backends.tools.catalog import LIVE_DEFAULT

    _, out, _ = weather_run
    raw = json.loads((out / "out.json").read_text())
    assert raw["settings"]["voice"] is None and raw["settings"]["tools"] is None
    persona = raw["persona"]
    assert persona["voice"] == "tiny0" and persona["voice_default"] is True and persona["voice_form"] == "codes"
    assert Path(persona["voice_file"]).parts[-2:] == ("voices", "tiny0.pt")
    assert persona["voice_frames"] == 20  # tiny0's frames, read in the prefix
    assert raw["tools"]["sets"] == list(LIVE_DEFAULT)
    assert {"get_time", "calculate", "get_weather", "recall_memory", "remember_fact"} <= set(raw["tools"]["names"])
    assert raw["tools"]["names"] == sorted(raw["tools"]["names"])


def test_a_named_voice_and_no_router_are_said_as_used(tiny_checkpoint_dir, fixtures_dir, tmp_path):
    """`--voice tiny1` is the named voice (not the default); with `--router none` no tool is in effect, whatever
    `--tools` asked (settings keeps what was asked)."""
    inp = fixtures_dir / "audio" / "greeting_24k.wav"
    _infer(
        tiny_checkpoint_dir, inp, tmp_path, "--asr", "none", "--router", "none", "--voice", "tiny1", "--tools", "clock"
    )
    raw = json.loads((tmp_path / "out.json").read_text())
    assert raw["settings"]["voice"] == "tiny1" and raw["settings"]["tools"] == "clock"
    assert raw["persona"]["voice"] == "tiny1" and raw["persona"]["voice_default"] is False
    assert raw["tools"] == {"sets": [], "names": []}
    InferOutput.model_validate(raw)


def test_a_run_starts_from_the_stored_profile_and_keeps_it(tiny_checkpoint_dir, tmp_path) -> None:
    """`--db FILE` remembers the user: a later run without --user-name/--user-city/--user-tz neither erases the stored
    profile nor ignores it (the persona names the user as before); a flag given changes only its own field."""
    from cspan.backends.context_db import ContextDB

    inp = tmp_path / "tone.wav"
    sf.write(inp, 0.3 * np.sin(np.arange(9600) * 2 * np.pi * 440 / 24000), 24000)
    db = tmp_path / "memory.sqlite"
    quick = ("--db", str(db), "--asr", "none", "--router", "none")

    def run(name: str, *extra: str) -> dict:
        _infer(tiny_checkpoint_dir, inp, tmp_path / name, *quick, *extra)
        return json.loads((tmp_path / name / "out.json").read_text())

    def stored() -> tuple[str, str, str]:
        with ContextDB(str(db)) as memory:
            p = memory.user("local").get_profile()
        assert p is not None
        return p.name, p.city, p.timezone

    first = run("first", "--user-name", "Ada", "--user-city", "Leeds", "--user-tz", "Europe/London")
    assert stored() == ("Ada", "Leeds", "Europe/London")
    second = run("second")
    assert stored() == ("Ada", "Leeds", "Europe/London")
    assert second["persona"]["text_tokens"] == first["persona"]["text_tokens"]
    assert second["settings"]["user_name"] == ""  # the settings say what was asked
    run("third", "--user-city", "York")
    assert stored() == ("Ada", "York", "Europe/London")
