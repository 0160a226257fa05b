// One-row quantized projections (FP8 e4m3 in scale blocks, INT4 in groups of 128 inputs or a multiple, with zero
// points) on the tensor cores, in CUDA C++ (cuda_gemv.py builds it beside gemv.cu and calls xc_qgemv):
// qgemv.py's operands and epilogues, y = epilogue(prologue(x) W^T) for x [1, K] and W as qlinear.py's QLinear
// stores it.
//
// The codes go to the tensor cores as they are stored, in 8-bit MMAs (m16n8k32: 16 output rows x 32 inputs),
// so no code is ever converted: FP8 codes as e4m3 against x in e4m3, INT4 codes (their nibbles masked into
// bytes, 0..15) as s8 against x in s8. x itself is cut into two 8-bit terms per input with a power of two s
// per group of 64 bytes of codes (64 FP8 inputs, 128 INT4 ones): x = s (hi + mid) in e4m3 with |x / s| < 256,
// or x / s = 128 hi + lo in s8 with |x / s| < 8192. The terms sit in two of the MMA's 8 columns (the others
// are zeros), so one MMA multiplies every code by both. A bf16 x is held exactly down to 2^-9 (FP8) or 2^-5
// (INT4) of its group's largest; below, the error stays under 2^-17 (2^-13) of that largest, far below the
// output's bf16 rounding. Sums are the MMA's fp32 (FP8; Hopper's FP8 MMAs are reported to keep fewer bits in
// their adds, so each group's 64-input sums go to an fp32 total) or exact int32 (INT4, with sum (q - z) X =
// sum q X - z sum X), scaled per group by s and per block by the weight scale. Converting each code to bf16
// instead (integer instructions, then bf16 MMAs) cost one decoder layer's FP8 projections 91.8 us at the
// Qwen3-8B shapes on the H200, against the Triton GEMV's 74.1.
//
// Layout of the work: a tile is 16 output rows (gated: and their 16 up rows), all of K, cut into slices of
// KS bytes of codes. A block takes a contiguous range of tiles; each (tile, slice) is one stage of a ring in
// shared memory, filled by the copy engine (cp.async.bulk, one copy a row) ``stages`` ahead, the first ones
// before the wait for the previous kernel. The block's ``warps`` consumer warps split a stage's bytes evenly;
// each runs MMAs over its part, keeps each row's sums across the tile's slices and says on the stage's
// ``empty`` mbarrier that it is done with it. One more warp, the producer, waits there, refills the stage and,
// at a tile's last slice, sums the consumers' sums from shared memory in warp order, lane j < 16 finishing
// column j (the bits depend on the block's warps and the slice only). So no warp waits for the others at a
// stage's end: with a block-wide barrier there instead, that barrier was the FP8 gate/up call's first stall
// reason (Nsight Compute on an H100: 2.2 of 6.4 cycles a warp waited per instruction issued).
//
// The MMA's K order is free, so each lane loads 16 bytes of a row and gives words 0-1 to one MMA and 2-3 to
// the next (INT4: the low nibbles to two MMAs, the high ones, inputs 64 further, to two more); x's terms are
// read in the same order, 16 bytes a lane, by the lanes of the MMA's columns 0 and 1.

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"

namespace {

using namespace xc;

constexpr int SPAN = 64;            // bytes of a row a warp's lanes cover at once: 4 lanes x 16 bytes
constexpr int PAD = 64;             // shared-memory row stride = KS + PAD: rows g and g + 1 on other banks
constexpr int XGROUP = 64;          // bytes of codes under one scale of x (FP8: 64 inputs, INT4: 128)

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t low4(uint32_t v) { return v & 0x0F0F0F0Fu; }       // 4 INT4 codes as bytes
__device__ __forceinline__ uint32_t high4(uint32_t v) { return (v >> 4) & 0x0F0F0F0Fu; }

__device__ __forceinline__ float pow2(int e) { return __uint_as_float((uint32_t)(127 + e) << 23); }  // |e| < 127

// two e4m3 bytes of a and b, rounded to nearest
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float2 from_e4m3x2(uint32_t v) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3)));
}

// x (times g, rounded, with the RMSNorm) into shared memory as its two 8-bit terms (header): hi at xq[0, k),
// mid (INT4: lo) at xq[k, 2k), each group's scale s in xsc and (INT4) its sum of x / s in xsum. Each thread
// cuts 8 inputs; a group's 8 (INT4: 16) threads are neighbouring lanes. Returns 1/rms (1 without the norm).
template <bool INT4, bool NORM>
__device__ float stage_x(const __nv_bfloat16* x, const __nv_bfloat16* g, unsigned char* xq, float* xsc, float* xsum,
                         int k, float eps, float* part) {
    constexpr int LANES = (INT4 ? 2 * XGROUP : XGROUP) / 8;   // threads of a group
    constexpr int SHIFT = INT4 ? 13 : 8;                      // |x / s| <= 2^13 (128 hi + lo) or 2^8 (e4m3)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    constexpr int U = 4;                                      // chunks a thread loads before cutting any
    float ss = 0.f;
    for (int base = warp * 32; base < k / 8; base += U * blockDim.x) {  // whole warps: the shuffles need all lanes
        uint4 xv[U], gv[U];                                   // U loads in flight: one wait, not U
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * blockDim.x + lane;
            if (c < k / 8) {
                xv[u] = reinterpret_cast<const uint4*>(x)[c];
                if (NORM) gv[u] = reinterpret_cast<const uint4*>(g)[c];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * blockDim.x + lane;
            const bool in = c < k / 8;                            // a group is in or out whole (k: a multiple of 128)
            float v[8] = {};
            if (in) {
                unpack(xv[u], v);
                if (NORM) {
                    float gf[8];
                    unpack(gv[u], gf);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        ss = fmaf(v[j], v[j], ss);
                        v[j] = round_bf16(v[j] * gf[j]);
                    }
                }
            }
            float m = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
#pragma unroll
            for (int o = 1; o < LANES; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            // m < 2^e: e from m's exponent field (at least -100, so that 2^(SHIFT - e) stays finite)
            const int e = max((int)((__float_as_uint(m) >> 23) & 0xFF) - 126, -100);
            const float inv = pow2(SHIFT - e), s = pow2(e - SHIFT);
            uint32_t hi[2], lo[2];
            float sum = 0.f;
            if (INT4) {
#pragma unroll
                for (int w = 0; w < 2; ++w) {
                    uint32_t h = 0, l = 0;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float q = rintf(v[4 * w + j] * inv), qh = rintf(q * (1.f / 128.f));
                        sum += q;
                        h |= ((uint32_t)(int)qh & 0xFFu) << (8 * j);
                        l |= ((uint32_t)(int)(q - 128.f * qh) & 0xFFu) << (8 * j);
                    }
                    hi[w] = h;
                    lo[w] = l;
                }
#pragma unroll
                for (int o = 1; o < LANES; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            } else {
#pragma unroll
                for (int w = 0; w < 2; ++w) {
                    uint32_t h[2], r[2];
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float a = v[4 * w + 2 * j] * inv, b = v[4 * w + 2 * j + 1] * inv;
                        h[j] = e4m3x2(a, b);
                        const float2 f = from_e4m3x2(h[j]);
                        r[j] = e4m3x2(a - f.x, b - f.y);
                    }
                    hi[w] = h[0] | (h[1] << 16);
                    lo[w] = r[0] | (r[1] << 16);
                }
            }
            if (in) {
                reinterpret_cast<uint2*>(xq)[c] = make_uint2(hi[0], hi[1]);
                reinterpret_cast<uint2*>(xq + k)[c] = make_uint2(lo[0], lo[1]);
                if (lane % LANES == 0) {
                    xsc[c / LANES] = s;
                    if (INT4) xsum[c / LANES] = sum;
                }
            }
        }
    }
    float rstd = 1.f;
    if (NORM) {
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
        if (lane == 0) part[warp] = ss;
    }
    __syncthreads();                                      // x staged (and the warps' squares written)
    if (NORM) {
        float t = 0.f;
        for (int i = 0; i < warps; ++i) t += part[i];
        rstd = rsqrtf(t / (float)k + eps);
    }
    return rstd;
}

struct Args {
    const __nv_bfloat16 *x, *g, *r;
    const unsigned char* codes;
    const float *scale, *zero;
    __nv_bfloat16 *y, *y2;
    int n_out, k, ck, sk, rows, cols, ks, stages, residual, extra, early;
    float eps;
};

// the copies of item i (tile i / slices, slice i % slices) into stage buffer dst: lane r < R copies row r
template <int R>
__device__ __forceinline__ void issue(const Args& a, unsigned char* dst, uint64_t* bar, int item, int slices,
                                      int lane) {
    constexpr int T = R > 16 ? 16 : R;
    const int tile = item / slices, off = (item % slices) * a.ks;
    if (lane == 0) bar_expect(bar, (uint32_t)(R * a.ks));
    __syncwarp();
    if (lane < R) {
        const int i = lane % T;
        int row = min(tile * T + i, a.n_out - 1);              // past the end: the last row again, not stored
        if (lane >= T) row += a.n_out;                          // the up rows
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        bulk_copy(dst + lane * (a.ks + PAD), a.codes + (size_t)row * a.ck + off, (uint32_t)a.ks, bar);
    }
}

template <bool INT4, bool NORM, bool GATED>
__global__ void qgemv_kernel(Args a) {
    constexpr int R = GATED ? 32 : 16;                        // rows a stage holds
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warps = (blockDim.x >> 5) - 1;                  // consumers; warp ``warps`` is the producer
    const int gi = lane >> 2, t = lane & 3;                   // the MMA's row group and lane in the group
    const size_t stage_bytes = (size_t)R * (a.ks + PAD);
    unsigned char* xq = smem + a.stages * stage_bytes;       // x's two terms [2][k] bytes
    float* xsc = reinterpret_cast<float*>(xq + 2 * a.k);      // x's scales and (INT4) sums, one a group
    float* xsums = xsc + a.k / XGROUP;
    uint64_t* full = reinterpret_cast<uint64_t*>(xsums + a.k / XGROUP);   // a stage's bytes have landed
    uint64_t* empty = full + a.stages;                        // every consumer is done with the stage
    float* red = reinterpret_cast<float*>(empty + a.stages); // [stages][warps][R], then [warps + 1]
    const int tiles = (a.n_out + 15) / 16, slices = a.ck / a.ks;
    const int t0 = (int)((long long)blockIdx.x * tiles / gridDim.x);
    const int items = ((int)((long long)(blockIdx.x + 1) * tiles / gridDim.x) - t0) * slices;
    const int first = t0 * slices;

    if (tid == 0) {
        for (int s = 0; s < a.stages; ++s) {
            bar_init(full + s);
            bar_init(empty + s, (uint32_t)warps);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == warps)
        for (int s = 0; s < min(a.stages, items); ++s)
            issue<R>(a, smem + s * stage_bytes, full + s, first + s, slices, lane);
    grid_wait();
    if (a.early) grid_launch_dependents();
    const float rstd = stage_x<INT4, NORM>(a.x, a.g, xq, xsc, xsums, a.k, a.eps, red + a.stages * warps * R);

    if (warp == warps) {                                      // the producer: refills, and finishes each tile
        for (int s = 0; s < items; ++s) {
            const int slot = s % a.stages, item = first + s, tile = item / slices;
            bar_wait(empty + slot, (uint32_t)(s / a.stages) & 1u);
            const float* sums = red + slot * warps * R;
            if (item % slices == slices - 1 && lane < 16) {
                const int col = tile * 16 + lane;
                float v = 0.f, vu = 0.f;
                for (int i = 0; i < warps; ++i) {
                    v += sums[i * R + lane];
                    if (GATED) vu += sums[i * R + 16 + lane];
                }
                if (col < a.n_out) {
                    float y = finish(v * rstd, vu * rstd, GATED);
                    if (a.residual) y = round_bf16(y + __bfloat162float(a.r[col]));
                    const __nv_bfloat16 out = __float2bfloat16_rn(y);
                    a.y[col] = out;
                    if (a.extra) a.y2[col] = out;
                }
            }
            __syncwarp();                                     // the sums are read before the stage's next use
            if (s + a.stages < items)
                issue<R>(a, smem + slot * stage_bytes, full + slot, item + a.stages, slices, lane);
        }
        if (!a.early) grid_launch_dependents();
        return;
    }
    const int wb = a.ks / warps;                              // bytes of a row each warp takes from a stage
    const int period = INT4 ? a.cols / 2 : a.cols;            // bytes of codes under one scale
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};               // [gate, up][row gi, row gi + 8]
    for (int s = 0; s < items; ++s) {
        const int slot = s % a.stages, item = first + s;
        const int tile = item / slices, slice = item % slices;
        size_t srow[R / 8];                                   // each row's scales: rows gi, gi + 8 (gated: up)
#pragma unroll
        for (int h = 0; h < R / 8; ++h)
            srow[h] = (size_t)((min(tile * 16 + gi + 8 * (h & 1), a.n_out - 1) + (h >= 2 ? a.n_out : 0)) / a.rows)
                      * a.sk;
        bar_wait(full + slot, (uint32_t)(s / a.stages) & 1u);
        const unsigned char* st = smem + slot * stage_bytes;
        int kb = (slice * a.ks + warp * wb) / period;         // the warp's first scale column in this stage
        float sc[R / 8], zn[R / 8];                           // its scales (INT4: zero points), one block ahead
#pragma unroll
        for (int h = 0; h < R / 8; ++h) {
            sc[h] = a.scale[srow[h] + kb];
            zn[h] = INT4 ? a.zero[srow[h] + kb] : 0.f;
        }
        for (int o0 = warp * wb; o0 < (warp + 1) * wb; o0 += period, ++kb) {
            float s_[R / 8], z_[R / 8];
            const int next = min(kb + 1, a.sk - 1);
#pragma unroll
            for (int h = 0; h < R / 8; ++h) {
                s_[h] = sc[h];
                z_[h] = zn[h];
                if (INT4) zn[h] = a.zero[srow[h] + next];
                sc[h] = a.scale[srow[h] + next];
            }
            float c[2][2] = {{0.f, 0.f}, {0.f, 0.f}};         // the block's sums [gate, up][row gi, gi + 8]
            for (int o = o0; o < o0 + period; o += SPAN) {
                const int ob = slice * a.ks + o;               // the span's first byte of the row
                uint4 w[R / 8];                                // rows gi, gi + 8 (gated: + 16, + 24)
#pragma unroll
                for (int h = 0; h < R / 8; ++h)
                    w[h] = *reinterpret_cast<const uint4*>(st + (gi + 8 * h) * (a.ks + PAD) + o + 16 * t);
                uint4 xv[2] = {};                              // x's term gi (columns 0, 1; zeros elsewhere)
                if (gi < 2) {
                    const unsigned char* p = xq + gi * a.k + (INT4 ? 2 * ob : ob) + 16 * t;
                    xv[0] = *reinterpret_cast<const uint4*>(p);
                    if (INT4) xv[1] = *reinterpret_cast<const uint4*>(p + SPAN);   // the high nibbles' inputs
                }
                const float xs = xsc[ob / XGROUP];
#pragma unroll
                for (int u = 0; u < (GATED ? 2 : 1); ++u) {
                    const uint4 &ra = w[2 * u], &rb = w[2 * u + 1];       // rows gi, gi + 8
                    if (INT4) {                                // a span: one chunk of 128 inputs
                        int d[4] = {0, 0, 0, 0};
                        mma_s8(d, low4(ra.x), low4(rb.x), low4(ra.y), low4(rb.y), xv[0].x, xv[0].y);
                        mma_s8(d, low4(ra.z), low4(rb.z), low4(ra.w), low4(rb.w), xv[0].z, xv[0].w);
                        mma_s8(d, high4(ra.x), high4(rb.x), high4(ra.y), high4(rb.y), xv[1].x, xv[1].y);
                        mma_s8(d, high4(ra.z), high4(rb.z), high4(ra.w), high4(rb.w), xv[1].z, xv[1].w);
                        const float xsum = xsums[ob / XGROUP];
#pragma unroll
                        for (int h = 0; h < 2; ++h)            // sum (q - z) x = s (sum q X - z sum X), X = 128 hi + lo
                            c[u][h] = fmaf((float)(128 * d[2 * h] + d[2 * h + 1]) - z_[2 * u + h] * xsum, xs,
                                           c[u][h]);
                    } else {
                        float d[4] = {0.f, 0.f, 0.f, 0.f};
                        mma_e4m3(d, ra.x, rb.x, ra.y, rb.y, xv[0].x, xv[0].y);
                        mma_e4m3(d, ra.z, rb.z, ra.w, rb.w, xv[0].z, xv[0].w);
#pragma unroll
                        for (int h = 0; h < 2; ++h) c[u][h] = fmaf(d[2 * h] + d[2 * h + 1], xs, c[u][h]);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < (GATED ? 2 : 1); ++u)         // the block's sums scaled per row (lanes of column 0)
#pragma unroll
                for (int h = 0; h < 2; ++h) acc[u][h] = fmaf(s_[2 * u + h], c[u][h], acc[u][h]);
        }
        const bool last = slice == slices - 1;
        float* sums = red + slot * warps * R;
        if (last && t == 0) {                                  // column 0 of the MMA: lanes 0, 4, ..., 28
#pragma unroll
            for (int u = 0; u < (GATED ? 2 : 1); ++u) {
                sums[warp * R + 16 * u + gi] = acc[u][0];
                sums[warp * R + 16 * u + gi + 8] = acc[u][1];
            }
        }
        if (last) acc[0][0] = acc[0][1] = acc[1][0] = acc[1][1] = 0.f;
        __syncwarp();                                         // the warp's reads of the stage and its sums done
        if (lane == 0) bar_arrive(empty + slot);
    }
    if (!a.early) grid_launch_dependents();
}

template <bool INT4, bool NORM, bool GATED>
cudaError_t launch(cudaLaunchConfig_t& cfg, int grid, int sms, const Args& a) {
    auto kernel = qgemv_kernel<INT4, NORM, GATED>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)cfg.dynamicSmemBytes);
    if (err != cudaSuccess) return err;
    int fit = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, (int)cfg.blockDim.x, cfg.dynamicSmemBytes);
    if (err != cudaSuccess) return err;
    if (fit < 1) return cudaErrorInvalidConfiguration;
    const int tiles = (a.n_out + 15) / 16;
    cfg.gridDim = dim3(min(tiles, grid > 0 ? grid : sms * fit));
    return cudaLaunchKernelEx(&cfg, kernel, a);
}

}  // namespace

// The launch (cuda_qgemv.py's fit() and qgemv() check the arguments): codes uint8 [N, ck] (FP8: ck = K; INT4:
// K / 2 bytes, each chunk of 128 inputs packed as qlinear.py packs it), scale (INT4: and zero) fp32
// [ceil(N / rows), sk]; ks bytes of a row a stage (dividing ck, a multiple of 64 x warps; each warp's share a
// multiple of the bytes under one scale), stages 2-8, grid blocks (0: as many as fit), K a multiple of 128
// (INT4: cols a multiple of 128, FP8: of 64); x, codes and g 16-byte aligned (read 16 bytes at a time).
// Returns the launch's cudaError_t (0: cudaSuccess).
extern "C" int xc_qgemv(const void* x, const void* codes, const void* scale, const void* zero, void* y, const void* r,
                        const void* g, void* y2, int n_out, int k, int ck, int sk, int rows, int cols, float eps,
                        int int4, int warps, int ks, int stages, int grid, int norm, int gated, int residual,
                        int extra, int early, int pdl, void* stream) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return (int)err;
    const int rows_a_stage = gated ? 32 : 16;
    Args a{(const __nv_bfloat16*)x, (const __nv_bfloat16*)g, (const __nv_bfloat16*)r, (const unsigned char*)codes,
           (const float*)scale, (const float*)zero, (__nv_bfloat16*)y, (__nv_bfloat16*)y2, n_out, k, ck, sk, rows,
           cols, ks, stages, residual, extra, early, eps};
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(32 * (warps + 1));                   // the consumers and the producer
    cfg.dynamicSmemBytes = (size_t)stages * rows_a_stage * (ks + PAD) + (size_t)k * 2 + (size_t)k / 8 + stages * 16 +
                           ((size_t)stages * warps * rows_a_stage + warps + 1) * 4;
    cfg.stream = static_cast<cudaStream_t>(stream);
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
#define XC_Q(I, N, G) \
    if (!!int4 == I && !!norm == N && !!gated == G) return (int)launch<I, N, G>(cfg, grid, sms, a);
    XC_Q(false, false, false) XC_Q(false, false, true) XC_Q(false, true, false) XC_Q(false, true, true)
    XC_Q(true, false, false) XC_Q(true, false, true) XC_Q(true, true, false) XC_Q(true, true, true)
#undef XC_Q
    return -1;
}
