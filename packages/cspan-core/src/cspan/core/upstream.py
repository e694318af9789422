"""Moshi's and PersonaPlex's command-line flags and their counterparts here, declared once.

``docs/COMING-FROM-MOSHI.md`` maps upstream commands, flags and files to ours for a reader; :data:`UPSTREAM_FLAGS`
is the same mapping for the ``cspan`` command line, which answers an upstream flag given to a verb with its
counterpart instead of a look-alike (``--voice-prompt NATF2.pt`` got "did you mean '--text-prompt'?", ``--greedy``
"'--seed'?"): ``unrecognized arguments: --greedy; --greedy is PersonaPlex's: here, --temp 0 --temp-text 0``. A flag
with no counterpart says so, and why. ``tests/test_docs.py`` holds the page's tables and this list to each other:
every upstream flag of the tables is here, with the counterpart the table gives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["UPSTREAM_DOC", "UPSTREAM_FLAGS", "UpstreamFlag", "upstream_hint", "upstream_positional_hint"]

UPSTREAM_DOC = "docs/COMING-FROM-MOSHI.md"
"""The page that maps Moshi's and PersonaPlex's commands to ours (named in the hint)."""

_PP = "PersonaPlex's"
_MOSHI = "Moshi's"
_BOTH = "Moshi's and PersonaPlex's"
_RUNTIME = ("infer", "serve")  # the verbs that run a conversation (upstream: moshi.offline, moshi.server)


@dataclass(frozen=True)
class UpstreamFlag:
    """One upstream flag that no verb here has.

    Attributes:
        flag: the upstream flag (``--voice-prompt``).
        origin: whose flag it is (``PersonaPlex's``).
        use: what to give here instead, as typed (``--temp 0 --temp-text 0``), or ``None`` when there is no
            counterpart.
        note: how to use the counterpart, or why there is none.
        verbs: the verbs that answer the flag; empty: every verb that has each flag ``use`` names.
    """

    flag: str
    origin: str
    use: str | None
    note: str = ""
    verbs: tuple[str, ...] = ()

    @property
    def flags(self) -> list[str]:
        """The flags of ours that ``use`` names (``['--temp', '--temp-text']``)."""
        return re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", self.use or "")

    def answers(self, verb: str, options: set[str] | frozenset[str]) -> bool:
        """Whether ``verb`` (``infer``, ``bench latency``), whose option strings are ``options``, answers it."""
        if self.verbs:
            return verb in self.verbs
        return bool(self.flags) and all(f in options for f in self.flags)

    def hint(self) -> str:
        """The sentence that answers it: its counterpart and how to use it, or that it has none."""
        if self.use is None:
            return f"{self.flag} is {self.origin} and has no counterpart here: {self.note}"
        return f"{self.flag} is {self.origin}: here, {self.use}" + (f" ({self.note})" if self.note else "")


UPSTREAM_FLAGS: dict[str, UpstreamFlag] = {
    f.flag: f
    for f in [
        # the checkpoint (moshi.offline, moshi.server, moshi.run_inference)
        UpstreamFlag("--hf-repo", _BOTH, "--checkpoint REPO", "a Hugging Face repo or a local folder"),
        UpstreamFlag(
            "--moshi-weight",
            _BOTH,
            "--checkpoint FILE.safetensors",
            "the other files are taken from its folder, or with --base DIR_OR_REPO those it lacks",
        ),
        UpstreamFlag(
            "--mimi-weight",
            _BOTH,
            "--checkpoint DIR",
            "the folder's tokenizer-e351c8d8-checkpoint125.safetensors, or config.json's mimi_name",
        ),
        UpstreamFlag(
            "--tokenizer",
            _BOTH,
            "--checkpoint DIR",
            "the folder's tokenizer_spm_32k_3.model, or config.json's tokenizer_name",
        ),
        UpstreamFlag("--config-path", _MOSHI, "--checkpoint DIR", "the folder's config.json"),
        UpstreamFlag("--lm-config", _MOSHI, "--checkpoint DIR", "the folder's config.json"),  # moshi.run_inference
        UpstreamFlag(
            "--lora-weight",
            _MOSHI,
            "--checkpoint DIR/lora.safetensors --base DIR_OR_REPO",
            "moshi-finetune's adapters, with its config.json next to them",
        ),
        UpstreamFlag(
            "--half", _BOTH, None, "the checkpoint's stored dtype (bf16) is used; load_checkpoint(dtype=...)", _RUNTIME
        ),
        UpstreamFlag("--cpu-offload", _PP, None, "the model is not offloaded to the CPU", _RUNTIME),
        # the persona (moshi.offline)
        UpstreamFlag(
            "--voice-prompt",
            _PP,
            "--voice NAME|FILE|RECORDING",
            "NATF2 for NATF2.pt of the checkpoint's voices, a .pt voice file, or a 2-30 s recording",
        ),
        UpstreamFlag(
            "--voice-prompt-dir",
            _PP,
            "the variable CSPAN_VOICES_DIR=DIR",
            "adds a folder of voices; a PersonaPlex base's voices.tgz is fetched with the checkpoint",
            _RUNTIME,
        ),
        # sampling (moshi.offline)
        UpstreamFlag("--temp-audio", _PP, "--temp TEMP", "the audio temperature; --temp-text is the text's"),
        UpstreamFlag("--greedy", _PP, "--temp 0 --temp-text 0"),
        UpstreamFlag(
            "--topk-audio", _PP, None, "top-k is fixed at upstream's defaults, 250 for audio and 25 for text", _RUNTIME
        ),
        UpstreamFlag(
            "--topk-text", _PP, None, "top-k is fixed at upstream's defaults, 250 for audio and 25 for text", _RUNTIME
        ),
        UpstreamFlag("--cpu", "Moshi's Rust server's (moshi-backend)", "--device cpu"),
        UpstreamFlag(
            "--cfg-coef", _MOSHI, None, "no classifier-free guidance (upstream's default 1.0 is none)", _RUNTIME
        ),
        UpstreamFlag(
            "--batch-size",
            _MOSHI,
            None,
            "one conversation per run; cspan serve --max-sessions N batches live conversations",
            ("infer",),
        ),
        # the server (moshi.server)
        UpstreamFlag(
            "--ssl",
            _BOTH,
            "--ssl-certfile DIR/cert.pem --ssl-keyfile DIR/key.pem",
            "https and wss; or a reverse proxy in front",
        ),
        UpstreamFlag("--static", _BOTH, None, "the page is built in", ("serve",)),
        UpstreamFlag(
            "--gradio-tunnel",
            _BOTH,
            None,
            "no tunnel: serve with --ssl-certfile and --ssl-keyfile, or behind a reverse proxy",
            ("serve",),
        ),
        UpstreamFlag("--gradio-tunnel-token", _MOSHI, None, "no tunnel (see --gradio-tunnel)", ("serve",)),
    ]
}
"""Upstream flags by name (``docs/COMING-FROM-MOSHI.md``'s tables)."""


_AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3")


def upstream_positional_hint(words: list[str], options: set[str] | frozenset[str]) -> str | None:
    """The answer to Moshi's positional input and output files (``python -m moshi.run_inference in.wav out.wav``)
    among the unrecognised ``words`` of a verb whose option strings are ``options``: here they are ``--input-wav``
    and ``--output-wav``; ``None`` when no such word is there or the verb takes no ``--input-wav``."""
    audio = [w for w in words if not w.startswith("-") and w.lower().endswith(_AUDIO_SUFFIXES)]
    if not audio or "--input-wav" not in options:
        return None
    given = f"--input-wav {audio[0]}" + (f" --output-wav {audio[1]}" if len(audio) > 1 else " --output-wav OUT.wav")
    return f"moshi.run_inference's positional IN OUT files are flags here: {given}"


def upstream_hint(flag: str, verb: str, options: set[str] | frozenset[str]) -> str | None:
    """The answer to upstream ``flag`` given to ``verb`` (whose option strings are ``options``), or ``None`` when
    it is no upstream flag this verb answers (then a look-alike may be suggested)."""
    entry = UPSTREAM_FLAGS.get(flag)
    if entry is None or flag in options or not entry.answers(verb, options):
        return None
    return entry.hint()
