// Projections of 2-32 rows (chain and tree verify, the tree drafter's steps) in CUDA C++ on the tensor
// cores (cuda_gemv.py builds this with gemv.cu and calls xc_rows through ctypes): y = epilogue(x W^T) for
// x [M, K] (already normalised: the RMSNorm runs apart), W [N_OUT, K] (gated: [2 N_OUT, K]).
//
// A fixed grid (a few blocks a SM) each takes a contiguous range of column groups (16 CT output columns).
// A group's weight rows (16 CT, gated 32 CT) are streamed slice by slice (KS of K) into a ring of shared-
// memory stages by the copy engine (cp.async.bulk), the first ones before the wait for the previous kernel,
// with the same slice of x's rows beside them. Each warp multiplies its part of a slice (KS / warps of K)
// with mma.m16n8k16 (the weight rows as A, x's rows as B: 8 rows of x an n-tile, unused ones zero), so a
// row's sums never meet another row's: its bits do not depend on how many rows the call carries. At a
// group's end the warps' sums meet in shared memory in warp order and the epilogue rounds as the
// reference modules do (common.cuh's finish, the residual added after).

#include "common.cuh"

namespace {

using namespace xc;

constexpr int PAD = 16;     // bytes after each row of a stage: rows 4 banks apart, so ldmatrix has no conflicts

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t (&r)[2]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// d += a (16 x 16, rows: output columns) b (16 x 8, columns: rows of x), fp32 sums
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A stage: WT tiles of 16 weight rows (the group's columns, CT tiles; gated: the gate tiles, then the up
// tiles), then 8 NT rows of x, each KS bf16 and PAD bytes. Warp 0 fills one: the weights (before the PDL
// wait for the first stages), x's rows (after it); one expect_tx covers both.
template <int CT, bool GATED>
__device__ __forceinline__ void issue_weights(unsigned char* stage, uint64_t* bar, const __nv_bfloat16* w, int group,
                                              int slice, int n_out, int k, int ks, int pitch, uint32_t bytes) {
    constexpr int WROWS = 16 * CT * (GATED ? 2 : 1);
    const int lane = threadIdx.x & 31;
    if (lane == 0) bar_expect(bar, bytes);
    __syncwarp();
    for (int i = lane; i < WROWS; i += 32) {
        const int c = i % (16 * CT);
        const int row = min(group * 16 * CT + c, n_out - 1) + (i >= 16 * CT ? n_out : 0);   // past the end: not stored
        bulk_copy(stage + i * pitch, w + (size_t)row * k + (size_t)slice * ks, ks * 2, bar);
    }
}

template <int CT, bool GATED>
__device__ __forceinline__ void issue_x(unsigned char* stage, uint64_t* bar, const __nv_bfloat16* x, int sx, int m,
                                        int slice, int ks, int pitch) {
    constexpr int WROWS = 16 * CT * (GATED ? 2 : 1);
    for (int i = threadIdx.x & 31; i < m; i += 32)
        bulk_copy(stage + (WROWS + i) * pitch, x + (size_t)i * sx + (size_t)slice * ks, ks * 2, bar);
}

template <int CT, int NT, bool GATED>
__global__ void rows_kernel(const __nv_bfloat16* x, int sx, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* y,
                            int sy, const __nv_bfloat16* r, int sr, __nv_bfloat16* y2, int s2, int m, int n_out, int k,
                            int ks, int residual, int extra, int early, int stages) {
    constexpr int WT = CT * (GATED ? 2 : 1), WROWS = 16 * WT, XROWS = 8 * NT;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int pitch = ks * 2 + PAD, stage_bytes = (WROWS + XROWS) * pitch;
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
    float* red = reinterpret_cast<float*>(full + stages);       // [warps][WT][16][XROWS]
    const int groups = (n_out + 16 * CT - 1) / (16 * CT), slices = k / ks;
    const int g0 = (int)((long long)blockIdx.x * groups / gridDim.x);
    const int n_stages = ((int)((long long)(blockIdx.x + 1) * groups / gridDim.x) - g0) * slices;
    const uint32_t bytes = (uint32_t)(WROWS + m) * ks * 2;

    const int pad_chunks = (XROWS - m) * pitch / 16;           // x's unused rows zero in every stage
    for (int i = tid; i < stages * pad_chunks; i += blockDim.x) {
        unsigned char* p = smem + (i / pad_chunks) * stage_bytes + (WROWS + m) * pitch + (i % pad_chunks) * 16;
        *reinterpret_cast<uint4*>(p) = make_uint4(0, 0, 0, 0);
    }
    if (tid == 0) {
        for (int s = 0; s < stages; ++s) bar_init(full + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int first = min(stages, n_stages);
    if (warp == 0)
        for (int s = 0; s < first; ++s)
            issue_weights<CT, GATED>(smem + s * stage_bytes, full + s, w, g0 + s / slices, s % slices, n_out, k, ks,
                                     pitch, bytes);
    grid_wait();
    if (early) grid_launch_dependents();
    if (warp == 0)
        for (int s = 0; s < first; ++s) issue_x<CT, GATED>(smem + s * stage_bytes, full + s, x, sx, m, s % slices, ks, pitch);

    const int kw = ks / warps;                                  // a warp's part of a slice, a multiple of 16
    const int q = lane >> 3, rr = lane & 7, g = lane >> 2, t = lane & 3;
    const uint32_t a_off = (rr + (q & 1) * 8) * pitch + (q >> 1) * 16;           // ldmatrix rows of A
    const uint32_t b_off = (WROWS + (q >> 1) * 8 + rr) * pitch + (q & 1) * 16;   // of B: two n-tiles (x4)
    const uint32_t b2_off = (WROWS + rr) * pitch + (q & 1) * 16;                 // one n-tile (x2)
    float acc[WT][NT][4] = {};
    for (int s = 0; s < n_stages; ++s) {
        const int slot = s % stages, slice = s % slices, group = g0 + s / slices;
        bar_wait(full + slot, (uint32_t)(s / stages) & 1u);
        const uint32_t base = smem_addr(smem + slot * stage_bytes) + warp * kw * 2;
#pragma unroll 4
        for (int kk = 0; kk < kw; kk += 16) {
            uint32_t a[WT][4];
#pragma unroll
            for (int i = 0; i < WT; ++i) ldsm_x4(base + i * 16 * pitch + a_off + kk * 2, a[i]);
            if constexpr (NT == 1) {
                uint32_t b[2];
                ldsm_x2(base + b2_off + kk * 2, b);
#pragma unroll
                for (int i = 0; i < WT; ++i) mma(acc[i][0], a[i], b[0], b[1]);
            } else {
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    uint32_t b[4];
                    ldsm_x4(base + b_off + j * 8 * pitch + kk * 2, b);
#pragma unroll
                    for (int i = 0; i < WT; ++i) {
                        mma(acc[i][j], a[i], b[0], b[1]);
                        mma(acc[i][j + 1], a[i], b[2], b[3]);
                    }
                }
            }
        }
        const bool last = slice == slices - 1;
        if (last) {                 // d0, d1: column g, rows 2t, 2t+1 of the n-tile; d2, d3: column g + 8
#pragma unroll
            for (int i = 0; i < WT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    float* p = red + (warp * WT + i) * 16 * XROWS + j * 8 + 2 * t;
                    p[g * XROWS] = acc[i][j][0];
                    p[g * XROWS + 1] = acc[i][j][1];
                    p[(g + 8) * XROWS] = acc[i][j][2];
                    p[(g + 8) * XROWS + 1] = acc[i][j][3];
                    acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
                }
        }
        __syncthreads();                                        // the stage is read: refill it
        if (warp == 0 && s + stages < n_stages) {
            const int next = s + stages;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue_weights<CT, GATED>(smem + slot * stage_bytes, full + slot, w, g0 + next / slices, next % slices,
                                     n_out, k, ks, pitch, bytes);
            issue_x<CT, GATED>(smem + slot * stage_bytes, full + slot, x, sx, m, next % slices, ks, pitch);
        }
        if (last) {
            for (int e = tid; e < 16 * CT * m; e += blockDim.x) {
                const int c = e % (16 * CT), row = e / (16 * CT), col = group * 16 * CT + c;
                const int tile = c / 16, cc = c % 16;
                float sum = 0.f, up = 0.f;
                for (int i = 0; i < warps; ++i) {
                    sum += red[((i * WT + tile) * 16 + cc) * XROWS + row];
                    if (GATED) up += red[((i * WT + CT + tile) * 16 + cc) * XROWS + row];
                }
                if (col < n_out) {
                    float v = finish(sum, up, GATED);
                    if (residual) v = round_bf16(v + __bfloat162float(r[(size_t)row * sr + col]));
                    const __nv_bfloat16 out = __float2bfloat16_rn(v);
                    y[(size_t)row * sy + col] = out;
                    if (extra) y2[(size_t)row * s2 + col] = out;
                }
            }
            __syncthreads();                                    // red is read before the next group's sums
        }
    }
    if (!early) grid_launch_dependents();
}

template <int CT, int NT, bool GATED>
cudaError_t launch(cudaLaunchConfig_t& cfg, int per_sm, int sms, const void* x, int sx, const void* w, void* y, int sy,
                   const void* r, int sr, void* y2, int s2, int m, int n_out, int k, int ks, int residual, int extra,
                   int early, int stages) {
    auto kernel = rows_kernel<CT, NT, GATED>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)cfg.dynamicSmemBytes);
    if (err != cudaSuccess) return err;
    int fit = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, (int)cfg.blockDim.x, cfg.dynamicSmemBytes);
    if (err != cudaSuccess) return err;
    if (fit < 1) return cudaErrorInvalidConfiguration;
    const int groups = (n_out + 16 * CT - 1) / (16 * CT);
    cfg.gridDim = dim3(min(groups, sms * (per_sm > 0 ? min(per_sm, fit) : fit)));
    return cudaLaunchKernelEx(&cfg, kernel, (const __nv_bfloat16*)x, sx, (const __nv_bfloat16*)w, (__nv_bfloat16*)y,
                              sy, (const __nv_bfloat16*)r, sr, (__nv_bfloat16*)y2, s2, m, n_out, k, ks, residual,
                              extra, early, stages);
}

}  // namespace

// The launch (cuda_gemv.py checks the arguments): m rows (2-32; 8 NT of them a launch's n-tiles, NT 1, 2 or
// 4), cols 16 or 32 output columns a group, ks of K a stage (k a multiple, ks a multiple of 16 x warps),
// stages of them in shared memory ((16 cols (gated: 32 cols) + 8 NT) x (2 ks + 16) bytes each), warps a
// block, per_sm blocks a SM (0: as many as fit); row strides sx, sy, sr, s2 in elements, x's a multiple of 8,
// every pointer 16-byte aligned; pdl: programmatic stream serialization on the launch. Returns the launch's
// cudaError_t (0: cudaSuccess); -1 for a shape this build has no kernel for.
extern "C" int xc_rows(const void* x, int sx, const void* w, void* y, int sy, const void* r, int sr, void* y2, int s2,
                       int m, int n_out, int k, int cols, int ks, int warps, int stages, int per_sm, int gated,
                       int residual, int extra, int early, int pdl, void* stream) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return (int)err;
    const int nt = m <= 8 ? 1 : m <= 16 ? 2 : 4;
    const int wrows = cols * (gated ? 2 : 1);
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(32 * warps);
    cfg.dynamicSmemBytes = (size_t)stages * (wrows + 8 * nt) * (2 * ks + PAD) + stages * 8 +
                           (size_t)warps * wrows * 8 * nt * 4;
    cfg.stream = static_cast<cudaStream_t>(stream);
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
#define XC_ROWS(CT, NT, G)                                                                                   \
    if (cols == 16 * CT && nt == NT && gated == G)                                                           \
        return (int)launch<CT, NT, G>(cfg, per_sm, sms, x, sx, w, y, sy, r, sr, y2, s2, m, n_out, k, ks, residual, \
                                      extra, early, stages);
    XC_ROWS(1, 1, 0) XC_ROWS(1, 2, 0) XC_ROWS(1, 4, 0) XC_ROWS(1, 1, 1) XC_ROWS(1, 2, 1) XC_ROWS(1, 4, 1)
    XC_ROWS(2, 1, 0) XC_ROWS(2, 2, 0) XC_ROWS(2, 4, 0) XC_ROWS(2, 1, 1) XC_ROWS(2, 2, 1) XC_ROWS(2, 4, 1)
#undef XC_ROWS
    return -1;
}
