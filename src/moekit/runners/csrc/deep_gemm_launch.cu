// moekit's host side for DeepGEMM's SM90 grouped GEMM kernels.
//
// The kernels are DeepGEMM's own templates, read from the include directory that the
// sgl-deep-gemm package ships for its JIT. This file instantiates one of them with the
// configuration given by MK_* macros (see moekit/runners/deep_gemm_jit.py), builds the TMA
// descriptors and launches it on the caller's stream. Only raw pointers cross the boundary, so
// no torch headers (and no torch ABI) are involved.
//
//   MK_FP8     1: sm90_fp8_gemm_1d2d (fp8 e4m3 operands, float32 scales: activations per row
//                 and 128 columns, weights per 128x128 block); 0: sm90_bf16_gemm (bf16)
//   MK_MASKED  1: masked layout (A [G*C, K], layout = rows used per group [G]);
//              0: contiguous layout (A [M, K], layout = end row of each group [G]: group g
//                 starts at its predecessor's end rounded up to MK_BLOCK_M), so the kernel
//                 visits only the row tiles that hold pairs (DeepGEMM's "psum" layout)
//   MK_MULTICAST 1, or 2: pairs of CTAs (a cluster) share each A tile through TMA multicast
//   MK_N, MK_K, MK_GROUPS, MK_BLOCK_M, MK_BLOCK_N, MK_STAGES, MK_SWIZZLE_D, MK_NUM_SMS
#include <cstdint>
#include <cstdio>
#include <cuda.h>
#include <cuda_runtime.h>

#if MK_FP8
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
#else
#include <deep_gemm/impls/sm90_bf16_gemm.cuh>
#endif

namespace {

using namespace deep_gemm;

constexpr uint32_t kElemBytes = MK_FP8 ? 1 : 2;
constexpr uint32_t kBlockK = 128 / kElemBytes;  // one 128-byte swizzle atom of K per stage
constexpr uint32_t kTMAThreads = 128;
constexpr uint32_t kMathThreads = MK_BLOCK_M <= 64 ? 128 : 256;
constexpr GemmType kGemmType =
    MK_MASKED ? GemmType::MGroupedMasked : GemmType::MGroupedContiguousWithPsumLayout;

constexpr uint32_t align_up(uint32_t x, uint32_t a) { return (x + a - 1) / a * a; }

// Dynamic shared memory, laid out as the kernel lays it out: D tile, the A / B (/ A scale)
// stages, the B scales (fp8), then a full and an empty barrier per stage.
constexpr uint32_t smem_bytes() {
    uint32_t d = align_up(MK_BLOCK_M * MK_BLOCK_N * 2, 1024);
    uint32_t stage = (MK_BLOCK_M + MK_BLOCK_N) * kBlockK * kElemBytes;
    uint32_t sfb = 0;
    if (MK_FP8) {
        stage += align_up(MK_BLOCK_M * 4, 128);
        uint32_t sfb_rows = (128 % MK_BLOCK_N == 0) ? 1 : 2;
        sfb = align_up((MK_K + 127) / 128 * sfb_rows * 4, 8);
    }
    return d + MK_STAGES * stage + sfb + MK_STAGES * 2 * 8;
}
static_assert(MK_NUM_SMS % MK_MULTICAST == 0, "the grid must hold whole clusters");
static_assert(smem_bytes() <= 232448, "configuration exceeds the SM90 shared memory per block");

#if MK_FP8
constexpr auto kKernel = &sm90_fp8_gemm_1d2d_impl<
    cute::UMMA::Major::K, 0, MK_N, MK_K, MK_GROUPS, MK_BLOCK_M, MK_BLOCK_N, kBlockK,
    128, 128, MK_SWIZZLE_D, MK_STAGES, kTMAThreads, kMathThreads, MK_MULTICAST, (MK_MULTICAST > 1),
    MK_NUM_SMS, kGemmType, cutlass::bfloat16_t, epilogue::transform::EpilogueIdentity, 128>;
#else
constexpr auto kKernel = &sm90_bf16_gemm_impl<
    cute::UMMA::Major::K, cute::UMMA::Major::K, 0, MK_N, MK_K, MK_GROUPS, MK_BLOCK_M,
    MK_BLOCK_N, kBlockK, 128, 128, MK_SWIZZLE_D, MK_STAGES, kTMAThreads, kMathThreads,
    MK_MULTICAST, (MK_MULTICAST > 1), MK_NUM_SMS, kGemmType, false, cutlass::bfloat16_t>;
#endif

char g_error[512] = "";

using EncodeFn = decltype(&cuTensorMapEncodeTiled);  // resolved at run time: no -lcuda

EncodeFn encode_fn() {
    static EncodeFn fn = nullptr;
    if (fn == nullptr) {
        cudaDriverEntryPointQueryResult found;
        void* ptr = nullptr;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                             cudaEnableDefault, &found) == cudaSuccess and
            found == cudaDriverEntryPointSuccess)
            fn = reinterpret_cast<EncodeFn>(ptr);
    }
    return fn;
}

CUtensorMapSwizzle swizzle_of(uint32_t bytes) {
    switch (bytes) {
        case 128: return CU_TENSOR_MAP_SWIZZLE_128B;
        case 64: return CU_TENSOR_MAP_SWIZZLE_64B;
        case 32: return CU_TENSOR_MAP_SWIZZLE_32B;
        default: return CU_TENSOR_MAP_SWIZZLE_NONE;
    }
}

// A row-major [outer, inner] tensor with rows `pitch` elements apart, read in boxes of
// [box_outer, box_inner].
bool make_map(CUtensorMap* map, const char* name, CUtensorMapDataType dtype, uint32_t elem_bytes,
              void* ptr, uint64_t inner, uint64_t outer, uint64_t pitch, uint32_t box_inner,
              uint32_t box_outer, uint32_t swizzle_bytes) {
    auto fn = encode_fn();
    if (fn == nullptr) {
        snprintf(g_error, sizeof(g_error), "cuTensorMapEncodeTiled is not available");
        return false;
    }
    cuuint64_t dims[2] = {inner, outer};
    cuuint64_t strides[1] = {pitch * elem_bytes};
    cuuint32_t box[2] = {box_inner, box_outer};
    cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = fn(map, dtype, 2, ptr, dims, strides, box, elem_strides,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_of(swizzle_bytes),
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        snprintf(g_error, sizeof(g_error),
                 "cuTensorMapEncodeTiled(%s) failed with %d: dims [%llu, %llu], box [%u, %u]",
                 name, int(r), (unsigned long long)outer, (unsigned long long)inner, box_outer,
                 box_inner);
        return false;
    }
    return true;
}

}  // namespace

extern "C" {

const char* mk_last_error() { return g_error; }

uint32_t mk_smem_bytes() { return smem_bytes(); }

// d = a @ b[group].T (bf16 out) over the rows of the layout; see the file comment.
//   a     [rows, K] (fp8 / bf16), rows = m (contiguous) or MK_GROUPS * m (masked, m = C)
//   sfa   fp8: float32 [MK_GROUPS (masked) or 1, K / 128, sfa_pitch] (scales of column m at m)
//   b     [MK_GROUPS * MK_N, K]; sfb fp8: float32 [MK_GROUPS, MK_N / 128, K / 128]
//   d     [rows, MK_N] bf16; layout int32 [MK_GROUPS] (see MK_MASKED)
// Returns 0, or a CUDA error code / -1 with mk_last_error() saying what failed.
int mk_launch(void* a, void* sfa, void* b, void* sfb, void* d, int* layout, uint32_t m,
              uint32_t sfa_pitch, void* stream) {
    const uint64_t rows = MK_MASKED ? uint64_t(m) * MK_GROUPS : m;
    const uint32_t d_box_n = MK_SWIZZLE_D ? MK_SWIZZLE_D / 2 : MK_BLOCK_N;
    const auto in_type = MK_FP8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUtensorMap map_a, map_b, map_d;
    if (not make_map(&map_a, "a", in_type, kElemBytes, a, MK_K, rows, MK_K, kBlockK,
                     MK_BLOCK_M, 128) or
        not make_map(&map_b, "b", in_type, kElemBytes, b, MK_K, uint64_t(MK_GROUPS) * MK_N,
                     MK_K, kBlockK, MK_BLOCK_N, 128) or
        not make_map(&map_d, "d", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, d, MK_N, rows, MK_N,
                     d_box_n, MK_BLOCK_M, MK_SWIZZLE_D))
        return -1;

    static uint64_t attribute_set = 0;  // per device (the caller makes a's device current)
    int device = 0;
    cudaGetDevice(&device);
    if (not (attribute_set >> (device & 63) & 1)) {
        cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             smem_bytes());
        if (e != cudaSuccess) {
            snprintf(g_error, sizeof(g_error), "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
            return int(e);
        }
        attribute_set |= uint64_t(1) << (device & 63);
    }
    auto s = static_cast<cudaStream_t>(stream);
#if MK_FP8
    CUtensorMap map_sfa;
    const uint64_t sf_k = (MK_K + 127) / 128;
    if (not make_map(&map_sfa, "sfa", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, sfa, sfa_pitch,
                     (MK_MASKED ? MK_GROUPS : 1) * sf_k, sfa_pitch, MK_BLOCK_M, 1, 0))
        return -1;
#endif
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(MK_NUM_SMS);
    config.blockDim = dim3(kTMAThreads + kMathThreads);
    config.dynamicSmemBytes = smem_bytes();
    config.stream = s;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = MK_MULTICAST;
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    // a cluster launch only for multicast: with the attribute even clusters of one ran the
    // H100 kernels 1.2-1.5x slower than a plain launch
    config.numAttrs = MK_MULTICAST > 1 ? 1 : 0;
#if MK_FP8
    cudaError_t e = cudaLaunchKernelEx(&config, kKernel, static_cast<float*>(sfb), layout, m,
                                       uint32_t(MK_N), uint32_t(MK_K), map_a, map_b, map_d,
                                       map_sfa);
#else
    (void)sfa, (void)sfb, (void)sfa_pitch;
    cudaError_t e = cudaLaunchKernelEx(&config, kKernel, layout, m, uint32_t(MK_N),
                                       uint32_t(MK_K), map_a, map_b, map_d);
#endif
    if (e == cudaSuccess)
        e = cudaGetLastError();
    if (e != cudaSuccess) {
        snprintf(g_error, sizeof(g_error), "kernel launch: %s", cudaGetErrorString(e));
        return int(e);
    }
    return 0;
}

}  // extern "C"
