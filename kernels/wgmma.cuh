// Hopper's warpgroup MMA (wgmma.mma_async; sm_90a, which the host compiles for on sm_90 devices).
// A warpgroup (4 warps) multiplies 64 rows of A, here from registers in exactly mma.sync's
// m16n8k16 A-fragment layout (warp w holds rows 16w..16w + 15), by a B tile the tensor cores read
// from shared memory through a 64-bit descriptor. The fp32 64 × N accumulator is spread like N/8
// mma.sync m16n8 C fragments per warp (d[4·nb + e] is s[nb][e]), so the softmax code of the
// mma.sync kernels runs unchanged on it. Other architectures compile these helpers to a trap; the
// host launches the kernels that use them only on sm_90.
//
// wgmma's shared-memory tiles here use the 128-byte swizzle (descriptor mode 1): a tile of rows × D
// bf16 is stored as D / 64 column blocks of rows × 128 bytes (one row of 64 elements per 128
// bytes), and within each 1024-byte group of 8 rows the 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) (the hardware applies the same XOR to address bits 4–6 from bits 7–9, so tiles
// start on 1024-byte boundaries). Eight threads copying the eight chunks of one 128-byte row
// read one whole line of global memory and write eight different bank groups. The same bytes
// serve as a K-major operand (rows = M or N, D = K: S = Q Kᵀ) and as an MN-major B (rows = K,
// D = N: O = P V); sw_kmajor and sw_mnmajor make the descriptors.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ARCH 1
#else
#define WG_ARCH 0
#endif

typedef unsigned long long u64;

// A shared-memory matrix descriptor: start address, leading- and stride-dimension byte offsets,
// each >> 4; no swizzle (core matrices of 8 rows × 16 bytes: LBO between core matrices along K,
// SBO along M or N).
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
}

// Element offset of chunk c (8 elements) of row r in a swizzled tile of `rows` rows (see above).
__device__ __forceinline__ int sw_offset(int r, int c, int rows) {
    return (c >> 3) * rows * 64 + r * 64 + ((c ^ r) & 7) * 8;
}

// `desc` moved on by `bytes` (a multiple of 16): an add into the start-address field, which
// cannot carry out of it (shared addresses stay below 2^18). A k-loop's descriptors are then its
// first one plus constants: one uniform add per wgmma instead of the add, shift, mask and move
// of a descriptor built from each address (issue slots the consumer warps share; SASS).
__device__ __forceinline__ u64 wg_step(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// K-major operand (rows = M or N, D = K) from a swizzled tile of `rows` rows, its first row at
// shared address `base` (row r of the tile starts r · 128 bytes after row 0), k-step kk (16
// elements of D): within a 128-byte row the step moves the start by 32 bytes and the hardware's
// XOR finds the chunks; SBO = 1024 (8 rows), LBO unused (1).
__device__ __forceinline__ u64 sw_kmajor(u32 base, int rows, int kk) {
    return wg_step(wg_desc(base, 16, 1024) | (1ull << 62), (kk >> 2) * rows * 128 + (kk & 3) * 32);
}

// MN-major operand (rows = K, D = N) from a swizzled tile of `rows` rows, k-step ks (16 rows):
// SBO = 1024 (next 8 rows along K), LBO = the column-block stride (next 64 along N).
__device__ __forceinline__ u64 sw_mnmajor(u32 base, int rows, int ks) {
    return wg_step(wg_desc(base, rows * 128, 1024) | (1ull << 62), ks * 2048);
}

#if WG_ARCH
#define WG_ASM(s) asm volatile(s ::: "memory")
#define WG_ASM_ARGS(s, ...) asm volatile(s ::__VA_ARGS__ : "memory")
#else
#define WG_ASM(s) __trap()
#define WG_ASM_ARGS(s, ...) __trap()
#endif
// Orders register writes before the wgmma that reads them (accumulators, A fragments).
__device__ __forceinline__ void wg_fence() { WG_ASM("wgmma.fence.sync.aligned;"); }
__device__ __forceinline__ void wg_commit() { WG_ASM("wgmma.commit_group.sync.aligned;"); }
__device__ __forceinline__ void wg_wait_all() { WG_ASM("wgmma.wait_group.sync.aligned 0;"); }
// Waits until at most N committed groups of this warp's wgmmas are still running (they finish
// in order: N = 1 after two commits waits for the first).
template <int N>
__device__ __forceinline__ void wg_wait() { WG_ASM_ARGS("wgmma.wait_group.sync.aligned %0;", "n"(N)); }
// Makes this thread's shared-memory writes (cp.async, stores: the generic proxy) visible to
// wgmma's operand reads (the async proxy); then a barrier, then the wgmma.
__device__ __forceinline__ void fence_async_smem() { WG_ASM("fence.proxy.async.shared::cta;"); }

// Pins N accumulator registers: the compiler may not read them before the wait that follows
// their wgmma (it does not know the asynchronous write) nor sink earlier writes past the issue.
template <int N>
__device__ __forceinline__ void wg_pin(float* d) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Keeps N A-fragment registers live up to here: wgmma reads them asynchronously, after the
// instruction that the compiler sees consume them; place after the wait.
template <int N>
__device__ __forceinline__ void wg_keep(const u32* a) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" ::"r"(a[i]) : "memory");
}

// The accumulator of an m64nN wgmma, N / 2 fp32 registers a thread (d[0] ..): its operand
// list in the asm's PTX (`%0, %1, …`, the first operands) and as read-write asm operands.
#define WG_REGS32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64 \
    WG_REGS32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS128 \
    WG_REGS64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32 WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24)
#define WG_ACC64 WG_ACC32, WG_ACC8(32), WG_ACC8(40), WG_ACC8(48), WG_ACC8(56)
#define WG_ACC128 WG_ACC64, WG_ACC8(64), WG_ACC8(72), WG_ACC8(80), WG_ACC8(88), WG_ACC8(96), WG_ACC8(104), \
    WG_ACC8(112), WG_ACC8(120)

// d (64 × N, fp32) += A (64 × 16 from registers) · B (16 × N, shared memory by `desc`); TB = 1
// when B is MN-major; SD = 0 overwrites d instead (d = A · B: no zeroing of the accumulator
// first). Generated shapes: N = 64 and 128.
template <int TB, int SD = 1>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float* d, const u32* a, u64 desc) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        WG_REGS32
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : WG_ACC32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SD), "n"(TB));
#else
    __trap();
#endif
}

template <int TB, int SD = 1>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float* d, const u32* a, u64 desc) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_REGS64
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : WG_ACC64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SD), "n"(TB));
#else
    __trap();
#endif
}

// d (64 × 64, fp32) += A (64 × 16, shared memory by `da`) · B (16 × 64 by `db`); TA / TB = 1
// when A / B is MN-major (K-major otherwise); SD = 0 overwrites d (no zeroing first).
template <int TA = 0, int TB = 0, int SD = 1>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, u64 da, u64 db) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        WG_REGS32
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : WG_ACC32
        : "l"(da), "l"(db), "n"(SD), "n"(TA), "n"(TB));
#else
    __trap();
#endif
}

// d (64 × 128, fp32) += A (64 × 16, shared memory by `da`, K-major) · B (16 × 128 by `db`,
// K-major); SD = 0 overwrites d.
template <int SD = 1>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float* d, u64 da, u64 db) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_REGS64
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64
        : "l"(da), "l"(db), "n"(SD));
#else
    __trap();
#endif
}

// d (64 × 128, fp32) += A (64 × 16, shared memory by `da`, K-major) · B (16 × 128 by `db`;
// TB = 1 when MN-major); `acc` = 0 overwrites d (a tile's first k-step), at run time.
template <int TB>
__device__ __forceinline__ void wgmma_m64n128k16_ss_acc(float* d, u64 da, u64 db, int acc) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_REGS64
        "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
        : WG_ACC64
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
#else
    __trap();
#endif
}

// The same with N = 256: 128 accumulator registers a thread; B (16 × 256) read from shared
// memory once for all 64 rows, where two m64n128 wgmmas of 128 rows read it twice.
template <int TB>
__device__ __forceinline__ void wgmma_m64n256k16_ss_acc(float* d, u64 da, u64 db, int acc) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        WG_REGS128
        "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
        : WG_ACC128
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
#else
    __trap();
#endif
}

template <int N, int TB, int SD = 1>
__device__ __forceinline__ void wgmma_rs(float* d, const u32* a, u64 desc) {
    static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
    if constexpr (N == 64) wgmma_m64n64k16_rs<TB, SD>(d, a, desc); else wgmma_m64n128k16_rs<TB, SD>(d, a, desc);
}

// Around a batch of wgmmas accumulating into N registers at `d`: wg_start pins them and fences
// (registers written since are ordered before the wgmmas), wg_finish commits, waits for every
// wgmma of this warp and pins them again.
template <int N>
__device__ __forceinline__ void wg_start(float* d) {
    wg_pin<N>(d);
    wg_fence();
}
template <int N>
__device__ __forceinline__ void wg_finish(float* d) {
    wg_commit();
    wg_wait_all();
    wg_pin<N>(d);
}

// mbarriers in shared memory (sm_90): `count` arrivals complete a phase; waiters name the parity
// of the phase they wait for (0 for the first, then alternating).
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    WG_ASM_ARGS("mbarrier.init.shared::cta.b64 [%0], %1;", "r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    WG_ASM_ARGS("mbarrier.arrive.shared::cta.b64 _, [%0];", "r"(smem_addr(bar)));
}
// Arrives once this thread's cp.async copies so far have landed (counts as one of `count`).
__device__ __forceinline__ void cp_arrive(u64* bar) {
    WG_ASM_ARGS("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];", "r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
#if WG_ARCH
    asm volatile(
        "{\n.reg .pred p;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra wait_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
#else
    __trap();
#endif
}

// TMA (sm_90's tensor memory accelerator): one thread copies a whole box of a tensor into shared
// memory, laid out (here) in the 128-byte swizzle above, rows past the tensor's end zero-filled,
// and the copy's bytes count against an mbarrier's expected transaction count, so the phase
// completes when every byte has landed. The host encodes the tensor map (cuTensorMapEncodeTiled,
// crates/kernels/src/cuda/tma.rs); it is passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    unsigned long long opaque[16];
};
// Arrives on `bar` (one of its count) and raises the phase's expected bytes by `bytes`.
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    WG_ASM_ARGS("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;", "r"(smem_addr(bar)), "r"(bytes));
}
// The box at coordinates (c0 innermost, c1, c2, c3) of the 4-d tensor `map` into `dst`
// (1024-byte aligned for the 128-byte swizzle), completing on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaMap* map, int c0, int c1, int c2, int c3, u64* bar) {
    WG_ASM_ARGS("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                " [%0], [%1, {%2, %3, %4, %5}], [%6];",
                "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar)));
}

// The box at (c0 innermost, c1) of the 2-d tensor `map` into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int c0, int c1, u64* bar) {
    WG_ASM_ARGS("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                " [%0], [%1, {%2, %3}], [%4];",
                "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar)));
}

// The same box written to the same shared-memory offset in every block of the cluster named in
// `mask` (bit r: cluster rank r), each completing on its own mbarrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_mc(void* dst, const TmaMap* map, int c0, int c1, u64* bar,
                                               unsigned short mask) {
    WG_ASM_ARGS("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                " [%0], [%1, {%2, %3}], [%4], %5;",
                "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(mask));
}

// Thread blocks in clusters (sm_90): this block's rank, the whole cluster's barrier (every
// thread of every block, release / acquire: mbarrier inits and shared writes before it are seen
// after it), and an arrival on the mbarrier at `bar`'s offset in the block of rank `peer`.
__device__ __forceinline__ u32 cluster_rank() {
    u32 r = 0;
#if WG_ARCH
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    WG_ASM("fence.mbarrier_init.release.cluster;\n"
           "barrier.cluster.arrive.release.aligned;\n"
           "barrier.cluster.wait.acquire.aligned;");
}
__device__ __forceinline__ void mbar_arrive_peer(u64* bar, u32 peer) {
    WG_ASM_ARGS("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}",
                "r"(smem_addr(bar)), "r"(peer));
}

// The box at (c0, c1) of the 2-d tensor `map` from `src` (shared memory in the map's swizzle,
// 1024-byte aligned; the generic proxy's writes fenced by fence_async_smem), as one bulk group;
// elements past the tensor's edge are not written. bulk_wait_read before refilling src.
__device__ __forceinline__ void tma_store_2d(const TmaMap* map, const void* src, int c0, int c1) {
    WG_ASM_ARGS("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
                "cp.async.bulk.commit_group;",
                "l"(map), "r"(smem_addr(src)), "r"(c0), "r"(c1));
}

// Register reallocation between the warpgroups of a warp-specialised block (setmaxnreg): every
// thread of a warpgroup executes one of these, the producer giving registers back (dealloc) and
// the consumers taking them (alloc, which waits until the pool has them). The pool is the block's
// launch allocation (threads · the kernel's register count), so the counts asked for must sum
// to no more than that or alloc waits forever. ptxas compiles the code after each for its new
// count, so the kernel's launch count only bounds the code before them.
template <int N>
__device__ __forceinline__ void wg_reg_dealloc() { WG_ASM_ARGS("setmaxnreg.dec.sync.aligned.u32 %0;", "n"(N)); }
template <int N>
__device__ __forceinline__ void wg_reg_alloc() { WG_ASM_ARGS("setmaxnreg.inc.sync.aligned.u32 %0;", "n"(N)); }

// Named barriers 1–15: `count` threads (whole warps) in all, some waiting (sync), some passing
// (arrive, no wait).
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Barrier 0 for the whole block where warps reach it from different code (`barrier.sync` without
// `.aligned`; __syncthreads' `bar.sync` requires every thread at the same instruction).
__device__ __forceinline__ void barrier_any() { asm volatile("barrier.sync 0;" ::: "memory"); }
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}


// dst[0..bytes/4) += src[...] in global memory from shared memory, as one asynchronous bulk
// reduction (sm_90; both 16-byte aligned, bytes a multiple of 16), then committed as a group.
// Wait with bulk_wait_read<N> before refilling src (at most N groups still reading) and with
// bulk_wait<N> for the writes.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, u32 bytes) {
    WG_ASM_ARGS("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                "cp.async.bulk.commit_group;",
                "l"(dst), "r"(smem_addr(src)), "r"(bytes));
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    WG_ASM_ARGS("cp.async.bulk.wait_group.read %0;", "n"(N));
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    WG_ASM_ARGS("cp.async.bulk.wait_group %0;", "n"(N));
}
