// Switches for kernel variants that exist for measurement and as escape hatches, set by the
// caller (the lab and benchmarks' flags, tests) instead of read from the environment deep in
// the kernels. Process-wide; set them before the kernels run (they are read at launch time).
#pragma once

namespace kvlm::cuda {

struct KernelSwitches {
  // Programmatic dependent launch where the GPU and the loaded code allow it (pdl.cuh); off:
  // every kernel waits for its predecessor to finish.
  bool pdl = true;
  // The warp-specialised wgmma prefill kernel where sm_90a code runs; off: the mma.sync
  // tiled kernel (what sm_80 / sm_89 and head 256 run).
  bool wgmma = true;
  // FP8 weights on the GPU (model/cuda/cuda_runner.cpp): Auto keeps them FP8 on Hopper when
  // the FP8 tensor-core GEMM takes every one above m = 16 (one scale per row, or 128 x 128
  // blocks that each block's rows share), and anywhere their copy in the compute dtype would
  // take more than half of the GPU's memory, else dequantizes them at load (faster above batch
  // 16 and in prefill than a dequantize per GEMM); Keep / Dequantize force it.
  enum class Fp8Weights { Auto, Keep, Dequantize } fp8_weights = Fp8Weights::Auto;
  // gemv_fp8's tensor-core kernel (for the lab): 16-row tiles per CTA (0: automatic, 1, 2 or 4)
  // and CTAs per cluster splitting k (0: automatic, 1, 2, 4 or 8).
  int fp8_tc_tiles = 0;
  int fp8_tc_splits = 0;
  // ... and whether it (and gemm_fp8_small) asks for the largest shared-memory carve-out (read
  // once per kernel and device, at its first launch: resident_ctas).
  bool fp8_tc_carveout = true;
  // The largest m gemv_fp8 runs on its FMA kernels (one pass per 4 rows) rather than the
  // tensor-core kernel, where both fit (automatic choice; 1 by default).
  int fp8_fma_max_m = 1;
  // FP8 weights (one scale per row) at m > 16: the FP8 tensor-core GEMM on activations
  // quantized per token; off: the weight dequantized before the 16-bit GEMM (weight-only
  // FP8, for measurements and tests).
  bool fp8_gemm = true;
  // ... and at m = 17..kGemmFp8SmallMaxM on Hopper (block-scaled weights: up to 32), that
  // GEMM is gemm_fp8_small (kvlm's kernel); off: cuBLASLt's (Gemm::linear_fp8), for
  // measurements.
  bool fp8_small_gemm = true;
  // ... and at m = 17..kGemmFp8SmallMaxM the RMSNorm before such a GEMM quantizes its output
  // for it (add_rmsnorm's codes), sparing the GEMM its own quantization pass; off: the GEMM
  // quantizes, for measurements.
  bool fp8_norm_codes = true;
  // gemv_int: bf16 4-bit codes in groups of 128 or more apply the scale after the MMA (one
  // instruction per pair of codes instead of three); off: the per-weight decode, for the lab.
  bool int_scale_after_mma = true;
  // gemv_int at m <= int_dp4a_max_m (0-4): x quantized to int8 per 16 bytes of codes and the
  // codes multiplied on the integer pipes (gemv_int_dp4a.h), where the layout allows; 0: the
  // tensor-core GEMV at every m.
  int int_dp4a_max_m = 4;
  // ... only for the shapes where it measured faster (gemv_int_dp4a_pays); off: wherever the
  // layout allows (tests, the lab).
  bool int_dp4a_by_shape = true;
  // gemv_int's tensor-core GEMV at m >= int_shared_x_min_m (plain GEMVs; experts keep the
  // other): the kernel whose CTA shares each round of x through shared memory
  // (gemv_int_xs_kernel) instead of each warp loading its own; 17: never.
  int int_shared_x_min_m = 9;
  // ... only for the shapes where it measured faster (gemv_int_shares_x); off: at every shape.
  bool int_shared_x_by_shape = true;
  // ... its 16-row tiles per warp (0: automatic, 1 or 2), for the lab.
  int int_shared_x_tiles = 0;
};

void set_kernel_switches(const KernelSwitches& s);
KernelSwitches kernel_switches();

}  // namespace kvlm::cuda
