// moekit's 4-bit weight-only MoE GEMMs for decode batches (the `w4a16` runner).
//
// Two kernels per call, on at most MAX_P (token, expert) pairs:
//   gate_up: h [P, I] = act(x[token] @ w13[e].T + b13[e]) for each pair; also zeroes out [T, H];
//   down:    out [T, H] += weight * (h[pair] @ w2[e].T + b2[e]) (bf16 atomics).
// Each block first groups the call's pairs by expert in shared memory (no alignment kernel),
// in segments of at most 8 * NT pairs of one expert, then loops over the work items
// (segment, weight rows, K share); its WARPS warps split rows or K (meeting in shared memory),
// and down's K may be split over k_blocks blocks (their partial sums meet in the atomics).
// On sm_90+ down may be a programmatic dependent launch of gate_up (`overlap`): its blocks are
// placed while gate_up finishes, group the pairs and start their first weight copies, and wait
// for gate_up before they read h or add into out.
// Two ways to stream a warp's K chunks (the plan picks per GEMM, benchmarks/w4a16_notes.md):
//   ring:   through STAGES slots in shared memory with cp.async (weights, scales and
//           activations): bytes in flight without registers held for them; pays where few
//           warps must keep the memory busy (small batches, few experts). Every lane copies and
//           reads back only its own bytes, so the ring needs no barrier.
//   direct: one chunk in registers, loaded after the last one is used (DEPTH 1, session 23):
//           fewer instructions a chunk; pays where the grid holds warps enough.
//
// Weights are streamed from a layout permuted once on the host (moekit.runners.w4a16.pack):
// a tile of 16 rows x 64 columns is 512 bytes, 16 per lane, which are exactly that lane's
// A fragments of four m16n8k16 bf16 MMAs (the weights are the MMA's A operand, the pairs its
// columns). The 64 columns of a tile are assigned to MMA slots so that a lane's activations
// for the tile are 16 consecutive values of one row (two 16-byte loads). The 4-bit codes are
// turned into bf16 in registers with a few integer operations and one or two bf16 products
// (the scale); the products and sums run on the tensor cores in float32.
//
// Compile-time format (-D): MK_FMT 0 int4 (w = (q - z) * s; bf16 scales, zero offsets
// 128 + z in bf16 when MK_ZERO), 1 mxfp4 (e8m0 scale per 32), 2 nvfp4 (e4m3 scale per 16
// times a float32 global scale per expert). MK_TWO_MUL (fp4): the exact e2m1 value first,
// then the scale, for scales too large to fold 2^126 into (see pack.py). MK_INT4_POST (int4
// with groups of 64 or more, where a K chunk lies in one group): the MMAs take q - z exactly
// and the scale multiplies each chunk's float32 sums (one bf16 product fewer per weight pair).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <cstdio>

// format codes (macros: the preprocessor branches on them)
#define MK_INT4 0
#define MK_MXFP4 1
#define MK_NVFP4 2
#ifndef MK_FMT
#define MK_FMT MK_INT4
#endif
#ifndef MK_ZERO
#define MK_ZERO 0
#endif
#ifndef MK_TWO_MUL
#define MK_TWO_MUL 0
#endif
// Probes (benchmarks/w4a16_notes.md, session 28; wrong results, for timing only): leave out the
// K chunks (the fixed cost of a call), the arithmetic (loads only), or the ring's activation or
// scale copies.
#ifndef MK_PROBE_NO_CHUNKS
#define MK_PROBE_NO_CHUNKS 0
#endif
#ifndef MK_PROBE_NO_MATH
#define MK_PROBE_NO_MATH 0
#endif
#ifndef MK_PROBE_NO_X
#define MK_PROBE_NO_X 0
#endif
#ifndef MK_PROBE_NO_SCALES
#define MK_PROBE_NO_SCALES 0
#endif
#ifndef MK_INT4_POST
#define MK_INT4_POST 0
#endif
#ifndef MK_STAGES  // chunks in a warp's ring (fewer where they would not fit STAGE_BUDGET)
#define MK_STAGES 4
#endif
#ifdef MK_MIN_BLOCKS  // probes: at least this many blocks per multiprocessor (caps registers)
#define MK_BOUNDS __launch_bounds__(THREADS, MK_MIN_BLOCKS)
#else
#define MK_BOUNDS __launch_bounds__(THREADS)
#endif

namespace {

constexpr int MAX_P = 128;   // pairs per call (one per thread in the grouping)
constexpr int WARPS = 4;     // warps per block, splitting K
constexpr int THREADS = WARPS * 32;
constexpr int STAGE_BUDGET = 44 * 1024;  // bytes of a block's rings (static shared: 48 KB)
constexpr int GATE_UP = 0, DOWN = 1;
constexpr int ACT_SILU = 0, ACT_GELU = 1, ACT_SWIGLU_OAI = 2;
static_assert(THREADS == MAX_P, "the grouping gives each thread one pair");

struct Args {
  const __nv_bfloat16* x;     // gate_up: x [T, K]; down: h [P, K]  (K: the reduction dim)
  const int* ids;             // [P] local expert of each pair; < 0 or >= E: none
  const float* topk_w;        // [P] routing weights (down)
  const uint4* wq;            // [E, rows / 16, K / 64, 32] packed tiles
  const uint8_t* ws;          // scales, per tile and block of max(group, 64) columns (pack.py)
  const uint8_t* wz;          // int4 zero offsets, same layout as ws (MK_ZERO)
  const float* gscale;        // nvfp4: [E]
  const __nv_bfloat16* bias;  // gate_up: [E, 2N] (gate rows, then up); down: [E, N]
  __nv_bfloat16* out;         // gate_up: h [P, N]; down: out [T, N] (added into)
  __nv_bfloat16* zero_out;    // gate_up: out [T, H] to zero for down
  long long zero_n;           // elements of zero_out (a multiple of 8)
  int P, topk, E, N, K, group, split_k;
  int k_blocks;               // down: blocks sharing one row block's K (partial sums added)
  float alpha, limit;
};

__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 as_bf2(uint32_t u) {
  return *reinterpret_cast<__nv_bfloat162*>(&u);
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Programmatic dependent launch (sm_90+): gate_up lets down's blocks be placed as soon as all
// of its own are running; down streams its first weights (which no kernel writes) and then
// waits for gate_up to finish before it reads h or adds into out.
__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// global -> shared copies that complete in the background (cp.async, sm_80+): 16 bytes through
// L2 only (streamed weights); 16 bytes through L1, zero-filled when !valid (activation rows,
// shared by the block's warps); 4 bytes through L1 (scales).
__device__ __forceinline__ void copy16_stream(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void copy16_or_zero(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>  // wait until at most N of this thread's newest copy groups are in flight
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// out[0:2] += (lo, hi) in bf16, as one reduction: on sm_90 a bf16x2 `red` is native, while a
// scalar bf16 atomicAdd compiles to a load and a compare-and-swap loop that the block then
// waits for at its barrier (measured: 16% of down's stall samples).
__device__ __forceinline__ void add_bf16x2(__nv_bfloat16* p, float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.noftz.bf16x2 [%0], %1;" ::"l"(p),
               "r"(*reinterpret_cast<uint32_t*>(&v))
               : "memory");
#else
  atomicAdd(reinterpret_cast<__nv_bfloat162*>(p), v);
#endif
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Bytes of scales per tile and block (one K chunk, or the 2^cshift chunks of one group of
// 128 or more), and this lane's offset in them: entries [groups in the block][g 0..7]
// [row g, row g + 8], of 2 bytes (int4: bf16) or 1 (fp4 codes).
constexpr int SCALE_ELEM = MK_FMT == MK_INT4 ? 2 : 1;

// int4 A fragment register j (0..3) of one 32-bit word of 8 codes: q - z in bf16x2, exact
// (z: the zero offset as bf16x2 of 128 + z).
template <int J>
__device__ __forceinline__ uint32_t int4_less_zero(uint32_t q, uint32_t z) {
  // codes j and j + 4 -> the mantissas of bf16 128 + q, less 128 + z: q - z, exact
  const uint32_t t = ((q >> (4 * J)) & 0x000F000Fu) | 0x43004300u;
  return as_u32(__hsub2(as_bf2(t), as_bf2(z)));
}

// A fragment register j (0..3) of one 32-bit word of 8 codes, as bf16x2; m: the row's scale
// multiplier (bf16x2), z: int4 zero offset (bf16x2 of 128 + z).
template <int J>
__device__ __forceinline__ uint32_t dequant(uint32_t q, uint32_t m, uint32_t z) {
#if MK_FMT == MK_INT4
  return as_u32(__hmul2(as_bf2(int4_less_zero<J>(q, z)), as_bf2(m)));
#else
  // sign to bit 15 / 31, exponent and mantissa to bits 8..6 / 24..22 (pack.bit_positions):
  // bf16 2^-126 times the e2m1 value (subnormal for codes 0, 1)
  uint32_t r;
  if (J < 3) {
    r = (q << (3 * J)) & 0x81C081C0u;
  } else {
    r = ((q << 1) & 0x80008000u) | ((q >> 5) & 0x01000100u) | ((q >> 4) & 0x00C000C0u);
  }
#if MK_TWO_MUL
  return as_u32(__hmul2(__hmul2(as_bf2(r), as_bf2(0x7E807E80u)), as_bf2(m)));  // * 2^126
#else
  return as_u32(__hmul2(as_bf2(r), as_bf2(m)));  // m holds 2^126 * scale
#endif
#endif
}

// bf16 multiplier bits of one scale code (fp4 formats).
__device__ __forceinline__ uint32_t fp4_multiplier(uint32_t code, float gs) {
#if MK_FMT == MK_MXFP4
#if MK_TWO_MUL
  return code ? code << 7 : 0x0040u;  // 2^(code - 127); code 0: 2^-127 (subnormal)
#else
  return (code + 126u) << 7;  // 2^126 * 2^(code - 127)
#endif
#else
  __nv_fp8_e4m3 s;
  s.__x = static_cast<__nv_fp8_storage_t>(code);
  float f = static_cast<float>(s) * gs;
#if !MK_TWO_MUL
  f *= 8.507059173023462e37f;  // 2^126
#endif
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&b);
#endif
}

template <int MT, int NT>
struct Chunk {
  uint4 a[MT];       // packed codes, 16 bytes per tile
  uint32_t s[MT];    // scales of rows g and g + 8 (the 4-byte word holding them)
  uint32_t z[MT];    // int4 zero offsets
  uint4 b[NT][2];    // activations: 16 values of pair row g
};

// One ring slot of a warp: a chunk for all 32 lanes, each lane's bytes at [..][lane]; zero
// offsets only with MK_ZERO.
template <int MT, int NT, bool ZERO = MK_ZERO>
struct Slot {
  uint4 a[MT][32];
  uint4 b[NT][2][32];
  uint32_t s[MT][32];
  uint32_t z[MT][32];
};
template <int MT, int NT>
struct Slot<MT, NT, false> {
  uint4 a[MT][32];
  uint4 b[NT][2][32];
  uint32_t s[MT][32];
};
template <int MT, int NT>
struct Stages {
  static constexpr int fit = STAGE_BUDGET / (WARPS * (int)sizeof(Slot<MT, NT>));
  static constexpr int value = fit < 1 ? 1 : (fit < MK_STAGES ? fit : MK_STAGES);
};

// MT: 16-row weight tiles per warp and item: gate_up 2 (gate and up), down 1 or 2. RING: the
// chunks stream through the shared-memory ring, else directly into registers.
template <int KIND, int ACT, bool BIAS, int NT, int MT, bool RING>
__global__ void MK_BOUNDS moe_w4(const Args a) {
  static_assert(KIND == DOWN || MT == 2, "gate_up takes one gate and one up tile");
  constexpr int SEG = 8 * NT;
  __shared__ int s_sorted[MAX_P];
  __shared__ int s_seg_start[MAX_P], s_seg_len[MAX_P], s_seg_e[MAX_P];
  __shared__ int s_nseg;
  constexpr int STAGES = Stages<MT, NT>::value;
  using Ring = Slot<MT, NT>[STAGES];
  // each warp's own shared memory: its ring (RING), then the K shares' partial sums after the
  // main loop (every real copy into the ring has been waited for by then)
  constexpr int RED_BYTES = sizeof(float) * MT * NT * 4 * 32;
  constexpr int WARP_BYTES = RING && sizeof(Ring) > RED_BYTES ? sizeof(Ring) : RED_BYTES;
  __shared__ __align__(16) unsigned char s_warp[WARPS][WARP_BYTES];
  // the grouping's scratch (expert and rank of each pair), before anything else uses them
  static_assert(sizeof(s_warp) >= 2 * MAX_P * sizeof(int), "the grouping's scratch fits");
  int* s_id = reinterpret_cast<int*>(&s_warp[0][0]);
  int* s_rank = s_id + MAX_P;

  if (KIND == GATE_UP) let_dependents_launch();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int P = a.P;

  // ---- group the pairs by expert: sorted position and segments (one pair per thread)
  int e_p = -1;
  if (tid < P) {
    const int v = a.ids[tid];
    e_p = (v >= 0 && v < a.E) ? v : -1;
  }
  s_id[tid] = e_p;
  if (tid == 0) s_nseg = 0;
  __syncthreads();
  int less = 0, same = 0, cnt = 0;
  if (e_p >= 0) {
    for (int q = 0; q < P; ++q) {
      const int f = s_id[q];
      if (f < 0) continue;
      less += f < e_p;
      cnt += f == e_p;
      same += (f == e_p) & (q < tid);
    }
    s_sorted[less + same] = tid;
  }
  s_rank[tid] = same;
  __syncthreads();
  if (e_p >= 0 && same % SEG == 0) {  // this pair leads a segment
    int sid = 0;
    for (int q = 0; q < P; ++q) {
      const int f = s_id[q];
      if (f < 0 || s_rank[q] % SEG) continue;
      sid += (f < e_p) | ((f == e_p) & (s_rank[q] < same));
    }
    s_seg_start[sid] = less + same;
    s_seg_len[sid] = min(SEG, cnt - same);
    s_seg_e[sid] = e_p;
    atomicAdd(&s_nseg, 1);
  }
  __syncthreads();
  const int nseg = s_nseg;

  if (KIND == GATE_UP) {  // zero the output that down adds into
    const long long step = 8LL * gridDim.x * THREADS;
    for (long long i = 8LL * (blockIdx.x * THREADS + tid); i < a.zero_n; i += step)
      *reinterpret_cast<uint4*>(a.zero_out + i) = make_uint4(0, 0, 0, 0);
  }

  const int N = a.N, K = a.K, KC = K / 64;
  // warps: WARPS / split_k row blocks of 16 (gate_up: gate and up) or 16 * MT (down) rows,
  // each over split_k shares of K
  const int split_k = a.split_k, wn_n = WARPS / split_k;
  const int wn = warp / split_k, wk = warp % split_k;
  const int rows_per_warp = KIND == GATE_UP ? 16 : 16 * MT;
  const int row_blocks = N / rows_per_warp;
  const int R = (row_blocks + wn_n - 1) / wn_n, KB = a.k_blocks;
  const int gsz = a.group < 64 ? a.group : 64;
  const int SB = (64 / gsz) * 16 * SCALE_ELEM;
  // chunks of a scale block: 2^cshift, more than one only for int4 groups of 128 or more (a
  // compile-time 0 elsewhere, which keeps the other builds' address arithmetic as it was)
  const int cshift =
      MK_FMT == MK_INT4 && MK_INT4_POST && a.group > 64 ? __ffs(a.group / 64) - 1 : 0;
  const int KS = KC >> cshift;  // scale blocks per row
  const int soff = ((16 * c) / gsz * 8 + g) * 2 * SCALE_ELEM;
  const int soff4 = soff & ~3, sshift = (soff & 2) * 8;  // the aligned word holding them
  const int row_div = KIND == GATE_UP ? a.topk : 1;
  const int tiles_per_e = KIND == GATE_UP ? 2 * N / 16 : N / 16;

  for (int item = blockIdx.x; item < nseg * R * KB; item += gridDim.x) {
    const int seg = item / (R * KB), rest = item - seg * R * KB, kb = rest % KB;
    const int rb = rest / KB * wn_n + wn;  // this warp's row block
    const bool busy = rb < row_blocks;
    // K chunks of this warp: share wk of the block's share kb
    const int kb0 = kb * KC / KB, kbn = (kb + 1) * KC / KB - kb0;
    const int kc0 = kb0 + wk * kbn / split_k;
    const int kc1 = MK_PROBE_NO_CHUNKS ? kc0 : kb0 + (wk + 1) * kbn / split_k;
    const int e = s_seg_e[seg], start = s_seg_start[seg], len = s_seg_len[seg];
    const __nv_bfloat16* xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int slot = nt * 8 + g;
      xrow[nt] = slot < len ? a.x + (long long)(s_sorted[start + slot] / row_div) * K : nullptr;
    }
    long long tile[MT];
    if (KIND == GATE_UP) {
      tile[0] = (long long)e * tiles_per_e + rb;            // gate rows
      tile[1] = (long long)e * tiles_per_e + N / 16 + rb;   // up rows
    } else {
#pragma unroll
      for (int t = 0; t < MT; ++t) tile[t] = (long long)e * tiles_per_e + MT * rb + t;
    }
    float gs = 1.f;
    if (MK_FMT == MK_NVFP4) gs = a.gscale[e];
    // the epilogue's operands, loaded now so that their latency hides behind the main loop:
    // biases of rows g and g + 8 of each tile, routing weights of this lane's pair columns
    float bias_v[MT][2] = {};
    float wt_v[NT][2] = {};
    if (busy && wk == 0) {
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long n = KIND == GATE_UP ? (long long)e * 2 * N + t * N + rb * 16 + g + 8 * h
                                              : (long long)e * N + (MT * rb + t) * 16 + g + 8 * h;
          if (BIAS && kb == 0) bias_v[t][h] = __bfloat162float(a.bias[n]);  // one K share
        }
      if (KIND == DOWN) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int slot = nt * 8 + 2 * c + j;
            if (slot < len) wt_v[nt][j] = a.topk_w[s_sorted[start + slot]];
          }
      }
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[t][nt][v] = 0.f;

    Ring& ring = *reinterpret_cast<Ring*>(&s_warp[warp][0]);
    // copies of chunk kc into ring slot st: weights and scales, then activations; `issue`
    // makes both one group (an empty group past kc1)
    auto issue_w = [&](int st, int kc) {
      if (kc >= kc1) return;
      Slot<MT, NT>& sl = ring[st];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const long long tk = tile[t] * KC + kc;
        copy16_stream(&sl.a[t][lane], a.wq + tk * 32 + lane);
        const long long ts = (tile[t] * KS + (kc >> cshift)) * SB + soff4;
        if (!MK_PROBE_NO_SCALES) copy4(&sl.s[t][lane], a.ws + ts);
        if constexpr (MK_ZERO) copy4(&sl.z[t][lane], a.wz + ts);
      }
    };
    auto issue_x = [&](int st, int kc) {
      if (kc >= kc1 || MK_PROBE_NO_X) return;
      Slot<MT, NT>& sl = ring[st];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const bool valid = xrow[nt] != nullptr;
        const uint4* bp = valid ? reinterpret_cast<const uint4*>(xrow[nt] + kc * 64 + 16 * c)
                                : reinterpret_cast<const uint4*>(a.x);
        copy16_or_zero(&sl.b[nt][0][lane], bp, valid);
        copy16_or_zero(&sl.b[nt][1][lane], bp + 1, valid);
      }
    };
    auto issue = [&](int st, int kc) {
      issue_w(st, kc);
      issue_x(st, kc);
      copy_commit();
    };
    // direct: chunk kc into registers (weights and scales, then activations)
    auto load_w = [&](Chunk<MT, NT>& ch, int kc) {
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const long long tk = tile[t] * KC + kc;
        ch.a[t] = ld_stream(a.wq + tk * 32 + lane);
        const long long ts = (tile[t] * KS + (kc >> cshift)) * SB + soff4;
        const uint32_t* sp = reinterpret_cast<const uint32_t*>(a.ws + ts);
        ch.s[t] = MK_PROBE_NO_SCALES ? 0x3F803F80u : __ldg(sp) >> sshift;
        if constexpr (MK_ZERO) ch.z[t] = __ldg(reinterpret_cast<const uint32_t*>(a.wz + ts));
      }
    };
    auto load_x = [&](Chunk<MT, NT>& ch, int kc) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (xrow[nt] != nullptr) {
          const uint4* bp = reinterpret_cast<const uint4*>(xrow[nt] + kc * 64 + 16 * c);
          ch.b[nt][0] = __ldg(bp);
          ch.b[nt][1] = __ldg(bp + 1);
        } else {
          ch.b[nt][0] = ch.b[nt][1] = make_uint4(0, 0, 0, 0);
        }
      }
    };
    auto load = [&](Chunk<MT, NT>& ch, int kc) {
      load_w(ch, kc);
      load_x(ch, kc);
    };
    auto read = [&](Chunk<MT, NT>& ch, int st) {
      const Slot<MT, NT>& sl = ring[st];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        ch.a[t] = sl.a[t][lane];
        ch.s[t] = MK_PROBE_NO_SCALES ? 0x3F803F80u : sl.s[t][lane] >> sshift;
        if constexpr (MK_ZERO) ch.z[t] = sl.z[t][lane];
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        ch.b[nt][0] = sl.b[nt][0][lane];
        ch.b[nt][1] = sl.b[nt][1][lane];
      }
    };

    auto compute = [&](const Chunk<MT, NT>& ch) {
      if (MK_PROBE_NO_MATH) {  // keep the loaded words alive only
        uint32_t v = 0;
#pragma unroll
        for (int t = 0; t < MT; ++t) v ^= ch.a[t].x ^ ch.a[t].y ^ ch.a[t].z ^ ch.a[t].w ^ ch.s[t];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) v ^= ch.b[nt][0].x ^ ch.b[nt][1].w;
        acc[0][0][0] += __uint_as_float(v & 0x3f800000u);
        return;
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        // POST: the MMAs take q - z, and the scales multiply the chunk's float32 sums after
        // them (no bf16 multipliers)
        constexpr bool POST = MK_FMT == MK_INT4 && MK_INT4_POST;
        uint32_t m0 = 0, m1 = 0, z0 = 0x43084308u, z1 = 0x43084308u;  // int4 sym.: 128 + 8
        if (MK_FMT == MK_INT4) {
          if (!POST) {
            m0 = __byte_perm(ch.s[t], 0, 0x1010);  // row g, both halves
            m1 = __byte_perm(ch.s[t], 0, 0x3232);  // row g + 8
          }
          if (MK_ZERO) {
            z0 = __byte_perm(ch.z[t], 0, 0x1010);
            z1 = __byte_perm(ch.z[t], 0, 0x3232);
          }
        } else {
          const uint32_t b0 = fp4_multiplier(ch.s[t] & 0xFFu, gs);
          const uint32_t b1 = fp4_multiplier((ch.s[t] >> 8) & 0xFFu, gs);
          m0 = b0 | (b0 << 16);
          m1 = b1 | (b1 << 16);
        }
        const uint32_t w[4] = {ch.a[t].x, ch.a[t].y, ch.a[t].z, ch.a[t].w};
        float part[NT][4];  // POST: the chunk's sums of q - z times x
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int v = 0; v < 4; ++v) part[nt][v] = 0.f;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a0, a1, a2, a3;
          if (POST) {
            a0 = int4_less_zero<0>(w[s], z0), a1 = int4_less_zero<1>(w[s], z1);
            a2 = int4_less_zero<2>(w[s], z0), a3 = int4_less_zero<3>(w[s], z1);
          } else {
            a0 = dequant<0>(w[s], m0, z0), a1 = dequant<1>(w[s], m1, z1);
            a2 = dequant<2>(w[s], m0, z0), a3 = dequant<3>(w[s], m1, z1);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4 bv = ch.b[nt][s >> 1];
            const uint32_t b0 = (s & 1) ? bv.z : bv.x, b1 = (s & 1) ? bv.w : bv.y;
            mma(POST ? part[nt] : acc[t][nt], a0, a1, a2, a3, b0, b1);
          }
        }
        if (POST) {  // bf16 scales of rows g (low half) and g + 8 (high half)
          const float s0 = __uint_as_float(ch.s[t] << 16);
          const float s1 = __uint_as_float(ch.s[t] & 0xFFFF0000u);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            acc[t][nt][0] = fmaf(part[nt][0], s0, acc[t][nt][0]);
            acc[t][nt][1] = fmaf(part[nt][1], s0, acc[t][nt][1]);
            acc[t][nt][2] = fmaf(part[nt][2], s1, acc[t][nt][2]);
            acc[t][nt][3] = fmaf(part[nt][3], s1, acc[t][nt][3]);
          }
        }
      }
    };

    // down's first item: its first weights are on their way before it waits for gate_up (the
    // first group of the ring then holds the weights of every slot and the first activations)
    const bool early = KIND == DOWN && item == blockIdx.x;
    Chunk<MT, NT> first;
    if (early && busy) {
      if (RING) {
#pragma unroll
        for (int st = 0; st < STAGES; ++st) issue_w(st, kc0 + st);
      } else if (kc0 < kc1) {
        load_w(first, kc0);
      }
    }
    if (early) wait_for_prerequisites();  // every thread, before h is read or out written

    // the ring: STAGES chunks in flight; each lane reads only what it copied itself, and refills
    // a slot only after its values were used (no barrier)
    if (RING && busy) {
#pragma unroll
      for (int st = 0; st < STAGES; ++st) {
        if (!early) issue_w(st, kc0 + st);
        issue_x(st, kc0 + st);
        copy_commit();
      }
      for (int kc = kc0, st = 0; kc < kc1; ++kc) {
        copy_wait<STAGES - 1>();
        Chunk<MT, NT> ch;
        read(ch, st);
        compute(ch);
        issue(st, kc + STAGES);
        st = st + 1 == STAGES ? 0 : st + 1;
      }
    } else if (!RING && busy && kc0 < kc1) {  // direct: the next chunk loads after this one's use
      Chunk<MT, NT>& ch = first;
      if (!early) load_w(ch, kc0);
      load_x(ch, kc0);
      for (int kc = kc0; kc < kc1; ++kc) {
        compute(ch);
        if (kc + 1 < kc1) load(ch, kc + 1);
      }
    }

    // ---- the K shares of a row block meet in its first warp, which writes them
    auto red = [&](int w) { return reinterpret_cast<float(*)[32]>(&s_warp[w][0]); };
    if (wk > 0) {
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int v = 0; v < 4; ++v) red(warp)[(t * NT + nt) * 4 + v][lane] = acc[t][nt][v];
    }
    __syncthreads();
    if (wk == 0 && busy) {
      for (int w2 = warp + 1; w2 < warp + split_k; ++w2)
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[t][nt][v] += red(w2)[(t * NT + nt) * 4 + v][lane];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int slot = nt * 8 + 2 * c + (v & 1);  // the same for lanes g and g + 1
          const bool valid = slot < len;
          const int pair = valid ? s_sorted[start + slot] : 0;
          const int r = g + 8 * (v >> 1);
          if constexpr (KIND == GATE_UP) {
            if (!valid) continue;
            const int f = rb * 16 + r;
            float gv = acc[0][nt][v] + bias_v[0][v >> 1], uv = acc[1][nt][v] + bias_v[1][v >> 1];
            float hv;
            if (ACT == ACT_SILU) {
              hv = gv / (1.f + __expf(-gv)) * uv;
            } else if (ACT == ACT_GELU) {
              hv = 0.5f * gv * (1.f + erff(gv * 0.7071067811865476f)) * uv;
            } else {
              gv = fminf(gv, a.limit);
              uv = fminf(fmaxf(uv, -a.limit), a.limit);
              hv = gv / (1.f + __expf(-a.alpha * gv)) * (uv + 1.f);
            }
            a.out[(long long)pair * N + f] = __float2bfloat16_rn(hv);
          } else {
            // rows r and r + 1 (lanes g and g + 1, one pair) meet in one bf16x2 reduction
            const int token = pair / a.topk;
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              const int n = (MT * rb + t) * 16 + r;
              const float y = valid ? (acc[t][nt][v] + bias_v[t][v >> 1]) * wt_v[nt][v & 1] : 0.f;
              const float y_next = __shfl_down_sync(0xffffffffu, y, 4);
              if (valid && !(g & 1)) add_bf16x2(a.out + (long long)token * N + n, y, y_next);
            }
          }
        }
      }
    }
    __syncthreads();
  }
}

// Work items of a call: (segment of up to 8 * nt pairs of one expert, row block of the warps,
// K block); the segments are counted for the worst case (no pair masked).
long long work_items(int kind, int nt, int mt, int P, int topk, int E, int N, int split_k,
                     int k_blocks) {
  const long long T = P / topk, seg = 8 * nt;
  long long segs = (long long)E * ((T + seg - 1) / seg);
  if (segs > P) segs = P;
  const long long row_blocks = N / (kind == GATE_UP ? 16 : 16 * mt), wn = WARPS / split_k;
  return segs * ((row_blocks + wn - 1) / wn) * k_blocks;
}

// How to launch: on `stream`; overlap: down as a programmatic dependent launch of gate_up (sm_90+;
// the caller decides where it pays, moekit.runners.w4a16.jit.down_overlaps); occupancy != nullptr:
// only say how many blocks of the kernel fit on one multiprocessor.
struct Launch {
  cudaStream_t stream;
  bool overlap;
  int* occupancy;
};

// One block per work item, at most a full wave of blocks (they loop over the items).
template <int KIND, int ACT, bool BIAS, int NT, int MT, bool RING>
int launch(const Args& a, const Launch& l) {
  auto kernel = moe_w4<KIND, ACT, BIAS, NT, MT, RING>;
  static int per_sm = 0, sms = 0, major = 0;
  if (per_sm == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, THREADS, 0);
    if (per_sm < 1) per_sm = 1;
  }
  if (l.occupancy != nullptr) {
    *l.occupancy = per_sm;
    return 0;
  }
  long long grid = (long long)per_sm * sms;
  const long long items = work_items(KIND, NT, MT, a.P, a.topk, a.E, a.N, a.split_k, a.k_blocks);
  if (items < grid) grid = items;
  if (grid < 1) grid = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid);
  cfg.blockDim = dim3(THREADS);
  cfg.stream = l.stream;
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  if (KIND == DOWN && l.overlap && major >= 9) {
    cfg.attrs = pdl;
    cfg.numAttrs = 1;
  }
  return (int)cudaLaunchKernelEx(&cfg, kernel, a);
}

// The variant of (kind, act, bias, nt, mt, ring): one template argument at a time.
struct Variant {
  int kind, act, has_bias, nt, mt, ring;
};

template <int KIND, int ACT, bool BIAS, int NT, int MT>
int launch_ring(const Variant& v, const Args& a, const Launch& l) {
  return v.ring ? launch<KIND, ACT, BIAS, NT, MT, true>(a, l)
                : launch<KIND, ACT, BIAS, NT, MT, false>(a, l);
}

template <int KIND, int ACT, bool BIAS, int NT>
int launch_mt(const Variant& v, const Args& a, const Launch& l) {
  if constexpr (KIND == DOWN) {
    if (v.mt == 1) return launch_ring<KIND, ACT, BIAS, NT, 1>(v, a, l);
  }
  return launch_ring<KIND, ACT, BIAS, NT, 2>(v, a, l);
}

template <int KIND, int ACT, bool BIAS>
int launch_nt(const Variant& v, const Args& a, const Launch& l) {
  return v.nt == 1 ? launch_mt<KIND, ACT, BIAS, 1>(v, a, l)
                   : launch_mt<KIND, ACT, BIAS, 2>(v, a, l);
}

template <int KIND, int ACT>
int launch_bias(const Variant& v, const Args& a, const Launch& l) {
  return v.has_bias ? launch_nt<KIND, ACT, true>(v, a, l)
                    : launch_nt<KIND, ACT, false>(v, a, l);
}

int dispatch(const Variant& v, const Args& a, const Launch& l) {
  if (v.kind == DOWN) return launch_bias<DOWN, 0>(v, a, l);
  if (v.act == ACT_SILU) return launch_bias<GATE_UP, ACT_SILU>(v, a, l);
  if (v.act == ACT_GELU) return launch_bias<GATE_UP, ACT_GELU>(v, a, l);
  return launch_bias<GATE_UP, ACT_SWIGLU_OAI>(v, a, l);
}

bool bad_variant(const Variant& v) {
  return (v.nt != 1 && v.nt != 2) || (v.mt != 1 && v.mt != 2) || (v.kind != DOWN && v.mt != 2) ||
         (v.ring != 0 && v.ring != 1);
}

thread_local char last_error[256];

}  // namespace

extern "C" {

int mk_w4_max_pairs() { return MAX_P; }

const char* mk_w4_last_error() { return last_error; }

// Blocks of one kernel variant that fit on a multiprocessor of the current device (0: bad
// arguments).
int mk_w4_occupancy(int kind, int act, int has_bias, int nt, int mt, int ring) {
  const Variant v{kind, act, has_bias, nt, mt, ring};
  if (bad_variant(v)) return 0;
  int per_sm = 0;
  dispatch(v, Args{}, Launch{nullptr, false, &per_sm});
  return per_sm;
}

// Work items of a call (its grid: at most this many blocks); see work_items.
long long mk_w4_items(int kind, int nt, int mt, int P, int topk, int E, int N, int split_k,
                      int k_blocks) {
  return work_items(kind, nt, mt, P, topk, E, N, split_k, k_blocks);
}

// kind 0: gate_up (act 0 silu, 1 gelu, 2 swiglu_oai), 1: down. nt: 1 or 2 (pairs per expert
// segment: 8 * nt). mt: 16-row tiles per warp (gate_up 2; down 1 or 2). ring: 1 the chunks
// stream through the shared-memory ring, 0 directly into registers. k_blocks: blocks sharing a
// row block's K (down only: 1, 2 or 4). overlap (down): a programmatic dependent launch of the
// gate_up before it on the stream (sm_90+). Returns 0 or a CUDA error code (mk_w4_last_error
// says which).
int mk_w4_launch(int kind, int act, int has_bias, int nt, int mt, int ring, const void* x,
                 const void* ids, const void* topk_w, const void* wq, const void* ws,
                 const void* wz, const void* gscale, const void* bias, void* out, void* zero_out,
                 long long zero_n, int P, int topk, int E, int N, int K, int group,
                 int split_k, int k_blocks, float alpha, float limit, int overlap,
                 void* stream) {
  last_error[0] = 0;
  const Variant v{kind, act, has_bias, nt, mt, ring};
  if (bad_variant(v) || P < 0 || P > MAX_P || topk < 1 || K % 64 || zero_n % 8 ||
      (split_k != 1 && split_k != 2 && split_k != 4) || N % (kind == DOWN ? 16 * mt : 16) ||
      (k_blocks != 1 && k_blocks != 2 && k_blocks != 4) || (kind != DOWN && k_blocks != 1) ||
      (MK_INT4_POST && group < 64)) {
    snprintf(last_error, sizeof last_error,
             "bad arguments: kind=%d P=%d (max %d) topk=%d N=%d K=%d nt=%d mt=%d ring=%d "
             "zero_n=%lld split_k=%d k_blocks=%d group=%d (post-scaled build: >= 64)", kind, P,
             MAX_P, topk, N, K, nt, mt, ring, zero_n, split_k, k_blocks, group);
    return -1;
  }
  Args a{static_cast<const __nv_bfloat16*>(x), static_cast<const int*>(ids),
         static_cast<const float*>(topk_w), static_cast<const uint4*>(wq),
         static_cast<const uint8_t*>(ws), static_cast<const uint8_t*>(wz),
         static_cast<const float*>(gscale), static_cast<const __nv_bfloat16*>(bias),
         static_cast<__nv_bfloat16*>(out), static_cast<__nv_bfloat16*>(zero_out), zero_n,
         P, topk, E, N, K, group, split_k, k_blocks, alpha, limit};
  const Launch l{static_cast<cudaStream_t>(stream), overlap != 0, nullptr};
  const int err = dispatch(v, a, l);
  if (err) snprintf(last_error, sizeof last_error, "%s", cudaGetErrorString((cudaError_t)err));
  return err;
}

}  // extern "C"
