"""``cspan model tiny``: a small random-weight checkpoint in exactly the released layout.

The folder holds what a Kyutai / PersonaPlex base repo holds (``model.safetensors``,
``tokenizer-e351c8d8-checkpoint125.safetensors``, ``tokenizer_spm_32k_3.model``, ``config.json``) plus
``voices/<name>.pt`` as in the Context Spanning release, so every loading, streaming and serving path runs on a
CPU without the 7B:

- the LM has the 7B's structure (RoPE, float32 RMSNorm, SiLU-gated FFN, multi-linear depformer with weights per
  step, the 7B's delays, 17 streams, dep_q 16 or 8) with small widths, ``card`` 2048 (so the placeholder codes
  ``SILENCE_TOKENS`` / ``SINE_TOKENS`` are valid; :func:`build_tiny_checkpoint`'s ``card`` makes a codec of fewer
  codes, for the paths that must refuse one) and ``text_card`` = the tokenizer's vocabulary (1000);
- Mimi has the real framing (24 kHz, SEANet ratios [8, 6, 5, 4], 12.5 Hz, 1920 samples per frame) with small
  widths; its codebook centroids are latents of a synthetic signal plus noise, so codes vary with the input;
- the SentencePiece model is trained on the spot on :mod:`cspan.core.tiny_corpus` with byte fallback, so ids
  0..3 are ``<unk>``, ``<s>``, ``</s>``, ``<pad>`` (Moshi's EPAD, BOS, EOS, PAD) and ids 4, 12, 13 are the byte
  pieces ``<0x00>``, ``<0x08>``, ``<0x09>`` (``<ret>``, span open, span close) as in the released tokenizer;
- the voices are Mimi encodings (by this tiny Mimi) of synthetic voiced signals.

Everything is drawn from generators seeded by ``seed`` and computed with one CPU thread, so two builds with the
same seed on the same machine write byte-identical files.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import CONFIG_FILE, LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_DIR
from .config import LMConfig, MimiConfig
from .errors import CheckpointError
from .lm import LMModel
from .mimi import Mimi

TINY_TEXT_CARD = 1000
"""SentencePiece vocabulary size of the tiny tokenizer (= the tiny LM's ``text_card``)."""
TINY_CARD = 2048
"""Audio codebook size (as the real Mimi: the placeholder codes go up to 2008)."""
TINY_VOICES: dict[str, tuple[int, float, float]] = {"tiny0": (20, 110.0, 150.0), "tiny1": (16, 190.0, 250.0)}
"""Voice name -> (frames, start and end fundamental frequency in Hz of its synthetic voiced signal)."""

_LM_STD = 0.02
_SAMPLE_RATE = 24000
_FRAME = 1920


def tiny_lm_config(dep_q: int = 16, text_card: int = TINY_TEXT_CARD, card: int = TINY_CARD) -> LMConfig:
    """The tiny LM: the PersonaPlex/Moshi 7B configuration with small widths.

    dim 64 (4 heads, 2 layers, hidden_scale 4.125), depformer dim 32 (2 heads, 2 layers, FFN 132), context 3000,
    ``card`` (default 2048) codes per audio stream, ``text_card`` as given, n_q 16, the 7B's delays.

    Raises:
        ValueError: ``dep_q`` is not 8 or 16.
    """
    if dep_q not in (8, 16):
        raise ValueError(f"dep_q must be 16 (PersonaPlex) or 8 (Moshi), got {dep_q}")
    data = LMConfig.personaplex_7b().to_upstream()
    data.update(
        dim=64,
        num_heads=4,
        num_layers=2,
        text_card=text_card,
        card=card,
        dep_q=dep_q,
        depformer_dim=32,
        depformer_num_heads=2,
        depformer_num_layers=2,
        depformer_dim_feedforward=int(4.125 * 32),
    )
    return LMConfig.from_upstream(data)


def tiny_mimi_config(card: int = TINY_CARD) -> MimiConfig:
    """The tiny Mimi: real framing (24 kHz, ratios [8, 6, 5, 4], 12.5 Hz), SEANet dimension 64 with n_filters 4,
    2-layer transformers of width 64, split RVQ of 16 codebooks x ``card`` (default 2048) bins of dimension 32."""
    data = MimiConfig.mimi_24khz().to_upstream()
    data["seanet"].update(dimension=64, n_filters=4)
    data["quantizer"].update(dimension=32, n_q=16, bins=card, input_dimension=64, output_dimension=64)
    data["transformer"].update(
        d_model=64, num_heads=4, num_layers=2, dim_feedforward=128, input_dimension=64, output_dimensions=[64]
    )
    return MimiConfig.from_upstream(data)


def train_tiny_tokenizer(vocab_size: int = TINY_TEXT_CARD) -> bytes:
    """Train the tiny SentencePiece model (unigram, byte fallback) on :func:`cspan.core.tiny_corpus.corpus_lines`.

    Ids 0..3 are ``<unk>``, ``<s>``, ``</s>``, ``<pad>``; the 256 byte pieces follow, so ``<0x00>`` = 4,
    ``<0x08>`` = 12, ``<0x09>`` = 13. Single-threaded, unshuffled, trained from memory (no file path in the model),
    so the bytes are the same on every run.

    Returns:
        The serialized model (the content of ``tokenizer_spm_32k_3.model``).
    """
    import sentencepiece as spm

    from .tiny_corpus import corpus_lines

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="unigram",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        pad_piece="<pad>",
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        seed_sentencepiece_size=1_000_000,
        minloglevel=2,
    )
    return buf.getvalue()


@dataclass
class TinyModels:
    """The in-memory result of :func:`make_tiny_models`.

    Attributes:
        lm / mimi: the models (float32, CPU, eval mode; Mimi encodes 8 codebooks).
        lm_config / mimi_config: their configurations.
        lm_state / mimi_state: the state dicts written to the safetensors files.
        voices: voice name -> LongTensor [8, P] codes.
    """

    lm: LMModel
    mimi: Mimi
    lm_config: LMConfig
    mimi_config: MimiConfig
    lm_state: dict[str, torch.Tensor]
    mimi_state: dict[str, torch.Tensor]
    voices: dict[str, torch.Tensor]


@contextmanager
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


MAX_SEED = 2**32 - 1
"""The largest seed. torch's CPU generator (mt19937) keeps the low 32 bits of its seed, and :func:`_generator`'s map
``seed * 1_000_003 + stream * 7919`` (an odd multiplier) is one-to-one modulo 2**32: each seed of ``0 .. MAX_SEED``
has its own weights, and any other integer repeats one of theirs (-1, 2**63 - 1 and 2**64 - 1 wrote the weights of
4294967295)."""


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + stream * 7919) % (2**63))


def _lm_state(cfg: LMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random LM weights: N(0, 0.02) for linears and embeddings, RMSNorm gains uniform in [0.9, 1.1]."""
    meta = LMModel(cfg, device="meta", dtype=torch.float32)
    gen = _generator(seed, 1)
    state = {}
    for key, ref in sorted(meta.state_dict().items()):
        shape = tuple(ref.shape)
        if key.endswith(".alpha"):
            value = 0.9 + 0.2 * torch.rand(shape, generator=gen)
        elif key.endswith(".scale"):
            value = torch.full(shape, 0.1)
        elif ".norm" in key and key.endswith(".bias"):
            value = torch.zeros(shape)
        elif ".norm" in key and key.endswith(".weight") and len(shape) == 1:
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=gen) * _LM_STD
        state[key] = value.to(ref.dtype).contiguous()
    return state


def _fan_in(shape: tuple[int, ...]) -> int:
    """PyTorch's fan-in of a weight: ``shape[1] * kernel`` for (transposed) convolutions, ``shape[-1]`` else."""
    if len(shape) == 3:
        return max(1, shape[1] * shape[2])
    return max(1, shape[-1])


def _mimi_state(cfg: MimiConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random Mimi weights with PyTorch's default scales (uniform within 1/sqrt(fan_in)); LayerNorm 1 / 0,
    LayerScale 0.01. Codebooks get placeholders here (see :func:`_fit_codebooks`)."""
    meta = Mimi(cfg, device="meta", dtype=torch.float32)
    gen = _generator(seed, 2)
    refs = meta.state_dict()
    state = {}
    for key, ref in sorted(refs.items()):
        shape = tuple(ref.shape)
        if "_codebook." in key:
            if key.endswith("cluster_usage") or key.endswith("_initialized"):
                value = torch.ones(shape)
            else:
                value = torch.randn(shape, generator=gen)
        elif key.endswith(".scale"):
            value = torch.full(shape, 0.01)
        elif ".norm" in key and len(shape) == 1:
            value = torch.ones(shape) if key.endswith(".weight") else torch.zeros(shape)
        elif key.endswith(".bias"):
            weight = refs.get(key[: -len("bias")] + "weight")
            fan = _fan_in(tuple(weight.shape)) if weight is not None else max(1, shape[0])
            value = (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(fan)
        elif len(shape) >= 2:
            value = (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(_fan_in(shape))
        else:
            value = torch.randn(shape, generator=gen) * _LM_STD
        state[key] = value.to(ref.dtype).contiguous()
    return state


def _voiced(frames: int, f0_start: float, f0_end: float, gen: torch.Generator) -> torch.Tensor:
    """A synthetic voiced signal [1, 1, frames * 1920]: harmonics 1..8 of a gliding fundamental with 1/h
    amplitudes, a 4 Hz syllable envelope, a little noise; peak 0.5."""
    n = frames * _FRAME
    t = torch.arange(n, dtype=torch.float64) / _SAMPLE_RATE
    duration = n / _SAMPLE_RATE
    f0 = f0_start + (f0_end - f0_start) * t / duration
    phase = 2 * math.pi * torch.cumsum(f0, 0) / _SAMPLE_RATE
    x = sum(torch.sin(h * phase) / h for h in range(1, 9))
    envelope = 0.55 - 0.45 * torch.cos(2 * math.pi * 4.0 * t)
    x = x * envelope + 0.02 * torch.randn(n, generator=gen, dtype=torch.float64)
    x = 0.5 * x / x.abs().max()
    return x.to(torch.float32).view(1, 1, n)


def _fit_codebooks(mimi: Mimi, state: dict[str, torch.Tensor], cfg: MimiConfig, seed: int) -> None:
    """Set every codebook from latents of a synthetic signal (the fixture recipe of
    ``shared/fixtures/reference/mimi-small``): per residual level, centroids are randomly chosen latents plus
    Gaussian noise of half the per-dimension spread, cluster usages uniform in [0.5, 2] (``embedding_sum`` =
    centroid * usage); the next level sees the residual after the nearest centroid. Updates ``mimi`` and
    ``state`` in place."""
    gen = _generator(seed, 3)
    # 12 s of material: voiced glides over several pitch ranges plus noise bursts.
    parts = [_voiced(25, lo, hi, gen) for lo, hi in ((90, 140), (140, 220), (220, 320), (300, 180), (120, 100))]
    noise = torch.randn(1, 1, 25 * _FRAME, generator=gen) * 0.2
    pcm = torch.cat([*parts, noise], dim=-1)
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for name in ("rvq_first", "rvq_rest"):
        proj = mimi.quantizer.get_submodule(f"{name}.input_proj")

        def keep(_mod, _inp, out, name=name):
            captured[name] = out.detach()

        hooks.append(proj.register_forward_hook(keep))
    try:
        with torch.no_grad():
            mimi.encode(pcm)
    finally:
        for h in hooks:
            h.remove()
    n_first = cfg.quantizer.n_q_semantic
    levels = {"rvq_first": n_first, "rvq_rest": cfg.quantizer.n_q - n_first}
    bins = cfg.quantizer.bins
    for name, count in levels.items():
        latent = captured[name]  # [1, D, T]
        residual = latent[0].transpose(0, 1).contiguous()  # [T, D]
        for level in range(count):
            prefix = f"quantizer.{name}.vq.layers.{level}._codebook."
            spread = residual.std(dim=0, keepdim=True).clamp(min=1e-4)
            idx = torch.randint(0, residual.shape[0], (bins,), generator=gen)
            centroids = residual[idx] + 0.5 * spread * torch.randn(bins, residual.shape[1], generator=gen)
            usage = 0.5 + 1.5 * torch.rand(bins, generator=gen)
            embedding_sum = (centroids * usage[:, None]).contiguous()
            state[prefix + "embedding_sum"] = embedding_sum
            state[prefix + "cluster_usage"] = usage.contiguous()
            codebook = mimi.quantizer.get_submodule(f"{name}.vq.layers.{level}._codebook")
            codebook.embedding_sum.copy_(embedding_sum)
            codebook.cluster_usage.copy_(usage)
            actual = embedding_sum / usage.clamp(min=1e-5)[:, None]
            nearest = torch.cdist(residual[None], actual[None])[0].argmin(dim=-1)
            residual = residual - actual[nearest]


def make_tiny_models(dep_q: int = 16, seed: int = 0, *, card: int = TINY_CARD) -> TinyModels:
    """Build the tiny LM, Mimi and voices in memory (what :func:`build_tiny_checkpoint` writes).

    Args:
        dep_q: 16 (PersonaPlex) or 8 (Moshi).
        seed: every random draw derives from it.
        card: codes per audio stream, of the LM and of Mimi's codebooks (default 2048, the released Mimi's).

    Raises:
        ValueError: ``dep_q`` is not 8 or 16.
    """
    with _one_thread(), torch.no_grad():
        lm_cfg = tiny_lm_config(dep_q, card=card)
        mimi_cfg = tiny_mimi_config(card)
        lm_state = _lm_state(lm_cfg, seed)
        lm = LMModel(lm_cfg, device="meta", dtype=torch.float32)
        lm.load_state_dict({k: v.clone() for k, v in lm_state.items()}, strict=True, assign=True)
        lm.eval()

        mimi_state = _mimi_state(mimi_cfg, seed)
        mimi = Mimi(mimi_cfg, device="meta", dtype=torch.float32)
        mimi.load_state_dict({k: v.clone() for k, v in mimi_state.items()}, strict=True, assign=True)
        mimi.eval()
        _fit_codebooks(mimi, mimi_state, mimi_cfg, seed)
        mimi.set_num_codebooks(8)

        gen = _generator(seed, 4)
        voices = {}
        for name, (frames, f0_start, f0_end) in TINY_VOICES.items():
            codes = mimi.encode(_voiced(frames, f0_start, f0_end, gen))
            voices[name] = codes[0].to(torch.long).clone()
    return TinyModels(lm, mimi, lm_cfg, mimi_cfg, lm_state, mimi_state, voices)


def _readme(dep_q: int, seed: int, lm_cfg: LMConfig, mimi_cfg: MimiConfig, n_params: int, vocab: int) -> str:
    voices = ", ".join(f"`{n}` ({f} frames)" for n, (f, _, _) in TINY_VOICES.items())
    return f"""# Tiny random Context Spanning checkpoint

Written by `cspan model tiny` (dep_q {dep_q}, seed {seed}). The weights are **random**: the model produces
noise, not speech. It exists so that loading, streaming, serving and training code runs on a CPU in the exact
layout of the released checkpoints (Kyutai / PersonaPlex base repo plus Context Spanning voices).

| file | what |
|---|---|
| `{LM_FILE}` | LM weights, float32 (the real one is bfloat16), upstream key names, {n_params:,} parameters |
| `{MIMI_FILE}` | Mimi codec weights, float32, {mimi_cfg.quantizer.n_q} codebooks of {mimi_cfg.quantizer.bins} |
| `{TOKENIZER_FILE}` | SentencePiece model, {vocab} pieces, byte fallback (ids 0-3 specials, `<0x00>` = 4) |
| `{CONFIG_FILE}` | LM keyword arguments in upstream format, plus `mimi_config` for the non-standard codec |
| `{VOICES_DIR}/*.pt` | voice prompts `{{"codes": LongTensor[8, P]}}`: {voices} |

LM: the 7B structure (RoPE, float32 RMSNorm, SiLU-gated FFN, multi-linear depformer with weights per step,
delays {lm_cfg.delays}) at dim {lm_cfg.dim}, {lm_cfg.num_layers} layers, depformer dim {lm_cfg.depformer_dim};
n_q {lm_cfg.n_q}, dep_q {lm_cfg.dep_q}, card {lm_cfg.card}, text_card {lm_cfg.text_card}, context {lm_cfg.context}.

Mimi: the real framing ({mimi_cfg.sample_rate} Hz, SEANet ratios {mimi_cfg.seanet.ratios}, {mimi_cfg.frame_rate} Hz,
{mimi_cfg.frame_size} samples per frame) at SEANet dimension {mimi_cfg.seanet.dimension}, transformer width
{mimi_cfg.transformer.d_model}.

Load it with `cspan.core.load_checkpoint("<this folder>")` or pass `--checkpoint <this folder>` to the commands;
`cspan model info <this folder>` prints a summary.
"""


def build_tiny_checkpoint(
    out_dir: str | os.PathLike[str], *, dep_q: int = 16, seed: int = 0, overwrite: bool = False, card: int = TINY_CARD
) -> Path:
    """Write the tiny checkpoint folder (see the module docstring for its content).

    Args:
        out_dir: the folder to write; created if absent.
        dep_q: 16 (PersonaPlex, default) or 8 (Moshi).
        seed: random seed; the same seed gives byte-identical files.
        overwrite: allow a non-empty folder (the checkpoint files in it are replaced).
        card: codes per audio stream (default 2048, the released Mimi's; fewer makes a codec that PersonaPlex's
            placeholder frames do not fit, which the engine and ``cspan voice encode --embeddings`` refuse).

    Returns:
        The folder.

    Raises:
        SettingsError: ``out_dir`` is empty, or ``seed`` outside ``0 .. MAX_SEED`` (exit status 2).
        CheckpointError: ``out_dir`` is a file, or a non-empty folder without ``overwrite``.
        OutputError: the folder cannot be written (checked before the models are built) or a write failed (path and
            cause: permission denied, no space left on device...); nothing is left at ``out_dir`` but the files
            that were there.
        ValueError: ``dep_q`` is not 8 or 16.
    """
    from safetensors.torch import save_file

    from .errors import SettingsError
    from .files import atomic_folder, check_writable

    if not os.fspath(out_dir):  # Path("") is the working folder: never write into it by accident
        raise SettingsError("OUT_DIR is empty; give the folder to write the tiny checkpoint into")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SettingsError(
            f"--seed {seed}: must be 0 to {MAX_SEED} (2**32 - 1); a seed outside that range would repeat another's "
            "weights"
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {str(out)!r} is a file; pass a folder path for the tiny checkpoint")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"output folder {str(out)!r} is not empty; pass --force to write into it anyway")
    probe = out / CONFIG_FILE if out.is_dir() else out  # where the temporary folder goes (see atomic_folder)
    check_writable(probe)  # before the models are built
    models = make_tiny_models(dep_q, seed, card=card)
    spm_bytes = train_tiny_tokenizer(models.lm_config.text_card)
    tensors = [*models.lm_state.values(), *models.mimi_state.values()]
    check_writable(probe, need_bytes=sum(t.nbytes for t in tensors) + len(spm_bytes) + 2**20)
    config = models.lm_config.to_upstream()
    config.update(moshi_name=LM_FILE, mimi_name=MIMI_FILE, tokenizer_name=TOKENIZER_FILE)
    config["mimi_config"] = models.mimi_config.to_upstream()
    n_params = sum(v.numel() for v in models.lm_state.values())
    readme = _readme(dep_q, seed, models.lm_config, models.mimi_config, n_params, TINY_TEXT_CARD)
    with atomic_folder(out, replace_files=overwrite) as tmp:  # the folder appears complete, or not at all
        (tmp / VOICES_DIR).mkdir()
        save_file(models.lm_state, str(tmp / LM_FILE), metadata={"format": "pt"})
        save_file(models.mimi_state, str(tmp / MIMI_FILE), metadata={"format": "pt"})
        (tmp / TOKENIZER_FILE).write_bytes(spm_bytes)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, codes in models.voices.items():
            torch.save({"codes": codes.clone()}, tmp / VOICES_DIR / f"{name}.pt")
        (tmp / "README.md").write_text(readme, encoding="utf-8")
    return out
