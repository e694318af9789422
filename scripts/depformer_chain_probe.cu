// Can one persistent CUDA kernel run the depformer's chain of matrix-vector products faster than one launch per
// product? A probe for issue 23's batch-1 step (docs/PERFORMANCE.md, "What remains"), not engine code.
//
// The depformer of the PersonaPlex-shaped 7B reads, per codebook, six layers of four bf16 products for one row:
// QKV [3D, D], output [D, D], gate-up [2F, D], down [D, F] (D = 1024, F = 2816: 154 MB, 36.6 us at 4.2 TB/s). In the
// engine each is its own GEMV launch (with the norms, attention and residuals fused around them: 33 launches per
// codebook, 110 us for one row, C41/C42). This times the bare chain (no norms, no attention: each product's input
// is the previous output; the down product's is silu(gate) * up) four ways on the same weights:
//
//   chain      one launch per product, every warp one row, weights to registers, a CUDA graph of all launches;
//   chain+PDL  the same with programmatic dependent launch: each kernel loads its weights, then waits for its
//              predecessor (griddepcontrol), as the engine's GEMV kernels do;
//   persistent one cooperative launch, one block per SM, a grid barrier between products; each block streams its
//              slice of the NEXT product's weights into shared memory (cp.async, two stages) before it waits at the
//              barrier for the current product's input, so weight reads overlap the barriers;
//   persistent+cg  the same with cooperative_groups' grid.sync() instead of the hand-written barrier;
//   and two references for the persistent kernel: without the prefetch (each product's weights requested after its
//   barrier) and the barriers alone (no loads, no products); then a version with bf16 activations (the input of a
//   product in one 16-byte load per thread), with the weights by TMA bulk copies, and with one arrival counter per
//   product instead of the grid barrier (docs/PERFORMANCE.md, C59-C64: the counters with prefetch are the only form
//   under the PDL chain, 95 against 122 us per codebook).
//
// Prints microseconds per codebook for each and the floor (one streaming read of the same weights), and checks that
// the persistent kernel's last output equals the chain's (float32 sums in another order).
//
// Build and run on the device (CUDA 12.3+, sm_90):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/depformer_chain_probe scripts/depformer_chain_probe.cu
//   /tmp/depformer_chain_probe [codebooks, default 8] [iterations, default 20]
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace cg = cooperative_groups;

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));             \
      exit(1);                                                                                       \
    }                                                                                                \
  } while (0)

constexpr int D = 1024, F = 2816, LAYERS = 6, PER_CODEBOOK = 4 * LAYERS, MAX_CODEBOOKS = 16;
constexpr int MAX_ROWS = 2 * F, MAX_COLS = F;
constexpr int PT = 512;  // threads per block of the persistent kernel
constexpr int XS_BYTES = MAX_COLS * 4;

struct Gemv {
  const __nv_bfloat16* w;  // [rows, cols] row-major
  int rows, cols, gated;   // gated: the input is silu(prev[0:F]) * prev[F:2F]
};

__constant__ Gemv c_gemvs[MAX_CODEBOOKS * PER_CODEBOOK];

// streaming loads (weights, read once); an output of another block (after a barrier) is read with __ldcg (L2 only)
__device__ __forceinline__ uint4 ld_cs(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float dot8(uint4 w, const float* x) {  // 8 bf16 weights . 8 floats
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    s += f.x * x[2 * i] + f.y * x[2 * i + 1];
  }
  return s;
}

__device__ __forceinline__ void load_x(float* xs, const float* prev, int cols, int gated) {
  // __ldcg (not volatile asm): the loads of one thread's elements are issued together, one L2 round trip
#pragma unroll 4
  for (int k = threadIdx.x; k < cols; k += blockDim.x) {
    float v;
    if (gated) {
      float a = __ldcg(prev + k), b = __ldcg(prev + F + k);
      v = a / (1.f + __expf(-a)) * b;
    } else {
      v = __ldcg(prev + k);
    }
    xs[k] = v;
  }
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// ---- one launch per product ----------------------------------------------------------------------------------------
template <int CHUNKS, bool PDL>  // cols = 256 * CHUNKS
__global__ void __launch_bounds__(256) gemv_chain(const __nv_bfloat16* __restrict__ w, int rows, const float* prev,
                                                  int gated, float* out) {
  extern __shared__ float xs_chain[];
  const int cols = 256 * CHUNKS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + warp;
  if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 wr[CHUNKS];
  if (row < rows) {
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * cols);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) wr[c] = ld_cs(wrow + lane + 32 * c);
  }
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  load_x(xs_chain, prev, cols, gated);
  __syncthreads();
  if (row < rows) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s += dot8(wr[c], xs_chain + (lane + 32 * c) * 8);
    s = warp_sum(s);
    if (lane == 0) out[row] = s;
  }
}

// ---- one persistent launch -----------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned target) {  // count reaches target
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(count, 1u);
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    } while (v < target);
  }
  __syncthreads();
}

// MODE: how products follow one another in the persistent kernel
// (RESIDENT: no weight loads at all, the products read whatever the stages hold: barrier + input + compute alone)
// (TMA_PREFETCH, bf16 version only: the next product's weights as ONE bulk copy per block by the tensor memory
// accelerator, completed on an mbarrier, so the critical path's input loads do not queue behind them)
enum { PREFETCH = 0, PREFETCH_CG = 1, NO_PREFETCH = 2, BARRIERS_ONLY = 3, RESIDENT = 4, TMA_PREFETCH = 5 };

template <int MODE>
__global__ void __launch_bounds__(PT, 1)
    gemv_persistent(int G, int stage_bytes, const float* x0, float* y0, float* y1, unsigned* count) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem);
  unsigned char* stages = smem + XS_BYTES;
  const int nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr bool ahead = MODE == PREFETCH || MODE == PREFETCH_CG;

  auto prefetch = [&](int g) {  // this block's rows of product g into stage g % 2
    const Gemv& m = c_gemvs[g];
    const int per = (m.rows + nb - 1) / nb, r0 = min(m.rows, b * per), r1 = min(m.rows, r0 + per);
    const char* src = reinterpret_cast<const char*>(m.w + (size_t)r0 * m.cols);
    unsigned char* dst = stages + (size_t)(g & 1) * stage_bytes;
    const int n16 = (r1 - r0) * m.cols / 8;
    for (int i = tid; i < n16; i += PT) cp_async16(dst + 16 * (size_t)i, src + 16 * (size_t)i);
    cp_async_commit();
  };

  if (ahead) prefetch(0);
  unsigned epoch = 0;
  for (int g = 0; g < G; ++g) {
    __syncthreads();  // every warp is done with stage (g + 1) % 2 (product g - 1)
    if (ahead && g + 1 < G) prefetch(g + 1);  // the next product's weights stream in across the barrier
    if (g > 0) {  // the previous product's outputs, from every block
      if (MODE == PREFETCH_CG) {
        __threadfence();
        cg::this_grid().sync();
      } else {
        grid_barrier(count, (++epoch) * nb);
      }
    }
    if (MODE == BARRIERS_ONLY) continue;
    if (MODE == NO_PREFETCH) prefetch(g);  // this product's weights, only now
    const Gemv& m = c_gemvs[g];
    const float* prev = g == 0 ? x0 : ((g - 1) & 1 ? y1 : y0);
    float* out = (g & 1) ? y1 : y0;
    load_x(xs, prev, m.cols, m.gated);
    if (ahead && g + 1 < G) cp_async_wait<1>(); else if (MODE != RESIDENT) cp_async_wait<0>();
    __syncthreads();
    const int per = (m.rows + nb - 1) / nb, r0 = min(m.rows, b * per), r1 = min(m.rows, r0 + per);
    const unsigned char* stage = stages + (size_t)(g & 1) * stage_bytes;
    for (int r = r0 + warp; r < r1; r += PT / 32) {
      const uint4* wrow = reinterpret_cast<const uint4*>(stage + (size_t)(r - r0) * m.cols * 2);
      float s = 0.f;
#pragma unroll 4
      for (int c = lane; c < m.cols / 8; c += 32) s += dot8(wrow[c], xs + c * 8);
      s = warp_sum(s);
      if (lane == 0) out[r] = s;
    }
  }
}


// ---- the persistent kernel with bf16 activations (third version) ---------------------------------------------------
// What the no-weight-load reference showed (C60: 3.6 us per product with no weights read, barrier 1.06) is the
// per-product critical path: this version cuts it where it can without a new structure. Outputs are bf16 (as the
// engine's), so a block reads a product's whole input with ONE 16-byte load per thread (two for the gated input),
// all in flight together, and keeps it in shared memory as bf16, read back one 16-byte vector per lane and chunk
// (no bank conflicts; float32 inputs read as 8 scalars per chunk were 8-way conflicted).
__device__ __forceinline__ float dot8bf(uint4 w, uint4 x) {  // 8 bf16 weights . 8 bf16 inputs, float32 sum
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

__device__ __forceinline__ uint4 silu_gate8(uint4 g, uint4 u) {  // silu(gate) * up for 8 bf16 pairs
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&g);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
  uint4 r;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    o[i] = __floats2bfloat162_rn(fa.x / (1.f + __expf(-fa.x)) * fb.x, fa.y / (1.f + __expf(-fa.y)) * fb.y);
  }
  return r;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void tma_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  if (bytes)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// FLAGS: instead of the grid barrier, one arrival counter per product (zeroed before the launch): a block's
// threads write their outputs, meet at __syncthreads, and one thread adds 1 with release semantics (no fence by
// every thread); before product g one thread polls product g - 1's counter with acquire loads until every block
// has arrived (no epoch, no reset)
template <int MODE, bool FLAGS = false>
__global__ void __launch_bounds__(PT, 1) gemv_persistent_bf16(int G, int stage_bytes, const __nv_bfloat16* x0,
                                                              __nv_bfloat16* y0, __nv_bfloat16* y1, unsigned* count) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* xs = reinterpret_cast<uint4*>(smem);  // the input, 8 bf16 per vector
  unsigned char* stages = smem + XS_BYTES;
  const int nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr bool tma = MODE == TMA_PREFETCH, ahead = MODE == PREFETCH || tma;
  __shared__ __align__(8) unsigned long long bars[2];  // one per stage (TMA_PREFETCH)
  if (tma && tid == 0) {
    for (int i = 0; i < 2; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bars + i)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (tma) __syncthreads();

  auto prefetch = [&](int g) {
    const Gemv& m = c_gemvs[g];
    const int per = (m.rows + nb - 1) / nb, r0 = min(m.rows, b * per), r1 = min(m.rows, r0 + per);
    const char* src = reinterpret_cast<const char*>(m.w + (size_t)r0 * m.cols);
    unsigned char* dst = stages + (size_t)(g & 1) * stage_bytes;
    if (tma) {  // this block's rows are one contiguous run of bytes: one bulk copy
      if (tid == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stage's last reads came first
        tma_load(dst, src, (unsigned)((r1 - r0) * m.cols * 2), bars + (g & 1));
      }
      return;
    }
    const int n16 = (r1 - r0) * m.cols / 8;
    for (int i = tid; i < n16; i += PT) cp_async16(dst + 16 * (size_t)i, src + 16 * (size_t)i);
    cp_async_commit();
  };

  if (ahead) prefetch(0);
  unsigned epoch = 0;
  for (int g = 0; g < G; ++g) {
    __syncthreads();
    if (ahead && g + 1 < G) prefetch(g + 1);
    if (g > 0 && !FLAGS) grid_barrier(count, (++epoch) * nb);
    if (g > 0 && FLAGS) {
      if (tid == 0) {
        unsigned v;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count + g - 1) : "memory");
        } while (v < (unsigned)nb);
      }
      __syncthreads();
    }
    if (MODE == BARRIERS_ONLY) {
      if (FLAGS && tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count + g) : "memory");
      continue;
    }
    if (MODE == NO_PREFETCH) prefetch(g);
    const Gemv& m = c_gemvs[g];
    const __nv_bfloat16* prev = g == 0 ? x0 : ((g - 1) & 1 ? y1 : y0);
    __nv_bfloat16* out = (g & 1) ? y1 : y0;
    const int nv = m.cols / 8;  // input vectors (at most F / 8 = 352 < PT: one per thread)
    if (tid < nv) {
      const uint4* p = reinterpret_cast<const uint4*>(prev);
      xs[tid] = m.gated ? silu_gate8(__ldcg(p + tid), __ldcg(p + F / 8 + tid)) : __ldcg(p + tid);
    }
    if (tma) mbar_wait(bars + (g & 1), (g >> 1) & 1);  // the stage's (g >> 1)-th fill
    else if (ahead && g + 1 < G) cp_async_wait<1>();
    else if (MODE != RESIDENT) cp_async_wait<0>();
    __syncthreads();
    const int per = (m.rows + nb - 1) / nb, r0 = min(m.rows, b * per), r1 = min(m.rows, r0 + per);
    const unsigned char* stage = stages + (size_t)(g & 1) * stage_bytes;
    for (int r = r0 + warp; r < r1; r += PT / 32) {
      const uint4* wrow = reinterpret_cast<const uint4*>(stage + (size_t)(r - r0) * m.cols * 2);
      float s = 0.f;
#pragma unroll 4
      for (int c = lane; c < nv; c += 32) s += dot8bf(wrow[c], xs[c]);
      s = warp_sum(s);
      if (lane == 0) out[r] = __float2bfloat16(s);
    }
    if (FLAGS) {  // this block's rows of product g are written
      __syncthreads();
      if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count + g) : "memory");
    }
  }
}

// ---- set-up and the read floor -------------------------------------------------------------------------------------
__global__ void init_bf16(__nv_bfloat16* p, size_t n, float a, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    p[i] = __float2bfloat16(a * ((float)(h & 0xFFFFFF) / 8388608.0f - 1.0f));
  }
}

__global__ void read_all(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = ld_cs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

static void launch_chain(const Gemv& m, const float* prev, float* out, bool pdl, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((m.rows + 7) / 8);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = m.cols * 4;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  if (m.cols == D) {
    if (pdl) CK(cudaLaunchKernelEx(&cfg, gemv_chain<D / 256, true>, m.w, m.rows, prev, m.gated, out));
    else CK(cudaLaunchKernelEx(&cfg, gemv_chain<D / 256, false>, m.w, m.rows, prev, m.gated, out));
  } else {
    if (pdl) CK(cudaLaunchKernelEx(&cfg, gemv_chain<F / 256, true>, m.w, m.rows, prev, m.gated, out));
    else CK(cudaLaunchKernelEx(&cfg, gemv_chain<F / 256, false>, m.w, m.rows, prev, m.gated, out));
  }
}

int main(int argc, char** argv) {
  const int C = argc > 1 ? std::min(MAX_CODEBOOKS, std::max(1, atoi(argv[1]))) : 8;
  const int iters = argc > 2 ? std::max(1, atoi(argv[2])) : 20;
  const int G = C * PER_CODEBOOK;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int nsm = prop.multiProcessorCount;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // the weights: C codebooks x 6 layers x (QKV, output, gate-up, down)
  const int shapes[4][3] = {{3 * D, D, 0}, {D, D, 0}, {2 * F, D, 0}, {D, F, 1}};
  size_t per_cb = 0;
  for (int k = 0; k < 4; ++k) per_cb += (size_t)LAYERS * shapes[k][0] * shapes[k][1];
  __nv_bfloat16* W;
  CK(cudaMalloc(&W, per_cb * C * 2));
  std::vector<Gemv> h(G);
  size_t off = 0;
  int stage_bytes = 0;
  for (int g = 0; g < G; ++g) {
    const int* sh = shapes[g % 4];
    h[g] = Gemv{W + off, sh[0], sh[1], sh[2]};
    init_bf16<<<4 * nsm, 256, 0, s>>>(W + off, (size_t)sh[0] * sh[1], 1.7f / sqrtf((float)sh[1]), 1234u + g);
    CK(cudaGetLastError());
    off += (size_t)sh[0] * sh[1];
    stage_bytes = std::max(stage_bytes, (sh[0] + nsm - 1) / nsm * sh[1] * 2);
  }
  CK(cudaMemcpyToSymbol(c_gemvs, h.data(), G * sizeof(Gemv)));
  float *x0, *y0, *y1, *z0, *z1;
  unsigned *count, *sink;
  CK(cudaMalloc(&x0, D * 4));
  for (float** p : {&y0, &y1, &z0, &z1}) CK(cudaMalloc(p, MAX_ROWS * 4));
  CK(cudaMalloc(&count, 4));
  CK(cudaMalloc(&sink, 4));
  std::vector<float> hx(D);
  for (int i = 0; i < D; ++i) hx[i] = std::sin(0.37f * i);
  CK(cudaMemcpy(x0, hx.data(), D * 4, cudaMemcpyHostToDevice));
  CK(cudaStreamSynchronize(s));

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_us = [&](auto&& body) {  // microseconds per codebook, median of iters
    for (int i = 0; i < 3; ++i) body();
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
      CK(cudaEventRecord(e0, s));
      body();
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.f / C);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };

  const double mb = per_cb * 2 / 1e6;
  const size_t n16 = per_cb * C * 2 / 16;
  float floor_us = time_us([&] { read_all<<<8 * nsm, 256, 0, s>>>(reinterpret_cast<const uint4*>(W), n16, sink); });
  printf("GPU %s, %d SMs; %d codebooks x %d products, %.1f MB of bf16 weights per codebook\n", prop.name, nsm, C,
         PER_CODEBOOK, mb);
  printf("floor (one streaming read of the weights): %7.1f us per codebook (%.2f TB/s)\n", floor_us,
         mb / floor_us);  // MB per us = TB/s

  for (int pdl = 0; pdl < 2; ++pdl) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int g = 0; g < G; ++g) launch_chain(h[g], g == 0 ? x0 : ((g - 1) & 1 ? z1 : z0), (g & 1) ? z1 : z0, pdl, s);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    float us = time_us([&] { CK(cudaGraphLaunch(exec, s)); });
    printf("%-34s %7.1f us per codebook (%.2f us per product)\n", pdl ? "chain + PDL (CUDA graph):" : "chain (CUDA graph):",
           us, us / PER_CODEBOOK);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }

  const int smem = XS_BYTES + 2 * stage_bytes;
  const struct { void (*kernel)(int, int, const float*, float*, float*, unsigned*); const char* name; } modes[] = {
      {gemv_persistent<BARRIERS_ONLY>, "persistent, barriers only:"},
      {gemv_persistent<RESIDENT>, "persistent, no weight loads:"},
      {gemv_persistent<NO_PREFETCH>, "persistent, no prefetch:"},
      {gemv_persistent<PREFETCH_CG>, "persistent + cg grid.sync:"},
      {gemv_persistent<PREFETCH>, "persistent, own barrier:"},  // last: its outputs are checked below
  };
  for (const auto& mode : modes) {
    CK(cudaFuncSetAttribute(mode.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int blocks_per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, mode.kernel, PT, smem));
    if (blocks_per_sm < 1) {
      printf("persistent kernel does not fit one block per SM (%d bytes of shared memory)\n", smem);
      return 1;
    }
    int g_arg = G, sb = stage_bytes;
    void* args[] = {&g_arg, &sb, &x0, &y0, &y1, &count};
    float us = time_us([&] {
      CK(cudaMemsetAsync(count, 0, 4, s));
      CK(cudaLaunchCooperativeKernel((const void*)mode.kernel, dim3(nsm), dim3(PT), args, smem, s));
    });
    printf("%-34s %7.1f us per codebook (%.2f us per product; %d KB of shared memory)\n", mode.name, us,
           us / PER_CODEBOOK, smem / 1024);
  }
  // the third version (bf16 activations): its own buffers, its input the chain's x0 rounded to bf16
  unsigned* flags;
  CK(cudaMalloc(&flags, G * 4));
  __nv_bfloat16 *bx0, *by0, *by1;
  for (__nv_bfloat16** p : {&bx0, &by0, &by1}) CK(cudaMalloc(p, MAX_ROWS * 2));
  {
    std::vector<__nv_bfloat16> hb(D);
    for (int i = 0; i < D; ++i) hb[i] = __float2bfloat16(hx[i]);
    CK(cudaMemcpy(bx0, hb.data(), D * 2, cudaMemcpyHostToDevice));
  }
  const struct { void (*kernel)(int, int, const __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, unsigned*);
                 const char* name; } bf16_modes[] = {
      {gemv_persistent_bf16<RESIDENT>, "bf16 acts, no weight loads:"},
      {gemv_persistent_bf16<NO_PREFETCH>, "bf16 acts, no prefetch:"},
      {gemv_persistent_bf16<BARRIERS_ONLY, true>, "bf16 acts, flags, exchange only:"},
      {gemv_persistent_bf16<RESIDENT, true>, "bf16 acts, flags, no weight loads:"},
      {gemv_persistent_bf16<NO_PREFETCH, true>, "bf16 acts, flags, no prefetch:"},
      {gemv_persistent_bf16<PREFETCH, true>, "bf16 acts, flags, prefetch:"},
      {gemv_persistent_bf16<PREFETCH>, "bf16 acts, prefetch, own barrier:"},
      {gemv_persistent_bf16<TMA_PREFETCH>, "bf16 acts, TMA prefetch:"},  // last: checked below
  };
  for (const auto& mode : bf16_modes) {
    CK(cudaFuncSetAttribute(mode.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int g_arg = G, sb = stage_bytes;
    void* args[] = {&g_arg, &sb, &bx0, &by0, &by1, &flags};
    float us = time_us([&] {
      CK(cudaMemsetAsync(flags, 0, G * 4, s));  // the barrier's counter is flags[0]; FLAGS uses one per product
      CK(cudaLaunchCooperativeKernel((const void*)mode.kernel, dim3(nsm), dim3(PT), args, smem, s));
    });
    printf("%-34s %7.1f us per codebook (%.2f us per product)\n", mode.name, us, us / PER_CODEBOOK);
  }
  CK(cudaStreamSynchronize(s));

  // the last product's outputs: persistent (y) against chain (z)
  const Gemv& last = h[G - 1];
  std::vector<float> a(last.rows), c(last.rows);
  CK(cudaMemcpy(a.data(), (G - 1) & 1 ? y1 : y0, last.rows * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(c.data(), (G - 1) & 1 ? z1 : z0, last.rows * 4, cudaMemcpyDeviceToHost));
  double diff = 0, mag = 0;
  for (int i = 0; i < last.rows; ++i) {
    diff = std::max(diff, (double)std::fabs(a[i] - c[i]));
    mag = std::max(mag, (double)std::fabs(c[i]));
  }
  {  // the bf16 version against the chain: bf16 roundings of every product's output, so a looser bound
    std::vector<__nv_bfloat16> hb(last.rows);
    CK(cudaMemcpy(hb.data(), (G - 1) & 1 ? by1 : by0, last.rows * 2, cudaMemcpyDeviceToHost));
    double bd = 0;
    for (int i = 0; i < last.rows; ++i) bd = std::max(bd, (double)std::fabs(__bfloat162float(hb[i]) - c[i]));
    printf("last product, bf16 version: max |bf16 - chain| %.3g (max |chain| %.3g)\n", bd, mag);
  }
  printf("last product: max |persistent - chain| %.3g, max |chain| %.3g (%s)\n", diff, mag,
         mag == 0 && diff == 0 ? "both underflowed to 0 over the chain: check the 1-codebook run"
         : diff <= 1e-3 * mag + 1e-30 && mag > 0 ? "equal within float32 sums" : "DIFFERENT");
  return 0;
}
