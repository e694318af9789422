"""Mimi codec against the reference fixture ``mimi-small`` (moshi 0.2.13, CPU float32): strict load, codes,
decoded PCM, intermediates, and frame-by-frame streaming with per-row resets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cspan.core import Mimi, MimiConfig

FRAME = 1920
ATOL_PCM = 2e-6
ATOL_INTERMEDIATE = 5e-6


@pytest.fixture(scope="module")
def one_thread():
    """The reference ran on one CPU thread; one thread also avoids oversubscribing the shared CI cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ref(fixture_file) -> dict[str, torch.Tensor]:
    def part(name: str) -> dict[str, torch.Tensor]:
        return load_file(fixture_file("reference", "mimi-small", name))

    out = {f"inter.{k}": v for k, v in part("intermediates.safetensors").items()}
    out["pcm"] = part("input.safetensors")["pcm"]
    out["codes"] = part("codes.safetensors")["codes"]
    out["decoded"] = part("decoded.safetensors")["pcm"]
    streaming = part("streaming.safetensors")
    out["stream.codes"] = streaming["codes"]
    out["stream.pcm"] = streaming["pcm"]
    return out


@pytest.fixture(scope="module")
def mimi(fixture_file, one_thread) -> Mimi:
    cfg = MimiConfig.from_upstream(json.loads(fixture_file("reference", "mimi-small", "config.json").read_text()))
    model = Mimi(cfg).eval()
    state_dict = load_file(fixture_file("reference", "mimi-small", "model.safetensors"))
    assert len(state_dict) == 126
    model.load_state_dict(state_dict, strict=True)
    return model


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_fixture_state_dict_matches_module_exactly(mimi: Mimi, fixture_file) -> None:
    ref_sd = load_file(fixture_file("reference", "mimi-small", "model.safetensors"))
    ours = {k: tuple(v.shape) for k, v in mimi.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in ref_sd.items()}
    assert sum(v.numel() for v in mimi.state_dict().values()) == 302173
    assert mimi.num_codebooks == 8 and mimi.total_codebooks == 8 and mimi.cardinality == 64
    assert mimi.frame_size == FRAME and mimi.sample_rate == 24000 and mimi.frame_rate == 12.5


def test_encode_equals_reference_codes(mimi: Mimi, ref) -> None:
    with torch.no_grad():
        codes = mimi.encode(ref["pcm"])
    assert codes.dtype == torch.int64
    assert codes.shape == (1, 8, 25)
    assert torch.equal(codes, ref["codes"])


def test_decode_matches_reference_pcm(mimi: Mimi, ref) -> None:
    with torch.no_grad():
        pcm = mimi.decode(ref["codes"])
    assert pcm.shape == (1, 1, 48000)
    assert _max_diff(pcm, ref["decoded"]) <= ATOL_PCM


def test_intermediates_match_reference(mimi: Mimi, ref) -> None:
    with torch.no_grad():
        seanet = mimi.encoder(ref["pcm"])
        enc_tr = mimi.encoder_transformer(seanet)
        latent = mimi.encode_to_latent(ref["pcm"])
        quantized = mimi.decode_latent(ref["codes"])
        upsampled = mimi.upsample(quantized)
        dec_tr = mimi.decoder_transformer(upsampled)
    got = {
        "seanet_encoder_out": seanet,
        "encoder_transformer_out": enc_tr,
        "latent": latent,
        "quantized_latent": quantized,
        "upsampled": upsampled,
        "decoder_transformer_out": dec_tr,
    }
    for name, value in got.items():
        assert _max_diff(value, ref[f"inter.{name}"]) <= ATOL_INTERMEDIATE, name
    # the reference intermediates chain: the quantizer on the reference latent gives the reference codes
    assert torch.equal(mimi.quantizer.encode(ref["inter.latent"]), ref["codes"])


def test_encode_right_pads_to_whole_frames(mimi: Mimi, ref) -> None:
    pcm = ref["pcm"][..., : 10 * FRAME - 700]
    padded = torch.nn.functional.pad(pcm, (0, 700))
    with torch.no_grad():
        assert torch.equal(mimi.encode(pcm), mimi.encode(padded))
        assert mimi.encode(pcm[..., :0]).shape == (1, 8, 0)


def test_streaming_encode_equals_non_streaming_codes(mimi: Mimi, ref) -> None:
    state = mimi.new_encoder_state(1)
    with torch.no_grad():
        codes = torch.cat([mimi.encode_step(ref["pcm"][..., i : i + FRAME], state) for i in range(0, 48000, FRAME)], -1)
    assert torch.equal(codes, ref["codes"])
    assert torch.equal(codes, ref["stream.codes"])
    assert state.transformer.offset.tolist() == [50]


def test_streaming_decode_matches_reference_streaming_pcm(mimi: Mimi, ref) -> None:
    state = mimi.new_decoder_state(1)
    with torch.no_grad():
        frames = [mimi.decode_step(ref["codes"][..., t : t + 1], state) for t in range(25)]
    assert all(f.shape == (1, 1, FRAME) for f in frames)
    pcm = torch.cat(frames, -1)
    assert _max_diff(pcm, ref["stream.pcm"]) <= ATOL_PCM
    assert _max_diff(pcm, ref["decoded"]) <= ATOL_PCM


def test_streaming_multi_frame_calls_equal_single_frame_calls(mimi: Mimi, ref) -> None:
    enc = mimi.new_encoder_state(1)
    dec = mimi.new_decoder_state(1)
    with torch.no_grad():
        codes = torch.cat(
            [mimi.encode_step(ref["pcm"][..., i : i + 5 * FRAME], enc) for i in range(0, 48000, 5 * FRAME)], -1
        )
        pcm = torch.cat([mimi.decode_step(ref["codes"][..., t : t + 5], dec) for t in range(0, 25, 5)], -1)
    assert torch.equal(codes, ref["codes"])
    assert _max_diff(pcm, ref["stream.pcm"]) <= ATOL_PCM


@pytest.mark.parametrize("rows_kind", ["list", "long", "mask"])
def test_per_row_reset_restarts_only_that_session(mimi: Mimi, ref, rows_kind: str) -> None:
    """Batch of 2: row 0 streams the whole input; row 1 first streams other audio (frames 15..24), is reset after
    10 frames and then streams the input from its start. Row 1 must then match a fresh single-row run, and row 0
    must be unaffected."""
    pcm, codes = ref["pcm"], ref["codes"]
    rows = {"list": [1], "long": torch.tensor([1]), "mask": torch.tensor([False, True])}[rows_kind]
    enc = mimi.new_encoder_state(2)
    dec = mimi.new_decoder_state(2)
    out_codes, out_pcm = [], []
    with torch.no_grad():
        for t in range(25):
            if t == 10:
                enc.reset(rows)
                dec.reset(rows)
            t1 = t + 15 if t < 10 else t - 10
            frame = torch.cat([pcm[..., t * FRAME : (t + 1) * FRAME], pcm[..., t1 * FRAME : (t1 + 1) * FRAME]])
            out_codes.append(mimi.encode_step(frame, enc))
            out_pcm.append(mimi.decode_step(torch.cat([codes[..., t : t + 1], codes[..., t1 : t1 + 1]]), dec))
        got_codes = torch.cat(out_codes, -1)
        got_pcm = torch.cat(out_pcm, -1)

        fresh_enc = mimi.new_encoder_state(1)
        fresh_dec = mimi.new_decoder_state(1)
        fresh_codes = torch.cat(
            [mimi.encode_step(pcm[..., t * FRAME : (t + 1) * FRAME], fresh_enc) for t in range(15)], -1
        )
        fresh_pcm = torch.cat([mimi.decode_step(codes[..., t : t + 1], fresh_dec) for t in range(15)], -1)

    assert enc.transformer.offset.tolist() == [50, 30]
    assert torch.equal(got_codes[:1], ref["codes"])
    assert torch.equal(got_codes[1:, :, 10:], fresh_codes)
    assert torch.equal(fresh_codes, ref["codes"][..., :15])
    assert _max_diff(got_pcm[:1], ref["stream.pcm"]) <= ATOL_PCM
    assert _max_diff(got_pcm[1:, :, 10 * FRAME :], fresh_pcm) <= ATOL_PCM
    assert _max_diff(fresh_pcm, ref["stream.pcm"][..., : 15 * FRAME]) <= ATOL_PCM


def test_full_reset_equals_new_state(mimi: Mimi, ref) -> None:
    enc = mimi.new_encoder_state(1)
    with torch.no_grad():
        for i in range(3):
            mimi.encode_step(ref["pcm"][..., -(i + 1) * FRAME : -i * FRAME or None], enc)
        enc.reset()
        codes = torch.cat(
            [mimi.encode_step(ref["pcm"][..., i : i + FRAME], enc) for i in range(0, 5 * FRAME, FRAME)], -1
        )
    assert torch.equal(codes, ref["codes"][..., :5])


def test_set_num_codebooks(mimi: Mimi, ref) -> None:
    try:
        mimi.set_num_codebooks(3)
        with torch.no_grad():
            codes = mimi.encode(ref["pcm"])
            assert torch.equal(codes, ref["codes"][:, :3])
            # decoding fewer codebooks uses only those
            assert mimi.decode(codes).shape == (1, 1, 48000)
        with pytest.raises(ValueError, match="out of range"):
            mimi.set_num_codebooks(9)
        with pytest.raises(ValueError, match="out of range"):
            mimi.set_num_codebooks(0)
    finally:
        mimi.set_num_codebooks(8)


def test_input_errors_name_the_problem(mimi: Mimi, ref) -> None:
    with pytest.raises(ValueError, match=r"\[B, 1, samples\]"):
        mimi.encode(ref["pcm"][0])
    with pytest.raises(ValueError, match="multiple of the frame size 1920"):
        mimi.encode_step(ref["pcm"][..., :1000], mimi.new_encoder_state(1))
    with pytest.raises(ValueError, match="batch of 1 rows for a state of 2"):
        mimi.encode_step(ref["pcm"][..., :FRAME], mimi.new_encoder_state(2))
    with pytest.raises(ValueError, match="integer codes"):
        mimi.decode(ref["codes"].float())
    with pytest.raises(ValueError, match="9 codebooks"):
        mimi.decode(torch.zeros(1, 9, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="0 frames"):
        mimi.decode_step(ref["codes"][..., :0], mimi.new_decoder_state(1))


def _capture(fn, static_in: torch.Tensor, state):
    """Warm up on a side stream, capture ``fn(static_in, state)`` in a CUDA graph, then restart the state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(static_in, state)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_in, state)
    state.reset()
    return graph, out


@pytest.mark.gpu
def test_frame_steps_have_no_host_sync_and_replay_in_cuda_graphs(fixture_file, ref) -> None:
    cfg = MimiConfig.from_upstream(json.loads(fixture_file("reference", "mimi-small", "config.json").read_text()))
    dev = torch.device("cuda")
    model = Mimi(cfg, device=dev).eval()
    model.load_state_dict(load_file(fixture_file("reference", "mimi-small", "model.safetensors")), strict=True)
    pcm, codes, stream_pcm = ref["pcm"].to(dev), ref["codes"].to(dev), ref["stream.pcm"].to(dev)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            enc, dec = model.new_encoder_state(1), model.new_decoder_state(1)
            model.encode_step(pcm[..., :FRAME], enc)
            model.decode_step(codes[..., :1], dec)
            enc.reset()
            dec.reset()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                model.encode_step(pcm[..., :FRAME], enc)
                model.decode_step(codes[..., :1], dec)
            finally:
                torch.cuda.set_sync_debug_mode("default")

            enc, dec = model.new_encoder_state(2), model.new_decoder_state(2)
            pcm_in = torch.zeros(2, 1, FRAME, device=dev)
            codes_in = torch.zeros(2, 8, 1, dtype=torch.long, device=dev)
            enc_graph, codes_out = _capture(model.encode_step, pcm_in, enc)
            dec_graph, pcm_out = _capture(model.decode_step, codes_in, dec)
            got_codes, got_pcm = [], []
            for t in range(25):
                if t == 10:
                    enc.reset([1])
                    dec.reset([1])
                t1 = t + 15 if t < 10 else t - 10
                pcm_in.copy_(
                    torch.cat([pcm[..., t * FRAME : (t + 1) * FRAME], pcm[..., t1 * FRAME : (t1 + 1) * FRAME]])
                )
                codes_in.copy_(torch.cat([codes[..., t : t + 1], codes[..., t1 : t1 + 1]]))
                enc_graph.replay()
                dec_graph.replay()
                got_codes.append(codes_out.clone())
                got_pcm.append(pcm_out.clone())
            got_codes_t, got_pcm_t = torch.cat(got_codes, -1), torch.cat(got_pcm, -1)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert torch.equal(got_codes_t[:1], codes)
    assert torch.equal(got_codes_t[1:, :, 10:], codes[..., :15])
    assert _max_diff(got_pcm_t[:1], stream_pcm) <= ATOL_PCM
    assert _max_diff(got_pcm_t[1:, :, 10 * FRAME :], stream_pcm[..., : 15 * FRAME]) <= ATOL_PCM


@pytest.mark.gpu
def test_convolutions_of_more_than_64_rows_equal_the_rows_computed_alone() -> None:
    from cspan.core.mimi import exact_float32
    from cspan.core.modules.conv import CUDNN_TIMED_ROWS, NormConv1d, NormConvTranspose1d

    torch.manual_seed(0)
    x = torch.randn(CUDNN_TIMED_ROWS + 32, 64, 24, device="cuda")
    benchmark = torch.backends.cudnn.benchmark
    for conv in (NormConv1d(64, 32, 7), NormConvTranspose1d(64, 32, 8, stride=4)):
        conv = conv.cuda()
        with torch.no_grad(), exact_float32():
            whole = conv(x)
            alone = torch.cat([conv(x[i : i + 1]) for i in range(x.shape[0])])
        assert whole.shape[0] == x.shape[0]
        assert torch.backends.cudnn.benchmark == benchmark  # set for the call only
        torch.testing.assert_close(whole, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_frame_steps_of_more_than_64_rows_replay_in_cuda_graphs_as_run_eagerly(fixture_file, ref) -> None:
    """Above ``CUDNN_TIMED_ROWS`` rows cuDNN times its algorithms at a shape's first (eager) call; a graph captured
    after it replays the same kernels: its codes and audio equal an eager run of the same frames."""
    from cspan.core.modules.conv import CUDNN_TIMED_ROWS

    cfg = MimiConfig.from_upstream(json.loads(fixture_file("reference", "mimi-small", "config.json").read_text()))
    dev = torch.device("cuda")
    model = Mimi(cfg, device=dev).eval()
    model.load_state_dict(load_file(fixture_file("reference", "mimi-small", "model.safetensors")), strict=True)
    B, frames = CUDNN_TIMED_ROWS + 32, 6
    pcm = (
        ref["pcm"].to(dev)[..., : frames * FRAME].expand(B, 1, -1)
        * torch.linspace(0.2, 1.0, B, device=dev)[:, None, None]
    )
    codes = ref["codes"].to(dev)[..., :frames].expand(B, -1, -1).contiguous()
    with torch.inference_mode():
        enc, dec = model.new_encoder_state(B), model.new_decoder_state(B)
        eager = [(model.encode_step(pcm[..., t * FRAME : (t + 1) * FRAME].contiguous(), enc),
                  model.decode_step(codes[..., t : t + 1], dec)) for t in range(frames)]  # fmt: skip
        enc, dec = model.new_encoder_state(B), model.new_decoder_state(B)
        pcm_in = torch.zeros(B, 1, FRAME, device=dev)
        codes_in = torch.zeros(B, 8, 1, dtype=torch.long, device=dev)
        enc_graph, codes_out = _capture(model.encode_step, pcm_in, enc)
        dec_graph, pcm_out = _capture(model.decode_step, codes_in, dec)
        for t in range(frames):
            pcm_in.copy_(pcm[..., t * FRAME : (t + 1) * FRAME])
            codes_in.copy_(codes[..., t : t + 1])
            enc_graph.replay()
            dec_graph.replay()
            assert torch.equal(codes_out, eager[t][0]), t
            assert torch.equal(pcm_out, eager[t][1]), t
    assert torch.backends.cudnn.benchmark is False
