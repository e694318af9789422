"""The `transformers` ASR engine on a tiny random CTC model written to disk (no Hub, no download).

The model is untrained, so its text is noise; the test checks the plumbing: loading a local directory,
resampling to the model's rate, word timings inside the clip, and the server endpoint on top of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_ctc_dir(tmp_path_factory) -> Path:
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
        Wav2Vec2Processor,
    )

    path = tmp_path_factory.mktemp("tiny-ctc")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4}
    vocab.update({c: 5 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz'")})
    (path / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = Wav2Vec2CTCTokenizer(str(path / "vocab.json"), word_delimiter_token="|")
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True)
    Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(path)
    config = Wav2Vec2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16,) * 7,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(config)
    with torch.no_grad():
        model.lm_head.bias[0] = -10.0  # never the blank: every 20 ms frame yields a letter or a word break
    model.save_pretrained(path)
    return path


def test_transformers_engine_runs_a_local_ctc_model(tiny_ctc_dir: Path, fixture_file) -> None:
    from cspan.backends.asr.engines import TransformersEngine

    pcm, sr = sf.read(fixture_file("audio", "question_weather_24k.wav"), dtype="float32")
    engine = TransformersEngine.load(tiny_ctc_dir, device="cpu")
    assert engine.sample_rate == 16000 and engine.name == "transformers"
    result = engine.transcribe(pcm, sr)
    assert result.text and result.words is not None
    assert [w.text for w in result.words] == result.text.split()
    duration = pcm.size / sr
    assert all(0.0 <= w.start_s <= w.end_s <= duration for w in result.words)
    assert engine.transcribe(pcm, sr) == result  # deterministic
    assert engine.transcribe(np.zeros(0, np.float32), sr).text == ""


async def test_server_with_transformers_engine(tiny_ctc_dir: Path, fixture_file) -> None:
    import httpx

    from cspan.backends.asr import OpenAITranscriber
    from cspan.backends.asr.engines import load_engine
    from cspan.backends.asr.server import ASRServerSettings, create_app

    pcm, sr = sf.read(fixture_file("audio", "question_weather_24k.wav"), dtype="float32")
    engine = load_engine("transformers", model=tiny_ctc_dir, device="cpu")
    app = create_app(engine, ASRServerSettings(allowed_hosts=("asr",)))  # the in-process client's Host
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://asr") as client:
        t = OpenAITranscriber("http://asr", api_key="", word_timestamps=True, client=client)
        result = await t.transcribe(pcm, sr)
        health = (await client.get("/health")).json()
    assert health["engine"] == "transformers" and health["model"] == str(tiny_ctc_dir)
    assert result == engine.transcribe(pcm, sr)
