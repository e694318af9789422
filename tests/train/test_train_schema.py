"""Dialogue schema validation, the text alignment convention, ``<ret>`` placement and the MoshiRAG delay sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cspan.core.constants import EPAD, PAD, RET
from cspan.train.data import align_text, build_text_row
from cspan.train.dataset import sample_rag_delay
from cspan.train.errors import DataError
from cspan.train.schema import SCHEMA_ID, dialogue_json_schema, load_dialogue, validate_dialogue

GOOD = {
    "persona": "You are Ada.",
    "profile": {"name": "Priya", "city": "Sydney"},
    "turns": [
        {"speaker": "user", "words": [{"word": "hours", "start": 0.1, "end": 0.4}]},
        {
            "speaker": "agent",
            "ret": True,
            "reference": "Open at seven.",
            "tool": "lookup",
            "arguments": {"q": "hours"},
            "body_word": 2,
            "words": [
                {"word": "let", "start": 1.0, "end": 1.2},
                {"word": "me", "start": 1.25, "end": 1.4},
                {"word": "open", "start": 2.0, "end": 2.3},
            ],
        },
    ],
}


def _with(path: tuple, value) -> dict:
    data = json.loads(json.dumps(GOOD))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("turns", 1, "words", 0, "start"), -1.0, "turns[1].words[0].start"),
        (("turns", 0, "speaker"), "moderator", "turns[0].speaker"),
        (("turns", 1, "words"), [], "turns[1].words"),
        (("turns", 1, "words", 2, "end"), 1.5, "turns[1].words[2]"),
        (("turns", 1, "reference"), "  ", "turns[1]"),
        (("turns", 1, "body_word"), 9, "turns[1]"),
        (("turns", 0, "tool"), "x", "turns[0]"),
        (("persona",), 3, "persona"),
        (("profile", "nmae"), "typo", "profile.nmae"),
        # values the printed JSON Schema refuses were coerced ("ret": "false" is True, "start": true is 1.0 s)
        (("turns", 1, "words", 0, "start"), True, "turns[1].words[0].start"),
        (("turns", 1, "words", 0, "end"), "1.2", "turns[1].words[0].end"),
        (("turns", 1, "ret"), "false", "turns[1].ret"),
        (("turns", 1, "body_word"), 1.0, "turns[1].body_word"),
    ],
)
def test_validation_names_file_and_field(tmp_path: Path, path: tuple, value, field: str) -> None:
    file = tmp_path / "d1.json"
    file.write_text(json.dumps(_with(path, value)))
    with pytest.raises(DataError) as err:
        load_dialogue(file)
    assert str(file) in str(err.value)
    assert f"field {field}" in str(err.value)


def test_bad_json_and_good_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"turns": [')
    with pytest.raises(DataError, match=r"x\.json.*not valid JSON \(line 1"):
        load_dialogue(bad)
    for text, why in [
        ('{"turns": 1' + "0" * 5000 + "}", r"not valid JSON \(a number is longer than 4300 digits\)$"),
        ("[" * 100_000 + "]" * 100_000, r"not valid JSON \(arrays or objects nested too deeply\)$"),
    ]:
        bad.write_text(text)
        with pytest.raises(DataError, match=why):
            load_dialogue(bad)
    good = validate_dialogue(GOOD)
    assert validate_dialogue(_with(("turns", 1, "words", 0, "start"), 1)).turns[1].words[0].start == 1.0  # an int
    assert good.turns[1].body_index == 2 and good.profile is not None and good.profile.city == "Sydney"
    unsorted = _with(("turns", 1, "words", 1, "start"), 0.5)
    with pytest.raises(DataError, match=r"words\[1\] starts at 0.5 s, before words\[0\]"):
        validate_dialogue(unsorted, "u.json")


def test_json_schema_describes_the_format() -> None:
    schema = dialogue_json_schema()
    assert schema["$id"] == SCHEMA_ID
    assert set(schema["properties"]) == {"persona", "voice", "profile", "turns", "meta"}
    assert schema["required"] == ["turns"]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(GOOD, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_with(("turns", 0, "speaker"), "moderator"), schema)


def test_align_text_convention() -> None:
    # word A (2 tokens) at 0.10 s -> frame 1; word B (1 token) at 0.12 s collides -> queued to frame 3;
    # word C at 0.50 s -> frame 6 (0.5 * 12.5 = 6.25); word D past the end
    words = [([101, 102], 0.10), ([103], 0.12), ([104, 105], 0.50), ([106], 0.95)]
    out = align_text(words, 9)
    assert out.tokens == [EPAD, 101, 102, 103, PAD, EPAD, 104, 105, PAD]
    assert out.first_frame == [1, 3, 6, None]
    assert out.dropped == 1
    # a word starting at frame 0 has no EPAD before it; a full queue at the end drops tokens
    out = align_text([([7, 8, 9], 0.0)], 2)
    assert out.tokens == [7, 8] and out.dropped == 1


class WordTokenizer:
    """One id per character (ids 30..), enough to check placement."""

    def encode(self, text: str) -> list[int]:
        return [30 + (ord(ch) % 200) for ch in text]


def test_ret_on_the_frame_before_the_grounded_turn_and_deadline() -> None:
    d = validate_dialogue(GOOD)
    text, spans, stats = build_text_row(d, WordTokenizer(), 40, max_span_frames=600)
    # "let" at 1.0 s -> frame 12 (3 tokens 12..14), "me" at 1.25 s -> frame 15, "open" at 2.0 s -> frame 25
    assert text[11].item() == RET  # the EPAD before "let" became <ret>
    assert text[12:15].tolist() == WordTokenizer().encode("let")
    assert text[14].item() != EPAD and text[24].item() == EPAD
    (span,) = spans
    assert span.ret_frame == 11
    assert span.deadline_frame == 25 - 2  # body word "open" starts at frame 25
    assert span.ids[0] == 12 and span.ids[-1] == 13 and span.tool == "lookup" and span.turn == 1
    assert stats["dropped_tokens"] == 0 and stats["ret_overwrote"] == 0
    # user words never reach the text row
    assert 30 + ord("h") not in text[:10].tolist()


def test_grounded_turn_in_the_first_frame_is_rejected() -> None:
    data = _with(("turns", 1, "words", 0, "start"), 0.0)
    with pytest.raises(DataError, match=r"field turns\[1\]\.words\[0\]\.start: .*no frame for <ret>"):
        build_text_row(validate_dialogue(data), WordTokenizer(), 40, where="d.json")


def test_moshirag_delay_sampler() -> None:
    rng = np.random.default_rng(0)
    # short lead (< 2 s = 25 frames): uniform over [0, lead]
    short = [sample_rag_delay(10, rng) for _ in range(4000)]
    assert min(short) == 0 and max(short) == 10
    assert abs(np.mean(short) - 5.0) < 0.3
    # long lead: 80 % uniform in [13, lead - 13] (>= 1 s after <ret>, >= 1 s before the body), 20 % over [0, lead]
    lead = 60
    long = np.array([sample_rag_delay(lead, rng) for _ in range(20000)])
    assert long.min() >= 0 and long.max() <= lead
    outside = np.mean((long < 13) | (long > lead - 13))
    # the 20 % branch falls outside [13, 47] with probability 26 / 61
    assert abs(outside - 0.2 * 26 / 61) < 0.02
    assert abs(np.mean(long) - 30.0) < 0.5
    # deterministic for a given generator state
    assert [sample_rag_delay(40, np.random.default_rng([1, 2])) for _ in range(3)] == [
        sample_rag_delay(40, np.random.default_rng([1, 2]))
    ] * 3
    # exactly 2 s of lead is "long"; 25 frames give an empty [13, 12] range and fall back to the whole lead
    assert 0 <= sample_rag_delay(25, rng) <= 25
    assert sample_rag_delay(0, rng) in (0, 1)


def test_the_training_doc_example_is_valid(repo_root: Path) -> None:
    """docs/TRAINING.md's dialogue example validates as written (its body_word once pointed past the turn's words)."""
    import re

    doc = (repo_root / "docs" / "TRAINING.md").read_text()
    example = json.loads(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
    dialogue = validate_dialogue(example, "docs/TRAINING.md")
    grounded = [turn for turn in dialogue.turns if turn.ret]
    assert grounded and all(turn.body_word is None or turn.body_word < len(turn.words) for turn in grounded)


def test_a_moshi_finetune_annotation_is_named_with_what_to_write_instead(tmp_path: Path) -> None:
    """kyutai-labs/moshi-finetune's ``annotate.py`` writes ``{"alignments": [[word, [start, end], speaker], ...]}``
    beside each stereo wav (left = Moshi): it got "field turns: Field required; field alignments: Extra inputs are not
    permitted". Now the file is named as that format, with the turns to write and the channels to swap."""
    path = tmp_path / "a.json"
    path.write_text(
        json.dumps({"alignments": [["hello", [0.1, 0.4], "SPEAKER_MAIN"], ["hi", [1.0, 1.2], "SPEAKER_1"]]})
    )
    with pytest.raises(DataError) as err:
        load_dialogue(path)
    message = str(err.value)
    assert message.startswith(f"dialogue file {str(path)!r} is kyutai-labs/moshi-finetune's annotate.py output")
    assert '"turns"' in message and "left = user, right = agent" in message and "swap the channels" in message
    assert "Extra inputs" not in message
    # a dialogue that has turns and a stray "alignments" still gets the schema's own answer
    with pytest.raises(DataError, match=r"field alignments: Extra inputs are not permitted"):
        validate_dialogue({**GOOD, "alignments": []}, "b.json")
