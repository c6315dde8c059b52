// Row softmax (forward and backward) for float32, float16 and bfloat16, in CUDA C++.
// Header-free on purpose: it compiles both with `nvcc -c` and with NVRTC (torch.cuda._compile_kernel),
// which is how static_dist.ops loads it on a GPU. fp16/bf16 are converted by hand (PTX cvt / bit shifts).
//
// One thread block per row; the block reduces the row's max and sum in float32 (warp shuffles, then one
// value per warp through shared memory), then writes exp(x - max) / sum. Bytes moved: one read of the row
// for the max, one for the sum, one read + one write for the output (the re-reads hit L2 for rows < ~1 MB).
// Backward: dx = y * (dy - sum(dy * y)), two passes over y and dy.

typedef unsigned short u16;
#define SD_NEG_INF (__int_as_float(0xff800000))   // -inf without math headers (NVRTC has none)

__device__ __forceinline__ float sd_h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 sd_f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float sd_b2f(u16 b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ u16 sd_f2b(float f) {            // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

struct F32 { typedef float T; static __device__ float load(const T* p) { return *p; } static __device__ T cast(float f) { return f; } };
struct F16 { typedef u16 T; static __device__ float load(const T* p) { return sd_h2f(*p); } static __device__ T cast(float f) { return sd_f2h(f); } };
struct BF16 { typedef u16 T; static __device__ float load(const T* p) { return sd_b2f(*p); } static __device__ T cast(float f) { return sd_f2b(f); } };

// Block-wide reduction (max or sum) of one float per thread; blockDim.x is a multiple of 32, at most 1024.
template <bool IS_MAX>
__device__ float sd_block_reduce(float v) {
    __shared__ float partial[32];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = IS_MAX ? fmaxf(v, w) : v + w;
    }
    __syncthreads();                                   // partial[] may still be read by a previous reduction
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const unsigned n_warps = (blockDim.x + 31u) >> 5;
    v = (threadIdx.x < n_warps) ? partial[threadIdx.x] : (IS_MAX ? SD_NEG_INF : 0.0f);
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = IS_MAX ? fmaxf(v, w) : v + w;
        }
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    return partial[0];
}

template <class D>
__device__ void sd_softmax_fwd(const typename D::T* x, typename D::T* y, int rows, int cols) {
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const typename D::T* xr = x + row * (long long)cols;
    typename D::T* yr = y + row * (long long)cols;
    float m = SD_NEG_INF;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, D::load(xr + c));
    m = sd_block_reduce<true>(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += __expf(D::load(xr + c) - m);
    s = sd_block_reduce<false>(s);
    const float inv = 1.0f / s;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = D::cast(__expf(D::load(xr + c) - m) * inv);
}

template <class D>
__device__ void sd_softmax_bwd(const typename D::T* y, const typename D::T* g, typename D::T* dx, int rows, int cols) {
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const long long off = row * (long long)cols;
    float dot = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dot += D::load(y + off + c) * D::load(g + off + c);
    dot = sd_block_reduce<false>(dot);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float yv = D::load(y + off + c);
        dx[off + c] = D::cast(yv * (D::load(g + off + c) - dot));
    }
}

extern "C" __global__ void sd_softmax_fwd_f32(const float* x, float* y, int rows, int cols) { sd_softmax_fwd<F32>(x, y, rows, cols); }
extern "C" __global__ void sd_softmax_fwd_f16(const u16* x, u16* y, int rows, int cols) { sd_softmax_fwd<F16>(x, y, rows, cols); }
extern "C" __global__ void sd_softmax_fwd_bf16(const u16* x, u16* y, int rows, int cols) { sd_softmax_fwd<BF16>(x, y, rows, cols); }
extern "C" __global__ void sd_softmax_bwd_f32(const float* y, const float* g, float* dx, int rows, int cols) { sd_softmax_bwd<F32>(y, g, dx, rows, cols); }
extern "C" __global__ void sd_softmax_bwd_f16(const u16* y, const u16* g, u16* dx, int rows, int cols) { sd_softmax_bwd<F16>(y, g, dx, rows, cols); }
extern "C" __global__ void sd_softmax_bwd_bf16(const u16* y, const u16* g, u16* dx, int rows, int cols) { sd_softmax_bwd<BF16>(y, g, dx, rows, cols); }
