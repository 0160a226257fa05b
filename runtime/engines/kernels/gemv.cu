// One-row bf16 projections in CUDA C++ (cuda_gemv.py builds this with nvcc and calls xc_gemv through
// ctypes): y = epilogue(prologue(x) W^T) for x [1, K], W [N_OUT, K] (gated: [2 N_OUT, K], gate rows then up
// rows), the operands and epilogues of gemv.py's Triton GEMV with its norm_late rounding: x * g rounded to
// bf16, the fp32 sums scaled by 1/rms at the end (rms from x's fp32 squares).
//
// The weight rows stream into shared memory by the copy engine (cp.async.bulk), not through registers: a
// fixed grid (a few blocks a SM) each takes a contiguous range of column groups (COLS output columns:
// COLS weight rows, 2 COLS gated). A group's rows, all of K, are one stage of a ring of ``stages`` stages,
// filled by copies that thread 0 issues ``stages`` groups ahead and that complete on the stage's mbarrier;
// the first ones are issued before the wait for the previous kernel (programmatic dependent launch), so a
// block's bytes in flight are bounded by its shared memory, not its registers. x (times g, with the
// RMSNorm) sits in registers, XCH 16-byte chunks a thread. Each thread adds up its chunks of a row in
// order, the warps' sums meet in shared memory in warp order, and thread j < COLS finishes column j: the
// bits depend on the block's warps only.

#include "common.cuh"

namespace {

using namespace xc;

template <int COLS, bool GATED>
__device__ __forceinline__ void issue_stage(unsigned char* stage, uint64_t* bar, const __nv_bfloat16* w, int group,
                                            int n_out, int k) {
    constexpr int ROWS = GATED ? 2 * COLS : COLS;
    const uint32_t row_bytes = (uint32_t)k * 2;
    bar_expect(bar, ROWS * row_bytes);
#pragma unroll
    for (int i = 0; i < COLS; ++i) {
        const int row = min(group * COLS + i, n_out - 1);   // past the end: the last row again, not stored
        bulk_copy(stage + i * row_bytes, w + (size_t)row * k, row_bytes, bar);
        if (GATED) bulk_copy(stage + (COLS + i) * row_bytes, w + (size_t)(row + n_out) * k, row_bytes, bar);
    }
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    float fa[8], fb[8];
    unpack(a, fa);
    unpack(b, fb);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(fa[j], fb[j], acc);
    return acc;
}

template <int COLS, int XCH, bool NORM, bool GATED>
__global__ void gemv_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                 __nv_bfloat16* y, const __nv_bfloat16* r, const __nv_bfloat16* __restrict__ g,
                                 __nv_bfloat16* y2, int n_out, int k, float eps, int residual, int extra, int early,
                                 int stages) {
    constexpr int ROWS = GATED ? 2 * COLS : COLS;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int chunks = k >> 3;
    const size_t stage_bytes = (size_t)ROWS * k * 2;
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
    float* red = reinterpret_cast<float*>(full + stages);           // [stages][warps][ROWS], then [warps]
    const int groups = (n_out + COLS - 1) / COLS;
    const int g0 = (int)((long long)blockIdx.x * groups / gridDim.x);
    const int n_groups = (int)((long long)(blockIdx.x + 1) * groups / gridDim.x) - g0;

    if (tid == 0) {
        for (int s = 0; s < stages; ++s) bar_init(full + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();                                      // the barriers initialised before anyone waits on them
    if (tid == 0) {
        for (int s = 0; s < min(stages, n_groups); ++s)
            issue_stage<COLS, GATED>(smem + s * stage_bytes, full + s, w, g0 + s, n_out, k);
    }
    grid_wait();
    if (early) grid_launch_dependents();

    uint4 xg[XCH];                       // x (times g, rounded) at chunks tid, tid + blockDim, ...
    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < XCH; ++q) {
        const int c = tid + q * blockDim.x;
        const uint4 xv = c < chunks ? reinterpret_cast<const uint4*>(x)[c] : make_uint4(0, 0, 0, 0);
        if (NORM) {
            const uint4 gv = c < chunks ? reinterpret_cast<const uint4*>(g)[c] : make_uint4(0, 0, 0, 0);
            float xf[8], gf[8];
            unpack(xv, xf);
            unpack(gv, gf);
            uint32_t packed[4];
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                ss = fmaf(xf[j], xf[j], ss);
                ss = fmaf(xf[j + 1], xf[j + 1], ss);
                const __nv_bfloat162 two = __floats2bfloat162_rn(xf[j] * gf[j], xf[j + 1] * gf[j + 1]);
                packed[j / 2] = *reinterpret_cast<const uint32_t*>(&two);
            }
            xg[q] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        } else {
            xg[q] = xv;
        }
    }
    float rstd = 1.f;
    if (NORM) {
        float* part = red + stages * warps * ROWS;
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        float t = 0.f;
        for (int i = 0; i < warps; ++i) t += part[i];
        rstd = rsqrtf(t / (float)k + eps);
    }

    for (int s = 0; s < n_groups; ++s) {
        const int slot = s % stages;
        bar_wait(full + slot, (uint32_t)(s / stages) & 1u);
        const uint4* tile = reinterpret_cast<const uint4*>(smem + slot * stage_bytes);
        float acc[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            acc[i] = 0.f;
#pragma unroll
            for (int q = 0; q < XCH; ++q) {
                const int c = tid + q * blockDim.x;
                if (c < chunks) acc[i] = dot8(tile[i * chunks + c], xg[q], acc[i]);
            }
#pragma unroll
            for (int m = 16; m >= 1; m >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], m);
        }
        float* sums = red + slot * warps * ROWS;
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < ROWS; ++i) sums[warp * ROWS + i] = acc[i];
        }
        __syncthreads();                                  // the stage is read: refill it
        if (tid == 0 && s + stages < n_groups) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue_stage<COLS, GATED>(smem + slot * stage_bytes, full + slot, w, g0 + s + stages, n_out, k);
        }
        if (tid < COLS) {
            const int col = (g0 + s) * COLS + tid;
            float t = 0.f, tu = 0.f;
            for (int i = 0; i < warps; ++i) {
                t += sums[i * ROWS + tid];
                if (GATED) tu += sums[i * ROWS + COLS + tid];
            }
            if (col < n_out) {
                float v = finish(t * rstd, tu * rstd, GATED);
                if (residual) v = round_bf16(v + __bfloat162float(r[col]));
                const __nv_bfloat16 out = __float2bfloat16_rn(v);
                y[col] = out;
                if (extra) y2[col] = out;
            }
        }
    }
    if (!early) grid_launch_dependents();
}

template <int COLS, int XCH, bool NORM, bool GATED>
cudaError_t launch(cudaLaunchConfig_t& cfg, int per_sm, int sms, const void* x, const void* w, void* y,
                   const void* r, const void* g, void* y2, int n_out, int k, float eps, int residual, int extra,
                   int early, int stages) {
    auto kernel = gemv_kernel<COLS, XCH, NORM, GATED>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)cfg.dynamicSmemBytes);
    if (err != cudaSuccess) return err;
    int fit = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, (int)cfg.blockDim.x, cfg.dynamicSmemBytes);
    if (err != cudaSuccess) return err;
    if (fit < 1) return cudaErrorInvalidConfiguration;
    const int groups = (n_out + COLS - 1) / COLS;
    cfg.gridDim = dim3(min(groups, sms * (per_sm > 0 ? min(per_sm, fit) : fit)));
    return cudaLaunchKernelEx(&cfg, kernel, (const __nv_bfloat16*)x, (const __nv_bfloat16*)w, (__nv_bfloat16*)y,
                              (const __nv_bfloat16*)r, (const __nv_bfloat16*)g, (__nv_bfloat16*)y2, n_out, k, eps,
                              residual, extra, early, stages);
}

template <int COLS, int XCH>
cudaError_t launch_flags(cudaLaunchConfig_t& cfg, int per_sm, int sms, int norm, int gated, const void* x,
                         const void* w, void* y, const void* r, const void* g, void* y2, int n_out, int k,
                         float eps, int residual, int extra, int early, int stages) {
#define XC_ARGS cfg, per_sm, sms, x, w, y, r, g, y2, n_out, k, eps, residual, extra, early, stages
    if (norm && gated) return launch<COLS, XCH, true, true>(XC_ARGS);
    if (norm) return launch<COLS, XCH, true, false>(XC_ARGS);
    if (gated) return launch<COLS, XCH, false, true>(XC_ARGS);
    return launch<COLS, XCH, false, false>(XC_ARGS);
#undef XC_ARGS
}

}  // namespace

// The launch (cuda_gemv.py checks the arguments): cols 1 or 2 output columns a stage, stages (2-8) of them
// in shared memory (cols x (gated: 2) x K x 2 bytes each, within the device's limit), warps a block, per_sm
// blocks a SM (0: as many as fit), k a multiple of 8 and at most 4096 x warps (XCH: k / 8 / (32 warps)
// chunks a thread, rounded up to 1, 2, 4, 8, 12 or 16), every pointer 16-byte aligned; pdl: programmatic
// stream serialization on the launch. Returns the launch's cudaError_t (0: cudaSuccess); -1 for a tile this
// build has no kernel for.
extern "C" int xc_gemv(const void* x, const void* w, void* y, const void* r, const void* g, void* y2, int n_out,
                       int k, float eps, int cols, int warps, int stages, int per_sm, int norm, int gated, int residual,
                       int extra, int early, int pdl, void* stream) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return (int)err;
    const int rows = (gated ? 2 : 1) * cols;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(32 * warps);
    cfg.dynamicSmemBytes = (size_t)stages * rows * k * 2 + stages * 8 + ((size_t)stages * warps * rows + warps) * 4;
    cfg.stream = static_cast<cudaStream_t>(stream);
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    const int need = (k / 8 + 32 * warps - 1) / (32 * warps);
#define XC_TILE(C, X)                                                                                            \
    if (cols == C && need <= X)                                                                                \
        return (int)launch_flags<C, X>(cfg, per_sm, sms, norm, gated, x, w, y, r, g, y2, n_out, k, eps, residual, \
                                       extra, early, stages);
    XC_TILE(1, 1) XC_TILE(1, 2) XC_TILE(1, 4) XC_TILE(1, 8) XC_TILE(1, 12) XC_TILE(1, 16)
    XC_TILE(2, 1) XC_TILE(2, 2) XC_TILE(2, 4) XC_TILE(2, 8) XC_TILE(2, 12) XC_TILE(2, 16)
#undef XC_TILE
    return -1;
}
