"""Split residual vector quantizer of the Mimi codec (inference: encode to codes, decode to latents).

Residual vector quantization follows Zeghidour et al., "SoundStream" (2021), Algorithm 1; the split into a
semantic ``rvq_first`` and an acoustic ``rvq_rest`` that both quantize the *same* latent through their own 1x1
projections follows Défossez et al., "Moshi" (2024), section 3.3 and Kyutai's ``moshi/quantization/vq.py``
(``SplitResidualVectorQuantizer``). Buffer names match upstream's checkpoints
(``vq.layers.{n}._codebook.embedding_sum`` / ``cluster_usage`` / ``_initialized``).

The centroids are ``embedding_sum / cluster_usage.clamp(min=1e-5)[:, None]`` (EMA statistics). The nearest
centroid is chosen exactly as upstream: ``torch.cdist`` (which, with more than 25 codebook entries, evaluates
``sqrt(clamp(|r|^2 + |c|^2 - 2 r.c, 0))`` through a matrix product) followed by ``argmin`` (first index on ties),
so that near-ties are decided the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class EuclideanCodebook(nn.Module):
    """One codebook of ``bins`` vectors of size ``dim`` stored as EMA statistics.

    Buffers: ``_initialized`` [1] (float flag, unused at inference), ``cluster_usage`` [bins],
    ``embedding_sum`` [bins, dim].

    The centroids, and the codebook's side of the distance product, are computed once and cached for the current
    buffer tensors and their version counters (a replaced buffer or an in-place change is seen; inference tensors
    have no version counter, so an in-place change made to one under ``torch.inference_mode`` is not: replace it).
    A CUDA graph captured after the first call reads the cached copy: capture again after changing the codebook.
    """

    epsilon = 1e-5

    def __init__(self, dim: int, bins: int, device=None, dtype=None) -> None:
        super().__init__()
        self.dim = dim
        self.bins = bins
        self.register_buffer("_initialized", torch.zeros(1, device=device, dtype=torch.float32))
        self.register_buffer("cluster_usage", torch.ones(bins, device=device, dtype=dtype))
        self.register_buffer("embedding_sum", torch.zeros(bins, dim, device=device, dtype=dtype))
        # (embedding_sum, cluster_usage, their versions, centroids, the codebook's side of the distance product)
        self._cache: tuple[Tensor, Tensor, tuple, Tensor, Tensor] | None = None

    @property
    def embedding(self) -> Tensor:
        """Centroids ``[bins, dim]`` = ``embedding_sum / cluster_usage.clamp(min=1e-5)[:, None]``."""
        return self._centroids()[0]

    def _centroids(self) -> tuple[Tensor, Tensor]:
        """(centroids ``[bins, dim]``, ``[1, bins, dim + 2]`` = ``[c, 1, |c|^2]`` for :meth:`encode`), cached."""
        held, usage = self.embedding_sum, self.cluster_usage
        versions = (_version(held), _version(usage))
        cached = self._cache
        if cached is not None and cached[0] is held and cached[1] is usage and cached[2] == versions:
            return cached[3], cached[4]
        with torch.no_grad():
            emb = held / usage.clamp(min=self.epsilon)[:, None]
            # torch.cdist's matrix-product form (aten::_euclidean_dist) of x2 = emb[None], built the same way
            x2 = emb[None]
            norm = x2.pow(2).sum(-1, keepdim=True)
            augmented = torch.cat([x2, torch.ones_like(norm), norm], -1)
        if not _capturing(emb):  # a tensor made during CUDA-graph capture holds nothing until the graph replays
            self._cache = (held, usage, versions, emb, augmented)
        return emb, augmented

    def encode(self, x: Tensor, embedding: Tensor | None = None) -> Tensor:
        """Nearest-centroid indices: ``x`` ``[N, dim]`` -> ``[N]`` int64 (``embedding`` may be given instead of the
        codebook's own centroids).

        Bit for bit ``torch.cdist(x[None], emb[None])[0].argmin(-1)``: above 25 rows on either side cdist takes
        ``sqrt(clamp(|x|^2 + |c|^2 - 2 x.c, 0))`` from one matrix product of ``[-2x, |x|^2, 1]`` and
        ``[c, 1, |c|^2]``; the codebook's side of it is cached, the rest is computed the same way.
        """
        if embedding is not None or (x.shape[0] <= 25 and self.bins <= 25):
            emb = self.embedding if embedding is None else embedding
            return torch.cdist(x[None], emb[None], p=2)[0].argmin(dim=-1)
        augmented = self._centroids()[1]
        x1 = x[None]
        norm = x1.pow(2).sum(-1, keepdim=True)
        dists = torch.cat([x1.mul(-2), norm, torch.ones_like(norm)], -1).matmul(augmented.mT)
        return dists.clamp_min_(0).sqrt_()[0].argmin(dim=-1)

    def decode(self, codes: Tensor, embedding: Tensor | None = None) -> Tensor:
        """Centroid lookup: codes ``[*]`` -> ``[*, dim]`` (codes must lie in ``[0, bins)``; not checked, no sync)."""
        emb = self.embedding if embedding is None else embedding
        return F.embedding(codes, emb)


def _version(t: Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class VectorQuantization(nn.Module):
    """Holder named like upstream (``_codebook``); the codebook dimension equals the input dimension."""

    def __init__(self, dim: int, bins: int, device=None, dtype=None) -> None:
        super().__init__()
        self._codebook = EuclideanCodebook(dim, bins, device=device, dtype=dtype)


class ResidualVectorQuantization(nn.Module):
    """``num_quantizers`` codebooks applied residually, in the projected space (``layers.{n}``)."""

    def __init__(self, dim: int, bins: int, num_quantizers: int, device=None, dtype=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [VectorQuantization(dim, bins, device=device, dtype=dtype) for _ in range(num_quantizers)]
        )

    def encode(self, x: Tensor, n_q: int) -> Tensor:
        """Residual quantization of ``x`` ``[B, D, T]`` with the first ``n_q`` codebooks -> ``[B, n_q, T]`` int64.

        Per level: ``code = argmin_j |r - c_j|``, then ``r <- r - c_code`` (r starts at x).
        """
        batch, dim, steps = x.shape
        residual = x.transpose(1, 2).reshape(batch * steps, dim)  # rows [N, D]: the same values, elementwise
        all_codes = []
        for layer in self.layers[:n_q]:
            codebook = layer._codebook
            codes = codebook.encode(residual)
            residual = residual - codebook.decode(codes)
            all_codes.append(codes.view(batch, steps))
        return torch.stack(all_codes, dim=1)

    def decode(self, codes: Tensor) -> Tensor:
        """Sum of the centroids of ``codes`` ``[B, K, T]`` over the K first levels -> ``[B, D, T]``.

        Raises:
            ValueError: more code rows than codebooks.
        """
        if codes.shape[1] > len(self.layers):
            raise ValueError(f"got {codes.shape[1]} codebooks of codes, this quantizer has only {len(self.layers)}")
        quantized: Tensor | None = None
        for k in range(codes.shape[1]):
            q = self.layers[k]._codebook.decode(codes[:, k])  # [B, T, D]
            quantized = q if quantized is None else quantized + q
        assert quantized is not None
        return quantized.transpose(1, 2)


class ResidualVectorQuantizer(nn.Module):
    """RVQ with 1x1 input/output projections: latent ``[B, C_in, T]`` <-> codes ``[B, n_q, T]``.

    Args:
        dimension: codebook vector size ``D``.
        input_dimension, output_dimension: latent channels before/after (projections ``input_proj`` /
            ``output_proj`` are ``nn.Conv1d`` k1 without bias, as upstream with ``force_projection``).
        n_q: codebooks; ``bins``: entries per codebook.
    """

    def __init__(
        self,
        dimension: int,
        input_dimension: int,
        output_dimension: int,
        n_q: int,
        bins: int,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.max_n_q = n_q
        self.n_q = n_q
        self.bins = bins
        self.input_proj = nn.Conv1d(input_dimension, dimension, 1, bias=False, device=device, dtype=dtype)
        self.output_proj = nn.Conv1d(dimension, output_dimension, 1, bias=False, device=device, dtype=dtype)
        self.vq = ResidualVectorQuantization(dimension, bins, n_q, device=device, dtype=dtype)

    def set_num_codebooks(self, n: int) -> None:
        """Use only the first ``n`` codebooks when encoding (0 <= n <= max_n_q).

        Raises:
            ValueError: ``n`` out of range.
        """
        if not 0 <= n <= self.max_n_q:
            raise ValueError(f"number of codebooks {n} out of range [0, {self.max_n_q}]")
        self.n_q = n

    def encode(self, x: Tensor) -> Tensor:
        """Latent ``[B, C_in, T]`` -> codes ``[B, n_q, T]`` int64."""
        if self.n_q == 0 or x.shape[-1] == 0:
            return torch.empty(x.shape[0], self.n_q, x.shape[-1], dtype=torch.long, device=x.device)
        return self.vq.encode(self.input_proj(x), self.n_q)

    def decode(self, codes: Tensor) -> Tensor:
        """Codes ``[B, K, T]`` (K <= max_n_q) -> latent ``[B, C_out, T]``."""
        return self.output_proj(self.vq.decode(codes))


class SplitResidualVectorQuantizer(nn.Module):
    """Mimi's quantizer: ``rvq_first`` (``n_q_semantic`` semantic codebooks) and ``rvq_rest`` (acoustic), both
    applied to the same latent; codes are concatenated ``[semantic; acoustic]`` and the decoded latent is the sum
    of both reconstructions.

    Args:
        cfg: a :class:`cspan.core.config.MimiQuantizerConfig`.
        device, dtype: factory arguments.
    """

    def __init__(self, cfg, device=None, dtype=None) -> None:
        super().__init__()
        self.n_q_semantic = cfg.n_q_semantic
        common = {
            "dimension": cfg.dimension,
            "input_dimension": cfg.input_dimension,
            "output_dimension": cfg.output_dimension,
            "bins": cfg.bins,
            "device": device,
            "dtype": dtype,
        }
        self.rvq_first = ResidualVectorQuantizer(n_q=cfg.n_q_semantic, **common)
        self.rvq_rest = ResidualVectorQuantizer(n_q=cfg.n_q - cfg.n_q_semantic, **common)

    @property
    def total_codebooks(self) -> int:
        """All codebooks in the checkpoint (32 for the real codec)."""
        return self.rvq_first.max_n_q + self.rvq_rest.max_n_q

    @property
    def num_codebooks(self) -> int:
        """Codebooks produced by :meth:`encode`."""
        return self.rvq_first.n_q + self.rvq_rest.n_q

    @property
    def cardinality(self) -> int:
        """Entries per codebook."""
        return self.rvq_first.bins

    def set_num_codebooks(self, n: int) -> None:
        """Encode with ``n`` codebooks: all semantic ones plus ``n - n_q_semantic`` acoustic ones.

        Raises:
            ValueError: ``n`` outside ``[n_q_semantic, total_codebooks]``.
        """
        if not self.n_q_semantic <= n <= self.total_codebooks:
            raise ValueError(
                f"number of codebooks {n} out of range [{self.n_q_semantic}, {self.total_codebooks}] for this Mimi"
            )
        self.rvq_rest.set_num_codebooks(n - self.n_q_semantic)

    def encode(self, x: Tensor) -> Tensor:
        """Latent ``[B, C, T]`` -> codes ``[B, num_codebooks, T]`` int64 (row 0 semantic)."""
        codes = self.rvq_first.encode(x)
        if self.rvq_rest.n_q > 0:
            codes = torch.cat([codes, self.rvq_rest.encode(x)], dim=1)
        return codes

    def decode(self, codes: Tensor) -> Tensor:
        """Codes ``[B, K, T]`` (``n_q_semantic <= K <= total_codebooks``) -> latent ``[B, C, T]``.

        Raises:
            ValueError: fewer than ``n_q_semantic`` or more than ``total_codebooks`` code rows.
        """
        k = codes.shape[1]
        if not self.n_q_semantic <= k <= self.total_codebooks:
            raise ValueError(
                f"codes have {k} codebooks; expected between {self.n_q_semantic} and {self.total_codebooks}"
            )
        quantized = self.rvq_first.decode(codes[:, : self.n_q_semantic])
        if k > self.n_q_semantic:
            quantized = quantized + self.rvq_rest.decode(codes[:, self.n_q_semantic :])
        return quantized
