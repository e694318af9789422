// Can a hand-written GEMV read the temporal transformer's weights faster than cuBLAS at batch 1? A probe for issue
// 23's batch-1 step (docs/PERFORMANCE.md, "What remains"), not engine code.
//
// At B = 1 the 7B's temporal products are matrix-vector products, read-bound: per layer QKV [3 x 4096, 4096],
// output [4096, 4096], gate-up [2 x 11264, 4096] and down [4096, 11264], 411 MB of bf16, 13.2 GB over 32 layers.
// The engine runs them through cuBLAS (`F.linear`): C58's profile of the full-ring step has them at 3.59 ms with
// cuBLAS's split-K reductions, against 3.09 ms at the copy rate, and cuBLAS's kernels do not overlap one another.
// This times the chain of 128 products (each input the previous output's first K values) from a CUDA graph:
//
//   cublas       cublasGemmEx per product (bf16 in and out, float32 sums), as torch's F.linear at one row;
//   warp         one warp per output row (R rows per warp), every weight of the row requested before any is used
//                (K / 256 loads of 16 bytes per lane in flight), the input vector in shared memory;
//   warp + PDL   the same with programmatic dependent launch: each kernel requests its weights, then waits for its
//                predecessor's output (griddepcontrol), so one product's weight reads overlap the previous tail;
//
// per kind of product (32 of a kind in a chain, each on its own weights) and for the whole 32-layer chain, against
// the floor of one streaming read of the same bytes; and checks the hand-written output against cuBLAS's.
//
// Build and run on the device (CUDA 12.3+, sm_90):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/temporal_gemv_probe scripts/temporal_gemv_probe.cu -ldl
//   (libcublas is opened at run time: LD_LIBRARY_PATH must reach it, e.g. torch's nvidia/*/lib)
//   /tmp/temporal_gemv_probe [iterations, default 20]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <vector>

// cuBLAS through dlopen (the wheels of torch ship libcublas without its headers): the four entry points used
using cublasHandle_t = void*;
using cublasStatus_t = int;
constexpr int CUBLAS_STATUS_SUCCESS = 0, CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUDA_R_16BF_ = 14;
constexpr int CUBLAS_COMPUTE_32F = 68, CUBLAS_GEMM_DEFAULT = -1;
static cublasStatus_t (*cublasCreate)(cublasHandle_t*);
static cublasStatus_t (*cublasSetStream)(cublasHandle_t, cudaStream_t);
static cublasStatus_t (*cublasSetWorkspace)(cublasHandle_t, void*, size_t);
static cublasStatus_t (*cublasGemmEx)(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int,
                                      const void*, int, int, const void*, void*, int, int, int, int);
static void load_cublas() {
  void* lib = nullptr;
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
    if ((lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL))) break;
  if (!lib) {
    fprintf(stderr, "libcublas not found (set LD_LIBRARY_PATH): %s\n", dlerror());
    exit(1);
  }
  cublasCreate = reinterpret_cast<decltype(cublasCreate)>(dlsym(lib, "cublasCreate_v2"));
  cublasSetStream = reinterpret_cast<decltype(cublasSetStream)>(dlsym(lib, "cublasSetStream_v2"));
  cublasSetWorkspace = reinterpret_cast<decltype(cublasSetWorkspace)>(dlsym(lib, "cublasSetWorkspace_v2"));
  cublasGemmEx = reinterpret_cast<decltype(cublasGemmEx)>(dlsym(lib, "cublasGemmEx"));
  if (!cublasCreate || !cublasSetStream || !cublasSetWorkspace || !cublasGemmEx) {
    fprintf(stderr, "libcublas lacks an entry point\n");
    exit(1);
  }
}

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));             \
      exit(1);                                                                                       \
    }                                                                                                \
  } while (0)
#define CB(x)                                                                                        \
  do {                                                                                               \
    cublasStatus_t s_ = (x);                                                                         \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                               \
      fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_);             \
      exit(1);                                                                                       \
    }                                                                                                \
  } while (0)

constexpr int D = 4096, F = 11264, LAYERS = 32, KINDS = 4;
constexpr int SHAPES[KINDS][2] = {{3 * D, D}, {D, D}, {2 * F, D}, {D, F}};  // [rows N, columns K]
const char* const NAMES[KINDS] = {"qkv", "out", "gate-up", "down"};
constexpr int MAX_N = 2 * F;

__device__ __forceinline__ uint4 ld_cs(const uint4* p) {  // a weight: read once, do not keep in L1
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {  // 8 bf16 weights . 8 bf16 inputs, float32 sum
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

// one warp per R output rows, K / 256 loads of 16 bytes per lane and row, all issued before the first use
template <int K, int R, bool PDL>
__global__ void __launch_bounds__(256) gemv_warp(const __nv_bfloat16* __restrict__ w, int rows,
                                                 const __nv_bfloat16* x, __nv_bfloat16* y) {
  constexpr int C = K / 256;  // 16-byte chunks per lane and row
  __shared__ __align__(16) __nv_bfloat16 xs[K];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * 8 + warp) * R;
  if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 wr[R][C];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)min(row0 + r, rows - 1) * K);
#pragma unroll
    for (int c = 0; c < C; ++c) wr[r][c] = ld_cs(wrow + lane + 32 * c);
  }
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = threadIdx.x; i < K / 8; i += 256)
    reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
  __syncthreads();
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const uint4 xv = reinterpret_cast<const uint4*>(xs)[lane + 32 * c];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] += dot8(wr[r][c], xv);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o; o >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = __float2bfloat16(s[r]);
  }
}

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

template <int K, int R>
static void launch_warp(const __nv_bfloat16* w, int rows, const __nv_bfloat16* x, __nv_bfloat16* y, bool pdl,
                        cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((rows + 8 * R - 1) / (8 * R));
  cfg.blockDim = dim3(256);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  if (pdl) CK(cudaLaunchKernelEx(&cfg, gemv_warp<K, R, true>, w, rows, x, y));
  else CK(cudaLaunchKernelEx(&cfg, gemv_warp<K, R, false>, w, rows, x, y));
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::max(1, atoi(argv[1])) : 20;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  load_cublas();
  cublasHandle_t handle;
  CB(cublasCreate(&handle));
  CB(cublasSetStream(handle, s));
  void* workspace;  // cuBLAS inside a graph capture: its workspace set beforehand, as torch does
  CK(cudaMalloc(&workspace, 32 << 20));
  CB(cublasSetWorkspace(handle, workspace, 32 << 20));

  // the weights: 32 layers x 4 kinds, one allocation each
  __nv_bfloat16* W[LAYERS][KINDS];
  size_t total = 0;
  for (int l = 0; l < LAYERS; ++l)
    for (int k = 0; k < KINDS; ++k) {
      const size_t n = (size_t)SHAPES[k][0] * SHAPES[k][1];
      CK(cudaMalloc(&W[l][k], n * 2));
      init_bf16<<<4 * prop.multiProcessorCount, 256, 0, s>>>(W[l][k], n, 1.7f / sqrtf((float)SHAPES[k][1]),
                                                             1234u + 7 * l + k);
      CK(cudaGetLastError());
      total += n * 2;
    }
  __nv_bfloat16 *x0, *a, *b, *c, *d;  // the chain's input, then ping-pong outputs (cuBLAS: a/b, ours: c/d)
  for (__nv_bfloat16** p : {&x0, &a, &b, &c, &d}) CK(cudaMalloc(p, MAX_N * 2));
  init_bf16<<<64, 256, 0, s>>>(x0, MAX_N, 1.0f, 99u);
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  CK(cudaStreamSynchronize(s));

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_us = [&](auto&& body) {  // median of iters, microseconds
    for (int i = 0; i < 3; ++i) body();
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
      CK(cudaEventRecord(e0, s));
      body();
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  auto graph_us = [&](auto&& capture) {  // capture a chain into a CUDA graph, time its launches
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    capture();
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const float us = time_us([&] { CK(cudaGraphLaunch(exec, s)); });
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return us;
  };

  const float one = 1.f, zero = 0.f;
  auto cublas = [&](int k, const __nv_bfloat16* w, const __nv_bfloat16* x, __nv_bfloat16* y) {
    const int N = SHAPES[k][0], K = SHAPES[k][1];  // y [N] = W [N, K] x [K]: column-major W^T is [K, N]
    CB(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, 1, K, &one, w, CUDA_R_16BF_, K, x, CUDA_R_16BF_, K, &zero, y,
                    CUDA_R_16BF_, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  auto ours = [&](int k, int R, const __nv_bfloat16* w, const __nv_bfloat16* x, __nv_bfloat16* y, bool pdl) {
    const int N = SHAPES[k][0];
    if (SHAPES[k][1] == D) {
      if (R == 1) launch_warp<D, 1>(w, N, x, y, pdl, s);
      else launch_warp<D, 2>(w, N, x, y, pdl, s);
    } else {
      launch_warp<F, 1>(w, N, x, y, pdl, s);  // 44 chunks per lane: one row per warp
    }
  };

  const double mb_layer = total / 1e6 / LAYERS;
  const float floor_us = time_us([&] {
    for (int l = 0; l < LAYERS; ++l)
      for (int k = 0; k < KINDS; ++k) {
        const size_t n16 = (size_t)SHAPES[k][0] * SHAPES[k][1] / 8;
        read_all<<<8 * prop.multiProcessorCount, 256, 0, s>>>(reinterpret_cast<const uint4*>(W[l][k]), n16, sink);
      }
  });
  printf("GPU %s, %d SMs; 32 layers x (qkv, out, gate-up, down): %.1f MB per layer, %.2f GB in all\n", prop.name,
         prop.multiProcessorCount, mb_layer, total / 1e9);
  printf("floor (streaming reads, one kernel per matrix): %8.1f us for 32 layers (%.2f TB/s)\n", floor_us,
         total / 1e6 / floor_us);

  // per kind: 32 products of the kind in a chain (each reads the previous output; inputs of K <= N values)
  const double rate = total / 1e6 / floor_us;  // MB per us
  printf("%-8s %8s %10s %10s %10s %10s  (us per product; TB/s for the best)\n", "kind", "floor", "cublas", "warp",
         "warp+PDL", "warp R=2");
  for (int k = 0; k < KINDS; ++k) {
    const double mb = (double)SHAPES[k][0] * SHAPES[k][1] * 2 / 1e6;
    const bool chainable = SHAPES[k][0] >= SHAPES[k][1];  // otherwise feed the constant input
    auto in = [&](int l, __nv_bfloat16* p, __nv_bfloat16* q) -> const __nv_bfloat16* {
      return l == 0 || !chainable ? x0 : ((l - 1) & 1 ? q : p);
    };
    const float t_cb = graph_us([&] {
      for (int l = 0; l < LAYERS; ++l) cublas(k, W[l][k], in(l, a, b), (l & 1) ? b : a);
    }) / LAYERS;
    float t_w[3];
    for (int v = 0; v < 3; ++v) {
      const int R = v == 2 ? 2 : 1;
      const bool pdl = v >= 1;
      t_w[v] = graph_us([&] {
        for (int l = 0; l < LAYERS; ++l) ours(k, R, W[l][k], in(l, c, d), (l & 1) ? d : c, pdl);
      }) / LAYERS;
    }
    const float best = std::min({t_cb, t_w[0], t_w[1], t_w[2]});
    printf("%-8s %8.2f %10.2f %10.2f %10.2f %10.2f  (%.2f TB/s)\n", NAMES[k], mb / rate, t_cb, t_w[0], t_w[1],
           SHAPES[k][1] == D ? t_w[2] : NAN, mb / best);
  }

  // the whole 32-layer chain: qkv -> out -> gate-up -> down (each input the previous output's first K values)
  auto chain = [&](int variant) {
    return graph_us([&] {
      const __nv_bfloat16* x = x0;
      for (int l = 0; l < LAYERS; ++l)
        for (int k = 0; k < KINDS; ++k) {
          const int i = l * KINDS + k;
          __nv_bfloat16* y = variant == 0 ? ((i & 1) ? b : a) : ((i & 1) ? d : c);
          if (variant == 0) cublas(k, W[l][k], x, y);
          else ours(k, variant == 3 ? 2 : 1, W[l][k], x, y, variant >= 2);
          x = y;
        }
    });
  };
  const float c_cb = chain(0), c_w = chain(1), c_pdl = chain(2), c_r2 = chain(3);
  printf("whole chain, 128 products: cublas %.1f us, warp %.1f, warp+PDL %.1f, warp+PDL R=2 (K = 4096) %.1f;"
         " floor %.1f\n", c_cb, c_w, c_pdl, c_r2, floor_us);

  // the last product of the chain: ours (variant 3 ran last, output in c/d) against cublas (a/b)
  chain(0);
  std::vector<__nv_bfloat16> ha(D), hc(D);
  const int last = LAYERS * KINDS - 1;
  CK(cudaMemcpy(ha.data(), (last & 1) ? b : a, D * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hc.data(), (last & 1) ? d : c, D * 2, cudaMemcpyDeviceToHost));
  double diff = 0, mag = 0;
  for (int i = 0; i < D; ++i) {
    const double u = __bfloat162float(ha[i]), v = __bfloat162float(hc[i]);
    diff = std::max(diff, std::fabs(u - v));
    mag = std::max(mag, std::fabs(u));
  }
  printf("last output: max |warp - cublas| %.3g, max |cublas| %.3g\n", diff, mag);
  return 0;
}
