"""``DuplexEngine``: batched full-duplex streaming of a Moshi-family model, with persona prefixes and Context Spans.

One engine runs B independent sessions (batch rows) in lock step at 12.5 frames per second. One frame::

    user PCM [B, 1920] -> Mimi streaming encode -> user codes [B, 8]
      -> ONE token step for the live sessions:
           token grid: user rows written at their delays; each session's pending column
           temporal transformer: every session's queued block (Context Span, persona prefix) and its next
             position in ONE ragged forward (the weights read once; Sarathi-Serve / vLLM mixed batches)
           text sampled, then the depformer over dep_q codebooks (forced entries kept); the column committed
      -> the finished frames (text + agent codes [B, 8]) -> Mimi streaming decode -> agent PCM [B, 1920]

Between two steps a session can be given a persona (:meth:`DuplexEngine.set_persona`), a Context Span
(:meth:`DuplexEngine.inject_span`), a reset, or be marked idle (:meth:`DuplexEngine.set_live`): all host-only, queued
in the sessions record and applied by the next step (:meth:`DuplexEngine.prepare` builds that step's inputs ahead
of it, between frames, while the device idles). Past the attention window the session's persona policy keeps
its persona prefix in the context (:mod:`cspan.core.window`: pinned sink positions, or a copy read again). The
step is one function of device tensors (the state object,
:class:`cspan.core.sessions.EngineState`, and the step's packed inputs), replayed from a CUDA graph per static shape
(:class:`cspan.core.graphs.GraphCache`); how it runs (kernels, graphs, KV dtype) is decided once, when the engine is
built (:class:`cspan.core.plan.ExecutionPlan`).

Frame alignment (upstream ``LMGen``, kyutai-labs/moshi 0.2.13; details in :mod:`cspan.core.streams` and
``docs/ENGINE.md``): call ``c`` of a session (counted from its reset) is given user frame ``c - 1`` and returns
agent frame ``c - 1`` (text, 8 agent codebooks) -- for the 7B delays. Call 0 returns nothing (``valid`` False),
and the user audio given at call 0 is encoded (the codec keeps streaming) but never reaches the LM. A session given
a persona prefix of P frames reads it in its next step, call P (its user audio is not used; it returns the prefix's
last frame); its next call is call P + 1, given user frame P.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .attention import FlashInferDecode
from .checks import (
    check_engine_options,
    check_frame_pcm,
    check_persona,
    check_placeholders,
    check_prefix,
    check_seed,
    check_session,
    check_step_codes,
    check_switches,
    check_voice,
    user_codes_needed,
)
from .config import CONTEXT_SPANNING
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
from .errors import CheckpointError, PersonaTooLongError, SpanError
from .graphs import GraphCache
from .plan import resolve_plan
from .prefix import PrefixReport, build_persona_prefix, prefix_block
from .sampling import SamplingParams, SessionSampling, sample_column, top_k_bound
from .sessions import EngineState, Persona, Sessions, SpanRead, StepBatch, StepHead, build_step, fresh_seed, unpack
from .span import ContextSpan, SpanReport, encode_span
from .window import DEFAULT_PERSONA_POLICY, WindowEvent, check_policy, reprefix_block

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .voice import VoicePrompt


@dataclass
class TokenStepOutput:
    """What one call of :meth:`DuplexEngine.step_tokens` produced (device tensors; idle sessions: -2 / False / 0).

    Attributes:
        frame: [B, K] long, the frame this call finished, undelayed (frame ``c - 1`` for the 7B delays): row 0
            text, rows 1..8 agent codes, rows 9..16 user codes (as given, or as sampled when dep_q = 16 and no user
            codes were given); -2 where ``valid`` is False.
        valid: [B] bool, False on a session's first call (nothing finished yet) and for idle sessions.
        input: [B, K] long, the column fed to the temporal transformer (position ``position``).
        column: [B, K] long, the column stored at position ``position + 1`` (sampled or forced).
        text_logits: [B, text_card] text logits of the fed position (model dtype): the prediction of the text
            token of frame ``c``.
        position: [B] long, the position fed (-1 for idle sessions).
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
        agent_pcm: [B, 1920] float32 at 24 kHz, the agent's audio of the returned frame as Mimi decodes it
            (nominally in [-1, 1], not clipped; zeros where ``valid`` is False).
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


class DuplexEngine:
    """Batched streaming duplex engine over a loaded Moshi-family checkpoint.

    Args:
        checkpoint: a :class:`cspan.core.checkpoint.Checkpoint` (``lm``, ``mimi``, ``tokenizer``; loading is the
            caller's: :func:`cspan.core.checkpoint.load_checkpoint`), or a bare :class:`cspan.core.lm.LMModel`
            (token-level use: :meth:`step_tokens`, voice-only personas, spans from ids; give ``mimi=`` /
            ``tokenizer=`` to enable the rest). The engine runs on the LM's device and dtype; Mimi in float32.
        batch_size: B, the number of sessions.
        temp, top_k: audio sampling (0.8 / 250); ``temp <= 0`` is greedy; ``top_k`` 0 keeps all.
        temp_text, top_k_text: text sampling (0.7 / 25); ``temp_text <= 0`` is greedy. These are every session's
            defaults; :meth:`set_sampling` gives a session its own (a reset restores the defaults).
        max_span_frames: longest Context Span block (600 positions = 48 s of frames); longer references are
            truncated. A block as long as the attention window or longer is read exactly, but its first columns
            are out of sight of the session's next position (:attr:`SpanReport.span_in_window` says so).
        seed: session i's sampling seed is ``seed + i``; None draws fresh seeds.
        mimi, tokenizer: used with a bare LM.
        agent_placeholder, user_placeholder: the audio codes of span blocks and prefix text/silence frames
            (SILENCE / SINE; other values only for models with another codec vocabulary): one Mimi code per
            codebook, each in 0 .. card - 1, checked here (TypeError / ValueError naming the argument).
        cuda_graphs: replay the token step and the whole frame from CUDA graphs, one per static shape (None: on
            for CUDA unless ``NO_CUDA_GRAPH`` is set; True off CUDA raises ValueError).
        predict_user: sample the depformer's user-stream codebooks too (dep_q = 16 models; upstream PersonaPlex
            ``LMGen`` does). False skips them in calls that bring user codes: the user's real codes overwrite
            those predictions before they are ever fed, so text and agent audio are unchanged and the depformer
            runs half its steps; the user rows of ``TokenStepOutput.column`` then hold the known codes, or -1
            where the prediction was skipped. Every call must then bring user codes (``step`` always does).
        kv_dtype: the KV cache's storage: None or "auto" (the model's dtype), "bf16", "fp16", "fp32" or "fp8" (e4m3
            with one scale per position and head: half the memory of bf16; see :mod:`cspan.core.kv_cache`), or
            one of those as a torch dtype.
        fused: the Triton kernels (None: for bf16/fp16 models on CUDA; see :func:`cspan.core.plan.resolve_plan`).
        persona_policy: how a session keeps its persona prefix in the attention window once the conversation is
            longer than the window: ``"pinned"`` (default: its keys and values stay as sink positions at the
            window's oldest end), ``"reprefix"`` (it is read again, as a block of the batched step, before it would
            leave) or ``"none"`` (it slides out); see :mod:`cspan.core.window`. ``set_persona(..., policy=)``
            overrides it for one session.
        max_block_columns: the most Context Span columns one step reads (None: all that are queued). Spans past it
            wait for the next step, in order, the sessions held back longest first (a step that reads no persona
            prefix always reads at least one span; prefixes and re-prefix copies are never held back): the frame
            that two long spans would double is shared out between frames, as a chunked-prefill token budget does
            (:class:`cspan.core.sessions.Sessions`). A held-back
            span starts one position later per step it waits (its :class:`SpanReport` gives the position at
            injection).

    Attributes:
        lm, mimi, tokenizer, checkpoint: the models in use (``checkpoint`` None for a bare LM).
        plan: the :class:`cspan.core.plan.ExecutionPlan`; ``state``: the device state of all sessions
            (:class:`cspan.core.sessions.EngineState`: ``lm``, the KV cache, as :attr:`lm_state`; ``grid``, as
            :attr:`grid`); ``sessions``: the host record (:class:`cspan.core.sessions.Sessions`: ``position``,
            ``started``, ``prefix_end``, ``seeds``, ``sampling``, ``live``; read them as the properties
            :attr:`positions`, :attr:`started`, ...).
        text_params, audio_params: the sessions' default sampling (:class:`cspan.core.sampling.SamplingParams`).

    Threads: :meth:`step`, :meth:`step_tokens` and :meth:`prepare` belong to one thread, the one that steps. The
    queueing methods (:meth:`reset`, :meth:`set_sampling`, :meth:`set_live`, :meth:`set_prefix`,
    :meth:`inject_span`, :meth:`take_window_events`, and :meth:`set_persona` with codes or a stored voice) are host
    work under the sessions' lock, so another thread may call them between or during steps; a call that lands
    while a step runs takes effect at the next step. :meth:`set_persona` with a recording encodes it with Mimi:
    call that from the stepping thread.

    Raises:
        CheckpointError: the model is not a duplex model (K must be 1 + 2 * C streams).
        TypeError: ``checkpoint`` is neither a checkpoint nor an LM; a size (``batch_size``, ``max_span_frames``,
            ``max_block_columns``) that is no int; a switch (``predict_user``, ``cuda_graphs``, ``fused``) that is no
            bool (or None); a placeholder code that is no int. ValueError: bad options (``batch_size`` < 1, sampling
            parameters: :meth:`cspan.core.sampling.SamplingParams.check`, ``kv_dtype``, ``persona_policy``,
            ``cuda_graphs=True`` off CUDA, ``fused=True`` where the kernels cannot run, a seed outside
            0 .. 2**63 - B, a placeholder that is not C codes in 0 .. card - 1). SpanError: ``max_span_frames`` < 3.
    """

    def __init__(
        self,
        checkpoint: Any,
        batch_size: int = 1,
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
        kv_dtype: str | torch.dtype | None = None,
        fused: bool | None = None,
        persona_policy: str = DEFAULT_PERSONA_POLICY,
        max_block_columns: int | None = None,
    ) -> None:
        check_engine_options(batch_size, max_span_frames, max_block_columns)
        check_switches(
            {"predict_user": predict_user, "cuda_graphs": cuda_graphs, "fused": fused},
            optional=("cuda_graphs", "fused"),
        )
        if hasattr(checkpoint, "lm") and hasattr(checkpoint, "mimi"):
            self.checkpoint, lm = checkpoint, checkpoint.lm
            mimi = mimi if mimi is not None else checkpoint.mimi
            tokenizer = tokenizer if tokenizer is not None else getattr(checkpoint, "tokenizer", None)
        elif isinstance(checkpoint, torch.nn.Module):
            self.checkpoint, lm = None, checkpoint
        else:
            raise TypeError(
                f"DuplexEngine takes a loaded Checkpoint (cspan.core.checkpoint.load_checkpoint) or an LMModel, got "
                f"{type(checkpoint).__name__}"
            )
        K, C = lm.num_codebooks, (lm.num_codebooks - 1) // 2
        if K != 1 + 2 * C or C < 1:
            raise CheckpointError(
                f"DuplexEngine needs a duplex model with 1 text + 2 x C audio streams; this LM has {K} streams "
                "(n_q must be even: the agent's and the user's codebooks)"
            )
        placeholders = check_placeholders(
            {"agent_placeholder": agent_placeholder, "user_placeholder": user_placeholder}, C, lm.card
        )
        self.lm, self.mimi, self.tokenizer = lm.eval(), mimi, tokenizer
        if mimi is not None:
            mimi.eval()
            mimi.set_num_codebooks(C)
        self.device, self.dtype, self.batch_size = lm.device, lm.dtype, batch_size
        self.num_streams, self.num_codebooks, self.dep_q = K, C, lm.dep_q
        self.user_rows = list(range(1 + C, 1 + 2 * C))
        self._stream_rows = [lm.cfg.text_card + 1] + [lm.card + 1] * (K - 1)  # each stream's embedding table
        self.agent_placeholder = placeholders["agent_placeholder"]
        self.user_placeholder = placeholders["user_placeholder"]
        self.max_span_frames = int(max_span_frames)
        text_card = lm.text_linear.out_features
        self.text_params = SamplingParams.text(temp_text, top_k_text).check("DuplexEngine: text", text_card)
        self.audio_params = SamplingParams.audio(temp, top_k).check("DuplexEngine: audio", lm.card)
        self.predict_user = bool(predict_user)
        self._no_user_codes = user_codes_needed(lm.dep_q, lm.n_q, self.predict_user)  # why a call must bring them
        self.persona_policy = check_policy(persona_policy, "DuplexEngine")

        self.plan = resolve_plan(lm, cuda_graphs=cuda_graphs, kv_dtype=kv_dtype, fused=fused)
        initial = [lm.text_initial_token_id] + [lm.initial_token_id] * lm.n_q
        self.state = EngineState(lm, mimi, batch_size, self.plan, (lm.delays, initial, self.user_rows))
        seed = check_seed(seed, "DuplexEngine", span=batch_size)
        seeds = [fresh_seed() if seed is None else seed + i for i in range(batch_size)]
        self.sessions = Sessions(
            seeds, SessionSampling(self.text_params, self.audio_params), lm.cfg.context, max_block_columns
        )
        self._library = None  # the library decode attention, where the plan chose it
        if self.plan.library is not None:
            cfg = lm.cfg
            self._library = FlashInferDecode(
                self.device, cfg.num_heads, cfg.dim // cfg.num_heads, cfg.context, self.dtype, self.plan.cuda_graphs
            )
        self._plain_batch: tuple[tuple, StepBatch] | None = None  # (rows and top-k, the inputs) of the last plain step
        self._prepared: tuple[int, StepBatch] | None = None  # (the sessions' version, the inputs): see prepare()
        self._step_graphs = GraphCache(self._token_step, self.plan.cuda_graphs)
        self._frame_graphs = GraphCache(self._frame, self.plan.cuda_graphs)
        self._silence = torch.tensor(self.agent_placeholder, dtype=torch.long, device=self.device)
        self._span_seq = itertools.count()  # SpanReport.seq

    # -- sessions (host only: queued for the next step) ---------------------------------------------------------

    def reset(self, i: int, seed: int | None = None) -> None:
        """Start session ``i`` again at its next step: empty KV cache row, fresh grid row (position 0), fresh codec
        states, sampling seed ``seed`` (a fresh random seed when None, also for an engine built with ``seed``:
        pass one to reproduce a run; see ``seeds[i]``) and the engine's default sampling parameters. Queued (host
        only): :attr:`started` is False and a Context Span is refused until the session's next step. Context Spans
        queued for the old stream and not read yet are dropped, with a warning that says how many (as by
        :meth:`set_persona` and :meth:`set_prefix`).

        Raises:
            IndexError: no such session. TypeError, ValueError: a seed that is no int in 0 .. 2**63 - 1.
        """
        i = check_session(i, self.batch_size, "reset")
        defaults = SessionSampling(self.text_params, self.audio_params)
        dropped = self.sessions.reset([i], [check_seed(seed, "reset")], sampling=defaults)  # one update
        _warn_dropped(i, dropped, "reset")

    def set_sampling(self, i: int, text: SamplingParams | None = None, audio: SamplingParams | None = None) -> None:
        """Sample session ``i``'s text and audio with these parameters from its next step on (None keeps that
        kind's current ones; :meth:`reset` restores the engine's defaults). All sessions are sampled in the same
        batched step, each row with its own temperature and top-k, so this costs nothing per step.

        Raises:
            IndexError: no such session. ValueError: a bad temperature or top-k
                (:meth:`cspan.core.sampling.SamplingParams.check`; nothing is changed).
        """
        i = check_session(i, self.batch_size, "set_sampling")
        self.sessions.set_sampling(i, self._checked_sampling(i, text, audio, "set_sampling"))

    def _checked_sampling(
        self, i: int, text: SamplingParams | None, audio: SamplingParams | None, where: str
    ) -> SessionSampling:
        """Session ``i``'s current sampling with ``text`` / ``audio`` (where not None) checked and put in; errors
        name ``where`` (the method)."""
        for kind, params in (("text", text), ("audio", audio)):
            if params is not None and not isinstance(params, SamplingParams):
                raise TypeError(
                    f"{where}: {kind} sampling is a SamplingParams (SamplingParams.{kind}(temp, top_k)), got {params!r}"
                )
        current = self.sessions.sampling[i]
        text = current.text if text is None else text.check(f"{where}: text", self.lm.text_linear.out_features)
        audio = current.audio if audio is None else audio.check(f"{where}: audio", self.lm.card)
        return SessionSampling(text, audio)

    def set_live(self, rows: Sequence[int] | int, live: bool = True) -> None:
        """Mark sessions live (stepped) or idle (not stepped: no compute, no KV reads; their outputs are invalid,
        their model state and queue stay as they are). Every session starts live. Mimi's streaming state moves on
        for idle rows (the frame encodes the PCM passed for them and decodes silence): pass zeros, and a resumed
        session continues as after a silent pause. ``rows``: a session index, or a sequence, 1-D tensor or 1-D numpy
        array of them.

        Raises:
            IndexError, TypeError: a row that is no session, or ``live`` not a bool (then no row is changed).
        """
        if not isinstance(live, bool):
            raise TypeError(f"set_live: live is True or False, got {type(live).__name__} {live!r}")
        many = isinstance(rows, Sequence) or (isinstance(rows, (torch.Tensor, np.ndarray)) and rows.ndim == 1)
        # every row checked before any is changed
        chosen = [check_session(i, self.batch_size, "set_live") for i in (rows if many else [rows])]
        for i in chosen:
            self.sessions.set_live(i, live)

    @torch.no_grad()
    def set_persona(
        self,
        i: int,
        text_prompt: str | None,
        voice: VoicePrompt | torch.Tensor | str | os.PathLike[str] | None = None,
        user_name: str | None = None,
        user_city: str | None = None,
        *,
        seed: int | None = None,
        sampling: SessionSampling | None = None,
        policy: str | None = None,
    ) -> PrefixReport:
        """Restart session ``i`` with a persona prefix (:mod:`cspan.core.prefix`, in the checkpoint's layout), read
        by its next step. Context Spans queued for the old stream and not read yet are dropped, with a warning
        (:meth:`reset`); one queued after this call is read by the step after the prefix's.

        Args:
            i: the session.
            text_prompt: the role prompt (wrapped as ``<system> ... <system>``), or None / "".
            voice: a :class:`cspan.core.voice.VoicePrompt` (Mimi codes, or PersonaPlex input embeddings), [8, N]
                long Mimi codes, a voice name of the checkpoint, a ``.pt`` voice file or a 2-30 s recording (encoded
                with the checkpoint's Mimi here: :func:`cspan.core.voice.load_voice_prompt`), or None.
            user_name, user_city: appended to the prompt as "The user's name is X." / "The user is in Y.".
            seed: the session's new sampling seed (None keeps its current one).
            sampling: the session's sampling parameters (None keeps its current ones; see :meth:`set_sampling`).
            policy: this session's persona policy (None: the engine's ``persona_policy``).

        Returns:
            :class:`PrefixReport` (``prefill_ms``: the host time of building the prefix). With neither voice nor
            text (and the Context Spanning layout) the session is only reset (P = 0).

        Raises:
            IndexError: no such session. CheckpointError: text prompt without tokenizer, unknown voice name or a
                voice file that cannot be read. AudioInputError: a recording too short, too long or silent.
            ValueError: voice codes not [8, N] integers in [0, card); bad sampling parameters; a prefix that does
                not fit the window; a seed outside 0 .. 2**63 - 1; text holding a lone surrogate (bytes that were
                not UTF-8). TypeError: an argument of another type (text that is no str, a seed that is no int,
                ``sampling`` that is no SessionSampling, voice codes in a meta or sparse tensor, ...). Each error names the method and the argument; nothing is changed when
                it raises.
        """
        i = check_session(i, self.batch_size, "set_persona")
        check_seed(seed, "set_persona")
        check_persona({"text_prompt": text_prompt, "user_name": user_name, "user_city": user_city})
        if sampling is not None and not isinstance(sampling, SessionSampling):
            raise TypeError(
                f"set_persona: sampling is a SessionSampling(text=SamplingParams, audio=SamplingParams), got {sampling!r}"
            )
        t0 = time.perf_counter()
        if sampling is not None:  # checked first, queued with the prefix: a failing call changes nothing
            sampling = self._checked_sampling(i, sampling.text, sampling.audio, "set_persona")
        if isinstance(voice, (str, os.PathLike)):
            from .voice import load_voice_prompt

            voice = load_voice_prompt(voice, self.checkpoint)
        check_voice(voice, self.lm.card, self.num_codebooks)
        prefix = build_persona_prefix(
            self.tokenizer,
            text_prompt,
            voice,
            layout=getattr(self.checkpoint, "prefix_layout", CONTEXT_SPANNING),
            user_name=user_name,
            user_city=user_city,
            num_codebooks=self.num_codebooks,
            agent_placeholder=self.agent_placeholder,
            user_placeholder=self.user_placeholder,
        )
        embeddings = None if prefix.embeddings is None else prefix.embeddings.to(self.dtype)
        P = self._restart(i, prefix.frames, embeddings, seed, policy, sampling, "set_persona")
        return PrefixReport(
            session=i,
            num_frames=P,
            voice_frames=prefix.voice_frames,
            text_frames=len(prefix.text_ids),
            text=prefix.text,
            text_ids=prefix.text_ids,
            positions=P + 1 if P else 0,
            next_position=P + 1 if P else 0,
            prefill_ms=(time.perf_counter() - t0) * 1000.0,
        )

    def set_prefix(
        self,
        i: int,
        frames: torch.Tensor,
        embeddings: torch.Tensor | None = None,
        *,
        seed: int | None = None,
        policy: str | None = None,
    ) -> int:
        """Restart session ``i`` with prefix frames [K, P] (and the input embeddings [E, D] of its first E
        positions, or None), read by its next step (:func:`cspan.core.prefix.prefix_block`), kept in the window by
        ``policy`` (None: the engine's ``persona_policy``). P = 0 only resets. ``seed`` None keeps the session's
        seed. Returns P.

        Raises:
            ValueError: frames that are not [K, P] integers with each row's ids in its embedding table (-1: no
                input; not in the last column's agent codes, which the step returns as the agent's frame),
                embeddings that are not [E <= P, D] floats (or, on the host, hold NaN or infinities); an unknown
                policy; a prefix that leaves no room in the window (P + 1 >= context) with a policy that keeps it
                there. TypeError: no tensor. TypeError, ValueError: a seed that is no int in 0 .. 2**63 - 1.
                Nothing is changed when it raises.
        """
        i = check_session(i, self.batch_size, "set_prefix")
        return self._restart(i, frames, embeddings, seed, policy, None, "set_prefix")

    def _restart(
        self,
        i: int,
        frames: torch.Tensor,
        embeddings: torch.Tensor | None,
        seed: int | None,
        policy: str | None,
        sampling: SessionSampling | None,
        where: str,
    ) -> int:
        """Queue session ``i``'s restart with a prefix (:meth:`set_prefix`; ``sampling``, already checked, or None
        to keep the session's, in the same update of the sessions record); errors name ``where``, the method.
        Returns P."""
        seed = self.sessions.seeds[i] if seed is None else check_seed(seed, where)
        policy = self.persona_policy if policy is None else check_policy(policy, where)
        check_prefix(frames, embeddings, self._stream_rows, self.lm.cfg.dim, where, agent_codes=self.num_codebooks)
        P = int(frames.shape[-1])
        if not P:
            _warn_dropped(i, self.sessions.reset([i], [seed], sampling=sampling), where)
            return 0
        ctx = self.context
        if policy != "none" and ctx is not None and ctx <= P + 1:
            raise PersonaTooLongError(
                f"{where}: a persona prefix of {P} frames fills the model's {ctx}-position window; the "
                f"{policy!r} policy needs room to talk after it (shorten the prompt, or use policy 'none')",
                frames=P,
                window=ctx,
            )
        initial = self.state.grid.initial_t.cpu()
        block = prefix_block(frames, self.lm.delays, initial, embeddings)
        copy = None
        if policy == "reprefix":
            copy = reprefix_block(block, self.lm.delays, self.agent_placeholder, self.user_placeholder)
        dropped = self.sessions.reset([i], [seed], block, Persona(policy, sinks=P + 1, copy=copy), sampling)
        _warn_dropped(i, dropped, where)
        return P

    def inject_span(self, i: int, span: ContextSpan | str) -> SpanReport:
        """Queue a Context Span for session ``i``: its next step reads the block before its next position, in the
        step's one forward (host work only here; the session continues n positions later, see :mod:`cspan.core.span`).
        References longer than ``max_span_frames`` are truncated (``truncated``). A span queued after
        :meth:`set_persona` and before the prefix's step is read by the step after it (``first_position`` P + 1).

        Raises:
            IndexError: no such session. TypeError: a session that is no int, a span that is neither a
                :class:`ContextSpan` nor a str.
            SpanError: the session has not started (no persona and no step since its reset), an empty reference
                or one holding a lone surrogate (bytes that were not UTF-8), ids outside the text vocabulary, or a
                text span without a tokenizer (a bare LM: use :meth:`ContextSpan.from_ids`).
        """
        i = check_session(i, self.batch_size, "inject_span")
        if not isinstance(span, (ContextSpan, str)):
            raise TypeError(f"inject_span: the span is a ContextSpan or a str, got {type(span).__name__}")
        if not self.sessions.started[i]:
            raise SpanError(
                f"session {i} has not started: a Context Span goes between two frames of a running stream; "
                "give it a persona (set_persona(i, ...) with a voice or a text prompt: with neither it is only "
                "reset) or step() first"
            )
        t0 = time.perf_counter()
        block, ids, truncated = encode_span(
            span,
            tokenizer=self.tokenizer,
            max_frames=self.max_span_frames,
            text_card=getattr(self.lm, "text_card", None),
            num_streams=self.num_streams,
            agent_placeholder=self.agent_placeholder,
            user_placeholder=self.user_placeholder,
        )
        seq = next(self._span_seq)
        first = self.sessions.queue(i, replace(block, span_seq=seq))
        ms = (time.perf_counter() - t0) * 1000.0
        # the position the next call feeds: after the span, and after a copy of the prefix queued behind it
        pending = max(first + len(ids), self.sessions.position[i])
        return SpanReport(
            session=i,
            n=len(ids),
            truncated=truncated,
            ids=tuple(ids),
            first_position=first,
            last_position=first + len(ids) - 1,
            next_position=first + len(ids),
            prefill_ms=ms,
            context=self.context,
            window_positions_left=self.sessions.window_left(i, pending),
            prefix_in_window=self.sessions.prefix_visible(i, pending),
            seq=seq,
        )

    # -- the step ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step_tokens(
        self, user_codes: torch.Tensor | None = None, forced: torch.Tensor | None = None
    ) -> TokenStepOutput:
        """One call for every live session, at the token level (no codec).

        Args:
            user_codes: [B, C] integer codes (C = 8 for the 7B; any integer dtype and device, read as long), the
                user frame given to this call (frame ``c - 1``), written at the user rows' delays (not for a session
                whose persona prefix this call reads; an idle session's row is ignored). None: the user rows are not
                written -- only allowed when the depformer predicts them (dep_q = 16), which then samples them.
            forced: [B, K] integer tokens of the target column (position ``c + 1``, delayed coordinates: text and
                semantic codes of frame c, acoustic codes of frame c - 1), -2 = sample; or None.

        Returns:
            :class:`TokenStepOutput`.

        Raises:
            TypeError: not a dense torch.Tensor. ValueError: wrong shapes, or no user codes for a model that does
                not predict them (or for an engine built with ``predict_user=False``); not integer tensors; tokens
                out of range (checked for tensors on the CPU: reading device tensors' values would make every step
                wait for the GPU). The inputs are checked before the step takes the queued work.
        """
        check_step_codes(user_codes, forced, self.batch_size, self._stream_rows, self._no_user_codes)
        batch = self._prepare()
        if not batch.rows:  # every session idle: nothing to compute
            return self._idle()
        user = None if user_codes is None else user_codes.to(self.device, torch.long)
        forced = None if forced is None else forced.to(self.device, torch.long)
        key = self._key(batch, "tokens", user is None, forced is None)
        emb = batch.embeddings or (None, None)
        out = self._step_graphs(key, batch.shape, batch.packed, user, forced, *emb)
        self.sessions.advance(batch.rows)
        return out

    @torch.no_grad()
    def step(self, user_pcm: torch.Tensor) -> FrameOutput:
        """One 80 ms frame for every session: user PCM in, agent PCM and text out.

        Args:
            user_pcm: [B, 1920] (or [B, 1, 1920]) float samples in [-1, 1] at 24 kHz (any float dtype, read as
                float32), each session's next user frame. As everywhere audio enters
                (:func:`cspan.core.audio.sanitize_pcm`), NaN and infinite samples are read as silence and samples
                beyond full scale are clipped.

        Returns:
            :class:`FrameOutput` (device tensors; read ``text_token`` to the host once per frame).

        Raises:
            CheckpointError: the engine has no Mimi codec. TypeError: not a dense floating-point tensor. ValueError:
            wrong PCM shape. The inputs are checked before the step takes the queued work, so a call that raises
            for its input changes nothing.
        """
        if self.mimi is None:
            raise CheckpointError(
                "DuplexEngine.step needs the Mimi codec; build the engine from a checkpoint or pass mimi=, or use "
                "step_tokens() for token-level streaming"
            )
        pcm, B = check_frame_pcm(user_pcm, self.batch_size), self.batch_size
        batch = self._prepare()
        if not batch.rows:  # every session idle: nothing to compute
            tokens = self._idle()
            silent = torch.zeros(B, FRAME_SIZE, device=self.device)
            text = torch.full((B,), -1, dtype=torch.long, device=self.device)
            return FrameOutput(
                silent, text, text == RET, tokens.frame[:, 1 : 1 + self.num_codebooks], tokens.valid, tokens
            )
        key = self._key(batch, "frame", False, True)
        emb = batch.embeddings or (None, None)
        out = self._frame_graphs(key, batch.shape, batch.packed, pcm.to(self.device, torch.float32), *emb)
        self.sessions.advance(batch.rows)
        if batch.first_call:  # a session's first call finishes no frame: its decoder must not have advanced
            assert self.state.decoder is not None
            self.state.decoder.reset(torch.tensor(batch.first_call, dtype=torch.long, device=self.device))
        return out

    def prepare(self) -> None:
        """Build the next step's inputs now, between two frames: its ragged layout and tables (host), and the
        decode attention's plan. A server calls this when a Context Span arrives, while the device is idle
        between frames, so that the frame reading it starts its device work at once (on an 80 ms frame
        clock the host work of a 600-column span's step is 0.5-1.9 ms at B = 64: docs/PERFORMANCE.md, C83-C85).

        The prepared inputs are the next step's only while nothing changes in between: any reset, persona,
        span, sampling or live change after this call, or a step, makes the next step build its own (nothing is
        applied to the device state here; the step applies the queued restarts and blocks as always). Call it
        once the previous step's outputs have reached the host (as a server's frame reads its text and audio), or
        after ``torch.cuda.synchronize()``: like the head of every step, FlashInfer's decode plan rewrites a
        page-locked buffer whose copy to the device the previous step queued. Call it from the thread that steps
        (it shares the step's host caches).
        """
        head = self.sessions.peek()
        self._prepared = (head.version, self._step_inputs(head))

    def _prepare(self) -> StepBatch:
        """The head of a step: apply the live sessions' queued restarts and blocks to the device state; their
        layout (the inputs :meth:`prepare` built, when nothing changed since)."""
        head = self.sessions.take()
        if head.sampling:
            self.state.set_sampling(head.sampling)
        for row, restart in head.restarts.items():
            self.state.restart(row, restart)
        for row, queued in head.blocks.items():
            for block in queued:
                self.state.grid.splice(row, block.tokens)
        if head.pins:  # pinned prefixes: at the oldest positions of their windows
            self.state.pin(head.pins)
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == head.version:
            return prepared[1]
        return self._step_inputs(head)

    def _step_inputs(self, head: StepHead) -> StepBatch:
        """The host-built inputs of the step that reads ``head`` (host only: the device state is not touched)."""
        rows, restarts, blocks = head.rows, head.restarts, head.blocks
        prefixes = {row: r.prefix for row, r in restarts.items() if r.prefix is not None}
        text_top = top_k_bound(head.text_top_k, self.lm.text_linear.out_features)
        # a plain step (no block, no restart, no first call) of the same rows as the last plain step has the same
        # inputs: reuse them (on CUDA: the same page-locked tensor, not a new one per frame). Without a restart in
        # between, a row past its first calls stays past them, so the cached step's own first_call decides.
        key, unchanged = (tuple(rows), text_top), not restarts and not blocks
        if unchanged and self._plain_batch is not None and self._plain_batch[0] == key:
            batch = self._plain_batch[1]
        else:
            batch = build_step(
                rows, blocks, prefixes, head.positions, self.state.grid.max_delay, self.num_streams,
                self.state.scratch, self.state.lm.transformer.cache.capacity, self.plan, self.dtype, text_top,
            )  # fmt: skip
            self._plain_batch = (key, batch) if unchanged and not batch.first_call else None
        if batch.shape.library and self._library is not None:  # the decode slots' rows and positions (host)
            scratch, position = self.state.scratch, head.positions
            self._library.plan(batch.slot_rows, [0 if r == scratch else position[r] for r in batch.slot_rows])
        return batch

    def _idle(self) -> TokenStepOutput:
        """The output of a step in which no session is live."""
        B, K, dev = self.batch_size, self.num_streams, self.device
        none = torch.full((B, K), -2, dtype=torch.long, device=dev)
        logits = torch.zeros(B, self.lm.text_linear.out_features, dtype=self.dtype, device=dev)
        valid = torch.zeros(B, dtype=torch.bool, device=dev)
        return TokenStepOutput(none, valid, none.clone(), none.clone(), logits, torch.full((B,), -1, device=dev))

    def _key(self, batch: StepBatch, kind: str, no_user: bool, no_forced: bool) -> tuple | None:
        """The graph key of a step (None: run eagerly, the block columns fit no bucket)."""
        if self.plan.block_bucket(batch.shape.columns) is None:
            return None
        return (kind, batch.shape, no_user, no_forced, self.predict_user)

    def _token_step(
        self,
        shape: Any,
        packed: torch.Tensor,
        user: torch.Tensor | None,
        forced: torch.Tensor | None,
        emb_values: torch.Tensor | None = None,
        emb_use: torch.Tensor | None = None,
    ) -> TokenStepOutput:
        """The token step on device tensors (CUDA-graph capturable): blocks and next positions in one forward,
        sampling, commit; outputs scattered to all B sessions."""
        io = unpack(packed.to(self.device, non_blocking=True), shape, self.num_streams)
        io.layout.decode = self._library if shape.library else None
        grid, state, B = self.state.grid, self.state, self.batch_size
        rows: torch.Tensor | slice = slice(0, B) if shape.identity else io.rows  # a slice: views, no gathers

        def take(x: torch.Tensor) -> torch.Tensor:  # the stepped rows of a [B, ...] input
            return x if shape.identity else x.index_select(0, io.rows.clamp_max(B - 1))

        if user is not None:
            grid.write_user(take(user), rows, io.write_user)
        position = grid.position.index_select(0, io.rows)  # the position each row feeds (after its block)
        column_in = grid.input_column(rows)  # [b, K]
        tokens = io.tokens  # [K, N]: the ragged tokens; a block row's next position is its sequence's last
        if io.fold is not None:  # (every written value of a duplicate index is that column's own)
            at = io.fold.clamp_min(0)
            tokens = tokens.index_copy(1, at, torch.where(io.fold >= 0, column_in.T, tokens.index_select(1, at)))
        if shape.slots:  # [K, b + N]: the decode slots first
            tokens = torch.cat([column_in.T, tokens], dim=1) if shape.columns else column_in.T.contiguous()
        emb = None
        if emb_values is not None and emb_use is not None:
            emb = (emb_values.to(self.device, non_blocking=True), emb_use.to(self.device, non_blocking=True))
        hidden, text_logits = self.lm.temporal_step(tokens, state.lm, io.layout, self.plan, emb)
        target = grid.target_column(None if forced is None else take(forced), rows)
        text_sampling, audio_sampling = state.row_sampling(rows, shape.text_top)
        column = sample_column(
            self.lm,
            hidden,
            text_logits,
            target,
            state.depformer(shape.rows),
            text=text_sampling,
            audio=audio_sampling,
            seed=state.seed[rows] if shape.identity else state.seed.index_select(0, io.rows),
            counter=position,
            plan=self.plan,
            depformer_steps=None if self.predict_user or user is None else self.num_codebooks,
            text_top=shape.text_top,
        )
        frame, valid = grid.commit(column, rows)
        if not shape.identity:
            state.lm.transformer.cache.offset[state.scratch :] = 0  # padding rows leave the scratch row empty

        def scatter(x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:  # to all B sessions
            if shape.identity:
                return x
            full = torch.full((B + 1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
            return full.index_copy_(0, io.rows, x)[:B]

        return TokenStepOutput(
            frame=scatter(frame, -2),
            valid=scatter(valid, False),
            input=scatter(column_in, -2),
            column=scatter(column, -2),
            text_logits=scatter(text_logits, 0),
            position=scatter(position, -1),
        )

    def _frame(
        self,
        shape: Any,
        packed: torch.Tensor,
        pcm: torch.Tensor,
        emb_values: torch.Tensor | None = None,
        emb_use: torch.Tensor | None = None,
    ) -> FrameOutput:
        """The whole frame on device tensors (CUDA-graph capturable): pcm [B, 1920] float32."""
        assert self.mimi is not None and self.state.encoder is not None and self.state.decoder is not None
        C = self.num_codebooks
        # the rule of cspan.core.audio.sanitize_pcm: a NaN or infinite sample is silence, the rest clipped to full
        # scale (a NaN in the codec's state would make the session deaf)
        pcm = torch.nan_to_num(pcm, nan=0.0, posinf=0.0, neginf=0.0).clamp_(-1.0, 1.0)
        user_codes = self.mimi.encode_step(pcm[:, None, :], self.state.encoder)[:, :C, 0]  # [B, C]
        out = self._token_step(shape, packed, user_codes, None, emb_values, emb_use)
        agent_codes, valid = out.frame[:, 1 : 1 + C], out.valid
        codes = torch.where(valid[:, None], agent_codes, self._silence[None, :])
        agent_pcm = self.mimi.decode_step(codes[:, :, None], self.state.decoder)[:, 0].float()  # [B, 1920]
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

    # -- inspection ---------------------------------------------------------------------------------------------

    @property
    def cuda_graphs(self) -> bool:
        return self.plan.cuda_graphs

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.plan.kv_dtype

    @property
    def grid(self) -> Any:
        """The :class:`cspan.core.streams.TokenGrid` (B + 1 rows: the last is the scratch row)."""
        return self.state.grid

    @property
    def lm_state(self) -> Any:
        """The temporal KV state (B + 1 rows: the last is the scratch row)."""
        return self.state.lm

    @property
    def max_delay(self) -> int:
        return self.state.grid.max_delay

    @property
    def positions(self) -> list[int]:
        """Each session's pending position: the position its next step feeds (queued blocks included)."""
        return list(self.sessions.position)

    @property
    def started(self) -> list[bool]:
        return list(self.sessions.started)

    @property
    def prefix_end(self) -> list[int | None]:
        return list(self.sessions.prefix_end)

    @property
    def seeds(self) -> list[int]:
        return list(self.sessions.seeds)

    @property
    def sampling(self) -> list[SessionSampling]:
        """Each session's sampling parameters (from its next step on)."""
        return list(self.sessions.sampling)

    @property
    def live(self) -> list[bool]:
        return list(self.sessions.live)

    @property
    def context(self) -> int | None:
        """The temporal attention window in positions (None = unbounded)."""
        return self.lm.cfg.context

    def window_positions_left(self, i: int) -> int | None:
        """Positions session ``i`` can still feed before the first position of its persona prefix (of the latest
        copy; position 0 without a prefix) leaves the attention window (None: unbounded)."""
        i = check_session(i, self.batch_size, "window_positions_left")
        return self.sessions.window_left(i, self.sessions.position[i])

    def prefix_in_window(self, i: int) -> bool:
        """Whether session ``i``'s next query sees its whole persona prefix (its latest copy inside the window, or
        its pinned entries); False without a prefix."""
        i = check_session(i, self.batch_size, "prefix_in_window")
        return self.sessions.prefix_visible(i, self.sessions.position[i])

    def take_window_events(self, i: int) -> list[WindowEvent]:
        """What session ``i``'s persona policy did since the last call (:class:`cspan.core.window.WindowEvent`:
        ``pin`` once, ``reprefix`` per copy read), oldest first. Host only, any thread."""
        i = check_session(i, self.batch_size, "take_window_events")
        return self.sessions.take_window_events(i)

    def take_span_reads(self, i: int) -> list[SpanRead]:
        """The Context Spans session ``i``'s steps read since the last call, in order
        (:class:`cspan.core.sessions.SpanRead`: :attr:`SpanReport.seq`, the first position as read, the columns).
        A span is read by the session's next step, or later: after its persona prefix's step when queued behind
        one, or a step per step the ``max_block_columns`` budget held it back (its first position then one more per
        step). Host only, any thread."""
        i = check_session(i, self.batch_size, "take_span_reads")
        return self.sessions.take_span_reads(i)


def _warn_dropped(i: int, dropped: int, where: str) -> None:
    """Say that a restart of session ``i`` (by ``where``) dropped Context Spans queued for its old stream."""
    if dropped:
        logger.warning(
            "%s: session %d had %d Context Span(s) queued and not read yet; they belonged to the stream it restarts "
            "and are dropped",
            where,
            i,
            dropped,
        )


__all__ = ["DuplexEngine", "FrameOutput", "PrefixReport", "SpanReport", "TokenStepOutput"]
