// One-row quantized projections (FP8 e4m3 in scale blocks, INT4 in groups of 128 inputs or a multiple, with zero
// points) on the
// tensor cores, in CUDA C++ (cuda_gemv.py builds it beside gemv.cu and calls xc_qgemv): qgemv.py's operands
// and epilogues, y = epilogue(prologue(x) W^T) for x [1, K] and W as qlinear.py's QLinear stores it.
//
// Why not the CUDA cores: a code costs a float conversion there (e4m3 -> f16 -> f32 runs at a quarter of the
// FMA rate). Here the codes are turned into bf16 pairs by a few integer instructions a 32-bit word (qcodes.py's
// recipes) and multiplied on the tensor cores, codes as the first operand of an m16n8k16 MMA (16 output rows x
// 16 inputs) and x as the second, in column 0 only (7 of its 8 columns wasted). Measured on the H200 (one
// decoder layer's four projections at the Qwen3-8B shapes, benchmarks/qlinear_tiles.py --cuda): INT4 71.1 us
// against the Triton GEMV's 77.3, FP8 91.8 against 74.1, so only INT4 runs here (cuda_qgemv.TILE).
//
// Layout of the work: a tile is 16 output rows (gated: and their 16 up rows), all of K, cut into slices of
// KS bytes of codes. A block takes a contiguous range of tiles; each (tile, slice) is one stage of a ring in
// shared memory, filled by the copy engine (cp.async.bulk, one copy a row) ``stages`` ahead, the first ones
// before the wait for the previous kernel. The block's warps split a stage's bytes evenly; each warp runs
// MMAs over its part and keeps each row's sums across the tile's slices; at the tile's last slice the warps'
// sums meet in shared memory in warp order and thread j < 16 finishes column j (the bits depend on the
// block's warps and the slice only).
//
// The MMA's K order is free, so each lane loads 16 bytes of a row and feeds word j of them to MMA j: a word's
// bytes (b0 b1 b2 b3) become the bf16 pairs (b0, b2) and (b1, b3), and x sits in shared memory permuted the
// same way in every group of 4 (x0 x2 x1 x3). A scale (INT4: and a zero point, folded into the codes) holds
// for a block of ``cols`` inputs: the MMA sums of a block are scaled per row and added up in fp32.

#include "common.cuh"

namespace {

using namespace xc;

constexpr int SPAN = 64;            // bytes of a row a warp's lanes cover at once: 4 lanes x 16 bytes
constexpr int PAD = 64;             // shared-memory row stride = KS + PAD: rows g and g + 1 on other banks

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// 4 e4m3 bytes -> their values as bf16 pairs (b0, b2) and (b1, b3), exactly: exponent and mantissa shifted into
// bf16's fields are the value times 2^-120 (subnormals too), times 2^120 in one bf16x2 FMA
__device__ __forceinline__ void e4m3x4(uint32_t v, uint32_t& even, uint32_t& odd) {
    const uint32_t e = ((v << 4) & 0x07F007F0u) | ((v << 8) & 0x80008000u);
    const uint32_t o = ((v >> 4) & 0x07F007F0u) | (v & 0x80008000u);
    even = fma_bf16x2(e, 0x7B807B80u, 0x80008000u);
    odd = fma_bf16x2(o, 0x7B807B80u, 0x80008000u);
}

// 4 bytes of two 4-bit codes each (low nibble: code i, high: code i + 64 of the chunk) and -(128 + z) as a
// bf16 pair -> q - z as bf16 pairs: low nibbles (b0, b2), (b1, b3), high nibbles (b0, b2), (b1, b3). A code
// or'ed into the mantissa of 128.0 is 128 + q, exactly.
__device__ __forceinline__ void u4x8(uint32_t v, uint32_t nz, uint32_t (&q)[4]) {
    constexpr uint32_t M = 0x000F000Fu, B = 0x43004300u, ONE = 0x3F803F80u;
    q[0] = fma_bf16x2((v & M) | B, ONE, nz);
    q[1] = fma_bf16x2(((v >> 8) & M) | B, ONE, nz);
    q[2] = fma_bf16x2(((v >> 4) & M) | B, ONE, nz);
    q[3] = fma_bf16x2(((v >> 12) & M) | B, ONE, nz);
}

// x (times g, rounded, with the RMSNorm) into shared memory as bf16, permuted x0 x2 x1 x3 in each group of 4;
// returns 1/rms (1 without the norm)
template <bool NORM>
__device__ float stage_x(const __nv_bfloat16* x, const __nv_bfloat16* g, uint32_t* xs, int k, float eps,
                         float* part) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    float ss = 0.f;
    for (int c = tid; c < k / 8; c += blockDim.x) {
        uint4 v = reinterpret_cast<const uint4*>(x)[c];
        if (NORM) {
            const uint4 gv = reinterpret_cast<const uint4*>(g)[c];
            float xf[8], gf[8];
            unpack(v, xf);
            unpack(gv, gf);
            uint32_t p[4];
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                ss = fmaf(xf[j], xf[j], ss);
                ss = fmaf(xf[j + 1], xf[j + 1], ss);
                const __nv_bfloat162 two = __floats2bfloat162_rn(xf[j] * gf[j], xf[j + 1] * gf[j + 1]);
                p[j / 2] = *reinterpret_cast<const uint32_t*>(&two);
            }
            v = make_uint4(p[0], p[1], p[2], p[3]);
        }
        reinterpret_cast<uint4*>(xs)[c] = make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632),
                                                     __byte_perm(v.z, v.w, 0x5410), __byte_perm(v.z, v.w, 0x7632));
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
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int gi = lane >> 2, t = lane & 3;                   // the MMA's row group and lane in the group
    const size_t stage_bytes = (size_t)R * (a.ks + PAD);
    uint32_t* xs = reinterpret_cast<uint32_t*>(smem + a.stages * stage_bytes);
    uint64_t* full = reinterpret_cast<uint64_t*>(xs + a.k / 2);
    float* red = reinterpret_cast<float*>(full + a.stages);  // [stages][warps][R], then [warps]
    const int tiles = (a.n_out + 15) / 16, slices = a.ck / a.ks;
    const int t0 = (int)((long long)blockIdx.x * tiles / gridDim.x);
    const int items = ((int)((long long)(blockIdx.x + 1) * tiles / gridDim.x) - t0) * slices;
    const int first = t0 * slices;

    if (tid == 0) {
        for (int s = 0; s < a.stages; ++s) bar_init(full + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0)
        for (int s = 0; s < min(a.stages, items); ++s)
            issue<R>(a, smem + s * stage_bytes, full + s, first + s, slices, lane);
    grid_wait();
    if (a.early) grid_launch_dependents();
    const float rstd = stage_x<NORM>(a.x, a.g, xs, a.k, a.eps, red + a.stages * warps * R);

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
            float s_[R / 8];
            uint32_t nz[R / 8];                               // INT4: -(128 + z) as a bf16 pair
            const int next = min(kb + 1, a.sk - 1);
#pragma unroll
            for (int h = 0; h < R / 8; ++h) {
                s_[h] = sc[h];
                if (INT4) {
                    const __nv_bfloat16 b = __float2bfloat16_rn(-128.f - zn[h]);
                    nz[h] = (uint32_t)(*reinterpret_cast<const uint16_t*>(&b)) * 0x10001u;
                    zn[h] = a.zero[srow[h] + next];
                }
                sc[h] = a.scale[srow[h] + next];
            }
            float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            for (int o = o0; o < o0 + period; o += SPAN) {
                const int ob = slice * a.ks + o;               // the span's first byte of the row
                uint4 w[R / 8];                                // rows gi, gi + 8 (gated: + 16, + 24)
#pragma unroll
                for (int h = 0; h < R / 8; ++h)
                    w[h] = *reinterpret_cast<const uint4*>(st + (gi + 8 * h) * (a.ks + PAD) + o + 16 * t);
                if (INT4) {                                    // a span: one chunk of 128 inputs
                    uint4 xl[2] = {}, xh[2] = {};
                    if (lane < 4) {
                        const uint4* p = reinterpret_cast<const uint4*>(xs + (2 * ob + 16 * t) / 2);
                        xl[0] = p[0]; xl[1] = p[1]; xh[0] = p[8]; xh[1] = p[9];      // + 64 inputs: 8 uint4
                    }
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const uint32_t* l = &xl[j / 2].x + 2 * (j % 2);
                        const uint32_t* hi = &xh[j / 2].x + 2 * (j % 2);
#pragma unroll
                        for (int u = 0; u < (GATED ? 2 : 1); ++u) {
                            uint32_t qa[4], qb[4];
                            u4x8((&w[2 * u].x)[j], nz[2 * u], qa);
                            u4x8((&w[2 * u + 1].x)[j], nz[2 * u + 1], qb);
                            mma(c[u], qa[0], qb[0], qa[1], qb[1], l[0], l[1]);
                            mma(c[u], qa[2], qb[2], qa[3], qb[3], hi[0], hi[1]);
                        }
                    }
                } else {
                    uint4 xv[2] = {};
                    if (lane < 4) {
                        const uint4* p = reinterpret_cast<const uint4*>(xs + (ob + 16 * t) / 2);
                        xv[0] = p[0]; xv[1] = p[1];
                    }
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const uint32_t* b = &xv[j / 2].x + 2 * (j % 2);
#pragma unroll
                        for (int u = 0; u < (GATED ? 2 : 1); ++u) {
                            uint32_t ae, ao, be, bo;
                            e4m3x4((&w[2 * u].x)[j], ae, ao);
                            e4m3x4((&w[2 * u + 1].x)[j], be, bo);
                            mma(c[u], ae, be, ao, bo, b[0], b[1]);
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < (GATED ? 2 : 1); ++u)         // the block's sums scaled per row (column 0)
#pragma unroll
                for (int h = 0; h < 2; ++h) acc[u][h] = fmaf(s_[2 * u + h], c[u][2 * h], acc[u][h]);
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
        __syncthreads();                                      // the stage is read: refill it
        if (warp == 0 && s + a.stages < items)
            issue<R>(a, smem + slot * stage_bytes, full + slot, item + a.stages, slices, lane);
        if (last && tid < 16) {
            const int col = tile * 16 + tid;
            float v = 0.f, vu = 0.f;
            for (int i = 0; i < warps; ++i) {
                v += sums[i * R + tid];
                if (GATED) vu += sums[i * R + 16 + tid];
            }
            if (col < a.n_out) {
                float y = finish(v * rstd, vu * rstd, GATED);
                if (a.residual) y = round_bf16(y + __bfloat162float(a.r[col]));
                const __nv_bfloat16 out = __float2bfloat16_rn(y);
                a.y[col] = out;
                if (a.extra) a.y2[col] = out;
            }
        }
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

// The launch (cuda_qgemv.py's fit() and qgemv() check the arguments): codes uint8 [N, ck] (FP8: ck = K; INT4: K / 2 bytes, each
// chunk of 128 inputs packed as qlinear.py packs it), scale (INT4: and zero) fp32 [ceil(N / rows), sk]; ks
// bytes of a row a stage (dividing ck, a multiple of 64 x warps; each warp's share a multiple of the bytes
// under one scale), stages 2-8, grid blocks (0: as many as fit), K a multiple of 128 (INT4: cols a multiple
// of 128, FP8: of 64); x, codes and g 16-byte aligned (read 16 bytes at a time). Returns the launch's cudaError_t (0: cudaSuccess).
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
    cfg.blockDim = dim3(32 * warps);
    cfg.dynamicSmemBytes = (size_t)stages * rows_a_stage * (ks + PAD) + (size_t)k * 2 + stages * 8 +
                           ((size_t)stages * warps * rows_a_stage + warps) * 4;
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
