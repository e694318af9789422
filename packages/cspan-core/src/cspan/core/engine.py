"""``DuplexEngine``: batched full-duplex streaming of a Moshi-family model, with persona prefixes and Context Spans.

One engine runs B independent sessions (batch rows) in lock step at 12.5 frames per second::

    user PCM [B, 1920] -> Mimi streaming encode (per-session state) -> user codes [B, 8]
      -> token grid: user rows written at their delays; pending column fed to the temporal transformer (1 position)
      -> text sampled, then the depformer over dep_q codebooks (forced entries kept)
      -> the finished frame (text + agent codes [B, 8]) -> Mimi streaming decode -> agent PCM [B, 1920]

Between two steps a session can read a Context Span (:meth:`DuplexEngine.inject_span`, one forward over the
block) or be given a persona (:meth:`DuplexEngine.set_persona`, one forward over the prefix). Every per-session
object (KV cache row, token grid row, sampling generator, codec states) is reset by :meth:`DuplexEngine.reset`.

Frame alignment (upstream ``LMGen``, kyutai-labs/moshi 0.2.13; details in :mod:`cspan.core.streams` and
``docs/ENGINE.md``): call ``c`` of a session (counted from its reset) is given user frame ``c - 1`` and returns
agent frame ``c - 1`` (text, 8 agent codebooks) -- for the 7B delays. Call 0 returns nothing (``valid`` False),
and the user audio given at call 0 is encoded (the codec keeps streaming) but never reaches the LM. After a
persona prefix of P frames, the first call is call P + 1: it is given user frame P and returns frame P, the first
live frame.

The per-frame path (:meth:`DuplexEngine.step_tokens`) is a function of preallocated device tensors: the grid
buffer ``[B, K, W]``, positions ``[B]``, the KV cache, the generators. It does not read tensor values on the host
and does not branch on them, so it can be captured in a CUDA graph; host-side session bookkeeping (positions,
whether a session has started) is mirrored in Python ints that change only through the engine's own calls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .constants import (
    DEFAULT_MAX_SPAN_FRAMES,
    DEFAULT_TEMP,
    DEFAULT_TEMP_TEXT,
    DEFAULT_TOP_K,
    DEFAULT_TOP_K_TEXT,
    FRAME_SIZE,
    RET,
    SILENCE_TOKENS,
    SINE_TOKENS,
)
from .errors import CheckpointError, SpanError
from .prefix import PrefixReport, build_persona_prefix, read_prefix
from .sampling import SamplingParams, make_generator, sample_column
from .span import ContextSpan, SpanInjector, SpanReport, prefill_buckets, warm_prefill
from .streams import TokenGrid


@dataclass
class TokenStepOutput:
    """What one call of :meth:`DuplexEngine.step_tokens` produced (device tensors).

    Attributes:
        frame: [B, K] long, the frame this call finished, undelayed (frame ``c - 1`` for the 7B delays): row 0
            text, rows 1..8 agent codes, rows 9..16 user codes (as given, or as sampled when dep_q = 16 and no user
            codes were given); -2 where ``valid`` is False.
        valid: [B] bool, False on a session's first call (nothing finished yet).
        input: [B, K] long, the column fed to the temporal transformer (position ``position``).
        column: [B, K] long, the column stored at position ``position + 1`` (sampled or forced).
        text_logits: [B, text_card] text logits of the fed position (model dtype): the prediction of the text
            token of frame ``c``.
        position: [B] long, the position fed.
    """

    frame: torch.Tensor
    valid: torch.Tensor
    input: torch.Tensor
    column: torch.Tensor
    text_logits: torch.Tensor
    position: torch.Tensor

    @property
    def text_token(self) -> torch.Tensor:
        """[B] long text token of the finished frame (-2 where not valid)."""
        return self.frame[:, 0]


@dataclass
class FrameOutput:
    """What one :meth:`DuplexEngine.step` returned.

    Attributes:
        agent_pcm: [B, 1920] float32 in [-1, 1] at 24 kHz, the agent's audio of the returned frame (zeros where
            ``valid`` is False).
        text_token: [B] long, the text token of the returned frame; -1 where ``valid`` is False.
        is_ret: [B] bool, ``text_token == 4`` (``<ret>``).
        agent_codes: [B, 8] long, the agent's Mimi codes of the returned frame (-2 where not valid).
        valid: [B] bool.
        tokens: the underlying :class:`TokenStepOutput`.
    """

    agent_pcm: torch.Tensor
    text_token: torch.Tensor
    is_ret: torch.Tensor
    agent_codes: torch.Tensor
    valid: torch.Tensor
    tokens: TokenStepOutput


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class DuplexEngine:
    """Batched streaming duplex engine over a Moshi-family checkpoint.

    Args:
        checkpoint: a :class:`cspan.core.checkpoint.Checkpoint` (``lm``, ``mimi``, ``tokenizer``), a source for
            :func:`cspan.core.checkpoint.load_checkpoint` (Hub repo id, local folder or file), or a bare
            :class:`cspan.core.lm.LMModel` (token-level use: :meth:`step_tokens`, voice-only personas, spans from
            ids; give ``mimi=`` / ``tokenizer=`` to enable the rest).
        batch_size: B, the number of sessions.
        device: default: the given model's device, else CUDA when available, else CPU.
        dtype: of the LM (default: the given model's, else the loader's); Mimi runs in float32.
        temp, top_k: audio sampling (0.8 / 250); ``temp <= 0`` is greedy.
        temp_text, top_k_text: text sampling (0.7 / 25); ``temp_text <= 0`` is greedy.
        max_span_frames: longest Context Span block (600 positions = 48 s of frames).
        seed: session i's generator is seeded ``seed + i``; None draws fresh seeds.
        mimi, tokenizer: used with a bare LM.
        agent_placeholder, user_placeholder: the audio codes of span blocks and prefix text/silence frames
            (SILENCE / SINE; other values only for models with another codec vocabulary).
        cuda_graphs: replay the per-frame token step from a CUDA graph (one per kind of call: with / without
            user codes and forced tokens), and the whole frame of :meth:`step` (Mimi encode, token step, Mimi
            decode) from another, each captured on its second call as upstream ``CUDAGraphed`` does; Context Span
            prefills replay graphs at a few padded lengths (:class:`cspan.core.span.PrefillGraphs`). None: on when
            the device is CUDA and ``NO_CUDA_GRAPH`` is not set; True off CUDA raises ValueError.
        predict_user: sample the depformer's user-stream codebooks too (dep_q = 16 models; upstream PersonaPlex
            ``LMGen`` does). False skips them in calls that bring user codes: the user's real codes overwrite
            those predictions before they are ever fed, so text and agent audio are unchanged and the depformer
            runs half its steps; the user rows of ``TokenStepOutput.column`` then hold the known codes, or -1
            where the prediction was skipped. Every call must then bring user codes (``step`` always does).
        defer_spans: read a Context Span block together with the session's next position, in ONE forward at its
            next step (one pass over the weights instead of two: the span's prefill and the step), instead of at
            :meth:`inject_span`. The result is the same up to float rounding (the same keys, values and next
            logits); :class:`SpanReport` then says ``deferred`` and its ``prefill_ms`` is the injection's host
            time. Blocks injected before the same step are read together. None: on for one session with CUDA
            graphs on the fused path (bf16/fp16: the combined forward replays a graph per padded length); needs
            ``batch_size`` 1. While a block is pending, ``positions`` (and the grid) are ahead of the KV cache's
            offset by its length.

    A given model is moved in place (``nn.Module.to``) when ``device`` / ``dtype`` differ from its own.

    Attributes:
        lm, mimi, tokenizer, checkpoint: the models in use (``checkpoint`` None for a bare LM).
        grid: the :class:`cspan.core.streams.TokenGrid`; ``lm_state``: the temporal KV state.
        generators, seeds: one ``torch.Generator`` per session and its seed.
        positions, started, prefix_end: host mirrors of each session's pending position, whether its stream has
            started (a persona or a call since its reset), and the last position of its persona prefix.

    Raises:
        CheckpointError: the model is not a duplex model (K must be 1 + 2 * C streams); loading errors.
        TypeError: ``checkpoint`` is none of the accepted kinds.
    """

    def __init__(
        self,
        checkpoint: Any,
        batch_size: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        temp: float = DEFAULT_TEMP,
        temp_text: float = DEFAULT_TEMP_TEXT,
        top_k: int = DEFAULT_TOP_K,
        top_k_text: int = DEFAULT_TOP_K_TEXT,
        max_span_frames: int = DEFAULT_MAX_SPAN_FRAMES,
        seed: int | None = None,
        mimi: Any | None = None,
        tokenizer: Any | None = None,
        agent_placeholder: Sequence[int] = SILENCE_TOKENS,
        user_placeholder: Sequence[int] = SINE_TOKENS,
        cuda_graphs: bool | None = None,
        predict_user: bool = True,
        defer_spans: bool | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"DuplexEngine: batch_size must be >= 1, got {batch_size}")
        ckpt, lm, mimi, tokenizer = self._resolve(checkpoint, device, dtype, mimi, tokenizer)
        self.checkpoint = ckpt
        target = torch.device(device) if device is not None else lm.device
        if lm.device != target or (dtype is not None and lm.dtype != dtype):
            lm = lm.to(device=target, dtype=dtype)
        self.device = lm.device
        if mimi is not None:
            mimi = mimi.to(device=self.device)
            mimi.eval()
        lm.eval()
        self.lm = lm
        self.mimi = mimi
        self.tokenizer = tokenizer
        self.dtype = lm.dtype
        self.batch_size = batch_size

        K = lm.num_codebooks
        C = (K - 1) // 2
        if K != 1 + 2 * C or C < 1:
            raise CheckpointError(
                f"DuplexEngine needs a duplex model with 1 text + 2 x C audio streams; this LM has {K} streams "
                "(n_q must be even: the agent's and the user's codebooks)"
            )
        self.num_streams = K
        self.num_codebooks = C
        self.dep_q = lm.dep_q
        self.user_rows = list(range(1 + C, 1 + 2 * C))
        self.agent_placeholder = tuple(int(t) for t in agent_placeholder)
        self.user_placeholder = tuple(int(t) for t in user_placeholder)
        if self.mimi is not None:
            self.mimi.set_num_codebooks(C)

        self.text_params = SamplingParams.text(temp_text, top_k_text)
        self.audio_params = SamplingParams.audio(temp, top_k)
        initial = [lm.text_initial_token_id] + [lm.initial_token_id] * lm.n_q
        self.grid = TokenGrid(lm.delays, initial, self.user_rows, batch_size, self.device)
        self.max_delay = self.grid.max_delay
        self.lm_state = lm.new_state(batch_size, self.device, self.dtype)
        self._dep_state = lm.new_depformer_state(batch_size, self.device, self.dtype)
        self._dep_state_one = lm.new_depformer_state(1, self.device, self.dtype)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and not os.environ.get("NO_CUDA_GRAPH")
        elif cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"DuplexEngine: cuda_graphs=True needs a CUDA device, the engine runs on {self.device}")
        self.cuda_graphs = bool(cuda_graphs)
        self.predict_user = bool(predict_user)
        if defer_spans is None:  # where the combined forward replays graphs (the fused bf16/fp16 path)
            with torch.no_grad():  # the engine's steps run without autograd; the check must too
                fused_ok = lm.transformer.fused_path(lm.text_emb.weight)
            defer_spans = self.cuda_graphs and batch_size == 1 and fused_ok
        elif defer_spans and batch_size != 1:
            raise ValueError(
                f"DuplexEngine: defer_spans needs batch_size 1 (a deferred block is read in the step's forward), "
                f"got {batch_size}"
            )
        self.defer_spans = bool(defer_spans)
        self._pending: list[torch.Tensor | None] = [None] * batch_size
        self._span_buckets = [size + 1 for size in prefill_buckets(max_span_frames)]
        self._span_graphs: dict[tuple[int, bool, bool, bool], _GraphedSpanStep | None] = {}
        self.injector = SpanInjector(
            lm,
            max_span_frames=max_span_frames,
            tokenizer=tokenizer,
            agent_placeholder=self.agent_placeholder,
            user_placeholder=self.user_placeholder,
            cuda_graphs=self.cuda_graphs,
        )
        self._enc_state = self.mimi.new_encoder_state(batch_size) if self.mimi is not None else None
        self._dec_state = self.mimi.new_decoder_state(batch_size) if self.mimi is not None else None
        self._silence_codes = torch.tensor(self.agent_placeholder, dtype=torch.long, device=self.device)

        self.seeds: list[int] = []
        self.generators: list[torch.Generator] = []
        for i in range(batch_size):
            gen = make_generator(self.device, None if seed is None else seed + i)
            self.generators.append(gen)
            self.seeds.append(int(gen.initial_seed()))
        self._graphs: dict[tuple[bool, bool, bool], _GraphedStep | None] = {}
        self._frame_graph: _GraphedFrame | None = None
        self._frame_calls = 0
        # host mirrors of per-session bookkeeping (changed only by the engine's own calls)
        self.positions: list[int] = [0] * batch_size
        self.prefix_end: list[int | None] = [None] * batch_size
        self.started: list[bool] = [False] * batch_size

    # -- construction --------------------------------------------------------------------------------------------

    @staticmethod
    def _resolve(
        checkpoint: Any, device: Any, dtype: Any, mimi: Any, tokenizer: Any
    ) -> tuple[Any | None, Any, Any | None, Any | None]:
        """(checkpoint object or None, lm, mimi, tokenizer) from what the constructor was given."""
        if isinstance(checkpoint, (str, os.PathLike)):
            from .checkpoint import load_checkpoint

            checkpoint = load_checkpoint(
                checkpoint, device=torch.device(device) if device is not None else _default_device(), dtype=dtype
            )
        if hasattr(checkpoint, "lm") and hasattr(checkpoint, "mimi"):
            return (
                checkpoint,
                checkpoint.lm,
                mimi if mimi is not None else checkpoint.mimi,
                tokenizer if tokenizer is not None else getattr(checkpoint, "tokenizer", None),
            )
        if isinstance(checkpoint, torch.nn.Module):
            return None, checkpoint, mimi, tokenizer
        raise TypeError(
            f"DuplexEngine: checkpoint must be a Checkpoint, an LMModel or a checkpoint source (str/path), "
            f"got {type(checkpoint).__name__}"
        )

    # -- session management ---------------------------------------------------------------------------------------

    def _check_session(self, i: int) -> None:
        if not 0 <= i < self.batch_size:
            raise IndexError(f"session {i} is outside 0..{self.batch_size - 1} (engine batch_size {self.batch_size})")

    def _clear_session(self, i: int) -> None:
        rows = torch.tensor([i], dtype=torch.long, device=self.device)
        self.lm_state.reset(rows)
        self.grid.reset(rows)
        if self._enc_state is not None:
            self._enc_state.reset(rows)
        if self._dec_state is not None:
            self._dec_state.reset(rows)
        self.positions[i] = 0
        self.prefix_end[i] = None
        self.started[i] = False
        self._pending[i] = None

    def reset(self, i: int, seed: int | None = None) -> None:
        """Start session ``i`` again: empty KV cache row, fresh grid row (position 0), fresh codec states, and its
        generator seeded with ``seed`` (a fresh random seed when None; see ``seeds[i]``).

        Raises:
            IndexError: no such session.
        """
        self._check_session(i)
        self._clear_session(i)
        self._reseed(i, seed)

    def _reseed(self, i: int, seed: int | None) -> None:
        gen = self.generators[i]
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        self.seeds[i] = int(gen.initial_seed())

    @torch.no_grad()
    def set_persona(
        self,
        i: int,
        text_prompt: str | None,
        voice_codes: torch.Tensor | str | os.PathLike[str] | None = None,
        user_name: str | None = None,
        user_city: str | None = None,
        *,
        seed: int | None = None,
    ) -> PrefixReport:
        """Restart session ``i`` with a persona prefix read in ONE temporal forward (see :mod:`cspan.core.prefix`).

        Args:
            i: the session.
            text_prompt: the role prompt (wrapped as ``<system> ... <system>``), or None / "".
            voice_codes: [8, N] long Mimi codes of the voice prompt, a voice name of the checkpoint or a voice file
                (loaded with :func:`cspan.core.checkpoint.load_voice`), or None.
            user_name, user_city: appended to the prompt as "The user's name is X." / "The user is in Y.".
            seed: reseed the session's generator first (None keeps its current state).

        Returns:
            :class:`PrefixReport`. With neither voice nor text the session is only reset (P = 0, no forward).

        Raises:
            IndexError: no such session. CheckpointError: text prompt without tokenizer, unknown voice name.
            ValueError: voice codes not [8, N] or outside [0, card).
        """
        self._check_session(i)
        if isinstance(voice_codes, (str, os.PathLike)):
            from .checkpoint import load_voice

            voice_codes = load_voice(voice_codes, self.checkpoint)
        if voice_codes is not None and voice_codes.numel():
            lo, hi = int(voice_codes.min()), int(voice_codes.max())
            if lo < 0 or hi >= self.lm.card:
                raise ValueError(
                    f"set_persona: voice codes in [{lo}, {hi}], expected Mimi codes in [0, {self.lm.card})"
                )
        self._clear_session(i)
        if seed is not None:
            self._reseed(i, seed)
        prefix = build_persona_prefix(
            self.tokenizer,
            text_prompt,
            voice_codes,
            user_name=user_name,
            user_city=user_city,
            num_codebooks=self.num_codebooks,
            agent_placeholder=self.agent_placeholder,
            user_placeholder=self.user_placeholder,
        )
        P = prefix.num_frames
        prefill_ms = 0.0
        if P:
            gens = [self.generators[i]]

            def tail(hidden: torch.Tensor, text_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return sample_column(
                    self.lm,
                    hidden,
                    text_logits,
                    target,
                    self._dep_state_one,
                    text=self.text_params,
                    audio=self.audio_params,
                    generators=gens,
                )

            prefill_ms = read_prefix(self.lm, self.lm_state, self.grid, i, prefix.frames, tail)
            self.positions[i] = P + 1
            self.prefix_end[i] = P
            self.started[i] = True
        return PrefixReport(
            session=i,
            num_frames=P,
            voice_frames=prefix.voice_frames,
            text_frames=len(prefix.text_ids),
            text=prefix.text,
            text_ids=prefix.text_ids,
            positions=P + 1 if P else 0,
            next_position=self.positions[i],
            prefill_ms=prefill_ms,
        )

    @torch.no_grad()
    def inject_span(self, i: int, span: ContextSpan | str, *, chunk: int | None = None) -> SpanReport:
        """Read a Context Span into session ``i`` between two steps (ONE forward over its n columns).

        The block goes before the session's pending position; the next step continues the stream n positions later
        (see :mod:`cspan.core.span`). References longer than ``max_span_frames`` are truncated (``truncated``).
        ``chunk`` (positions per forward, default all) exists for the step-by-step reference (``chunk=1``) and for
        memory-bounded prefill; the result does not depend on it beyond float rounding.

        Raises:
            IndexError: no such session.
            SpanError: the session has not started (no persona and no step since its reset), or an empty reference.
        """
        self._check_session(i)
        if not self.started[i]:
            raise SpanError(
                f"session {i} has not started: a Context Span goes between two frames of a running stream; "
                "call set_persona(i, ...) or step() first"
            )
        if not self.defer_spans or chunk is not None:
            self._flush_span(i)
            report = self.injector.inject(
                self.lm_state,
                self.grid,
                i,
                span,
                position=self.positions[i],
                prefix_end=self.prefix_end[i],
                chunk=chunk,
            )
            self.positions[i] += report.n
            return report
        t0 = time.perf_counter()
        block, ids, truncated = self.injector.block_for(span, self.grid.num_rows)
        block_d = block.to(self.device)
        pending = self._pending[i]
        if pending is not None and pending.shape[-1] + block_d.shape[-1] + 1 > self._span_buckets[-1]:
            self._flush_span(i)  # too long to read with the next position: read the earlier block now
            pending = None
        self.grid.splice(i, block_d)
        self._pending[i] = block_d if pending is None else torch.cat([pending, block_d], dim=1)
        ms = (time.perf_counter() - t0) * 1000.0
        report = self.injector.report(i, ids, truncated, self.positions[i], self.prefix_end[i], ms, deferred=True)
        self.positions[i] += report.n
        return report

    def _flush_span(self, i: int) -> None:
        """Read session ``i``'s deferred block into the KV cache now (the grid already holds it)."""
        block = self._pending[i]
        if block is not None:
            self._pending[i] = None
            self.injector.read(self.lm_state, i, block)

    # -- the per-frame path -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step_tokens(
        self, user_codes: torch.Tensor | None = None, forced: torch.Tensor | None = None
    ) -> TokenStepOutput:
        """One call for every session, at the token level (no codec).

        Args:
            user_codes: [B, 8] long, the user frame given to this call (frame ``c - 1``), written at the user rows'
                delays. None: the user rows are not written -- only allowed when the depformer predicts them
                (dep_q = 16), which then samples them (upstream ``LMGen`` with dep_q = n_q ignores user codes).
            forced: [B, K] long tokens of the target column (position ``c + 1``, delayed coordinates: text and
                semantic codes of frame c, acoustic codes of frame c - 1), -2 = sample; or None.

        Returns:
            :class:`TokenStepOutput`.

        Raises:
            ValueError: wrong shapes, or no user codes for a model that does not predict them (or for an engine
                built with ``predict_user=False``).
        """
        B, K = self.batch_size, self.num_streams
        if user_codes is None:
            if self.dep_q < self.lm.n_q:
                raise ValueError(
                    f"step_tokens: user_codes [B, {self.num_codebooks}] are required: this model's depformer predicts "
                    f"only {self.dep_q} of {self.lm.n_q} audio streams, so the user rows cannot be sampled"
                )
            if not self.predict_user:
                raise ValueError(
                    "step_tokens: user_codes are required with predict_user=False: the engine skips the "
                    "depformer's user-stream predictions, so a call without user codes would feed the skipped "
                    "entries; build the engine with predict_user=True to let the model predict the user"
                )
        elif tuple(user_codes.shape) != (B, self.num_codebooks):
            raise ValueError(
                f"step_tokens: user_codes must be [{B}, {self.num_codebooks}], got {tuple(user_codes.shape)}"
            )
        if forced is not None and tuple(forced.shape) != (B, K):
            raise ValueError(f"step_tokens: forced must be [{B}, {K}], got {tuple(forced.shape)}")
        if self._pending[0] is not None:
            out = self._span_step_any(user_codes, forced)
        else:
            out = self._graphed_step(user_codes, forced) if self.cuda_graphs else self._step(user_codes, forced)
        self._advance_host()
        return out

    def _advance_host(self) -> None:
        for i in range(self.batch_size):
            self.positions[i] += 1
            self.started[i] = True

    def _step(self, user_codes: torch.Tensor | None, forced: torch.Tensor | None) -> TokenStepOutput:
        """The per-frame computation: tensor operations on preallocated state only (CUDA-graph capturable)."""
        grid = self.grid
        if user_codes is not None:
            grid.write_user(user_codes)
        position = grid.position.clone()
        column_in = grid.input_column().clone()
        hidden, text_logits = self.lm.temporal(column_in[:, :, None], self.lm_state)
        return self._tail(hidden[:, -1], text_logits[:, -1], column_in, position, forced, user_codes is None)

    def _tail(
        self,
        hidden: torch.Tensor,
        text_logits: torch.Tensor,
        column_in: torch.Tensor,
        position: torch.Tensor,
        forced: torch.Tensor | None,
        no_user: bool,
    ) -> TokenStepOutput:
        """Sample the target column from the fed position's outputs and commit it (tensor operations only)."""
        grid = self.grid
        target = grid.target_column(forced)
        column = sample_column(
            self.lm,
            hidden,
            text_logits,
            target,
            self._dep_state,
            text=self.text_params,
            audio=self.audio_params,
            generators=self.generators,
            depformer_steps=None if self.predict_user or no_user else self.num_codebooks,
        )
        frame, valid = grid.commit(column)
        return TokenStepOutput(
            frame=frame, valid=valid, input=column_in, column=column, text_logits=text_logits, position=position
        )

    def _span_step(
        self,
        user_codes: torch.Tensor | None,
        forced: torch.Tensor | None,
        tokens: torch.Tensor,
        n_valid: torch.Tensor | None,
    ) -> TokenStepOutput:
        """A step whose forward also reads the deferred block (batch 1): ``tokens`` [1, K, T] holds the block in
        its first n columns; the pending column goes to column n (``n_valid - 1``, or T - 1 when unpadded)."""
        grid = self.grid
        if user_codes is not None:
            grid.write_user(user_codes)
        position = grid.position.clone()
        column_in = grid.input_column().clone()
        T = tokens.shape[-1]
        last = n_valid - 1 if n_valid is not None else torch.full((1,), T - 1, dtype=torch.long, device=self.device)
        tokens.index_copy_(2, last, column_in[:, :, None])
        hidden, text_logits = self.lm.temporal_last(tokens, self.lm_state, n_valid)
        return self._tail(hidden, text_logits, column_in, position, forced, user_codes is None)

    def _span_step_any(self, user_codes: torch.Tensor | None, forced: torch.Tensor | None) -> TokenStepOutput:
        """The step of session 0 with its deferred block: eager, or a graph per padded length (captured on the
        second use of a length, as :meth:`_graphed_step` does)."""
        block = self._pending[0]
        assert block is not None
        self._pending[0] = None
        size = next((b for b in self._span_buckets if b > block.shape[-1]), None)
        key = (size, user_codes is None, forced is None, self.predict_user)
        graphable = self.cuda_graphs and size is not None and self.lm.transformer.fused_path(self.lm.text_emb.weight)
        if not graphable or key not in self._span_graphs:  # eager (the first use of a length warms it up)
            if graphable:
                self._span_graphs[key] = None
            tokens = torch.cat([block[None], block[None, :, -1:]], dim=2)  # the last column is the next position's
            return self._span_step(user_codes, forced, tokens, None)
        graphed = self._span_graphs[key]
        if graphed is None:
            graphed = _GraphedSpanStep.capture_span(self, size, user_codes, forced)
            self._span_graphs[key] = graphed
        graphed.load_block(block)
        graphed.load(user_codes, forced)
        return graphed.replay()

    def _graphed_step(self, user_codes: torch.Tensor | None, forced: torch.Tensor | None) -> TokenStepOutput:
        """:meth:`_step` through a CUDA graph: the first call of a kind runs eagerly (library warm-up), the second
        captures and replays, later calls copy their inputs into the static buffers and replay. Session operations
        between steps (reset, persona, span) change the same state tensors in place, so the graph sees them."""
        key = (user_codes is None, forced is None, self.predict_user)
        if key not in self._graphs:
            self._graphs[key] = None
            return self._step(user_codes, forced)
        graphed = self._graphs[key]
        if graphed is None:
            graphed = _GraphedStep.capture(self, user_codes, forced)
            self._graphs[key] = graphed
        else:
            graphed.load(user_codes, forced)
        return graphed.replay()

    @torch.no_grad()
    def step(self, user_pcm: torch.Tensor) -> FrameOutput:
        """One 80 ms frame for every session: user PCM in, agent PCM and text out.

        Args:
            user_pcm: [B, 1920] (or [B, 1, 1920]) float32 in [-1, 1] at 24 kHz, each session's next user frame.

        Returns:
            :class:`FrameOutput` (device tensors; read ``text_token`` to the host once per frame).

        Raises:
            CheckpointError: the engine has no Mimi codec. ValueError: wrong PCM shape.
        """
        if self.mimi is None or self._enc_state is None or self._dec_state is None:
            raise CheckpointError(
                "DuplexEngine.step needs the Mimi codec; build the engine from a checkpoint or pass mimi=, or use "
                "step_tokens() for token-level streaming"
            )
        B = self.batch_size
        pcm = user_pcm
        if pcm.dim() == 3 and pcm.shape[1] == 1:
            pcm = pcm[:, 0]
        if tuple(pcm.shape) != (B, FRAME_SIZE):
            raise ValueError(
                f"step: user_pcm must be [{B}, {FRAME_SIZE}] float32 at 24 kHz, got {tuple(user_pcm.shape)}"
            )
        invalid = [i for i in range(B) if self.positions[i] < self.max_delay]
        out = self._graphed_frame(pcm) if self.cuda_graphs else self._frame(pcm.to(self.device, torch.float32))
        self._advance_host()
        if invalid:
            # a session's first call finishes no frame: its decoder must not have advanced
            self._dec_state.reset(torch.tensor(invalid, dtype=torch.long, device=self.device))
        return out

    def _frame(self, pcm: torch.Tensor) -> FrameOutput:
        """The whole frame on device tensors (CUDA-graph capturable): pcm [B, 1920] float32 on the device."""
        assert self.mimi is not None and self._enc_state is not None and self._dec_state is not None
        B, C = self.batch_size, self.num_codebooks
        user_codes = self.mimi.encode_step(pcm[:, None, :], self._enc_state)[:, :C, 0]  # [B, C]
        out = self._span_step_any(user_codes, None) if self._pending[0] is not None else self._step(user_codes, None)
        agent_codes = out.frame[:, 1 : 1 + C]
        valid = out.valid
        decode_codes = torch.where(valid[:, None], agent_codes, self._silence_codes[None, :].expand(B, -1))
        agent_pcm = self.mimi.decode_step(decode_codes[:, :, None], self._dec_state)[:, 0].float()  # [B, 1920]
        agent_pcm = torch.where(valid[:, None], agent_pcm, torch.zeros_like(agent_pcm))
        text_token = torch.where(valid, out.frame[:, 0], torch.full_like(out.frame[:, 0], -1))
        return FrameOutput(
            agent_pcm=agent_pcm,
            text_token=text_token,
            is_ret=text_token == RET,
            agent_codes=agent_codes,
            valid=valid,
            tokens=out,
        )

    def _graphed_frame(self, pcm: torch.Tensor) -> FrameOutput:
        """:meth:`_frame` through a CUDA graph: eager on the first call, captured on the second, replayed after."""
        if self._pending[0] is not None:  # a deferred span: the combined step has its own graphs
            return self._frame(pcm.to(self.device, torch.float32))
        self._frame_calls += 1
        if self._frame_calls == 1:
            return self._frame(pcm.to(self.device, torch.float32))
        if self._frame_graph is None or self._frame_graph.predict_user != self.predict_user:
            self._frame_graph = _GraphedFrame.capture(self, pcm)
        else:
            self._frame_graph.pcm.copy_(pcm)
        return self._frame_graph.replay()

    # -- inspection ---------------------------------------------------------------------------------------------

    @property
    def context(self) -> int | None:
        """The temporal attention window in positions (None = unbounded)."""
        return self.lm.cfg.context

    def window_positions_left(self, i: int) -> int | None:
        """Positions session ``i`` can still feed before its position 0 leaves the attention window."""
        ctx = self.context
        return None if ctx is None else max(0, ctx - 1 - self.positions[i])


class _GraphedStep:
    """One captured :meth:`DuplexEngine._step` with its static inputs and outputs (see ``_graphed_step``)."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        user: torch.Tensor | None,
        forced: torch.Tensor | None,
        out: TokenStepOutput,
    ) -> None:
        self.graph = graph
        self.user = user
        self.forced = forced
        self.out = out

    @classmethod
    def capture(
        cls,
        engine: DuplexEngine,
        user_codes: torch.Tensor | None,
        forced: torch.Tensor | None,
        step: Callable[[torch.Tensor | None, torch.Tensor | None], TokenStepOutput] | None = None,
    ) -> _GraphedStep:
        """Capture ``step(user, forced)`` (default :meth:`DuplexEngine._step`) on static copies of the inputs."""
        dev = engine.device
        user = None if user_codes is None else user_codes.to(dev, torch.long).clone()
        forced_s = None if forced is None else forced.to(dev, torch.long).clone()
        graph = torch.cuda.CUDAGraph()
        for gen in engine.generators:
            graph.register_generator_state(gen)
        with torch.cuda.graph(graph):  # records only: the state is not advanced until replay
            out = (step or engine._step)(user, forced_s)
        return cls(graph, user, forced_s, out)

    def load(self, user_codes: torch.Tensor | None, forced: torch.Tensor | None) -> None:
        if self.user is not None and user_codes is not None:
            self.user.copy_(user_codes)
        if self.forced is not None and forced is not None:
            self.forced.copy_(forced)

    def replay(self) -> TokenStepOutput:
        self.graph.replay()
        return _copy_tokens(self.out)


def _copy_tokens(o: TokenStepOutput) -> TokenStepOutput:
    """Copies of a graph's static outputs (overwritten by its next replay)."""
    return TokenStepOutput(
        frame=o.frame.clone(),
        valid=o.valid.clone(),
        input=o.input.clone(),
        column=o.column.clone(),
        text_logits=o.text_logits.clone(),
        position=o.position.clone(),
    )


class _GraphedSpanStep(_GraphedStep):
    """A captured :meth:`DuplexEngine._span_step` at a padded length (block + the next position), with its static
    token columns and real length."""

    tokens: torch.Tensor  # [1, K, size] long
    n_valid: torch.Tensor  # [1] long

    @classmethod
    def capture_span(
        cls, engine: DuplexEngine, size: int, user_codes: torch.Tensor | None, forced: torch.Tensor | None
    ) -> _GraphedSpanStep:
        dev = engine.device
        tokens = torch.zeros(1, engine.num_streams, size, dtype=torch.long, device=dev)
        n_valid = torch.full((1,), size, dtype=torch.long, device=dev)
        warm_prefill(engine.lm, engine.lm_state, tokens)
        graphed = cls.capture(engine, user_codes, forced, lambda u, f: engine._span_step(u, f, tokens, n_valid))
        graphed.tokens, graphed.n_valid = tokens, n_valid
        return graphed

    def load_block(self, block: torch.Tensor) -> None:
        n = block.shape[-1]
        self.tokens[0, :, :n].copy_(block)  # the columns past n + 1 keep earlier valid ids: never stored nor seen
        self.n_valid.fill_(n + 1)


class _GraphedFrame:
    """One captured :meth:`DuplexEngine._frame` (Mimi encode, token step, Mimi decode) with its static PCM input."""

    def __init__(self, graph: torch.cuda.CUDAGraph, pcm: torch.Tensor, out: FrameOutput, predict_user: bool) -> None:
        self.graph = graph
        self.pcm = pcm
        self.out = out
        self.predict_user = predict_user

    @classmethod
    def capture(cls, engine: DuplexEngine, pcm: torch.Tensor) -> _GraphedFrame:
        static = pcm.to(engine.device, torch.float32).clone()
        graph = torch.cuda.CUDAGraph()
        for gen in engine.generators:
            graph.register_generator_state(gen)
        with torch.cuda.graph(graph):  # records only: the state is not advanced until replay
            out = engine._frame(static)
        return cls(graph, static, out, engine.predict_user)

    def replay(self) -> FrameOutput:
        self.graph.replay()
        o = self.out  # static buffers: hand out copies
        tokens = _copy_tokens(o.tokens)
        return FrameOutput(
            agent_pcm=o.agent_pcm.clone(),
            text_token=o.text_token.clone(),
            is_ret=o.is_ret.clone(),
            agent_codes=tokens.frame[:, 1 : 1 + o.agent_codes.shape[1]],
            valid=tokens.valid,
            tokens=tokens,
        )


__all__ = ["DuplexEngine", "FrameOutput", "PrefixReport", "SpanReport", "TokenStepOutput"]
