// Helpers of gemv.cu (kept apart for the next CUDA kernel; cuda_gemv.py builds the library): programmatic
// dependent launch, bf16 unpacking, mbarriers and bulk copies (cp.async.bulk) into shared memory, the epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace xc {

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }          // bf16 -> fp32
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// the 8 bf16 of a chunk as fp32
__device__ __forceinline__ void unpack(uint4 c, float (&f)[8]) {
    f[0] = lo(c.x); f[1] = hi(c.x); f[2] = lo(c.y); f[3] = hi(c.y);
    f[4] = lo(c.z); f[5] = hi(c.z); f[6] = lo(c.w); f[7] = hi(c.w);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// one of the count arrivals bar's phase waits for (release: this thread's earlier writes are seen by its waiters)
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    }
}

// bytes (a multiple of 16, at most 1 MB) from global src to shared dst, completing on bar
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// a column's value from its fp32 sums (each already scaled by 1/rms where the RMSNorm is late), with the
// reference modules' rounding: the matmul rounded to bf16, gated: SiLU(gate) rounded, times up, rounded
__device__ __forceinline__ float finish(float t, float tu, bool gated) {
    float v = round_bf16(t);
    if (gated) {
        const float sl = round_bf16(v / (1.f + __expf(-v)));
        v = round_bf16(sl * round_bf16(tu));
    }
    return v;
}

}  // namespace xc
