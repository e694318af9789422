"""Voices from recordings (`cspan voice encode`, `--voice file.wav`), the Context Spanning layout with an embedding
voice, and the clear errors of bad recordings."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from cspan.core.config import CONTEXT_SPANNING, PERSONAPLEX
from cspan.core.errors import AudioInputError, CheckpointError
from cspan.core.prefix import build_persona_prefix, prefix_frames
from cspan.core.voice import (
    VoicePrompt,
    encode_voice_audio,
    find_voice,
    load_voice,
    load_voice_prompt,
    voice_embeddings_form,
)


@pytest.fixture(scope="module")
def greeting(fixture_file) -> Path:
    return fixture_file("audio", "greeting_24k.wav")


def _cli(capsys, *args: str) -> SimpleNamespace:
    """``cspan ARGS`` in this process (a subprocess would pay torch's start-up for each call)."""
    from cspan.core.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_wav_as_voice_is_encoded_not_called_corrupt(tiny_checkpoint, greeting: Path) -> None:
    codes = load_voice(greeting, tiny_checkpoint)
    assert codes.shape == (8, 46) and codes.dtype == torch.long  # 3.65 s -> 46 frames of 1920 samples
    direct, audio = encode_voice_audio(greeting, tiny_checkpoint.mimi)
    assert torch.equal(codes, direct) and audio.loudness_lufs < 0
    assert tiny_checkpoint.load_voice_prompt(greeting).kind == "codes"
    with pytest.raises(CheckpointError, match="needs the checkpoint's Mimi"):  # no codec to encode it with
        load_voice(greeting)


def test_voice_encode_cli_round_trip(tiny_checkpoint_dir, tiny_checkpoint, greeting: Path, tmp_path, capsys) -> None:
    out = tmp_path / "mine.pt"
    done = _cli(capsys, "voice", "encode", str(greeting), str(out), "--checkpoint", str(tiny_checkpoint_dir))
    assert done.returncode == 0, done.stderr
    assert "46 frames" in done.stdout and "-24 LUFS" in done.stdout
    stored = torch.load(out, weights_only=True)
    assert set(stored) == {"codes"}  # the tiny checkpoint uses the Context Spanning layout: codes only
    assert torch.equal(stored["codes"], load_voice(greeting, tiny_checkpoint))
    assert torch.equal(load_voice(out, tiny_checkpoint), stored["codes"])
    # with PersonaPlex's form too: the same codes, plus embeddings and the token ring PersonaPlex's loader reads
    both = tmp_path / "both.pt"
    done = _cli(
        capsys, "voice", "encode", str(greeting), str(both), "--checkpoint", str(tiny_checkpoint_dir), "--embeddings"
    )
    assert done.returncode == 0, done.stderr
    stored = torch.load(both, weights_only=True)
    assert set(stored) == {"codes", "embeddings", "cache"}
    assert stored["embeddings"].shape == (45, 1, 1, 64) and stored["cache"].shape == (1, 17, 4)
    assert load_voice_prompt(both, tiny_checkpoint).kind == "codes"  # codes are preferred where both are stored


def _write(path: Path, pcm: np.ndarray, rate: int = 24000, subtype: str = "PCM_16") -> Path:
    sf.write(path, pcm, rate, subtype=subtype)
    return path


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda d, g: _write(d / "short.wav", sf.read(g, dtype="float32")[0][:24000]), "1.00 s long"),
        (lambda d, g: _write(d / "long.wav", np.tile(sf.read(g, dtype="float32")[0], 9)), "over the limit of 30 s"),
        (lambda d, g: _write(d / "silent.wav", np.zeros(72000, dtype=np.float32)), "silent"),
        (lambda d, g: _write(d / "quiet.wav", np.full(72000, 1e-5, dtype=np.float32)), "silent"),
        (lambda d, g: (d / "text.wav").write_text("not audio at all\n") and d / "text.wav", "cannot decode audio"),
        (
            lambda d, g: _write(d / "nan.wav", np.full(72000, np.nan, dtype=np.float32), subtype="FLOAT"),
            "silent \\(peak below -80 dBFS; its 72000 NaN or infinite samples count as silence\\)",
        ),
    ],
)
def test_bad_recording_gives_a_clear_error(tiny_checkpoint, greeting, tmp_path, make, expect) -> None:
    path = make(tmp_path, greeting)
    with pytest.raises(AudioInputError, match=expect) as err:
        load_voice(path, tiny_checkpoint)
    assert str(path) in str(err.value)


def test_a_many_channel_high_rate_recording_is_decoded_one_channel_at_a_time(tmp_path: Path) -> None:
    """A client's recording is at most 8 MiB, but a compressed file of many channels at a high rate decodes to far
    more: 8 channels at 655 kHz for 29 s is 3 MB of FLAC and 690 MB of float32. Only channel 0 is kept, so the
    other channels are read a block at a time instead of all at once; the samples are those of channel 0 alone."""
    import tracemalloc

    from cspan.core.voice import prepare_voice_audio

    rate, seconds, channels = 96_000, 29, 8
    t = np.arange(rate * seconds) / rate
    voice = (0.1 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    many, mono = tmp_path / "many.flac", tmp_path / "mono.flac"
    sf.write(mono, voice, rate, subtype="PCM_16")
    with sf.SoundFile(many, "w", rate, channels, subtype="PCM_16") as f:
        for o in range(0, len(voice), rate):
            block = np.zeros((len(voice[o : o + rate]), channels), dtype=np.float32)
            block[:, 0] = voice[o : o + rate]
            f.write(block)

    def peak_of(path: Path) -> tuple[object, int]:
        data = path.read_bytes()
        tracemalloc.start()
        try:
            return prepare_voice_audio(io.BytesIO(data)), tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    prepare_voice_audio(mono)  # imports and first-call caches are not what is measured
    expected, mono_peak = peak_of(mono)
    got, peak = peak_of(many)
    all_channels = len(voice) * channels * 4  # 89 MB: what reading every channel at once took
    assert peak < mono_peak + all_channels / 4, (peak, mono_peak, all_channels)
    assert np.array_equal(got.pcm, expected.pcm) and got.loudness_lufs == expected.loudness_lufs


def test_bytes_that_are_not_audio_are_refused_without_an_object_repr() -> None:
    """A client's recording arrives as bytes: libsndfile names the file object it opened (``<_io.BytesIO object at
    0x...>``), which must not reach the client; the cause and the formats it can send do."""
    import io

    from cspan.core.voice import prepare_voice_audio

    with pytest.raises(AudioInputError) as err:
        prepare_voice_audio(io.BytesIO(b"RIFF this is not a wave file at all" * 20))
    message = str(err.value)
    assert message.startswith("the voice recording: cannot decode audio (Format not recognised.)"), message
    assert "object at 0x" not in message and "BytesIO" not in message
    assert "MP3" in message


def test_a_damaged_pt_voice_is_called_damaged_not_undecodable_audio(
    tiny_checkpoint, tiny_checkpoint_dir: Path, tmp_path: Path, capsys
) -> None:
    """A ``.pt`` that is not a torch file (a truncated download, a voices.tgz member gone bad) is refused as a damaged
    voice file by the loader and listed as such by ``cspan model info``, never decoded as a recording."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_dir, folder)
    damaged = folder / "voices" / "damaged.pt"
    damaged.write_bytes(b"garbage, not a zip archive" * 10)
    with pytest.raises(CheckpointError, match="named as a torch file but is not one") as err:
        load_voice_prompt(damaged, tiny_checkpoint)
    assert str(damaged) in str(err.value) and "decode audio" not in str(err.value)
    info = _cli(capsys, "model", "info", str(folder))
    assert info.returncode == 0, info.stderr
    (line,) = [ln for ln in info.stdout.splitlines() if ln.strip().startswith("damaged:")]
    assert "unreadable: named as a torch file but is not one" in line, line


def test_a_directory_as_a_voice_is_called_a_directory(tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a directory; pass a voice name") as err:
        find_voice(tmp_path, tiny_checkpoint)
    assert f"CSPAN_VOICES_DIR={tmp_path}" in str(err.value)


def test_voice_encode_cli_errors_are_clear(tiny_checkpoint_dir: Path, greeting: Path, tmp_path: Path, capsys) -> None:
    short = _write(tmp_path / "short.wav", sf.read(greeting, dtype="float32")[0][:30000])
    out = tmp_path / "v.pt"
    for args, expect, code in (
        ((str(short), str(out)), "a voice needs 2 to 30 s", 1),
        ((str(tmp_path / "missing.wav"), str(out)), "no such file", 1),
        ((str(greeting), str(tmp_path / "v.wav")), "ends in .pt", 2),  # a bad argument, as infer's --output-wav
        ((str(greeting), str(tmp_path)), "ends in .pt", 2),
        ((str(greeting), str(short / "v.pt")), "not a directory", 1),
    ):
        done = _cli(capsys, "voice", "encode", *args, "--checkpoint", str(tiny_checkpoint_dir))
        assert done.returncode == code and expect in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("cspan voice encode: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert not out.exists() and not list(tmp_path.glob(".*.part"))


def test_voice_encode_refuses_the_embeddings_form_on_a_codec_of_fewer_codes(
    greeting: Path, tmp_path: Path, capsys
) -> None:
    """PersonaPlex's embeddings form holds its 440 Hz sine frame (codes up to 1611 of the released 2048-code Mimi) as
    the user's audio: on a codec of 1024 codes the embedding lookup was an IndexError traceback. Now one line, before
    the LM loads: exit 1 where the checkpoint's PersonaPlex layout chose the form, exit 2 where --embeddings asked for
    it; the codes form (--no-embeddings) is still written, in the codec's range."""
    import json

    from cspan.core.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / "small-codec", card=1024)
    config = json.loads((folder / "config.json").read_text())
    assert config["card"] == 1024 and config["mimi_config"]["quantizer"]["bins"] == 1024
    config["prefix_layout"] = "personaplex"  # the form is then the default, as for PersonaPlex's base
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "v.pt"
    cause = (
        "this model's audio streams have 1024 codes, but PersonaPlex's embeddings form of a voice holds the user's "
        "placeholder frame (PersonaPlex's 440 Hz sine frame, codes of the released 2048-code Mimi, up to 1611); "
        "write the codes form only (cspan voice encode --no-embeddings)\n"
    )
    for flags, code, where in (
        ((), 1, f"checkpoint {str(folder)!r} (PersonaPlex's prefix layout): "),
        (("--embeddings",), 2, f"--embeddings: checkpoint {str(folder)!r}: "),
    ):
        done = _cli(capsys, "voice", "encode", str(greeting), str(out), "--checkpoint", str(folder), *flags)
        assert (done.returncode, done.stderr) == (code, f"cspan voice encode: error: {where}{cause}")
        assert not out.exists()
    done = _cli(capsys, "voice", "encode", str(greeting), str(out), "--checkpoint", str(folder), "--no-embeddings")
    assert done.returncode == 0, done.stderr
    stored = torch.load(out, weights_only=True)
    assert set(stored) == {"codes"} and stored["codes"].shape == (8, 46)
    assert int(stored["codes"].min()) >= 0 and int(stored["codes"].max()) < 1024
    # the library's own check, for a caller that builds the form from a loaded model
    from cspan.core.checkpoint import load_checkpoint

    lm = load_checkpoint(folder).lm
    with pytest.raises(CheckpointError, match=r"^this model's audio streams have 1024 codes, but PersonaPlex's"):
        voice_embeddings_form(stored["codes"], lm)
    form = voice_embeddings_form(stored["codes"], lm, user_placeholder=[1] * 8)  # its own placeholder: taken
    assert form["embeddings"].shape == (45, 1, 1, 64)


def test_voice_encode_reads_the_recording_before_the_checkpoint(greeting: Path, tmp_path: Path, capsys) -> None:
    """A missing recording was reported only after the checkpoint resolved: without --checkpoint, offline, the
    error was the Hub's, not the recording's."""
    done = _cli(capsys, "voice", "encode", str(tmp_path / "missing.wav"), str(tmp_path / "v.pt"))
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"cspan voice encode: error: {tmp_path / 'missing.wav'}: no such file;")


def test_voice_encode_suggests_a_path_with_spaces_quoted(tiny_checkpoint_dir, greeting: Path, tmp_path, capsys) -> None:
    """`use it with --voice my dir/é v.pt` could not be pasted into a shell."""
    out = tmp_path / "my dir" / "é v.pt"
    done = _cli(capsys, "voice", "encode", str(greeting), str(out), "--checkpoint", str(tiny_checkpoint_dir))
    assert done.returncode == 0 and out.is_file(), done.stderr
    assert done.stdout.endswith(f"; use it with --voice '{out}'\n"), done.stdout


def test_voice_encode_into_a_read_only_folder_fails_before_loading(tmp_path: Path, greeting: Path, capsys) -> None:
    """Issue 22 (F7): a folder that cannot be written is one line naming the path and the cause, found before the
    checkpoint loads (the checkpoint here does not even exist), not torch's traceback after the encoding."""
    from fs_faults import read_only_folder

    (tmp_path / "v.pt").write_bytes(b"x")
    for out, cause in (
        (tmp_path / "ro" / "a.pt", "(permission denied|operation not permitted)"),
        (tmp_path / "v.pt" / "a.pt", "not a directory"),
    ):
        with read_only_folder(tmp_path / "ro"):
            done = _cli(capsys, "voice", "encode", str(greeting), str(out), "--checkpoint", str(tmp_path / "nope"))
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"cspan voice encode: error: {out}: cannot write: "), done.stderr
        assert re.search(cause, lines[0]), lines[0]
    assert not list((tmp_path / "ro").iterdir())


@torch.no_grad()
def test_context_spanning_layout_with_an_embedding_voice(tiny_checkpoint) -> None:
    """An embedding voice opens the prefix with its E frames in both layouts; reading it gives the same state as the
    codes it was made from, from position E on (the embeddings are those codes' input embeddings)."""
    lm = tiny_checkpoint.lm
    codes = tiny_checkpoint.load_voice("tiny1")[:, :6]
    form = voice_embeddings_form(codes, lm)
    from cspan.core.voice import frames_from_ring

    initial = [lm.text_initial_token_id] + [lm.initial_token_id] * lm.n_q
    voice = VoicePrompt(
        source=Path("x.pt"),
        embeddings=form["embeddings"][:, 0, 0],
        frames=frames_from_ring(form["cache"][0], 5, lm.delays, initial),
    )
    tok = tiny_checkpoint.tokenizer
    cs = build_persona_prefix(tok, "Be kind.", voice, layout=CONTEXT_SPANNING)
    L = len(cs.text_ids)
    assert cs.num_frames == 5 + 1 + L + 1 and cs.voice_frames == 5 and cs.embeddings.shape == (5, 64)
    pp = build_persona_prefix(tok, "Be kind.", voice, layout=PERSONAPLEX)
    assert pp.num_frames == 5 + 6 + L + 6
    by_codes = build_persona_prefix(tok, "Be kind.", codes, layout=PERSONAPLEX)
    assert by_codes.num_frames == pp.num_frames and by_codes.voice_frames == 5
    from cspan.core.prefix import prefix_inputs
    from cspan.core.streams import delay_tokens

    def hidden(prefix):
        delayed = delay_tokens(prefix.frames, lm.delays, initial)[:, : prefix.num_frames + 1]
        x = prefix_inputs(lm, delayed, prefix.embeddings)
        return lm.temporal(None, lm.new_state(1), embeddings=x)[0]

    assert torch.equal(hidden(pp)[:, 5:], hidden(by_codes)[:, 5:])


def test_layout_frame_counts() -> None:
    voice = torch.full((8, 4), 9)
    assert prefix_frames([7, 8], voice, layout=PERSONAPLEX).shape == (17, 4 - 1 + 6 + 2 + 6)
    assert prefix_frames([], None, layout=PERSONAPLEX).shape == (17, 11)  # silences always; frame 0 dropped
    assert prefix_frames([], None, layout=CONTEXT_SPANNING).shape == (17, 0)
    with pytest.raises(ValueError, match="not both"):
        prefix_frames([], voice, voice_frames=torch.zeros(17, 2, dtype=torch.long))


def test_unknown_voice_of_a_personaplex_checkpoint_without_its_archive_says_why(tmp_path: Path) -> None:
    """``--voice NATF2`` on a PersonaPlex checkpoint whose voices.tgz is missing (an offline cache that lacks it)."""
    pp = SimpleNamespace(prefix_layout=PERSONAPLEX, archive_voices={}, voices={})
    with pytest.raises(CheckpointError, match=r"known voices: none.*no voices\.tgz came with it.*HF_HUB_OFFLINE"):
        find_voice("NATF2", pp)
    cs = SimpleNamespace(prefix_layout=CONTEXT_SPANNING, archive_voices={}, voices={})
    with pytest.raises(CheckpointError, match="known voices: none") as err:
        find_voice("NATF2", cs)
    assert "voices.tgz" not in str(err.value)


def test_undecodable_recording_is_named_in_words(tmp_path: Path) -> None:
    """Issue 22 (final trial): a recording libsndfile cannot open is named as the caller names it, with libsndfile's
    reason, not soundfile's "Error opening <_io.BytesIO object at 0x...>" (a client's bytes) or the path as bytes."""
    from cspan.core.audio import read_audio
    from cspan.core.voice import prepare_voice_audio

    with pytest.raises(AudioInputError) as err:
        prepare_voice_audio(io.BytesIO(b"not audio at all\n" * 50))
    assert str(err.value).startswith("the voice recording: cannot decode audio (Format not recognised.);"), err.value
    text = tmp_path / "text.wav"
    text.write_text("not audio at all\n")
    with pytest.raises(AudioInputError) as err:
        read_audio(text)
    assert str(err.value).startswith(f"{text}: cannot decode audio (Format not recognised.);"), err.value
    assert "b'" not in str(err.value) and "Error opening" not in str(err.value)


def test_a_voices_dir_that_is_no_folder_is_said(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """$CSPAN_VOICES_DIR naming a missing folder was ignored without a word: every voice name of it was unknown."""
    monkeypatch.setenv("CSPAN_VOICES_DIR", str(tmp_path / "typo"))
    with pytest.raises(CheckpointError, match=rf"CSPAN_VOICES_DIR={tmp_path / 'typo'}: not a folder"):
        find_voice("NATF2", tiny_checkpoint)


def test_a_voice_path_under_home_written_with_a_tilde_is_found(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "my home"
    (home / "voices").mkdir(parents=True)
    shutil.copyfile(tiny_checkpoint.voices["tiny0"], home / "voices" / "me.pt")
    monkeypatch.setenv("HOME", str(home))
    assert tiny_checkpoint.load_voice_prompt("~/voices/me.pt").codes.shape[0] == 8
