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
    """

    epsilon = 1e-5

    def __init__(self, dim: int, bins: int, device=None, dtype=None) -> None:
        super().__init__()
        self.dim = dim
        self.bins = bins
        self.register_buffer("_initialized", torch.zeros(1, device=device, dtype=torch.float32))
        self.register_buffer("cluster_usage", torch.ones(bins, device=device, dtype=dtype))
        self.register_buffer("embedding_sum", torch.zeros(bins, dim, device=device, dtype=dtype))

    @property
    def embedding(self) -> Tensor:
        """Centroids ``[bins, dim]`` = ``embedding_sum / cluster_usage.clamp(min=1e-5)[:, None]``."""
        return self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]

    def encode(self, x: Tensor, embedding: Tensor | None = None) -> Tensor:
        """Nearest-centroid indices: ``x`` ``[N, dim]`` -> ``[N]`` int64 (``embedding`` may be precomputed)."""
        emb = self.embedding if embedding is None else embedding
        dists = torch.cdist(x[None], emb[None], p=2)[0]
        return dists.argmin(dim=-1)

    def decode(self, codes: Tensor, embedding: Tensor | None = None) -> Tensor:
        """Centroid lookup: codes ``[*]`` -> ``[*, dim]`` (codes must lie in ``[0, bins)``; not checked, no sync)."""
        emb = self.embedding if embedding is None else embedding
        return F.embedding(codes, emb)


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
        residual = x
        all_codes = []
        for layer in self.layers[:n_q]:
            codebook = layer._codebook
            emb = codebook.embedding
            flat = residual.transpose(1, 2).reshape(batch * steps, dim)
            codes = codebook.encode(flat, emb).view(batch, steps)
            quantized = codebook.decode(codes, emb).transpose(1, 2)  # [B, D, T]
            residual = residual - quantized
            all_codes.append(codes)
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
